"""W4A8 (QQQ) kernels: per-token int8 activation quantization and the int8 x int4 GEMM.

Math and layouts: formats/qqq.py. Design (why):
- Rounding without libdevice and without relying on FMA contraction: a float32 v with
  |v| <= 127 is rounded half-to-even by adding 1.5 * 2**23 (the sum's ulp is 1); the
  rounded integer is then read from the sum's low mantissa bits (bits - 0x4B400000),
  which also avoids a float -> int conversion instruction. The add is always preceded
  by a clamp (min/max), never directly by a multiply, so the compiler cannot fuse it
  into an FMA that would round differently from the reference (activations), or the
  product is exact anyway (weights: fp16 scale x 4-bit integer).
- Per-row reciprocal with tl.math.div_rn: Triton's fp32 `/` is the approximate
  div.full.f32 on NVIDIA, which would not match the PyTorch reference bit for bit.
- GEMM, "swap AB" as the W4A16 kernel: each program computes acc^T[n, m] =
  w8[n, :] . x_q[m, :] with tl.dot(w8 (BLOCK_N, BLOCK_K), trans(x_q (BLOCK_M, BLOCK_K))).
  Both operands are K-contiguous (the weight rows are packed along K, x_q is row-major),
  which is what 8-bit wgmma needs on Hopper (both operands K-major); the small batch
  dimension M is the MMA's N dimension (>= 16), so decode M = 1 runs on tensor cores.
- int8 x int8 -> int32 accumulation is exact. Split-K: each K slice stores its int32
  partial tile in a workspace (SPLIT_K, M, N) and `_w4a8_splitk_reduce_kernel` adds the
  slices (exact, so deterministic) and applies the epilogue: two launches, no memset
  (cheaper at decode than int32 atomics into a zeroed buffer, which needs a third).
- Epilogue y = (float(acc) * s_ch[n]) * s_tok[m] (+ bias) in float32, stored in the
  output dtype through common.cast_out (bf16 under the interpreter: see common.py).
- Three paths (tuning.Config.kernel), after the W4A16 measurements on H200 (commit
  0efbcce): "mma" the fused tensor-core tiles above; "gemv" for M = 1, int32
  multiply-adds on CUDA cores (at M = 1 moving the unpacked tile into the tensor-core
  operand layout costs more than the arithmetic: W4A16 166 -> 122 us); "dequant" for
  large M, the int8 weight written once by `_w4a8_dequant_kernel`, then cuBLAS's int8
  GEMM (torch._int_mm) and the epilogue in `_w4a8_splitk_reduce_kernel`.
- Codes are unpacked with tl.join (common._unpack8), not a broadcast-and-shift over a new
  axis, which spread a word's 8 nibbles over 8 threads that each re-read it from shared
  memory (W4A16: 296 vs 16 ld.shared per iteration, M=1 240 -> 167 us).
- 64-bit offsets wherever a product of a row index and a row length can pass 2**31
  elements: activation / output / workspace rows (M * N reaches 2**31 at M = 37450 on
  N = 57344), the weight rows (N * Kp / 8 words) and the split-K slices. Offsets within a
  row, and the group-scale offsets (N * Kp / 128 < 2**31 for any weight under 64 GiB), stay
  32-bit. tests/test_w4a8.py checks the compiled IR for this.
- A token (row) holding NaN or +-Inf gets scale NaN and x_q = 0, so all of its outputs are
  NaN (a float matmul's output row would be non-finite too), never silently finite:
  tl.max / tl.maximum drop NaN, so non-finite values are mapped to +Inf before the max and
  an infinite max marks the row.
"""
import triton
import triton.language as tl

from .common import _unpack8, cast_out, grouped_tile, split_k_range

_RND = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + _RND has ulp 1 for |x| <= 2**22
_RND_BITS = tl.constexpr(0x4B400000)  # bit pattern of _RND
_INF = tl.constexpr(float("inf"))


@triton.jit
def _round_i8(v):
    """float32 -> int32 in [-127, 127]: clamp, round half to even (see module docstring)."""
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    return (v + _RND).to(tl.int32, bitcast=True) - _RND_BITS


@triton.jit
def _to_f32(x):
    """fp16/bf16/fp32 -> fp32, exact. bf16 is widened by a 16-bit shift (what the hardware
    does): Triton 3.9's interpreter flushes bf16 subnormals in its bf16 -> fp32 cast."""
    if x.dtype == tl.bfloat16:
        y = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


# ----------------------------------------------------------------------------------
# Activation quantization
# ----------------------------------------------------------------------------------
@triton.jit
def _abs_or_inf(x):
    """|x|, with NaN mapped to +Inf: tl.max / tl.maximum drop NaN, so a NaN would vanish
    from the row maximum; this way the maximum is +Inf exactly when the row is not finite."""
    return tl.where(x == x, tl.abs(x), _INF)


@triton.jit
def _quantize_per_token_kernel(x_ptr, xq_ptr, s_ptr, K, stride_xm, stride_qm,
                               BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    """x (M, K) fp16/bf16 -> x_q int8 (M, K), s float32 (M,). One program per row.

    ONE_PASS: the row fits in one BLOCK_K tile and stays in registers; otherwise a
    max pass and a quantize pass over the row (the second one mostly hits L2).
    A row holding NaN or +-Inf: s = NaN, x_q = 0 (formats.qqq.quantize_activations).
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = xq_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:
        x = _to_f32(tl.load(x_row + offs, mask=offs < K, other=0.0))
        amax = tl.max(_abs_or_inf(x), axis=0)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xk = _to_f32(tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0))
            amax = tl.maximum(amax, _abs_or_inf(xk))
        amax = tl.max(amax, axis=0)
    bad = amax == _INF  # a NaN or an Inf in the row; then den = inf, inv = 0 and x is zeroed
    # tiny rows: scale by 2**64 first (exact) so that 127 / amax cannot overflow
    c = tl.where(amax < 8.673617379884035e-19, 1.8446744073709552e19, 1.0)
    den = tl.where(amax > 0.0, amax * c, 1.0)
    inv = tl.where(amax > 0.0, tl.math.div_rn(tl.full((), 127.0, tl.float32), den), 0.0)
    # NaN scale for a bad row as inf - inf: a NaN global constexpr never equals itself, so
    # Triton (3.6) takes it for a changed global and refuses to launch the cached kernel
    tl.store(s_ptr + row, tl.where(bad, amax - amax, tl.math.div_rn(amax, tl.full((), 127.0, tl.float32))))
    if ONE_PASS:
        x = tl.where(bad, 0.0, x)  # inf * 0 would be NaN, which no int8 can hold
        tl.store(q_row + offs, _round_i8((x * c) * inv).to(tl.int8), mask=offs < K)
    else:
        for k0 in range(0, K, BLOCK_K):
            xk = _to_f32(tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0))
            xk = tl.where(bad, 0.0, xk)
            tl.store(q_row + k0 + offs, _round_i8((xk * c) * inv).to(tl.int8), mask=k0 + offs < K)


# ----------------------------------------------------------------------------------
# GEMM
# ----------------------------------------------------------------------------------
@triton.jit
def _int8_weight(words, sg_ptr, rn, k0, stride_gn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """int32 (BLOCK_N, BLOCK_K // 8) packed codes -> w8 as int32 (BLOCK_N, BLOCK_K), values
    in [-127, 127] (formats.qqq.codes_to_int8); GROUP_SIZE 0: per-channel, w8 = q - 8."""
    # One return at the end: the compiler (unlike the interpreter) keeps generating the
    # statements after a `return` inside a constexpr `if`.
    q = _unpack8(words, BLOCK_N, BLOCK_K)
    if GROUP_SIZE == 0:
        w8 = q - 8
    else:
        # (q | 0x4B000000) read as fp32 is 2**23 + q exactly; minus (2**23 + 8) gives q - 8
        t = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        if BLOCK_K <= GROUP_SIZE:
            s = tl.load(sg_ptr + rn * stride_gn + k0 // GROUP_SIZE).to(tl.float32)
            w8 = _round_i8(t * s[:, None])  # the product is exact
        else:
            NG: tl.constexpr = BLOCK_K // GROUP_SIZE
            g = k0 // GROUP_SIZE + tl.arange(0, NG)
            s = tl.load(sg_ptr + rn[:, None] * stride_gn + g[None, :]).to(tl.float32)
            t3 = tl.reshape(t, (BLOCK_N, NG, GROUP_SIZE))
            w8 = tl.reshape(_round_i8(t3 * s[:, :, None]), (BLOCK_N, BLOCK_K))
    return w8


@triton.jit
def _epilogue(acc, xs_ptr, sch_ptr, bias_ptr, rm, rn, HAS_BIAS: tl.constexpr):
    """int32 acc^T (BLOCK_N, BLOCK_M) -> float32 y^T = (acc * s_ch[n]) * s_tok[m] (+ bias[n])."""
    s_ch = tl.load(sch_ptr + rn)
    s_tok = tl.load(xs_ptr + rm)
    y = (acc.to(tl.float32) * s_ch[:, None]) * s_tok[None, :]
    if HAS_BIAS:
        y = y + _to_f32(tl.load(bias_ptr + rn))[:, None]
    return y


@triton.jit
def _w4a8_kernel(
    xq_ptr, xs_ptr, qw_ptr, sch_ptr, sg_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, stride_qn, stride_gn,
    GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr, RAW: tl.constexpr, EMU_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """x_q int8 (M, K) row-major, s_tok float32 (M,); qweight int32 (N, Kp // 8);
    s_ch float32 (N,); s_g float16 (N, Kp // 128) (GROUP_SIZE = 128; 0: per-channel).

    Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT_K). y is (M, N) in the output
    dtype, or int32 when RAW (the accumulator itself). SPLIT_K > 1: y is the int32
    workspace (SPLIT_K, M, N), slice pid_k gets this program's partial sum.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # wrap out-of-range rows/channels onto valid ones: unmasked loads, results dropped
    rm = offs_m % M
    rn = offs_n % N

    kt0, kt1 = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)

    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = qw_ptr + rn.to(tl.int64)[:, None] * stride_qn + (kt0 * (BLOCK_K // 8) + offs_w)[None, :]
    x_ptrs = xq_ptr + rm.to(tl.int64)[:, None] * stride_xm + (kt0 * BLOCK_K + offs_k)[None, :]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    for kt in range(kt0, kt1):
        k0 = kt * BLOCK_K
        words = tl.load(w_ptrs, eviction_policy="evict_first")
        if EVEN_K:
            x = tl.load(x_ptrs, eviction_policy="evict_last")
        else:
            x = tl.load(x_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0, eviction_policy="evict_last")
        w8 = _int8_weight(words, sg_ptr, rn, k0, stride_gn, BLOCK_N, BLOCK_K, GROUP_SIZE).to(tl.int8)
        acc = tl.dot(w8, tl.trans(x), acc, out_dtype=tl.int32)  # triton 3.6 needs it spelled out
        w_ptrs += BLOCK_K // 8
        x_ptrs += BLOCK_K

    out_mask = (offs_m < M)[None, :] & (offs_n < N)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]  # M * N may pass 2**31
    if SPLIT_K > 1:
        tl.store(y_ptrs + pid_k.to(tl.int64) * M * N, acc, mask=out_mask)
    elif RAW:
        tl.store(y_ptrs, acc, mask=out_mask)
    else:
        y = _epilogue(acc, xs_ptr, sch_ptr, bias_ptr, rm, rn, HAS_BIAS)
        tl.store(y_ptrs, cast_out(y, y_ptr.dtype.element_ty, EMU_BF16), mask=out_mask)


@triton.jit
def _w4a8_gemv_kernel(
    xq_ptr, xs_ptr, qw_ptr, sch_ptr, sg_ptr, bias_ptr, y_ptr,
    N, K, stride_qn, stride_gn,
    GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr, RAW: tl.constexpr, EMU_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """M = 1: acc[n] = sum_k x_q[k] * w8[n, k] with int32 multiply-adds on CUDA cores into a
    (BLOCK_N, BLOCK_K) accumulator reduced once at the end. Same operands, outputs and
    split-K protocol as _w4a8_kernel. Grid: (cdiv(N, BLOCK_N), SPLIT_K)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N
    kt0, kt1 = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = qw_ptr + rn.to(tl.int64)[:, None] * stride_qn + (kt0 * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8))[None, :]
    x_ptrs = xq_ptr + kt0 * BLOCK_K + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    for kt in range(kt0, kt1):
        k0 = kt * BLOCK_K
        words = tl.load(w_ptrs, eviction_policy="evict_first")
        if EVEN_K:
            xv = tl.load(x_ptrs, eviction_policy="evict_last")
        else:
            xv = tl.load(x_ptrs, mask=k0 + offs_k < K, other=0, eviction_policy="evict_last")
        w8 = _int8_weight(words, sg_ptr, rn, k0, stride_gn, BLOCK_N, BLOCK_K, GROUP_SIZE)
        acc += w8 * xv.to(tl.int32)[None, :]
        w_ptrs += BLOCK_K // 8
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    mask = offs_n < N
    if SPLIT_K > 1:
        tl.store(y_ptr + pid_k.to(tl.int64) * N + offs_n, out, mask=mask)
    elif RAW:
        tl.store(y_ptr + offs_n, out, mask=mask)
    else:
        y = (out.to(tl.float32) * tl.load(sch_ptr + rn)) * tl.load(xs_ptr)
        if HAS_BIAS:
            y = y + _to_f32(tl.load(bias_ptr + rn))
        tl.store(y_ptr + offs_n, cast_out(y, y_ptr.dtype.element_ty, EMU_BF16), mask=mask)


@triton.jit
def _w4a8_dequant_kernel(qw_ptr, sg_ptr, w_ptr, N, K, stride_qn, stride_gn, stride_wn,
                         GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Write w8 int8 (N, K) (the large-M path hands the product to cuBLAS).
    Grid: (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K)); BLOCK_K must divide Kp."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rn = offs_n % N
    words = tl.load(qw_ptr + rn.to(tl.int64)[:, None] * stride_qn + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :])
    w8 = _int8_weight(words, sg_ptr, rn, k0, stride_gn, BLOCK_N, BLOCK_K, GROUP_SIZE)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    tl.store(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], w8.to(tl.int8), mask=mask)


@triton.jit
def _w4a8_splitk_reduce_kernel(ws_ptr, xs_ptr, sch_ptr, bias_ptr, y_ptr, M, N, stride_ym,
                               SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, RAW: tl.constexpr,
                               EMU_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 ws (SPLIT_K, M, N) -> y (M, N): the exact int32 sum over the slices, then the
    epilogue of _w4a8_kernel (RAW: the int32 sum itself). Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[None, :] & (offs_n < N)[:, None]
    rm = offs_m % M
    rn = offs_n % N
    # 64-bit: M * N passes 2**31 at M = 37450 on N = 57344 (the dequant path's large M)
    ws_ptrs = ws_ptr + rm.to(tl.int64)[None, :] * N + rn[:, None]
    mn = tl.cast(M, tl.int64) * N  # one workspace slice
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptrs + s * mn)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    if RAW:
        tl.store(y_ptrs, acc, mask=mask)
    else:
        y = _epilogue(acc, xs_ptr, sch_ptr, bias_ptr, rm, rn, HAS_BIAS)
        tl.store(y_ptrs, cast_out(y, y_ptr.dtype.element_ty, EMU_BF16), mask=mask)
