"""The MoE router's softmax + top-k (+ renormalisation) in one launch (launcher, reference and op:
ops/router.py).

Why: in a compiled decode step transformers' router is, after its F.linear, inductor's softmax,
torch.topk as two kernels (a bitonic sort and a gather) and the renormalisation: ~9 us a layer
at batch 1 on an H100 (docs/perf_log.md v44), for a row of 8 to 512 numbers.

Design (why):
- One program per ROWS tokens, each row (E experts, BLOCK_E >= E) in registers: the softmax in
  fp32 as torch computes it (m = max, e = exp(x - m), s = sum e, p = e / s with an IEEE division),
  then top_k rounds of "take the largest": the ids come out in torch.topk's descending order.
- The selection ranks the logits, not the probabilities: exp is monotone, so the order is the
  same wherever the rounded probabilities are distinct, and the logits are exact (no tie made by
  rounding). Each logit becomes an order-preserving int32 key (the float's bits with the
  magnitude bits flipped for negatives; -0 first made +0), NaN the largest key (torch.topk ranks
  NaN above everything); key and (BLOCK_E - 1 - column) packed in an int64 make each round ONE
  max reduction whose winner is the largest logit, ties to the lowest index. Taken and padding
  columns get INT64_MIN, below every key.
- The chosen logit is the key decoded (the transform is its own inverse), so each selected
  probability is recomputed from it with the same instructions as the row's e: no second
  reduction to fetch it. NaN decodes to a NaN.
- Non-finite rows follow from the formula, as torch's: a NaN or +Inf logit (x - m is NaN there)
  or an all -Inf row makes s NaN, hence every weight NaN.
- Renormalisation: the k probabilities over their sum, an IEEE division.
- T is not specialized (do_not_specialize): one bound kernel per (device, dtype, E, k, flags,
  row stride) whatever the number of tokens (ops/router.py keeps it as rowwise's plans).
- bf16 under the interpreter: loaded with w4a8.to_f32, stored with integer rounding (EMU_BF16).
"""
import triton
import triton.language as tl

from .common import cast_out
from .w4a8 import to_f32

INT64_MIN = tl.constexpr(-2**63)


@triton.jit
def _keys(x):
    """fp32 -> int32 keys in the floats' order (-0 as +0; NaN the largest, as torch.topk ranks it)."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    k = b ^ ((b >> 31) & 0x7FFFFFFF)
    return tl.where(x != x, 0x7FFFFFFF, k)


@triton.jit
def _unkey(k):
    """The inverse of _keys (a NaN key gives a NaN)."""
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["T"])
def router_topk_kernel(x_ptr, w_ptr, id_ptr, T, E, stride_xt,
                       K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                       RENORM: tl.constexpr, EMU_BF16: tl.constexpr):
    """x (T, E) logits, rows stride_xt apart -> w (T, K) the top-K softmax probabilities in
    descending order (RENORM: over their sum) in w's dtype, id (T, K) int64 their columns."""
    OUT: tl.constexpr = w_ptr.dtype.element_ty
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_E)[None, :]
    mask = row_ok[:, None] & (cols < E)
    x = to_f32(tl.load(x_ptr + rows[:, None] * stride_xt + cols, mask=mask, other=0.0))
    x = tl.where(mask, x, float("-inf"))
    m = tl.max(x, axis=1)[:, None]
    s = tl.sum(tl.where(mask, tl.exp(x - m), 0.0), axis=1)[:, None]
    packed = (_keys(x).to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)
    packed = tl.where(mask, packed, INT64_MIN)
    kcols = tl.arange(0, BLOCK_K)[None, :]
    best = tl.full((ROWS, BLOCK_K), INT64_MIN, tl.int64)
    for j in range(K):
        top = tl.max(packed, axis=1)[:, None]
        best = tl.where(kcols == j, top, best)
        packed = tl.where(packed == top, INT64_MIN, packed)
    ids = BLOCK_E - 1 - (best - ((best >> 32) << 32))  # (the low 32 bits, in int64 arithmetic)
    p = tl.math.div_rn(tl.exp(_unkey((best >> 32).to(tl.int32)) - m), s)
    if RENORM:
        p = tl.math.div_rn(p, tl.sum(tl.where(kcols < K, p, 0.0), axis=1)[:, None])
    out = row_ok[:, None] & (kcols < K)
    tl.store(w_ptr + rows[:, None] * K + kcols, cast_out(p, OUT, EMU_BF16), mask=out)
    tl.store(id_ptr + rows[:, None] * K + kcols, ids, mask=out)
