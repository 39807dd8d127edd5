"""What the kernel families share above the kernels: the Hopper Gluon switch and its one
compile-failure fallback, the Gluon K step and split rule, the batch-invariant config, and the
split-K tile counters of the in-kernel split-K sum (sync_buffer; W4A8 and W4A16's GEMVs).

One switch for every family: `runtime.flags.FLAGS.gluon` (SAILFISH_GLUON). A Gluon kernel that
fails to compile (a Triton whose Gluon API differs from the tested 3.6-3.9) turns it off for
the process (runtime/plan.py gluon_compile_failed), so every family's Gluon configs run as their
Triton twins from then on.
"""
from __future__ import annotations

import threading
from functools import lru_cache
from typing import List

import torch

from ..formats.int4 import K_CHUNK
from ..runtime.device import gluon_capable, pdl
from ..runtime.flags import FLAGS
from ..runtime.launch import stream_getter
from ..tuning import Config, split_k_for

GLUON_STEP = 2 * K_CHUNK  # channels per K step of the Gluon kernels (their BLOCK_K)


@lru_cache(maxsize=None)
def _gluon_kernels_import(module: str) -> bool:
    """Whether kernels/<module> (w4a16_gluon or w4a8_gluon) imports: a Triton with Gluon, with
    the API the kernels use. (Imported here, on first use, after TRITON_INTERPRET is settled.)"""
    try:
        if module == "w4a8_gluon":
            from ..kernels import w4a8_gluon  # noqa: F401
        else:
            from ..kernels import w4a16_gluon  # noqa: F401
    except Exception:  # noqa: BLE001 - a Triton without Gluon or with another Gluon API
        return False
    return True


def gluon_device(device_index: int, module: str = "w4a16_gluon") -> bool:
    """An sm_90 GPU (Gluon's Hopper warpgroup_mma) and a Triton whose Gluon compiles the
    family's kernel module (3.6 to 3.9 are tested), unless SAILFISH_GLUON=0 or a Gluon kernel
    failed to compile in this process."""
    return gluon_capable(device_index) and _gluon_kernels_import(module)


def gluon_split_ok(split: int, steps: int) -> bool:
    """Every one of `split` splits of `steps` K steps gets one at least (the Gluon kernels give
    split k the steps from k * ceil(steps / split))."""
    return 1 <= split <= steps and (split - 1) * -(-steps // split) < steps


def gluon_overlap_split_ok(split: int, steps: int) -> bool:
    """Every one of `split` splits of `steps` K steps gets an even number of them, 2 at least (the
    overlap kernels, kernels/w4a16_gluon.w4a16_gluon_overlap_kernel and
    kernels/w4a8_gluon.w4a8_gluon_overlap_kernel, work through their steps two at a time)."""
    if not gluon_split_ok(split, steps):
        return False
    per = -(-steps // split)
    last = steps - (split - 1) * per
    return per % 2 == 0 and last % 2 == 0 and last >= 2


def invariant_config(M: int, N: int, Kp: int) -> Config:
    """The config of batch-invariant mode (ops.set_batch_invariant) for an (M, N, padded K)
    problem: the Triton tensor-core tile with one K order at every M (BLOCK_K 128, the scales
    on the weights, a split-K that depends on N and K only: 2 programs per SM at M = 1 on a
    132-SM GPU, so the bits do not depend on the GPU model either); only BLOCK_M, BLOCK_N and
    the warps follow M, and they do not change any output element's arithmetic: bit-identical
    outputs for BLOCK_M 16-128, BLOCK_N 64-256, 4 / 8 warps, fp16 / bf16, symmetric /
    asymmetric, g128 / per channel, M = 1-300 (NVIDIA H200; also for the W4A8 fp8 kernel,
    ops/w4a8.py). No GEMV, Gluon kernel or dequantize + cuBLAS: their reduction orders differ
    (fp16 g128 rows differ by up to 2e-3 between M buckets without the mode)."""
    # tiles: the fastest of a sweep per M bucket on the H200 (fp16 g128, 8 Llama-3 shapes, the
    # split fixed as below; docs/perf_log.md v34)
    bm, bn, warps, stages = ((16, 128, 4, 4) if M <= 8 else (16, 64, 4, 3) if M <= 16 else (32, 64, 4, 4) if M <= 32
                             else (64, 64, 4, 3) if M <= 64 else (128, 256, 8, 3))
    split = split_k_for(-(-N // 64), Kp // 128, 132)
    return Config(bm, bn, 128, split, 8, warps, stages)


# Triton 3.6-3.8 leave the mma kernel's wgmmas (A in registers) in flight across the K loop's
# back edge; the kernel's ACC_FENCE makes them complete inside each K tile (kernels/w4a16.py; the MoE kernels take the same fence).
# Triton 3.9 waits correctly (`python -m sailfish.bench.ptx --hazard` checks the SASS of every
# shipped tile, tests/test_w4a16.py::test_no_wgmma_register_hazard). SAILFISH_ACC_FENCE=0 / 1
# overrides the version rule (to measure; 0 on Triton < 3.9 can give wrong results).
def acc_fence() -> bool:
    if FLAGS.acc_fence != "auto":
        return FLAGS.acc_fence == "1"
    return _triton_before_3_9()


@lru_cache(maxsize=None)
def _triton_before_3_9() -> bool:
    import triton

    return tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2]) < (3, 9)


# Split-K slices summed inside the GEMM by each tile's last slice (kernels/common.py last_slice,
# sum_slices) instead of by a reduce kernel after it: its tile counters.
SYNC_CAP = 1 << 14  # output tiles of one launch the counters serve (more: the reduce kernel)
_SYNC = {}
_SPARE = {}  # device index -> zeroed buffers made outside any capture, for streams first seen in one
SYNC_SPARES = 4
_CURRENT_STREAM = None  # Triton's current-stream function, on first use


def fixup_fits(tiles: int, M: int, N: int) -> bool:
    """Whether a split-K launch of `tiles` output tiles over an (M, N) output can sum its slices in
    the kernel: a counter for every tile, and 32-bit offsets within a workspace slice."""
    return tiles <= SYNC_CAP and M * N < 2**31


def _kept_zeros(device: torch.device, device_index: int, n: int, count: int) -> List[torch.Tensor]:
    """`count` int32 zero tensors of n elements, made on a thread of their own (kept by the caller):
    outside any CUDA graph memory pool this thread's allocations may be routed to
    (torch.compile's cudagraph trees warm up with every allocation of the current thread going to
    their pool, and refuse live allocations there that are not the graph's outputs). That thread
    waits for the zeroing before they are handed over (once per stream: a host sync is fine)."""
    made: List[torch.Tensor] = []
    failed: List[BaseException] = []

    def make() -> None:
        try:
            with torch.cuda.device(device_index):
                made.extend(torch.zeros(n, dtype=torch.int32, device=device) for _ in range(count))
                torch.cuda.current_stream(device_index).synchronize()
        except BaseException as e:  # (re-raised on the caller's thread)
            failed.append(e)

    worker = threading.Thread(target=make, name="sailfish-sync-buffers")
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    return made


def _stream_key(device_index: int) -> tuple:
    """(device index, the raw current stream of it); (device_index, 0) for the interpreter's CPU."""
    global _CURRENT_STREAM
    if device_index < 0:
        return (device_index, 0)
    if _CURRENT_STREAM is None:
        _CURRENT_STREAM = stream_getter()
    return (device_index, _CURRENT_STREAM(device_index))


def sync_buffer(device: torch.device, device_index: int) -> torch.Tensor:
    """The split-K tile counters (int32, zero between launches) of the current stream of
    `device`: one buffer per stream, since two launches running at once must not share them
    (launches on one stream run one after another, so every family and plan shares it).
    Kept for the life of the process, so a captured CUDA graph's pointer stays valid. A graph
    keeps the buffer of the stream it was captured on: two graphs captured on one stream must not
    be replayed at the same time on two streams (a split-K launch with the fixup in each would
    share it). device_index < 0: the interpreter's (CPU) buffer."""
    key = _stream_key(device_index)
    buf = _SYNC.get(key)
    if buf is None:
        from ..kernels.common import SYNC_TILES  # (after TRITON_INTERPRET is settled)

        n = SYNC_TILES.value + SYNC_CAP
        # A buffer first needed inside a CUDA graph capture (the usual warm-up runs on another
        # stream than the capture) must not be zeroed by a kernel of that graph: a second graph
        # captured on the stream, replayed before the first ever is, would start from garbage.
        # So buffers made outside a capture leave zeroed spares, and a capture takes one.
        capturing = device_index >= 0 and torch.cuda.is_current_stream_capturing()
        spares = _SPARE.setdefault(device_index, [])
        if capturing and spares:
            buf = spares.pop()
        elif capturing or device_index < 0:  # (a first use inside a capture: the graph zeroes it)
            buf = torch.zeros(n, dtype=torch.int32, device=device)
        else:
            buf, *more = _kept_zeros(device, device_index, n, 1 + SYNC_SPARES - len(spares))
            spares.extend(more)
        _SYNC[key] = buf
    return buf


def as_dependent(device_index: int) -> dict:
    """Launch options for a small kernel that waits for the previous grid before touching memory
    (kernels/common.py pdl_wait at its start): launched as a programmatic dependent where PDL
    serves (runtime/device.py pdl), so that a kernel before it that releases early (the W4A8
    GEMMs, the decode attention) lets it launch while it runs and the launch gap is hidden
    (docs/perf_log.md v52). A kernel before it that does not release gives a plain boundary."""
    return {"PDL": True, "launch_pdl": True} if pdl(device_index) else {}


# Whether the current stream is being captured into a CUDA graph: one C call, read by the plans
# that sum split-K slices in the kernel (a CPU-only torch has none)
capturing = torch.cuda.is_current_stream_capturing if torch.backends.cuda.is_built() else (lambda: False)


class _Scratch:
    __slots__ = ("ws", "ws_ptr", "sync", "sync_ptr")


_SCRATCH = {}


def eager_scratch(device: torch.device, device_index: int, numel: int) -> _Scratch:
    """For a split-K launch outside any CUDA graph capture that sums its slices in the kernel: the
    current stream's tile counters (sync_buffer; .sync, .sync_ptr) and an fp32 workspace of at
    least `numel` elements (.ws, .ws_ptr) kept for the stream, where each call would otherwise
    allocate one (3.6-8.6 us of host time an allocation on the H100 host, docs/perf_log.md v51).
    Launches on one stream run in order, so they may share it; grown (to a power of two) when a
    larger one is asked for, made on a thread of its own as sync_buffer's (outside torch.compile's
    cudagraph pools). Never for a launch being captured: a graph replays on other streams, so its
    workspace is its own allocation."""
    key = _stream_key(device_index)
    entry = _SCRATCH.get(key)
    if entry is not None and entry.ws.numel() >= numel:
        return entry
    if entry is None:
        entry = _SCRATCH[key] = _Scratch()
        entry.sync = sync_buffer(device, device_index)
        entry.sync_ptr = entry.sync.data_ptr()
    elif device_index >= 0:  # (the smaller one may still be read on this stream: not reused before)
        entry.ws.record_stream(torch.cuda.current_stream(device_index))
    n = 1 << max(numel - 1, 1).bit_length()
    entry.ws = (torch.zeros(n, dtype=torch.int32, device=device) if device_index < 0
                else _kept_zeros(device, device_index, n, 1)[0]).view(torch.float32)
    entry.ws_ptr = entry.ws.data_ptr()
    return entry
