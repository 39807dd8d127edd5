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
  The weight is wgmma's A operand, taken from registers; x_q (K-contiguous, as 8-bit
  wgmma needs) is the shared-memory B operand, and the small batch dimension M is the
  MMA's N dimension (>= 16), so decode M = 1 runs on tensor cores.
- Fragment order (formats.qqq.PackedQQQ, layout 2): the weight is read as bytes, and the
  4 bytes of a 32-bit load are 4 weights of one int8 A-fragment register (low nibbles)
  and 4 of another (high nibbles). The unpack is elementwise inline asm with pack=4 (one
  register in, two out: `_ASM_CHAN` 7 instructions per 8 weights, `_ASM_GROUP` 25 with the
  group scale), then tl.join + reshape/permute that Triton lowers to nothing: the int8
  tile never goes through shared memory (`python -m sailfish.bench.ptx --family w4a8` counts it; the
  natural order of layout 1 cost a st.shared + ldmatrix round trip per K tile).
- int8 x int8 -> int32 accumulation is exact. Split-K: each K slice stores its int32
  partial tile in a workspace (SPLIT_K, M, N); the slices are added in slice order (exact, so
  deterministic) and the epilogue applied either by `_w4a8_splitk_reduce_kernel`, a second
  launch, or (FIXUP) by the last slice of each tile to finish, found with a per-tile counter
  (_add_slices): one launch, no memset (int32 atomics into a zeroed buffer would need one).
- Epilogue y = (float(acc) * s_ch[n]) * s_tok[m] (+ bias) in float32, stored in the
  output dtype through common.cast_out (bf16 under the interpreter: see common.py).
- Three paths (tuning.Config.kernel): "mma" the fused tensor-core tiles above (every M;
  on H200 it beat the CUDA-core GEMV at M = 1 too once the tile stopped going through
  shared memory: 8192x57344 per-channel 86.5 vs 101.3 us, quantization included; and the
  dequant path at M = 1024: 748 vs 1294 us); "gemv" for M = 1, int32 multiply-adds on CUDA
  cores; "dequant", the int8 weight written once by `_w4a8_dequant_kernel`, then cuBLAS's
  int8 GEMM (torch._int_mm) and the epilogue in `_w4a8_splitk_reduce_kernel`.
- fp8 activations (x_q float8 e4m3): the same kernel with an e4m3 weight tile q - 8 (exact),
  f32.e4m3.e4m3 wgmma, and each K tile's partial sum added (per group: scaled by s_g) on
  CUDA cores in fp32 (formats.qqq.fp8_weight).
- 64-bit offsets wherever a product of a row index and a row length can pass 2**31
  elements: activation / output / workspace rows (M * N reaches 2**31 at M = 37450 on
  N = 57344), the weight rows (N * Kp / 2 bytes) and the split-K slices. Offsets within a
  row, and the group-scale offsets (N * Kp / 128 < 2**31 for any weight under 64 GiB), stay
  32-bit. tests/test_w4a8.py checks the compiled IR for this.
- A token (row) holding NaN or +-Inf gets scale NaN and x_q = 0, so all of its outputs are
  NaN (a float matmul's output row would be non-finite too), never silently finite:
  tl.max / tl.maximum drop NaN, so non-finite values are mapped to +Inf before the max and
  an infinite max marks the row.
"""
import triton
import triton.language as tl

from .common import (SYNC_TILES, cast_out, grouped_tile, last_slice, pdl_release, pdl_wait, split_k_range,
                     sum_slices)

_RND = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + _RND has ulp 1 for |x| <= 2**22
_RND_BITS = tl.constexpr(0x4B400000)  # bit pattern of _RND
_INF = tl.constexpr(float("inf"))


@triton.jit
def _round_i8(v, CLAMP: tl.constexpr = True):
    """float32 -> int32 in [-127, 127]: clamp, round half to even (see module docstring).
    CLAMP=False: the caller guarantees |v| < 127.5 (kernels' group-scale twin)."""
    if CLAMP:
        v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    return (v + _RND).to(tl.int32, bitcast=True) - _RND_BITS


@triton.jit
def to_f32(x):
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
def abs_or_inf(x):
    """|x|, with NaN mapped to +Inf: tl.max / tl.maximum drop NaN, so a NaN would vanish
    from the row maximum; this way the maximum is +Inf exactly when the row is not finite."""
    return tl.where(x == x, tl.abs(x), _INF)


@triton.jit
def _e4m3(v):
    """float32 v, |v| <= 448 -> float8 e4m3 (e4m3fn) nearest, ties to even, with integer ops
    only: Triton 3.9's interpreter rounds its float -> fp8 casts wrongly near powers of two
    (7.97 -> 4.0), and one code path keeps the GPU and the interpreter on the same bits.
    Normal range (|v| >= 2**-6): round the fp32 mantissa to 3 bits at bit 20 (a carry moves
    into the exponent, as it should), rebias the exponent 127 -> 7. Subnormals (step 2**-9):
    the integer rne(|v| * 512) in 0..8, 8 being the smallest normal's encoding."""
    b = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    ab = a.to(tl.int32, bitcast=True)
    r = ab + 0x7FFFF + ((ab >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    sub = (a * 512.0 + _RND).to(tl.int32, bitcast=True) - _RND_BITS  # a * 512 is exact
    mag = tl.where(a >= 0.015625, normal, sub)
    return (((b >> 24) & 0x80) | mag).to(tl.int8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _quantize_value(v, FP8: tl.constexpr):
    """float32 v (already scaled to the code range) -> the stored activation: int8 (clamp to
    +-127, round half to even) or, FP8, float8 e4m3 (clamp to +-448, round to nearest even,
    as torch's .to(float8_e4m3fn))."""
    if FP8:
        q = _e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0))
    else:
        q = _round_i8(v).to(tl.int8)
    return q


@triton.jit
def _quantize_per_token_kernel(x_ptr, xq_ptr, s_ptr, K, stride_xm, stride_qm,
                               BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, FP8: tl.constexpr,
                               PDL: tl.constexpr = False):
    """x (M, K) fp16/bf16 -> x_q (M, K) int8 (FP8: float8 e4m3), s float32 (M,). One program
    per row. QMAX = 127 (FP8: 448, e4m3's largest finite value): s = amax / QMAX and
    x_q = x * (QMAX / amax) stored by _quantize_value.

    ONE_PASS: the row fits in one BLOCK_K tile and stays in registers; otherwise a
    max pass and a quantize pass over the row (the second one mostly hits L2).
    A row holding NaN or +-Inf: s = NaN, x_q = 0 (formats.qqq.quantize_activations).
    """
    pdl_wait(PDL)  # (PDL: launched as a programmatic dependent of the kernel before it)
    QMAX: tl.constexpr = 448.0 if FP8 else 127.0
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = xq_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:
        x = to_f32(tl.load(x_row + offs, mask=offs < K, other=0.0))
        amax = tl.max(abs_or_inf(x), axis=0)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xk = to_f32(tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0))
            amax = tl.maximum(amax, abs_or_inf(xk))
        amax = tl.max(amax, axis=0)
    bad, c, inv, scale = token_scale(amax, QMAX)
    tl.store(s_ptr + row, scale)
    if ONE_PASS:
        tl.store(q_row + offs, quantize_scaled(x, bad, c, inv, FP8), mask=offs < K)
    else:
        for k0 in range(0, K, BLOCK_K):
            xk = to_f32(tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0))
            tl.store(q_row + k0 + offs, quantize_scaled(xk, bad, c, inv, FP8), mask=k0 + offs < K)


@triton.jit
def token_scale(amax, QMAX: tl.constexpr):
    """A row's max |x| (abs_or_inf's: +Inf for a row holding NaN or Inf; a scalar, or one per
    row) -> (bad, c, inv, scale): bad marks a non-finite row (then inv = 0 and the row is zeroed
    by quantize_scaled), x is quantized as (x * c) * inv, and scale = amax / QMAX (NaN if bad).
    Shared with kernels/rowwise.py's fused quantizations, which must give these bits."""
    bad = amax == _INF
    # tiny rows: scale by 2**64 first (exact) so that QMAX / amax cannot overflow
    c = tl.where(amax < 8.673617379884035e-19, 1.8446744073709552e19, 1.0)
    den = tl.where(amax > 0.0, amax * c, 1.0)
    inv = tl.where(amax > 0.0, tl.math.div_rn(tl.full((), QMAX, tl.float32) + tl.zeros_like(den), den), 0.0)
    # NaN scale for a bad row as inf - inf: a NaN global constexpr never equals itself, so
    # Triton (3.6) takes it for a changed global and refuses to launch the cached kernel
    scale = tl.where(bad, amax - amax, tl.math.div_rn(amax, tl.full((), QMAX, tl.float32) + tl.zeros_like(amax)))
    return bad, c, inv, scale


@triton.jit
def quantize_scaled(x, bad, c, inv, FP8: tl.constexpr):
    """float32 x with token_scale's (bad, c, inv) (broadcast to x) -> the stored activation."""
    x = tl.where(bad, 0.0, x)  # inf * 0 would be NaN, which no int8 can hold
    return _quantize_value((x * c) * inv, FP8)


# ----------------------------------------------------------------------------------
# GEMM
# ----------------------------------------------------------------------------------
@triton.jit
def _add_slices(acc, ws_ptr, offs, cnt_ptr, mn, mask, SPLIT_K: tl.constexpr):
    """Split-K without a reduce kernel (kernels/common.py last_slice, sum_slices): every slice
    stores its partial tile in the workspace (SPLIT_K, M, N) and counts itself in; the last of
    the tile's slices adds the SPLIT_K slices in slice order (int32: exact; fp8's float32: one
    fixed order, so deterministic as well) and returns (True, sum); the others (False, their
    partial). Its own partial is read from memory too: keeping acc live costs registers in the
    K loop; 64-bit pointers per element cost BM 32 / BN 64 26 more registers than 32-bit offsets."""
    tl.store(ws_ptr + tl.program_id(1).to(tl.int64) * mn + offs, acc, mask=mask)
    last = last_slice(cnt_ptr, SPLIT_K)
    total = acc
    if last:
        total = sum_slices(tl.zeros_like(acc), ws_ptr, offs, cnt_ptr, mn, mask, SPLIT_K)
    return last, total


# 4 packed bytes (8 codes) -> two registers of 4 int8 weights: `lo` from the low nibbles,
# `hi` from the high ones (byte e of each register from byte e of the input), in the
# wgmma A-fragment byte order (formats.qqq.PackedQQQ). Per-channel, w8 = q - 8 per byte
# without carries between bytes: (q | 0x80) - 8 lies in [0x78, 0x87], and xor 0x80 turns
# it into the two's complement of q - 8. 7 instructions per 8 weights.
_ASM_CHAN = tl.constexpr("""
{
.reg .b32 t;
lop3.b32 t, $2, 0x0f0f0f0f, 0x80808080, 0xea;
sub.u32 t, t, 0x08080808;
xor.b32 $0, t, 0x80808080;
shr.u32 t, $2, 4;
lop3.b32 t, t, 0x0f0f0f0f, 0x80808080, 0xea;
sub.u32 t, t, 0x08080808;
xor.b32 $1, t, 0x80808080;
}
""")
# Per-group: w8 = clamp(rne(s_g * (q - 8)), -127, 127) two weights per f16x2 instruction.
# Low nibbles: lop3 (b & 0x000f000f) | 0x64006400 is the half2 (1024 + q, 1024 + q') of bytes
# 0 and 2; minus 1032 gives q - 8 exactly; fma.rn(q - 8, s, 1536) rounds the exact product
# plus 1536 once, and in [1024, 2048) fp16 has ulp 1, so that is 1536 + rne(s * (q - 8)) (1536
# is even: ties go the same way). High nibbles without a shift: (b & 0x00f000f0) | 0x64006400
# is 1024 + 16 q, minus 1152 is 16 (q - 8), and fma(16 (q - 8), s, 24576) lands in [16384,
# 32768) where the ulp is 16: 16 * (1536 + rne(s * (q - 8))), whose bits are again 0x7600 plus
# the integer. Clamped to +-127 units around the magic number (a product outside the binade
# rounds coarser but lands outside that range anyway), the low byte of each half is the int8
# weight; prmt gathers them. $3..$6: the scale pairs (s, s) of bytes 0..3. 25 instructions
# per 8 weights; 17 without the clamp (max / min), which cannot change anything when every
# |s_g| < 127.5 / 8 (then |rne(s_g * (q - 8))| <= 127 for every code): what quantize_qqq
# produces, and what the launcher checks (ops/w4a8.py group_scales_in_range) before it drops
# them. The clamp was 128 of the 479 SASS instructions of a BM 16 / BN 64 / BK 256 K tile.
_GROUP_LINES = """
.reg .b32 a, b, c, d, s02, s13, u, z1, z16, m1, m16, l1, h1, l16, h16;
mov.b32 z1, 0x64086408;
mov.b32 z16, 0x64806480;
mov.b32 m1, 0x66006600;
mov.b32 m16, 0x76007600;
mov.b32 l1, 0x65816581;
mov.b32 h1, 0x667f667f;
mov.b32 l16, 0x75817581;
mov.b32 h16, 0x767f767f;
prmt.b32 s02, $3, $5, 0x5410;
prmt.b32 s13, $4, $6, 0x5410;
lop3.b32 a, $2, 0x000f000f, 0x64006400, 0xea;
lop3.b32 c, $2, 0x00f000f0, 0x64006400, 0xea;
shr.u32 u, $2, 8;
lop3.b32 b, u, 0x000f000f, 0x64006400, 0xea;
lop3.b32 d, u, 0x00f000f0, 0x64006400, 0xea;
sub.rn.f16x2 a, a, z1;
sub.rn.f16x2 b, b, z1;
sub.rn.f16x2 c, c, z16;
sub.rn.f16x2 d, d, z16;
fma.rn.f16x2 a, a, s02, m1;
fma.rn.f16x2 b, b, s13, m1;
fma.rn.f16x2 c, c, s02, m16;
fma.rn.f16x2 d, d, s13, m16;
max.f16x2 a, a, l1;
max.f16x2 b, b, l1;
max.f16x2 c, c, l16;
max.f16x2 d, d, l16;
min.f16x2 a, a, h1;
min.f16x2 b, b, h1;
min.f16x2 c, c, h16;
min.f16x2 d, d, h16;
prmt.b32 $0, a, b, 0x6240;
prmt.b32 $1, c, d, 0x6240;
""".strip().splitlines()
_ASM_GROUP = tl.constexpr("{\n" + "\n".join(_GROUP_LINES) + "\n}")
_ASM_GROUP_NOCLAMP = tl.constexpr("{\n" + "\n".join(
    ln.replace(", l1, h1, l16, h16", "") for ln in _GROUP_LINES
    if not ln.startswith(("max.", "min.", "mov.b32 l", "mov.b32 h"))) + "\n}")


# fp8 activations (e4m3 wgmma): the weight operand is q - 8 in e4m3, exact (every integer
# in [-8, 8] is an e4m3 value). lop3 + sub give the exact half2 (q - 8, q' - 8) (_ASM_GROUP),
# cvt.rn.satfinite.e4m3x2.f16x2 turns it into two e4m3 bytes (exact, so no rounding happens),
# prmt restores the byte order. The group scale is applied to the fp32 partial sums instead.
_ASM_FP8 = tl.constexpr("""
{
.reg .b32 a, b, c, d, u, z;
.reg .b16 a8, b8, c8, d8;
mov.b32 z, 0x64086408;
lop3.b32 a, $2, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $2, 8;
lop3.b32 b, u, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $2, 4;
lop3.b32 c, u, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $2, 12;
lop3.b32 d, u, 0x000f000f, 0x64006400, 0xea;
sub.rn.f16x2 a, a, z;
sub.rn.f16x2 b, b, z;
sub.rn.f16x2 c, c, z;
sub.rn.f16x2 d, d, z;
cvt.rn.satfinite.e4m3x2.f16x2 a8, a;
cvt.rn.satfinite.e4m3x2.f16x2 b8, b;
cvt.rn.satfinite.e4m3x2.f16x2 c8, c;
cvt.rn.satfinite.e4m3x2.f16x2 d8, d;
mov.b32 a, {a8, b8};
mov.b32 c, {c8, d8};
prmt.b32 $0, a, 0, 0x3120;
prmt.b32 $1, c, 0, 0x3120;
}
""")


@triton.jit
def _fp8_pair(b, USE_ASM: tl.constexpr):
    """Packed bytes int8 (BLOCK_N, BLOCK_K // 2) -> (lo, hi) float8 e4m3: q - 8 of every byte's
    low and high nibble (exact). USE_ASM: _ASM_FP8; else the pure-Triton twin."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(_ASM_FP8, "=r,=r,r", [b], dtype=(tl.float8e4nv, tl.float8e4nv),
                                           is_pure=True, pack=4)
    else:
        bi = b.to(tl.int32)
        lo = _e4m3(((bi & 0xF) - 8).to(tl.float32))
        hi = _e4m3((((bi >> 4) & 0xF) - 8).to(tl.float32))
    return lo, hi


@triton.jit
def _group_scales(sg_ptr, rn, k0, stride_gn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_SIZE: tl.constexpr):
    """float16 group scales of the K tile at k0, one per packed byte: (BLOCK_N, BLOCK_K // 2).
    A group (128 channels) is a run of 64 whole bytes (formats.qqq.PackedQQQ), so the
    (BLOCK_N, groups) tile is only broadcast and reshaped: every value stays in the
    registers of the threads that own its bytes."""
    if BLOCK_K <= GROUP_SIZE:
        s = tl.load(sg_ptr + rn * stride_gn + k0 // GROUP_SIZE)
        return tl.broadcast_to(s[:, None], (BLOCK_N, BLOCK_K // 2))
    else:
        NG: tl.constexpr = BLOCK_K // GROUP_SIZE
        s = tl.load(sg_ptr + rn[:, None] * stride_gn + (k0 // GROUP_SIZE + tl.arange(0, NG))[None, :])
        return tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, NG, GROUP_SIZE // 2)), (BLOCK_N, BLOCK_K // 2))


@triton.jit
def _int8_pair(b, s, GROUP_SIZE: tl.constexpr, USE_ASM: tl.constexpr, CLAMP: tl.constexpr = True):
    """Packed bytes int8 (BLOCK_N, BLOCK_K // 2) (+ their fp16 group scales, same shape) ->
    (lo, hi) int8: w8 of every byte's low and high nibble (formats.qqq.codes_to_int8).
    USE_ASM: the inline asm above (GPU); else the pure-Triton twin computing the same
    exact values (the interpreter cannot run asm): per-channel q - 8; per-group the exact
    float32 product s * (q - 8), rounded half to even by _round_i8 (which clamps first:
    the same result as rounding first, since +-127 are integers). CLAMP=False (per-group):
    the caller guarantees every |s| < 127.5 / 8 (ops/w4a8.py group_scales_in_range), so the
    clamp cannot change a value; the asm drops it (_ASM_GROUP_NOCLAMP) and so does the twin,
    whose int8 cast then wraps an out-of-range product as the asm's byte pick would."""
    if USE_ASM:
        if GROUP_SIZE == 0:
            lo, hi = tl.inline_asm_elementwise(_ASM_CHAN, "=r,=r,r", [b], dtype=(tl.int8, tl.int8),
                                               is_pure=True, pack=4)
        else:
            sb = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            lo, hi = tl.inline_asm_elementwise(_ASM_GROUP if CLAMP else _ASM_GROUP_NOCLAMP,
                                               "=r,=r,r,r,r,r,r", [b, sb | (sb << 16)],
                                               dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    else:
        bi = b.to(tl.int32)
        q_lo = bi & 0xF
        q_hi = (bi >> 4) & 0xF
        if GROUP_SIZE == 0:
            lo = (q_lo - 8).to(tl.int8)
            hi = (q_hi - 8).to(tl.int8)
        else:
            sf = s.to(tl.float32)
            # (q | 0x4B000000) read as fp32 is 2**23 + q exactly; minus (2**23 + 8) gives q - 8
            t_lo = (q_lo | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            t_hi = (q_hi | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            lo = _round_i8(t_lo * sf, CLAMP).to(tl.int8)  # the products are exact
            hi = _round_i8(t_hi * sf, CLAMP).to(tl.int8)
    return lo, hi


@triton.jit
def _int8_tile(b, sg_ptr, rn, k0, stride_gn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_SIZE: tl.constexpr, USE_ASM: tl.constexpr, CLAMP: tl.constexpr = True):
    """The K tile's packed bytes at k0 -> (lo, hi) int8 weights (_int8_pair), loading the
    group scales it needs."""
    if GROUP_SIZE == 0:
        s = b  # unused
    else:
        s = _group_scales(sg_ptr, rn, k0, stride_gn, BLOCK_N, BLOCK_K, GROUP_SIZE)
    return _int8_pair(b, s, GROUP_SIZE, USE_ASM, CLAMP)


@triton.jit
def _byte_offsets(BLOCK_K: tl.constexpr):
    """Offsets (within the K tile's first chunk) of the BLOCK_K // 2 packed bytes a K tile
    reads, in the tile's byte order (t, s, e) for BLOCK_K < 128; 0 .. BLOCK_K / 2 - 1 else.
    A 128-channel chunk holds byte 16t + 4s + e (t, s, e < 4); a tile of S = BLOCK_K / 32
    k32 steps takes s in [s0, s0 + S): S runs of 4 bytes per t."""
    if BLOCK_K >= 128:
        return tl.arange(0, BLOCK_K // 2)
    else:
        S: tl.constexpr = BLOCK_K // 32
        i = tl.arange(0, BLOCK_K // 2)
        return 16 * (i // (4 * S)) + i % (4 * S)


@triton.jit
def _tile_byte0(k0, BLOCK_K: tl.constexpr):
    """Byte offset of the K tile at channel k0 within a packed row (see _byte_offsets)."""
    if BLOCK_K >= 128:
        return k0 // 2
    else:
        return 64 * (k0 // 128) + 4 * ((k0 % 128) // 32)


@triton.jit
def _fragment_tile(lo, hi, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(lo, hi) int8 (BLOCK_N, BLOCK_K // 2) in byte order -> the (BLOCK_N, BLOCK_K) int8 weight
    tile in channel order. Byte 64c + 4S t + 4s + e, nibble h is channel 128c + 32s + 16h +
    4t + e (S = 4, or BLOCK_K / 32 for a tile shorter than a chunk). Join, reshape and permute
    only move values between a thread's registers: in wgmma's int8 A fragment, lane t = lane
    % 4 of a row holds channels 4t + e and 16 + 4t + e of each k32 step, 4 per 32-bit
    register, which is exactly a thread's (s, h) registers here."""
    C: tl.constexpr = BLOCK_K // 128 if BLOCK_K >= 128 else 1
    S: tl.constexpr = 4 if BLOCK_K >= 128 else BLOCK_K // 32
    q = tl.join(lo, hi)                                  # (n, b, h)
    q = tl.reshape(q, (BLOCK_N, C, 4, S, 4, 2))          # (n, c, t, s, e, h)
    q = tl.permute(q, (0, 1, 3, 5, 2, 4))                # (n, c, s, h, t, e)
    return tl.reshape(q, (BLOCK_N, BLOCK_K))


@triton.jit
def _byte_order(x, BLOCK_K: tl.constexpr):
    """x (BLOCK_K,) in channel order -> the order of the joined (byte, nibble) tile, position
    2b + h (the inverse of _fragment_tile's permutation), for the GEMV's elementwise product."""
    C: tl.constexpr = BLOCK_K // 128 if BLOCK_K >= 128 else 1
    S: tl.constexpr = 4 if BLOCK_K >= 128 else BLOCK_K // 32
    x = tl.reshape(x, (C, S, 2, 4, 4))                   # (c, s, h, t, e)
    x = tl.permute(x, (0, 3, 1, 4, 2))                   # (c, t, s, e, h)
    return tl.reshape(x, (BLOCK_K,))


@triton.jit
def _epilogue(acc, xs_ptr, sch_ptr, bias_ptr, rm, rn, HAS_BIAS: tl.constexpr):
    """int32 acc^T (BLOCK_N, BLOCK_M) -> float32 y^T = (acc * s_ch[n]) * s_tok[m] (+ bias[n])."""
    s_ch = tl.load(sch_ptr + rn)
    s_tok = tl.load(xs_ptr + rm)
    y = (acc.to(tl.float32) * s_ch[:, None]) * s_tok[None, :]
    if HAS_BIAS:
        y = y + to_f32(tl.load(bias_ptr + rn))[:, None]
    return y


@triton.jit
def _store_tile(acc, y_ptrs, mask, xs_ptr, sch_ptr, bias_ptr, rm, rn, HAS_BIAS: tl.constexpr, RAW: tl.constexpr,
                EMU_BF16: tl.constexpr):
    """Store a finished accumulator tile: as it is (RAW) or through _epilogue."""
    if RAW:
        tl.store(y_ptrs, acc, mask=mask)
    else:
        y = _epilogue(acc, xs_ptr, sch_ptr, bias_ptr, rm, rn, HAS_BIAS)
        tl.store(y_ptrs, cast_out(y, y_ptrs.dtype.element_ty, EMU_BF16), mask=mask)


@triton.jit
def _bytes(qw_ptr):
    """The packed weight as bytes: the launchers pass qweight's int32 words as they are (a
    .view(torch.int8) per call costs host time) and stride_qn in bytes."""
    return qw_ptr.to(tl.pointer_type(tl.int8))


@triton.jit
def _w4a8_kernel(
    xq_ptr, xs_ptr, qb_ptr, sch_ptr, sg_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, stride_qn, stride_gn, sync_ptr, ws_ptr,
    GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr, RAW: tl.constexpr, EMU_BF16: tl.constexpr, USE_ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, CLAMP: tl.constexpr = True, FIXUP: tl.constexpr = False,
    PDL_EARLY: tl.constexpr = False,
):
    """x_q int8 (M, K) row-major (or float8 e4m3: the fp8 variant, fp32 accumulator, the
    group scale applied to each K tile's partial sum, BLOCK_K <= GROUP_SIZE), s_tok float32
    (M,); qweight int32 (N, Kp // 8) read as its bytes (N, Kp // 2)
    (formats.qqq.PackedQQQ, stride_qn in bytes); s_ch float32 (N,); s_g float16 (N, Kp // 128)
    (GROUP_SIZE = 128; 0: per-channel).

    Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT_K). y is (M, N) in the output
    dtype, or int32 (fp8: float32) when RAW (the accumulator itself). SPLIT_K > 1: y is the
    int32 (fp8: float32) workspace (SPLIT_K, M, N), slice pid_k gets this program's partial sum;
    with FIXUP, ws_ptr is that workspace and the tile's last slice writes y (_add_slices; sync_ptr:
    the stream's counters). CLAMP=False (per-group int8): every |s_g| < 127.5 / 8, checked by the
    launcher (_int8_pair).
    """
    pdl_release(PDL_EARLY)  # (the row kernel after it may launch now: it waits itself)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # wrap out-of-range rows/channels onto valid ones: unmasked loads, results dropped
    rm = offs_m % M
    rn = offs_n % N

    kt0, kt1 = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)

    offs_k = tl.arange(0, BLOCK_K)
    w_rows = _bytes(qb_ptr) + rn.to(tl.int64)[:, None] * stride_qn + _byte_offsets(BLOCK_K)[None, :]
    x_ptrs = xq_ptr + rm.to(tl.int64)[:, None] * stride_xm + (kt0 * BLOCK_K + offs_k)[None, :]

    FP8: tl.constexpr = xq_ptr.dtype.element_ty == tl.float8e4nv
    # x rows past M are not read (masked: zero-filled, no request) although their pointers wrap:
    # at M < BLOCK_M the wrapped rows all repeat row m % M, and every program asks L2 for the same
    # few lines in the same K step. H200, per channel M = 1: 8192x57344 91.2 -> 75.3 us, 8192x8192
    # 19.9 -> 16.3 (same tile); M >= 8 unchanged (docs/perf_log.md v22)
    x_rows = (offs_m < M)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32 if FP8 else tl.int32)
    for kt in range(kt0, kt1):
        k0 = kt * BLOCK_K
        b = tl.load(w_rows + _tile_byte0(k0, BLOCK_K), eviction_policy="evict_first")
        if EVEN_K:
            x = tl.load(x_ptrs, mask=x_rows, other=0.0, eviction_policy="evict_last")
        else:
            x = tl.load(x_ptrs, mask=x_rows & ((k0 + offs_k)[None, :] < K), other=0.0, eviction_policy="evict_last")
        if FP8:
            lo, hi = _fp8_pair(b, USE_ASM)
            part = tl.dot(_fragment_tile(lo, hi, BLOCK_N, BLOCK_K), tl.trans(x))
            # each K tile's fp32 partial sum is added on CUDA cores: Hopper's fp8 wgmma keeps
            # fewer accumulator bits than fp32, and per-group this is where s_g applies
            # (BLOCK_K <= 128: one group per tile)
            if GROUP_SIZE == 0:
                acc += part
            else:
                acc += part * tl.load(sg_ptr + rn * stride_gn + k0 // GROUP_SIZE).to(tl.float32)[:, None]
        else:
            lo, hi = _int8_tile(b, sg_ptr, rn, k0, stride_gn, BLOCK_N, BLOCK_K, GROUP_SIZE, USE_ASM, CLAMP)
            w8 = _fragment_tile(lo, hi, BLOCK_N, BLOCK_K)
            acc = tl.dot(w8, tl.trans(x), acc, out_dtype=tl.int32)  # triton 3.6 needs it spelled out
        x_ptrs += BLOCK_K

    out_mask = (offs_m < M)[None, :] & (offs_n < N)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]  # M * N may pass 2**31
    if SPLIT_K > 1 and FIXUP:
        last, acc = _add_slices(acc, ws_ptr, offs_m[None, :] * N + offs_n[:, None], sync_ptr + SYNC_TILES + pid,
                                tl.cast(M, tl.int64) * N, out_mask, SPLIT_K)
        if last:
            _store_tile(acc, y_ptrs, out_mask, xs_ptr, sch_ptr, bias_ptr, rm, rn, HAS_BIAS, RAW, EMU_BF16)
    elif SPLIT_K > 1:
        tl.store(y_ptrs + pid_k.to(tl.int64) * M * N, acc, mask=out_mask)
    else:
        _store_tile(acc, y_ptrs, out_mask, xs_ptr, sch_ptr, bias_ptr, rm, rn, HAS_BIAS, RAW, EMU_BF16)


@triton.jit
def _w4a8_gemv_kernel(
    xq_ptr, xs_ptr, qb_ptr, sch_ptr, sg_ptr, bias_ptr, y_ptr,
    N, K, stride_qn, stride_gn, sync_ptr, ws_ptr,
    GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr, RAW: tl.constexpr, EMU_BF16: tl.constexpr, USE_ASM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CLAMP: tl.constexpr = True, FIXUP: tl.constexpr = False,
    PDL_EARLY: tl.constexpr = False,
):
    """M = 1: acc[n] = sum_k x_q[k] * w8[n, k] with int32 multiply-adds on CUDA cores into a
    (BLOCK_N, BLOCK_K) accumulator reduced once at the end. Same operands, outputs and
    split-K protocol as _w4a8_kernel. The weights stay in byte order (a sum over K does not
    care); x is loaded in channel order (wide loads) and permuted to it in registers, as the
    W4A16 GEMV does (docs/perf_log.md v10). Grid: (cdiv(N, BLOCK_N), SPLIT_K). FIXUP, sync_ptr,
    ws_ptr: as _w4a8_kernel's."""
    pdl_release(PDL_EARLY)  # (the row kernel after it may launch now: it waits itself)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N
    kt0, kt1 = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = _bytes(qb_ptr) + rn.to(tl.int64)[:, None] * stride_qn + _byte_offsets(BLOCK_K)[None, :]
    x_ptrs = xq_ptr + kt0 * BLOCK_K + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    for kt in range(kt0, kt1):
        k0 = kt * BLOCK_K
        b = tl.load(w_rows + _tile_byte0(k0, BLOCK_K), eviction_policy="evict_first")
        if EVEN_K:
            xv = tl.load(x_ptrs, eviction_policy="evict_last")
        else:
            xv = tl.load(x_ptrs, mask=k0 + offs_k < K, other=0, eviction_policy="evict_last")
        lo, hi = _int8_tile(b, sg_ptr, rn, k0, stride_gn, BLOCK_N, BLOCK_K, GROUP_SIZE, USE_ASM, CLAMP)
        w8 = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
        acc += w8.to(tl.int32) * _byte_order(xv, BLOCK_K).to(tl.int32)[None, :]
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    mask = offs_n < N
    last = True
    if SPLIT_K > 1 and FIXUP:
        last, out = _add_slices(out, ws_ptr, offs_n, sync_ptr + SYNC_TILES + pid_n, tl.cast(N, tl.int64), mask,
                                SPLIT_K)
    elif SPLIT_K > 1:
        tl.store(y_ptr + pid_k.to(tl.int64) * N + offs_n, out, mask=mask)
        last = False
    if last:
        if RAW:
            tl.store(y_ptr + offs_n, out, mask=mask)
        else:
            y = (out.to(tl.float32) * tl.load(sch_ptr + rn)) * tl.load(xs_ptr)
            if HAS_BIAS:
                y = y + to_f32(tl.load(bias_ptr + rn))
            tl.store(y_ptr + offs_n, cast_out(y, y_ptr.dtype.element_ty, EMU_BF16), mask=mask)


@triton.jit
def _w4a8_dequant_kernel(qb_ptr, sg_ptr, w_ptr, N, K, stride_qn, stride_gn, stride_wn,
                         GROUP_SIZE: tl.constexpr, USE_ASM: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CLAMP: tl.constexpr = True):
    """Write w8 int8 (N, K) in channel order (the large-M path hands the product to cuBLAS).
    Grid: (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K)); BLOCK_K must divide Kp."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rn = offs_n % N
    b = tl.load(_bytes(qb_ptr) + rn.to(tl.int64)[:, None] * stride_qn
                + (_tile_byte0(k0, BLOCK_K) + _byte_offsets(BLOCK_K))[None, :])
    lo, hi = _int8_tile(b, sg_ptr, rn, k0, stride_gn, BLOCK_N, BLOCK_K, GROUP_SIZE, USE_ASM, CLAMP)
    w8 = _fragment_tile(lo, hi, BLOCK_N, BLOCK_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    tl.store(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], w8, mask=mask)


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
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=ws_ptr.dtype.element_ty)  # int32, or fp8's float32
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptrs + s * mn)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    if RAW:
        tl.store(y_ptrs, acc, mask=mask)
    else:
        y = _epilogue(acc, xs_ptr, sch_ptr, bias_ptr, rm, rn, HAS_BIAS)
        tl.store(y_ptrs, cast_out(y, y_ptr.dtype.element_ty, EMU_BF16), mask=mask)
