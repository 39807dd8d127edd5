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

from .common import cast_out, grouped_tile, round_bf16_emu, split_k_range


@triton.jit
def _unpack8(words, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 (BLOCK_N, BLOCK_K // 8) words -> int32 (BLOCK_N, BLOCK_K) codes, channel 8r + j
    from bits 4j of word r. Built with tl.join (see _join8): a broadcast-and-shift over a
    new axis instead spread the 8 nibbles over 8 threads, each re-reading the word from
    shared memory (296 vs 16 ld.shared per iteration; M=1 8192x57344: 240 -> 167 us)."""
    return _join8(words & 0xF, (words >> 4) & 0xF, (words >> 8) & 0xF, (words >> 12) & 0xF,
                  (words >> 16) & 0xF, (words >> 20) & 0xF, (words >> 24) & 0xF, (words >> 28) & 0xF,
                  BLOCK_N, BLOCK_K)


# One int32 word -> its 8 codes, dequantized, as 8 half-precision values, in 15 instructions
# (Marlin's trick): lop3 (w & 0x000f000f) | 0x64006400 puts nibbles j and j+4 into the
# mantissas of a half2 whose exponent makes it (1024 + q_j, 1024 + q_j+4); one sub.x2 of
# (1024 + zero) and one mul.x2 by the scale finish two weights. The pure-Triton path in
# _dequant computes the identical values (used by the interpreter, which cannot run asm).
_ASM_DEQUANT = """
{
.reg .b32 t0, t1, t2, t3, u;
lop3.b32 t0, $8, 0x000f000f, MAGIC2, 0xea;
shr.u32 u, $8, 4;
lop3.b32 t1, u, 0x000f000f, MAGIC2, 0xea;
shr.u32 u, $8, 8;
lop3.b32 t2, u, 0x000f000f, MAGIC2, 0xea;
shr.u32 u, $8, 12;
lop3.b32 t3, u, 0x000f000f, MAGIC2, 0xea;
sub.rn.TY t0, t0, $10;
sub.rn.TY t1, t1, $10;
sub.rn.TY t2, t2, $10;
sub.rn.TY t3, t3, $10;
mul.rn.TY t0, t0, $9;
mul.rn.TY t1, t1, $9;
mul.rn.TY t2, t2, $9;
mul.rn.TY t3, t3, $9;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}
"""
_ASM_F16 = tl.constexpr(_ASM_DEQUANT.replace("MAGIC2", "0x64006400").replace("TY", "f16x2"))
_ASM_BF16 = tl.constexpr(_ASM_DEQUANT.replace("MAGIC2", "0x43004300").replace("TY", "bf16x2"))


@triton.jit
def _pair(v):
    """half-precision tensor -> int32 holding (v, v) as a half2."""
    b = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _join8(n0, n1, n2, n3, n4, n5, n6, n7, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """8 tensors (BLOCK_N, R) -> (BLOCK_N, 8R) with element [n, 8r + j] = n_j[n, r].
    Each join appends a minor axis that Triton keeps in the same thread's registers;
    index [b2, b1, b0] of the three appended axes is nibble 4*b2 + 2*b1 + b0."""
    q = tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)), tl.join(tl.join(n1, n5), tl.join(n3, n7)))
    return tl.reshape(q, (BLOCK_N, BLOCK_K))


@triton.jit
def _dequant_asm(words, s_ptr, z_ptr, rn, k0, stride_sn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, DTYPE: tl.constexpr):
    """GPU fast path of _dequant (no general g_idx): same values, packed half2 math."""
    if DTYPE == tl.float16:
        MAGIC: tl.constexpr = 1024.0
    else:
        MAGIC: tl.constexpr = 128.0
    R: tl.constexpr = BLOCK_K // 8
    if GROUP_SIZE == 0 or BLOCK_K <= GROUP_SIZE:
        g0 = 0 if GROUP_SIZE == 0 else k0 // GROUP_SIZE
        s = tl.load(s_ptr + rn * stride_sn + g0)
        if HAS_ZEROS:
            zb = tl.load(z_ptr + rn * stride_sn + g0) + MAGIC
        else:
            zb = tl.full((BLOCK_N,), MAGIC + 8.0, DTYPE)
        s2 = tl.broadcast_to(_pair(s)[:, None], (BLOCK_N, R))
        z2 = tl.broadcast_to(_pair(zb)[:, None], (BLOCK_N, R))
    else:
        NG: tl.constexpr = BLOCK_K // GROUP_SIZE
        g = k0 // GROUP_SIZE + tl.arange(0, NG)
        sz_off = rn[:, None] * stride_sn + g[None, :]
        s = tl.load(s_ptr + sz_off)
        if HAS_ZEROS:
            zb = tl.load(z_ptr + sz_off) + MAGIC
        else:
            zb = tl.full((BLOCK_N, NG), MAGIC + 8.0, DTYPE)
        s2 = tl.reshape(tl.broadcast_to(_pair(s)[:, :, None], (BLOCK_N, NG, R // NG)), (BLOCK_N, R))
        z2 = tl.reshape(tl.broadcast_to(_pair(zb)[:, :, None], (BLOCK_N, NG, R // NG)), (BLOCK_N, R))
    if DTYPE == tl.float16:
        n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
            _ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, s2, z2],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
            _ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, s2, z2],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    return _join8(n0, n1, n2, n3, n4, n5, n6, n7, BLOCK_N, BLOCK_K)


@triton.jit
def _dequant(words, s_ptr, z_ptr, gidx_ptr, rn, k0, stride_sn,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
             HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, DTYPE: tl.constexpr,
             EMU_BF16: tl.constexpr):
    """int32 (BLOCK_N, BLOCK_K // 8) packed words -> (BLOCK_N, BLOCK_K) weights in DTYPE
    (EMU_BF16: fp32 holding the bf16 values; see common.py)."""
    q = _unpack8(words, BLOCK_N, BLOCK_K)
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
    M, N, K, stride_xm, stride_ym, stride_qn, stride_sn,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, EMU_BF16: tl.constexpr,
    USE_ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """x (M, K) row-major; qweight int32 (N, Kp // 8), Kp >= K; scales/zeros (N, Gp); y (M, N).

    Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT_K). With SPLIT_K > 1 the fp32
    partial tile goes to ws (SPLIT_K, M, N) and bias/cast happen in the reduce kernel.
    """
    DTYPE = x_ptr.dtype.element_ty
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
        if USE_ASM:
            w = _dequant_asm(words, s_ptr, z_ptr, rn, k0, stride_sn,
                             BLOCK_N, BLOCK_K, GROUP_SIZE, HAS_ZEROS, DTYPE)
        else:
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
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, bias_ptr, y_ptr, ws_ptr,
    M, N, K, stride_xm, stride_ym, stride_qn, stride_sn,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, EMU_BF16: tl.constexpr,
    USE_ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Small M (BLOCK_M >= M rows, one program per N tile): y[m, n] = sum_k x[m, k] W[n, k]
    on CUDA cores, fp32 FMAs into a (BLOCK_M, BLOCK_N, BLOCK_K) accumulator reduced once
    at the end. Same dequantization, layout and split-K protocol as _w4a16_kernel.
    Why a separate path: at M = 1 moving the dequantized tile into the tensor-core
    operand layout costs more than the FMAs (8192x57344 on H200: 166 us with tl.dot
    vs 122 us here; the loads alone stream in 60 us)."""
    DTYPE = x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rn = offs_n % N
    rm = offs_m % M
    kt0, kt1 = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = qw_ptr + rn[:, None] * stride_qn + (kt0 * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8))[None, :]
    # BLOCK_M == 1 keeps a 2-D accumulator and a 1-D x load: the 3-D form costs 20-30%
    # at M = 1 (8192x57344: 149 vs 122 us on H200)
    if BLOCK_M == 1:
        x_ptrs = x_ptr + kt0 * BLOCK_K + offs_k
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        x_ptrs = x_ptr + rm[:, None] * stride_xm + (kt0 * BLOCK_K + offs_k)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kt in range(kt0, kt1):
        k0 = kt * BLOCK_K
        words = tl.load(w_ptrs, eviction_policy="evict_first")
        if BLOCK_M == 1:
            if EVEN_K:
                xv = tl.load(x_ptrs, eviction_policy="evict_last")
            else:
                xv = tl.load(x_ptrs, mask=k0 + offs_k < K, other=0.0, eviction_policy="evict_last")
        else:
            if EVEN_K:
                xv = tl.load(x_ptrs, eviction_policy="evict_last")
            else:
                xv = tl.load(x_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0, eviction_policy="evict_last")
        if USE_ASM:
            w = _dequant_asm(words, s_ptr, z_ptr, rn, k0, stride_sn,
                             BLOCK_N, BLOCK_K, GROUP_SIZE, HAS_ZEROS, DTYPE)
        else:
            w = _dequant(words, s_ptr, z_ptr, gidx_ptr, rn, k0, stride_sn,
                         BLOCK_N, BLOCK_K, GROUP_SIZE, HAS_ZEROS, HAS_GIDX, DTYPE, EMU_BF16)
        if BLOCK_M == 1:
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        else:
            acc += w.to(tl.float32)[None, :, :] * xv.to(tl.float32)[:, None, :]
        w_ptrs += BLOCK_K // 8
        x_ptrs += BLOCK_K
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]  # (1, BLOCK_N)
    else:
        out = tl.sum(acc, axis=2)  # (BLOCK_M, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], cast_out(out, DTYPE, EMU_BF16), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], out, mask=mask)


@triton.jit
def _w4a16_dequant_kernel(
    qw_ptr, s_ptr, z_ptr, gidx_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_wn,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    EMU_BF16: tl.constexpr, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Write the effective weight W (N, K) in the activation dtype (act-order: in the
    permuted channel order), for the large-M path that hands the product to cuBLAS."""
    DTYPE = w_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rn = offs_n % N
    words = tl.load(qw_ptr + rn[:, None] * stride_qn + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :])
    if USE_ASM:
        w = _dequant_asm(words, s_ptr, z_ptr, rn, k0, stride_sn, BLOCK_N, BLOCK_K, GROUP_SIZE, HAS_ZEROS, DTYPE)
    else:
        w = _dequant(words, s_ptr, z_ptr, gidx_ptr, rn, k0, stride_sn,
                     BLOCK_N, BLOCK_K, GROUP_SIZE, HAS_ZEROS, HAS_GIDX, DTYPE, EMU_BF16)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], cast_out(w.to(tl.float32), DTYPE, EMU_BF16), mask=mask)


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
