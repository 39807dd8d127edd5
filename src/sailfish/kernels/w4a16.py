"""W4A16 GEMM kernels: y = x @ W^T (+ bias), x fp16/bf16, W 4-bit (formats.int4.PackedW4).

Design (why, see docs/perf_log.md for the measurements):
- "Swap AB": each program computes the transposed tile y^T[n, m] = W[n, :] @ x[m, :]^T,
  so the dequantized weight is the *left* operand of tl.dot, which Hopper's wgmma can take
  from registers; the small batch dimension M becomes the MMA's N dimension (>= 16).
- The packed words are stored in *fragment order* (formats.int4.PackedW4): the 8 nibbles
  of a word are 8 values that one thread owns in the wgmma A fragment and a thread's words
  are adjacent. The unpack (lop3 asm -> tl.join x3 -> reshape/permute, `_fragment_tile`) is
  then register-local: Triton loads the int32 tile from the cp.async buffer straight into
  the fragment layout and the dequantized tile never goes through shared memory (the
  natural order cost a st.shared + ldmatrix + barrier round trip per K tile: ~60% of the
  kernel at M = 16; v9 in the perf log).
- Each packed word is loaded exactly once, with eviction_policy="evict_first" (weights are
  streamed once); activations use "evict_last" (every N tile rereads them).
- int4 -> fp16/bf16 by the exponent trick: (q | 0x6400) read as fp16 is 1024 + q, so
  one OR and one subtraction of (1024 + zero) give q - zero exactly (bf16: 0x4300 = 128);
  the GPU path does it two values per instruction (Marlin's lop3 trick, `_ASM_DEQUANT`).
- Split-K over a fixed partition of the K tiles when there are too few output tiles
  to fill the GPU; partial sums go to an fp32 workspace and `_splitk_reduce_kernel`
  adds them in a fixed order, so results are deterministic run to run.
- Offsets that scale with M * N or N * K are int64 (57344 x 40960 passes 2^31).
"""
import triton
import triton.language as tl

from .common import cast_out, grouped_tile, join8, round_bf16_emu, split_k_range

# One int32 word -> its 8 codes, dequantized, as 8 half-precision values (Marlin's trick):
# lop3 (w & 0x000f000f) | MAGIC puts nibbles j and j+4 into the mantissas of a half2 whose
# exponent makes it (1024 + q_j, 1024 + q_j+4); one sub.x2 of (1024 + zero) and one mul.x2 by
# the scale finish two weights. fp16 (13 instructions; the 1/16 constant is hoisted): the odd nibbles are masked in place
# (0x00f000f0 gives 1024 + 16 q, exact) and one fma.x2 by 1/16 minus (64 + zero) replaces
# their shift and subtraction; every intermediate is an integer below 2048, so q - zero is
# exact as before. bf16 (15): 16 q would overflow bf16's 7 mantissa bits, so each nibble
# pair is shifted down. `_dequant_words`' pure-Triton branch computes the identical values
# (the interpreter cannot run asm). The bf16x2 instructions need sm_90: the launcher uses
# the pure branch for bf16 on older GPUs.
# $8 = word, $9 = scale (s, s), $10 = (1024 + z, 1024 + z) [fp16] / (128 + z, ...) [bf16],
# $11 = (-(64 + z), -(64 + z)) [fp16 only].
_ASM_F16 = tl.constexpr("""
{
.reg .b32 t0, t1, t2, t3, u, c;
mov.b32 c, 0x2c002c00;
lop3.b32 t0, $8, 0x000f000f, 0x64006400, 0xea;
lop3.b32 t1, $8, 0x00f000f0, 0x64006400, 0xea;
shr.u32 u, $8, 8;
lop3.b32 t2, u, 0x000f000f, 0x64006400, 0xea;
lop3.b32 t3, u, 0x00f000f0, 0x64006400, 0xea;
sub.rn.f16x2 t0, t0, $10;
fma.rn.f16x2 t1, t1, c, $11;
sub.rn.f16x2 t2, t2, $10;
fma.rn.f16x2 t3, t3, c, $11;
mul.rn.f16x2 t0, t0, $9;
mul.rn.f16x2 t1, t1, $9;
mul.rn.f16x2 t2, t2, $9;
mul.rn.f16x2 t3, t3, $9;
mov.b32 {$0, $4}, t0;
mov.b32 {$2, $6}, t2;
mov.b32 {$1, $5}, t1;
mov.b32 {$3, $7}, t3;
}
""")
_ASM_BF16 = tl.constexpr("""
{
.reg .b32 t0, t1, t2, t3, u;
lop3.b32 t0, $8, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $8, 4;
lop3.b32 t1, u, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $8, 8;
lop3.b32 t2, u, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $8, 12;
lop3.b32 t3, u, 0x000f000f, 0x43004300, 0xea;
sub.rn.bf16x2 t0, t0, $10;
sub.rn.bf16x2 t1, t1, $10;
sub.rn.bf16x2 t2, t2, $10;
sub.rn.bf16x2 t3, t3, $10;
mul.rn.bf16x2 t0, t0, $9;
mul.rn.bf16x2 t1, t1, $9;
mul.rn.bf16x2 t2, t2, $9;
mul.rn.bf16x2 t3, t3, $9;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}
""")


@triton.jit
def _pair(v):
    """half-precision tensor -> int32 holding (v, v) as a half2."""
    b = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _channel_of(w, j):
    """Channel (within the K tile) of nibble j of word w in the fragment order of
    formats.int4.PackedW4: word 16c + 4t + a, nibble 4e + 2h + r0."""
    return (128 * (w // 16) + 32 * (w % 4) + 2 * ((w // 4) % 4)
            + 16 * (j % 2) + 8 * ((j // 2) % 2) + j // 4)


@triton.jit
def _load_groups(s_ptr, rn, k0, stride_sn, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
                 PAIRED: tl.constexpr = False):
    """The (N, Gp) per-group values (scales or zeros) of the K tile at k0: (BLOCK_N,) if the
    tile lies in one group, else (BLOCK_N, BLOCK_K // GROUP_SIZE).
    PAIRED (the launcher checks that rows start 4-byte aligned): a row's BLOCK_K // GROUP_SIZE
    values are loaded as int32 pairs, so that Triton's pipeliner can stream them with cp.async
    (it needs >= 4 bytes per thread) instead of a synchronous 2-byte load in the K loop."""
    if GROUP_SIZE == 0:  # per channel: the same values every tile
        return tl.load(s_ptr + rn * stride_sn)
    elif BLOCK_K <= GROUP_SIZE:
        if PAIRED:  # the int32 pair holding this tile's group and its neighbour
            DT1: tl.constexpr = s_ptr.dtype.element_ty
            g = k0 // GROUP_SIZE
            p1 = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            w1 = tl.load(p1 + rn * (stride_sn // 2) + g // 2)
            return (w1 >> (16 * (g % 2))).to(tl.int16).to(DT1, bitcast=True)
        else:
            return tl.load(s_ptr + rn * stride_sn + k0 // GROUP_SIZE)
    else:
        NG: tl.constexpr = BLOCK_K // GROUP_SIZE
        if PAIRED:
            DT: tl.constexpr = s_ptr.dtype.element_ty
            p = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            w = tl.load(p + rn[:, None] * (stride_sn // 2) + (k0 // (2 * GROUP_SIZE) + tl.arange(0, NG // 2))[None, :])
            lo = w.to(tl.int16).to(DT, bitcast=True)
            hi = (w >> 16).to(tl.int16).to(DT, bitcast=True)
            return tl.reshape(tl.join(lo, hi), (rn.shape[0], NG))
        else:
            return tl.load(s_ptr + rn[:, None] * stride_sn + (k0 // GROUP_SIZE + tl.arange(0, NG))[None, :])


@triton.jit
def _word_tile(v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """`_load_groups`' values -> (BLOCK_N, BLOCK_K // 8): the value of every packed word of
    the tile (a word's 8 channels lie in one group). Broadcasts, reshapes, joins and splits
    only: a select chain over the word index makes Triton convert the dequantized tile
    through shared memory again (shared/probes/regA_probe.py)."""
    W: tl.constexpr = BLOCK_K // 8
    if GROUP_SIZE == 0 or BLOCK_K <= GROUP_SIZE:  # one group in the tile
        return tl.broadcast_to(v[:, None], (BLOCK_N, W))
    else:
        NG: tl.constexpr = BLOCK_K // GROUP_SIZE
        if GROUP_SIZE >= 128:  # words 16c + 4t + a: a group is a run of whole chunks c
            return tl.reshape(tl.broadcast_to(v[:, :, None], (BLOCK_N, NG, W // NG)), (BLOCK_N, W))
        else:  # 32 or 64: the group is a // (4 // GPC), so it changes inside one thread's 4
            # words. A broadcast/reshape of the (BLOCK_N, NG) tile here, or a load gathered
            # straight into the word shape, sends the dequantized tile through shared memory
            # (bench/ptx.py); tl.split / tl.join keep every value in its thread's registers.
            C: tl.constexpr = BLOCK_K // 128
            GPC: tl.constexpr = 128 // GROUP_SIZE
            v = tl.permute(tl.reshape(v, (BLOCK_N, C, 2, GPC // 2)), (0, 1, 3, 2))
            lo, hi = tl.split(v)  # groups [0, GPC/2) and [GPC/2, GPC) of each chunk
            if GPC == 4:
                lo0, lo1 = tl.split(lo)
                hi0, hi1 = tl.split(hi)
                v = tl.reshape(tl.join(tl.join(lo0, hi0), tl.join(lo1, hi1)), (BLOCK_N, C, 1, 4))
                return tl.reshape(tl.broadcast_to(v, (BLOCK_N, C, 4, 4)), (BLOCK_N, W))
            else:
                v = tl.reshape(tl.join(lo, hi), (BLOCK_N, C, 1, 2, 1))
                return tl.reshape(tl.broadcast_to(v, (BLOCK_N, C, 4, 2, 2)), (BLOCK_N, W))


@triton.jit
def _dequant_words(words, sv, zv, s_ptr, z_ptr, gidx_ptr, rn, k0, stride_sn,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
                   HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, DTYPE: tl.constexpr,
                   EMU_BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """int32 (BLOCK_N, W) packed words -> 8 tensors (BLOCK_N, W), n_j = weight of nibble j,
    s * (q - z) in DTYPE (EMU_BF16: fp32 holding the bf16 values; see common.py).
    sv / zv: the tile's scales / zero points from `_load_groups` (symmetric: z_ptr is the
    scales and zv is not used, so the compiler drops its load);
    HAS_GIDX ignores them and gathers every channel's own group."""
    if EMU_BF16:
        MAGIC: tl.constexpr = 8388608.0  # 2**23: (q | 0x4B000000) as fp32 is 2**23 + q
        CT: tl.constexpr = tl.float32
    elif DTYPE == tl.float16:
        MAGIC: tl.constexpr = 1024.0
        CT: tl.constexpr = tl.float16
    else:
        MAGIC: tl.constexpr = 128.0
        CT: tl.constexpr = tl.bfloat16
    if HAS_GIDX:  # per-channel groups: _dequant_nibble loads them (no asm on this path)
        s = tl.full((BLOCK_N, BLOCK_K // 8), 1.0, CT)
        zb = s
    else:
        s = _word_tile(sv, BLOCK_N, BLOCK_K, GROUP_SIZE).to(CT)
        if HAS_ZEROS:
            zb = _word_tile(zv, BLOCK_N, BLOCK_K, GROUP_SIZE).to(CT) + MAGIC
        else:
            zb = tl.full((BLOCK_N, BLOCK_K // 8), MAGIC + 8.0, CT)
    if USE_ASM:
        if HAS_ZEROS:
            z2 = _pair(zb)
        elif DTYPE == tl.float16:  # (1032, 1032) as an int32 constant: a converted fp16 constant
            z2 = tl.full((BLOCK_N, BLOCK_K // 8), 0x64086408, tl.int32)  # sends the tile via smem
        else:  # (136, 136) in bf16
            z2 = tl.full((BLOCK_N, BLOCK_K // 8), 0x43084308, tl.int32)
        if DTYPE == tl.float16:
            if HAS_ZEROS:  # -(64 + z) for the odd nibbles' fma
                z16 = _pair(960.0 - zb)
            else:  # (-72, -72) = 0xD480D480 as a signed int32
                z16 = tl.full((BLOCK_N, BLOCK_K // 8), -729754496, tl.int32)
            n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
                _ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r", [words, _pair(s), z2, z16],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
                _ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, _pair(s), z2],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        return n0, n1, n2, n3, n4, n5, n6, n7
    else:
        wi = tl.arange(0, BLOCK_K // 8)
        n0 = _dequant_nibble(words, 0, s, zb, s_ptr, z_ptr, gidx_ptr, rn, k0, wi, stride_sn, BLOCK_N,
                             HAS_ZEROS, HAS_GIDX, CT, MAGIC, EMU_BF16)
        n1 = _dequant_nibble(words, 1, s, zb, s_ptr, z_ptr, gidx_ptr, rn, k0, wi, stride_sn, BLOCK_N,
                             HAS_ZEROS, HAS_GIDX, CT, MAGIC, EMU_BF16)
        n2 = _dequant_nibble(words, 2, s, zb, s_ptr, z_ptr, gidx_ptr, rn, k0, wi, stride_sn, BLOCK_N,
                             HAS_ZEROS, HAS_GIDX, CT, MAGIC, EMU_BF16)
        n3 = _dequant_nibble(words, 3, s, zb, s_ptr, z_ptr, gidx_ptr, rn, k0, wi, stride_sn, BLOCK_N,
                             HAS_ZEROS, HAS_GIDX, CT, MAGIC, EMU_BF16)
        n4 = _dequant_nibble(words, 4, s, zb, s_ptr, z_ptr, gidx_ptr, rn, k0, wi, stride_sn, BLOCK_N,
                             HAS_ZEROS, HAS_GIDX, CT, MAGIC, EMU_BF16)
        n5 = _dequant_nibble(words, 5, s, zb, s_ptr, z_ptr, gidx_ptr, rn, k0, wi, stride_sn, BLOCK_N,
                             HAS_ZEROS, HAS_GIDX, CT, MAGIC, EMU_BF16)
        n6 = _dequant_nibble(words, 6, s, zb, s_ptr, z_ptr, gidx_ptr, rn, k0, wi, stride_sn, BLOCK_N,
                             HAS_ZEROS, HAS_GIDX, CT, MAGIC, EMU_BF16)
        n7 = _dequant_nibble(words, 7, s, zb, s_ptr, z_ptr, gidx_ptr, rn, k0, wi, stride_sn, BLOCK_N,
                             HAS_ZEROS, HAS_GIDX, CT, MAGIC, EMU_BF16)
        return n0, n1, n2, n3, n4, n5, n6, n7


@triton.jit
def _dequant_nibble(words, J: tl.constexpr, s, zb, s_ptr, z_ptr, gidx_ptr, rn, k0, wi, stride_sn,
                    BLOCK_N: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
                    CT: tl.constexpr, MAGIC: tl.constexpr, EMU_BF16: tl.constexpr):
    """Pure-Triton twin of the asm for nibble J: the same exact (1024 + q) - (1024 + z), then
    one rounding in the multiply by the scale. HAS_GIDX: every channel has its own group."""
    q = (words >> (4 * J)) & 0xF
    if EMU_BF16:
        w = (q | 0x4B000000).to(tl.float32, bitcast=True)
    elif CT == tl.float16:
        w = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        w = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    if HAS_GIDX:
        g = tl.load(gidx_ptr + k0 + _channel_of(wi, J))
        off = rn[:, None] * stride_sn + g[None, :]
        s = tl.load(s_ptr + off).to(CT)
        if HAS_ZEROS:
            zb = tl.load(z_ptr + off).to(CT) + MAGIC
        else:
            zb = tl.full((BLOCK_N, wi.shape[0]), MAGIC + 8.0, CT)
    w = (w - zb) * s
    if EMU_BF16:
        w = round_bf16_emu(w)
    return w


@triton.jit
def _fragment_tile(n0, n1, n2, n3, n4, n5, n6, n7, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """8 nibble tensors (BLOCK_N, W) -> the (BLOCK_N, BLOCK_K) weight tile in channel order.
    join8 puts nibble 4e + 2h + r0 at minor index [e, h, r0]; word w = 16c + 4t + a; the
    permute gives k = 128c + 32a + 16r0 + 8h + 2t + e. All of it stays in each thread's
    registers when the tile feeds wgmma's A operand (the fragment order is the point)."""
    C: tl.constexpr = BLOCK_K // 128
    q = join8(n0, n1, n2, n3, n4, n5, n6, n7)                  # (n, w, e, h, r0)
    if C == 1:
        q = tl.reshape(q, (BLOCK_N, 4, 4, 2, 2, 2))           # (n, t, a, e, h, r0)
        q = tl.permute(q, (0, 2, 5, 4, 1, 3))                 # (n, a, r0, h, t, e)
    else:
        q = tl.reshape(q, (BLOCK_N, C, 4, 4, 2, 2, 2))        # (n, c, t, a, e, h, r0)
        q = tl.permute(q, (0, 1, 3, 6, 5, 2, 4))              # (n, c, a, r0, h, t, e)
    return tl.reshape(q, (BLOCK_N, BLOCK_K))


@triton.jit
def _word_order(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x (BLOCK_K,) or (BLOCK_M, BLOCK_K) in channel order -> the order of the joined word
    tile, position 8w + j = channel `_channel_of(w, j)` (the inverse of `_fragment_tile`)."""
    C: tl.constexpr = BLOCK_K // 128
    if BLOCK_M == 1:
        x = tl.reshape(x, (C, 4, 2, 2, 4, 2))                # (c, a, r0, h, t, e)
        x = tl.permute(x, (0, 4, 1, 5, 3, 2))                # (c, t, a, e, h, r0)
        return tl.reshape(x, (BLOCK_K,))
    else:
        x = tl.reshape(x, (BLOCK_M, C, 4, 2, 2, 4, 2))
        x = tl.permute(x, (0, 1, 5, 2, 6, 4, 3))
        return tl.reshape(x, (BLOCK_M, BLOCK_K))


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, bias_ptr, y_ptr, ws_ptr,
    M, N, K, stride_xm, stride_ym, stride_qn, stride_sn,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, EMU_BF16: tl.constexpr,
    USE_ASM: tl.constexpr, PREFETCH_S: tl.constexpr, PAIRED_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
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
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)

    kt0, kt1 = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)

    W: tl.constexpr = BLOCK_K // 8
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = qw_ptr + rn[:, None] * stride_qn + (kt0 * W + tl.arange(0, W))[None, :]
    x_ptrs = x_ptr + rm[None, :] * stride_xm + (kt0 * BLOCK_K + offs_k)[:, None]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PREFETCH_S:
        s_nxt = _load_groups(s_ptr, rn, kt0 * BLOCK_K, stride_sn, BLOCK_K, GROUP_SIZE)
        z_nxt = _load_groups(z_ptr, rn, kt0 * BLOCK_K, stride_sn, BLOCK_K, GROUP_SIZE)
    for kt in range(kt0, kt1):
        k0 = kt * BLOCK_K
        words = tl.load(w_ptrs, eviction_policy="evict_first")
        if EVEN_K:
            xt = tl.load(x_ptrs, eviction_policy="evict_last")
        else:
            xt = tl.load(x_ptrs, mask=(k0 + offs_k)[:, None] < K, other=0.0,
                         eviction_policy="evict_last")
        if PREFETCH_S:  # this tile's groups were loaded one iteration ago (latency hidden)
            sv = s_nxt
            zv = z_nxt
            kn = tl.minimum(kt + 1, kt1 - 1) * BLOCK_K
            s_nxt = _load_groups(s_ptr, rn, kn, stride_sn, BLOCK_K, GROUP_SIZE)
            z_nxt = _load_groups(z_ptr, rn, kn, stride_sn, BLOCK_K, GROUP_SIZE)
        else:
            sv = _load_groups(s_ptr, rn, k0, stride_sn, BLOCK_K, GROUP_SIZE, PAIRED_S)
            zv = _load_groups(z_ptr, rn, k0, stride_sn, BLOCK_K, GROUP_SIZE, PAIRED_S)
        n0, n1, n2, n3, n4, n5, n6, n7 = _dequant_words(
            words, sv, zv, s_ptr, z_ptr, gidx_ptr, rn, k0, stride_sn, BLOCK_N, BLOCK_K, GROUP_SIZE,
            HAS_ZEROS, HAS_GIDX, DTYPE, EMU_BF16, USE_ASM)
        w = _fragment_tile(n0, n1, n2, n3, n4, n5, n6, n7, BLOCK_N, BLOCK_K)
        if EMU_BF16:
            xt = xt.to(tl.float32)
        acc = tl.dot(w, xt, acc)
        w_ptrs += W
        x_ptrs += BLOCK_K

    out_mask = (offs_m < M)[None, :] & (offs_n < N)[:, None]
    om = offs_m.to(tl.int64)
    on = offs_n.to(tl.int64)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
        tl.store(y_ptr + om[None, :] * stride_ym + on[:, None], cast_out(acc, DTYPE, EMU_BF16), mask=out_mask)
    else:
        ws_ptrs = ws_ptr + (pid_k * M + om[None, :]) * N + on[:, None]
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
    at the end. Same dequantization and split-K protocol as _w4a16_kernel. The weights stay
    in word order (a sum over K does not care about the order); x is read in that order.
    Why a separate path: at M = 1 the FMAs are cheaper than filling a 16-wide MMA
    (8192x57344 on H200: 166 us with tl.dot vs 122 us here, natural-order layout)."""
    DTYPE = x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rn = (offs_n % N).to(tl.int64)
    rm = offs_m % M
    kt0, kt1 = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    W: tl.constexpr = BLOCK_K // 8
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = qw_ptr + rn[:, None] * stride_qn + (kt0 * W + tl.arange(0, W))[None, :]
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
        sv = _load_groups(s_ptr, rn, k0, stride_sn, BLOCK_K, GROUP_SIZE)
        zv = _load_groups(z_ptr, rn, k0, stride_sn, BLOCK_K, GROUP_SIZE)
        n0, n1, n2, n3, n4, n5, n6, n7 = _dequant_words(
            words, sv, zv, s_ptr, z_ptr, gidx_ptr, rn, k0, stride_sn, BLOCK_N, BLOCK_K, GROUP_SIZE,
            HAS_ZEROS, HAS_GIDX, DTYPE, EMU_BF16, USE_ASM)
        w = tl.reshape(join8(n0, n1, n2, n3, n4, n5, n6, n7), (BLOCK_N, BLOCK_K))
        # x is read in channel order (wide loads) and permuted to the words' order in
        # registers: gathering it in word order cost 9% at M = 1 (8192x57344 H200: 132.6 -> 128.3 us, tuned)
        xv = _word_order(xv, BLOCK_M, BLOCK_K)
        if BLOCK_M == 1:
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        else:
            acc += w.to(tl.float32)[None, :, :] * xv.to(tl.float32)[:, None, :]
        w_ptrs += W
        x_ptrs += BLOCK_K
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]  # (1, BLOCK_N)
    else:
        out = tl.sum(acc, axis=2)  # (BLOCK_M, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    on = offs_n.to(tl.int64)
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + on[None, :], cast_out(out, DTYPE, EMU_BF16), mask=mask)
    else:
        tl.store(ws_ptr + (pid_k * M + offs_m[:, None]) * N + on[None, :], out, mask=mask)


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
    rn = (offs_n % N).to(tl.int64)
    words = tl.load(qw_ptr + rn[:, None] * stride_qn + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :])
    sv = _load_groups(s_ptr, rn, k0, stride_sn, BLOCK_K, GROUP_SIZE)
    zv = _load_groups(z_ptr, rn, k0, stride_sn, BLOCK_K, GROUP_SIZE)
    n0, n1, n2, n3, n4, n5, n6, n7 = _dequant_words(
        words, sv, zv, s_ptr, z_ptr, gidx_ptr, rn, k0, stride_sn, BLOCK_N, BLOCK_K, GROUP_SIZE,
        HAS_ZEROS, HAS_GIDX, DTYPE, EMU_BF16, USE_ASM)
    w = _fragment_tile(n0, n1, n2, n3, n4, n5, n6, n7, BLOCK_N, BLOCK_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    tl.store(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
             cast_out(w.to(tl.float32), DTYPE, EMU_BF16), mask=mask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, bias_ptr, y_ptr, M, N, stride_ym,
                          SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, EMU_BF16: tl.constexpr,
                          BLOCK: tl.constexpr):
    """y[m, n] = sum_s ws[s, m, n] (+ bias[n]), summed in a fixed order."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    MN = (offs * 0 + M) * N  # int64 (M may be specialised to a constant 1: no .to on it)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    m = offs // N
    tl.store(y_ptr + m * stride_ym + n, cast_out(acc, y_ptr.dtype.element_ty, EMU_BF16), mask=mask)
