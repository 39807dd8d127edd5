"""Probe (Hopper GPU; not part of the package): silu_mul_quant at decode sizes with the row's
parts meeting at a grid barrier instead of the split kernel's serial tail (issue 39, W4A8 at
batch 16; docs/perf_log.md v52).

Why: the package's split form (kernels/rowwise.silu_mul_quant_split_kernel) has the row's last
program read the row back and quantize all of it alone, after three dependent global round
trips (v50: 4.96 us at M = 16 over 14336 channels, against inductor's silu * up at 1.78). Here
every part keeps its outputs in registers, the row's parts meet at a barrier (a cooperative
launch, so every program is resident) and each quantizes its own outputs: one round trip, no
serial pass. Prediction before the run: ~3 us. Measured (H100, v52): 5.13 us against the split
kernel's 4.93, and the W4A8 decode step at batch 16 0.04 ms slower: not adopted; the kernel
stays here with the measurement.

    PYTHONPATH=src python benchmarks/probes/silu_coop_probe.py [--m 16]

The codes and scales are checked against the package's split kernel first (bit for bit), then
both are timed in CUDA graphs (20 calls), 5 interleaved rounds, beside inductor's silu * up.
"""
import argparse
import functools

import torch
import triton
import triton.language as tl

from sailfish.kernels.common import SYNC_TILES
from sailfish.kernels.rowwise import _chunk
from sailfish.kernels.w4a8 import abs_or_inf, quantize_scaled, token_scale


@triton.jit(do_not_specialize=["M"])
def silu_mul_quant_coop_kernel(a_ptr, pam_ptr, out_ptr, s_ptr, sync_ptr, M, n, stride_am,
                               BLOCK_K: tl.constexpr, PARTS: tl.constexpr, ROWS_CAP: tl.constexpr,
                               FP8: tl.constexpr, EMU_BF16: tl.constexpr):
    """silu_mul_quant_split_kernel's work without its serial tail, for a GPU launch with every
    program resident at once (launch_cooperative_grid; grid (M, cdiv(n, BLOCK_K)), M <=
    ROWS_CAP): program (row, part) computes its BLOCK_K outputs and keeps them in registers,
    stores their max |y| in pam (M, PARTS), and waits at the row's barrier until every part of
    the row has stored its maximum; then each part reads the row's maxima and quantizes its own
    outputs. Why: the split kernel's last program reads the row back and quantizes all of it
    alone after three dependent global round trips (docs/perf_log.md v50: 4.96 us at M = 16,
    14336 channels, H100, against inductor's silu * up alone at 1.78); here the parts quantize
    in parallel, there is one round trip (the barrier) and no h round trip.
    The barrier: arrivals on the row's counter (sync_ptr + SYNC_TILES + row, acq_rel: the
    maxima stored before it are visible after it), each program spinning until it reads the
    row's part count; departures on a second counter (+ ROWS_CAP), whose last program puts both
    back to zero (by then no program of the row is still reading the first), so the counters
    are zero between launches as ops/common.sync_buffer's contract says.
    Not under the interpreter, which runs the programs one after another (a program waiting
    for a later one would wait forever): there the split kernel is its twin, with the same
    bits (the same rounded outputs, maximum and token_scale / quantize_scaled)."""
    DTYPE: tl.constexpr = a_ptr.dtype.element_ty
    QMAX: tl.constexpr = 448.0 if FP8 else 127.0
    row = tl.program_id(0)
    part = tl.program_id(1)
    nparts = tl.num_programs(1)
    rows = (row + tl.arange(0, 1)).to(tl.int64)
    row_ok = rows < M
    a_rows = a_ptr + (rows * stride_am)[:, None]
    k0 = part * BLOCK_K
    cols = tl.arange(0, BLOCK_K)[None, :]
    y, mask = _chunk(a_rows, a_ptr, cols, k0, n, row_ok, 0.0, False, DTYPE, EMU_BF16)
    tl.store(pam_ptr + rows * PARTS + part, tl.max(abs_or_inf(y), axis=1))
    arrived = sync_ptr + SYNC_TILES + row
    tl.debug_barrier()  # (every thread's maximum stored before the release)
    count = tl.atomic_add(arrived, 1, sem="acq_rel") + 1
    while count < nparts:
        count = tl.atomic_add(arrived, 0, sem="acquire")
    tl.debug_barrier()
    p = tl.arange(0, PARTS)[None, :]
    amax = tl.max(tl.load(pam_ptr + rows[:, None] * PARTS + p, mask=p < nparts, other=0.0, cache_modifier=".cg"),
                  axis=1)
    bad, c, inv, scale = token_scale(amax, QMAX)
    if part == 0:
        tl.store(s_ptr + rows, scale, mask=row_ok)
    tl.store(out_ptr + (rows * n)[:, None] + k0 + cols, quantize_scaled(y, bad[:, None], c[:, None], inv[:, None], FP8),
             mask=mask)
    left = sync_ptr + SYNC_TILES + ROWS_CAP + row
    if tl.atomic_add(left, 1, sem="acq_rel") == nparts - 1:
        tl.atomic_xchg(arrived, 0, sem="relaxed")
        tl.atomic_xchg(left, 0, sem="relaxed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=16, help="rows (at most one program an SM: 18 at 14336 channels)")
    m = ap.parse_args().m
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from sailfish.bench.timing import interleaved_graph_times_us
    from sailfish.ops import rowwise as R
    from sailfish.ops.common import SYNC_CAP, sync_buffer
    from sailfish.runtime.launch import Launch

    i, bk = 14336, R.SPLIT_BLOCK
    parts = -(-i // bk)
    if m * parts > torch.cuda.get_device_properties(0).multi_processor_count:
        raise SystemExit(f"{m} x {parts} programs: more than one an SM, the barrier could wait forever")
    torch.manual_seed(0)
    gu = torch.randn(m, 2 * i, dtype=torch.float16, device="cuda")
    want_q, want_s = R.silu_mul_launch(gu, "int8", split=True)
    q, s = torch.empty_like(want_q), torch.empty_like(want_s)
    pam = torch.empty((m, triton.next_power_of_2(parts)), dtype=torch.float32, device="cuda")
    sync = sync_buffer(gu.device, 0)
    launch = Launch(silu_mul_quant_coop_kernel, dict(BLOCK_K=bk, PARTS=pam.shape[1], ROWS_CAP=SYNC_CAP // 2,
                                                     FP8=False, EMU_BF16=False, num_warps=R._tile(bk, None)["num_warps"],
                                                     launch_cooperative_grid=True), 0)

    def coop():
        launch((m, parts), gu, pam, q, s, sync, m, i, 2 * i)
    coop()
    print(torch.cuda.get_device_name(), f"M = {m}: codes equal {torch.equal(q, want_q)}, scales equal "
          f"{torch.equal(s, want_s)}, counters back at zero {not sync.any().item()}", flush=True)
    silu = torch.compile(lambda gu: torch.nn.functional.silu(gu[:, :i]) * gu[:, i:], fullgraph=True)
    times = interleaved_graph_times_us({"split (the package)": functools.partial(R.silu_mul_launch, gu, "int8"),
                                        "coop": coop, "inductor silu * up": functools.partial(silu, gu)}, 20, 5)
    for k, v in times.items():
        print(f"{k:25s} {v:6.2f} us", flush=True)

if __name__ == "__main__":
    main()
