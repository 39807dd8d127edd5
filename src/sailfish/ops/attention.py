"""Decode attention (issue 39): one query token per sequence against a KV cache, as transformers'
attention functions see it, in one launch.

    sailfish::decode_attention(q, k, v, mask, scale) -> out
        q (B, Hq, 1, D), k / v (B, Hkv, L, D) float16 / bfloat16, Hq a multiple of Hkv, D a power
        of two in 16..256; mask None, boolean (True: attend) or additive (any float dtype),
        broadcastable as (B or 1, 1 or Hq, 1, L); out (B, 1, Hq, D) contiguous (what an
        attention function returns, before the o_proj's reshape).

The reference below is the contract: softmax(q k^T * scale + mask) v in fp32, each query head
reading its group's KV head, a row with every position masked giving 0. The kernel
(kernels/attention.py) differs from it by the probabilities' rounding to the cache's dtype
before P @ V (as flash attention's), the order of the sums and exp2: tests/test_attention.py
bounds it.

Where it runs: CUDA tensors and, with TRITON_INTERPRET=1, CPU tensors run the kernel; other CPU
tensors the reference. On CUDA the bound kernel is kept per (device, dtypes, shapes, strides,
splits) and a steady call is a dict lookup, the allocations and the direct launch
(runtime/plan.py run_steady / keep), as the row ops' are.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch

from ..formats.int4 import HALF_DTYPES
from ..runtime.device import check_devices, device_of, pdl, sms_for, use_triton
from ..runtime.dispatch import define_op
from ..runtime.launch import Launch
from ..runtime.plan import keep, run_steady
from .common import SYNC_CAP, sync_buffer

# Cached tokens per step of a program's loop: 128 (64 for head dims > 128, whose 128-token
# tiles at 4 warps the sweep left out for their registers). H100 sweep (docs/perf_log.md v45,
# benchmarks/probes/decode_attention_sweep.py): 128 with 4 warps was the best tile at every
# point of 32/8 and 32/4 heads, batch 1 and 16, 1024 and 4096 tokens.
BLOCK_N = 128
MAX_SPLITS = 32  # cache chunks per (sequence, KV head) at most (the combine reads them all at once)
COMBINE_TILE = 4096  # fp32 partial-output values the combine loads at once (32 registers a thread)
HEAD_DIMS = (16, 32, 64, 128, 256)


@lru_cache(maxsize=None)
def _kernel():
    """kernels.attention's kernel, imported on first use (after TRITON_INTERPRET is settled)."""
    from ..kernels.attention import decode_attention_kernel
    return decode_attention_kernel


class _AttnPlans:
    """run_steady's view of the kept launches (no config to tune: the splits follow from the
    shapes and the GPU's SM count)."""
    plans: dict = {}


# ----------------------------------------------------------------------------------
# Reference (the contract)
# ----------------------------------------------------------------------------------
def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                               scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v in fp32, grouped-query heads, fully masked rows 0:
    q (B, Hq, 1, D), k / v (B, Hkv, L, D) -> (B, 1, Hq, D) in q's dtype."""
    B, hq, _, D = q.shape
    hkv, L = k.shape[1], k.shape[2]
    g = hq // hkv
    qf = q.float().reshape(B, hkv, g, D)
    s = torch.einsum("bhgd,bhld->bhgl", qf, k.float()) * scale
    if mask is not None:
        m = mask.expand(B, hq, 1, L).reshape(B, hkv, g, L)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    out = torch.einsum("bhgl,bhld->bhgd", p, v.float())
    return out.reshape(B, 1, hq, D).to(q.dtype)


# ----------------------------------------------------------------------------------
# Checks (shared by the op and its fake implementation)
# ----------------------------------------------------------------------------------
def decode_attention_problem(q, k, v, mask, scale) -> Optional[Exception]:
    """What is wrong with the operands (the TypeError / ValueError check_decode_attention raises),
    or None: the one list of what the kernel takes, also asked by the model's attention function
    (fuse.sailfish_attention), which runs sdpa instead where there is a problem. Devices aside."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            return ValueError(f"{name} must be 4-D (batch, heads, tokens, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in HALF_DTYPES:
            return TypeError(f"{name} dtype {t.dtype} is not supported; allowed: float16, bfloat16")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {tuple(t.stride())}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, hq, sq, D = q.shape
    if sq != 1:
        return ValueError(f"q must hold one token per sequence (decode): q.shape[2] must be 1, got {sq}")
    if D not in HEAD_DIMS:
        return ValueError(f"head_dim {D} is not supported; allowed: {HEAD_DIMS}")
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        return ValueError(f"k and v must have shape ({B}, Hkv, L, {D}) alike, got {tuple(k.shape)} and {tuple(v.shape)}")
    hkv, L = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv:
        return ValueError(f"q's {hq} heads must be a multiple of k's {hkv} heads")
    if L == 0:
        return ValueError("k and v must hold at least one token (L > 0)")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            return TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            return TypeError(f"mask dtype {mask.dtype} is not supported; allowed: bool (True: attend) or a float dtype "
                             "(added to the scores)")
        if (mask.dim() != 4 or mask.shape[0] not in (1, B) or mask.shape[1] not in (1, hq) or mask.shape[2] != 1
                or mask.shape[3] != L):
            return ValueError(f"mask must have shape ({B} or 1, 1 or {hq}, 1, {L}), got {tuple(mask.shape)}")
    if not isinstance(scale, (float, int)) or not math.isfinite(scale):
        return ValueError(f"scale must be a finite float, got {scale!r}")
    return None


def check_decode_attention(q, k, v, mask, scale, fake: bool = False) -> None:
    problem = decode_attention_problem(q, k, v, mask, scale)
    if problem is not None:
        raise problem
    check_devices(fake, q=q, k=k, v=v, mask=mask)


# ----------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------
def _splits(programs: int, L: int, g: int, device: torch.device) -> int:
    """Splits of the cache per (sequence, KV head): up to one program per SM, each split at
    least 128 tokens a KV head with up to 4 query heads on it (256 at 8, 512 at 16: the partial
    outputs and the combine grow with the heads); 1 when the counters would not cover the
    programs. H100 sweep (docs/perf_log.md v45): at batch 1 and 1024 tokens 8 splits for 32/8
    heads (7.7 us, the old rule's 16 took 8.9) and 4 for 32/4 (10.3 us; 16 took 15.2); at batch 16
    1-2. (The interpreter counts an H100's SMs, runtime/device.sms_for, so it runs the splits a
    GPU would.)"""
    if programs > SYNC_CAP:
        return 1
    floor = 128 * max(1, g // 4)
    return max(1, min(L // floor, sms_for(device) // programs, MAX_SPLITS))


def decode_attention_launch(q, k, v, mask, scale: float, splits: Optional[int] = None,
                            block_n: Optional[int] = None, num_warps: int = 4) -> torch.Tensor:
    """The kernel on checked operands; splits: the number of cache chunks (default _splits's),
    block_n / num_warps: the loop's tile (default BLOCK_N, 64 for head dims > 128) and the
    program's warps (tests and benchmarks/probes/decode_attention_sweep.py pass others)."""
    if block_n is None:
        block_n = BLOCK_N if q.shape[-1] <= 128 else 64
    if block_n not in (16, 32, 64, 128) or num_warps not in (1, 2, 4, 8):
        raise ValueError(f"block_n={block_n} / num_warps={num_warps} not supported; allowed: block_n 16, 32, 64, 128 "
                         "and num_warps 1, 2, 4, 8")
    B, hq, _, D = q.shape
    hkv, L = k.shape[1], k.shape[2]
    g = hq // hkv
    programs = B * hkv
    if splits is None:
        splits = _splits(programs, L, g, q.device)
    if splits > 1 and programs > SYNC_CAP:
        raise ValueError(f"splits={splits} needs one counter per (sequence, KV head): {programs} > {SYNC_CAP}")
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits={splits} is not supported; allowed: 1..{MAX_SPLITS}")
    chunk = -(-(-(-L // splits)) // block_n) * block_n  # whole block_n steps per split
    splits = -(-L // chunk)
    out = q.new_empty((B, 1, hq, D))
    if splits > 1:
        ws = torch.empty((splits, B * hq, D), dtype=torch.float32, device=q.device)
        ml = torch.empty((splits, B * hq, 2), dtype=torch.float32, device=q.device)
        cnt = sync_buffer(q.device, q.get_device())
    else:
        ws = ml = cnt = out  # (unused)
    if mask is None:
        kind, m, ms = 0, q, (0, 0, 0)
    else:
        kind = 1 if mask.dtype == torch.bool else 2
        m = mask.view(torch.uint8) if kind == 1 else mask
        ms = tuple(0 if m.shape[i] == 1 else m.stride(i) for i in (0, 1, 3))
    ints = (hkv, L, chunk, float(scale), q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), *ms, out.stride(0), out.stride(2))
    operands = (q, k, v, m, out, ws, ml, cnt)
    grid = (programs, splits)
    key = None
    if q.is_cuda:
        dev = q.get_device()
        key = (dev, q.dtype, m.dtype, kind, g, D, grid, ints, block_n, num_warps)
        if run_steady(_AttnPlans, key, dev, q, grid, operands, ints):
            return out
    g_p2, s_p2 = 1 << (g - 1).bit_length(), 1 << (splits - 1).bit_length()
    meta = dict(G=g, BLOCK_G=max(16, g_p2), D=D, BLOCK_N=block_n, SPLITS=splits, MASK=kind,
                EMU_BF16=q.dtype is torch.bfloat16 and not q.is_cuda, SPLITS_P2=s_p2, G_P2=g_p2,
                CS=max(1, min(s_p2, COMBINE_TILE // (g_p2 * D))), num_warps=num_warps, num_stages=3,
                PDL_EARLY=pdl(q.get_device()))  # (a row kernel after it may launch early: ops/common as_dependent)
    launch = Launch(_kernel(), meta, q.get_device())
    with device_of(q):
        launch(grid, *operands, *ints)
    keep(None if key is None else _AttnPlans.plans, key, launch, *operands)
    return out


# ----------------------------------------------------------------------------------
# torch.library op (inference only: no derivative)
# ----------------------------------------------------------------------------------
def decode_attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                          scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for one query token per sequence: see the module's doc."""
    check_decode_attention(q, k, v, mask, scale)
    if use_triton(q):
        return decode_attention_launch(q, k, v, mask, scale)
    return decode_attention_reference(q, k, v, mask, scale)


def _decode_attention_fake(q, k, v, mask, scale):
    check_decode_attention(q, k, v, mask, scale, fake=True)
    return q.new_empty((q.shape[0], 1, q.shape[1], q.shape[3]))


decode_attention = define_op("decode_attention", "(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor",
                             decode_attention_impl, _decode_attention_fake)
