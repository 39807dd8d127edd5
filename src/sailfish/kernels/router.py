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

router_linear_topk_kernel adds the router's F.linear (ops/router.py router_linear_topk):
- The weight (E x H, 512 KB for Qwen3-MoE) is too much for one program to stream at decode, so
  the logits are spread over a grid of (expert slices, token blocks): each program a SLICE_E x
  BLOCK_T tile of logits, a K loop over H in fixed BLOCK_H steps with fp32 sums of exact
  products (CUDA cores: at T <= 16 a tensor-core tile would be mostly padding), stored rounded
  to the logits' dtype.
- The last program of a token block to finish (kernels/common.arrive_last, one counter per
  token block from SYNC_TILES on, in the stream's ops/common.sync_buffer) reads the block's
  rounded logits back past L1 (.cg: other SMs wrote them) and ranks them with router_topk's code
  (_topk_rows), ROWS rows at a time. No atomics on values: the same bits run to run.
"""
import triton
import triton.language as tl

from .common import SYNC_TILES, arrive_last, cast_out
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


@triton.jit
def _topk_rows(x_ptr, rows, w_ptr, id_ptr, T, E, stride_xt,
               K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
               RENORM: tl.constexpr, EMU_BF16: tl.constexpr, CACHE: tl.constexpr):
    """The rows `rows` (ROWS of them, those >= T skipped) of x (T, E) logits, rows stride_xt apart,
    loaded with CACHE (".cg": logits other programs of the launch wrote) -> their top-K softmax
    probabilities in descending order (RENORM: over their sum) in w's dtype and int64 columns."""
    OUT: tl.constexpr = w_ptr.dtype.element_ty
    row_ok = rows < T
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_E)[None, :]
    mask = row_ok[:, None] & (cols < E)
    x = to_f32(tl.load(x_ptr + rows[:, None] * stride_xt + cols, mask=mask, other=0.0, cache_modifier=CACHE))
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


@triton.jit(do_not_specialize=["T"])
def router_topk_kernel(x_ptr, w_ptr, id_ptr, T, E, stride_xt,
                       K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                       RENORM: tl.constexpr, EMU_BF16: tl.constexpr):
    """x (T, E) logits, rows stride_xt apart -> w (T, K) the top-K softmax probabilities in
    descending order (RENORM: over their sum) in w's dtype, id (T, K) int64 their columns."""
    _topk_rows(x_ptr, tl.program_id(0) * ROWS + tl.arange(0, ROWS), w_ptr, id_ptr, T, E, stride_xt,
               K, BLOCK_E, BLOCK_K, ROWS, RENORM, EMU_BF16, "")


@triton.jit(do_not_specialize=["T"])
def router_linear_topk_kernel(x_ptr, g_ptr, l_ptr, w_ptr, id_ptr, cnt_ptr, T, E, H, stride_xt, stride_ge,
                              K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                              RENORM: tl.constexpr, EMU_BF16: tl.constexpr, SLICE_E: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, EMU_LOGITS: tl.constexpr,
                              STAGES: tl.constexpr):
    """The whole router: l (T, E) = x (T, H) @ g (E, H)^T (fp32 sums, one rounding to l's dtype),
    then router_topk_kernel's w (T, K) and id (T, K) from l. Program (i, j): experts
    [i * SLICE_E, (i + 1) * SLICE_E) of tokens [j * BLOCK_T, (j + 1) * BLOCK_T); the last of the
    token block's programs to finish (its counter: cnt_ptr[SYNC_TILES + j]) ranks the block's rows,
    ROWS at a time, from the rounded logits read back. EMU_BF16 / EMU_LOGITS: the weights / the
    logits are bf16 under the interpreter."""
    L: tl.constexpr = l_ptr.dtype.element_ty
    t0 = tl.program_id(1) * BLOCK_T
    t = t0 + tl.arange(0, BLOCK_T)
    e = tl.program_id(0) * SLICE_E + tl.arange(0, SLICE_E)
    t_ok = t < T
    e_ok = e < E
    t = t.to(tl.int64)
    e = e.to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_T, SLICE_E), tl.float32)
    # Fixed BLOCK_H steps over H, each a fixed-shape sum: the same order run to run. The products
    # of two fp16 / bf16 values are exact in fp32, so only the sums round. STAGES > 1: the loads
    # of the next steps in flight (cp.async on sm_90), for the several-step loops of T > 1.
    for h0 in tl.range(0, H, BLOCK_H, num_stages=STAGES):
        hh = h0 + h
        h_ok = hh < H
        xb = to_f32(tl.load(x_ptr + t[:, None] * stride_xt + hh[None, :], mask=t_ok[:, None] & h_ok[None, :],
                            other=0.0))
        gb = to_f32(tl.load(g_ptr + e[:, None] * stride_ge + hh[None, :], mask=e_ok[:, None] & h_ok[None, :],
                            other=0.0))
        acc += tl.sum(xb[:, None, :] * gb[None, :, :], axis=2)
    tl.store(l_ptr + t[:, None] * E + e[None, :], cast_out(acc, L, EMU_LOGITS), mask=t_ok[:, None] & e_ok[None, :])
    if arrive_last(cnt_ptr + SYNC_TILES + tl.program_id(1), tl.num_programs(0)):
        for r0 in range(0, BLOCK_T, ROWS):
            _topk_rows(l_ptr, t0 + r0 + tl.arange(0, ROWS), w_ptr, id_ptr, T, E, E,
                       K, BLOCK_E, BLOCK_K, ROWS, RENORM, EMU_BF16, ".cg")
