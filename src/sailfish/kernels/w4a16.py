"""W4A16 GEMM kernels: y = x @ W^T (+ bias), x fp16/bf16, W 4-bit (formats.int4.PackedW4).

Design (why, see docs/perf_log.md for the measurements):
- "Swap AB": each program computes the transposed tile y^T[n, m] = W[n, :] @ x[m, :]^T,
  so the dequantized weight is the *left* operand of tl.dot. On Hopper that lets the
  compiler feed it to wgmma straight from registers, and the small batch dimension M
  becomes the MMA's N dimension (>= 16), so even M = 1 runs on tensor cores with
  BLOCK_N = 64..256 output channels per program.
- Each packed int32 word is loaded exactly once, 4 words (32 channels) per 16-byte
  vector load, with eviction_policy="evict_first" (weights are streamed once), and
  unpacked in registers by shifting it into 8 lanes; activations use "evict_last"
  (every N tile rereads them).
- int4 -> fp16/bf16 by the exponent trick: (q | 0x6400) read as fp16 is 1024 + q, so
  one OR and one subtraction of (1024 + zero) give q - zero exactly (bf16: 0x4300 = 128).
- Split-K over a fixed partition of the K tiles when there are too few output tiles
  to fill the GPU; partial sums go to an fp32 workspace and `_splitk_reduce_kernel`
  adds them in a fixed order, so results are deterministic run to run.
- Grouped (swizzled) tile order for L2 reuse of x and W tiles at large M.
"""
import triton
import triton.language as tl

from .common import cast_out, round_bf16_emu


@triton.jit
def _dequant(words, s_ptr, z_ptr, gidx_ptr, rn, k0, stride_sn,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
             HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, DTYPE: tl.constexpr,
             EMU_BF16: tl.constexpr):
    """int32 (BLOCK_N, BLOCK_K // 8) packed words -> (BLOCK_N, BLOCK_K) weights in DTYPE
    (EMU_BF16: fp32 holding the bf16 values; see common.py)."""
    shifts = tl.arange(0, 8) * 4
    q = (words[:, :, None] >> shifts[None, None, :]) & 0xF
    q = tl.reshape(q, (BLOCK_N, BLOCK_K))
    if EMU_BF16:
        w = (q | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + q, exact
        MAGIC: tl.constexpr = 8388608.0
        CT: tl.constexpr = tl.float32
    elif DTYPE == tl.float16:
        w = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + q, exact
        MAGIC: tl.constexpr = 1024.0
        CT: tl.constexpr = tl.float16
    else:
        w = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q, exact
        MAGIC: tl.constexpr = 128.0
        CT: tl.constexpr = tl.bfloat16
    if HAS_GIDX:
        # general act-order: every channel carries its own group index
        g = tl.load(gidx_ptr + k0 + tl.arange(0, BLOCK_K))
        sz_off = rn[:, None] * stride_sn + g[None, :]
        s = tl.load(s_ptr + sz_off).to(CT)
        if HAS_ZEROS:
            zb = tl.load(z_ptr + sz_off).to(CT) + MAGIC
        else:
            zb = tl.full((BLOCK_N, BLOCK_K), MAGIC + 8.0, CT)
        w = (w - zb) * s
    elif GROUP_SIZE == 0 or BLOCK_K <= GROUP_SIZE:
        # one group in this K tile (GROUP_SIZE == 0: one group per output channel)
        g0 = 0 if GROUP_SIZE == 0 else k0 // GROUP_SIZE
        s = tl.load(s_ptr + rn * stride_sn + g0).to(CT)
        if HAS_ZEROS:
            zb = tl.load(z_ptr + rn * stride_sn + g0).to(CT) + MAGIC
            w = (w - zb[:, None]) * s[:, None]
        else:
            w = (w - (MAGIC + 8.0)) * s[:, None]
    else:
        # BLOCK_K spans NG whole groups: scale each slice of GROUP_SIZE channels
        NG: tl.constexpr = BLOCK_K // GROUP_SIZE
        g = k0 // GROUP_SIZE + tl.arange(0, NG)
        sz_off = rn[:, None] * stride_sn + g[None, :]
        s = tl.load(s_ptr + sz_off).to(CT)
        w3 = tl.reshape(w, (BLOCK_N, NG, GROUP_SIZE))
        if HAS_ZEROS:
            zb = tl.load(z_ptr + sz_off).to(CT) + MAGIC
            w3 = (w3 - zb[:, :, None]) * s[:, :, None]
        else:
            w3 = (w3 - (MAGIC + 8.0)) * s[:, :, None]
        w = tl.reshape(w3, (BLOCK_N, BLOCK_K))
    if EMU_BF16:
        w = round_bf16_emu(w)
    return w


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, bias_ptr, y_ptr, ws_ptr,
    M, N, K, Kp, stride_xm, stride_ym, stride_qn, stride_sn,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, EMU_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """x (M, K) row-major; qweight int32 (N, Kp // 8); scales/zeros (N, Gp); y (M, N).

    Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT_K). With SPLIT_K > 1 the fp32
    partial tile goes to ws (SPLIT_K, M, N) and bias/cast happen in the reduce kernel.
    """
    DTYPE = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row-tiles share each weight tile while it is in L2
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # wrap out-of-range rows/channels onto valid ones: unmasked loads, results dropped
    rm = offs_m % M
    rn = offs_n % N

    k_tiles = Kp // BLOCK_K
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)

    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = qw_ptr + rn[:, None] * stride_qn + (kt0 * (BLOCK_K // 8) + offs_w)[None, :]
    x_ptrs = x_ptr + rm[None, :] * stride_xm + (kt0 * BLOCK_K + offs_k)[:, None]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(kt0, kt1):
        k0 = kt * BLOCK_K
        words = tl.load(w_ptrs, eviction_policy="evict_first")
        if EVEN_K:
            xt = tl.load(x_ptrs, eviction_policy="evict_last")
        else:
            xt = tl.load(x_ptrs, mask=(k0 + offs_k)[:, None] < K, other=0.0,
                         eviction_policy="evict_last")
        w = _dequant(words, s_ptr, z_ptr, gidx_ptr, rn, k0, stride_sn,
                     BLOCK_N, BLOCK_K, GROUP_SIZE, HAS_ZEROS, HAS_GIDX, DTYPE, EMU_BF16)
        if EMU_BF16:
            xt = xt.to(tl.float32)
        acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K // 8
        x_ptrs += BLOCK_K

    out_mask = (offs_m < M)[None, :] & (offs_n < N)[:, None]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
        y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, cast_out(acc, DTYPE, EMU_BF16), mask=out_mask)
    else:
        ws_ptrs = ws_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None]
        tl.store(ws_ptrs, acc, mask=out_mask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, bias_ptr, y_ptr, M, N, stride_ym,
                          SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, EMU_BF16: tl.constexpr,
                          BLOCK: tl.constexpr):
    """y[m, n] = sum_s ws[s, m, n] (+ bias[n]), summed in a fixed order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    m = offs // N
    tl.store(y_ptr + m * stride_ym + n, cast_out(acc, y_ptr.dtype.element_ty, EMU_BF16), mask=mask)
