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
  adds them in a fixed order, so results are deterministic run to run. The GEMVs (FIXUP)
  can instead have each output tile's last slice add them (`_gemv_fixup`): the same order and
  the same bits, one launch instead of two.
- Offsets that scale with M * N or N * K are int64 (57344 x 40960 passes 2^31).
"""
import re
from functools import lru_cache

import triton
import triton.language as tl

from .common import (SYNC_TILES, cast_out, grouped_tile, join8, last_slice, pdl_release, pdl_wait, round_bf16_emu,
                     split_k_range, sum_slices)

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



def _unscaled(asm: str) -> str:
    """The same asm without the scale (SCALE_ACC: the kernel scales the fp32 accumulator
    instead): the mul.x2 by $9 dropped and the later operands renumbered, so q - z exactly
    in 9 (fp16) / 11 (bf16) instructions per word; $8 = word, $9 = (MAGIC + z) pair, $10 =
    the fp16 fma's -(64 + z) pair."""
    asm = re.sub(r"mul\.rn\.\w+ t\d, t\d, \$9;\n", "", asm)
    return asm.replace("$10", "$9").replace("$11", "$10")


_ASM_F16_Q = tl.constexpr(_unscaled(_ASM_F16.value))
_ASM_BF16_Q = tl.constexpr(_unscaled(_ASM_BF16.value))

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
    through shared memory again (`python -m sailfish.bench.ptx` counts it)."""
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
            # (tools/ptx.py); tl.split / tl.join keep every value in its thread's registers.
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
                   EMU_BF16: tl.constexpr, USE_ASM: tl.constexpr, SCALED: tl.constexpr = True):
    """int32 (BLOCK_N, W) packed words -> 8 tensors (BLOCK_N, W), n_j = weight of nibble j,
    s * (q - z) in DTYPE (EMU_BF16: fp32 holding the bf16 values; see common.py);
    SCALED=False: q - z (exact), for a kernel that scales its accumulator (SCALE_ACC).
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
        if SCALED:
            s = _word_tile(sv, BLOCK_N, BLOCK_K, GROUP_SIZE).to(CT)
        else:
            s = tl.full((BLOCK_N, BLOCK_K // 8), 1.0, CT)  # (x * 1 is exact and folded away)
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
            if SCALED:
                n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
                    _ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r", [words, _pair(s), z2, z16],
                    dtype=(tl.float16,) * 8, is_pure=True, pack=1)
            else:
                n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
                    _ASM_F16_Q, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, z2, z16],
                    dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        elif SCALED:
            n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
                _ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, _pair(s), z2],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
                _ASM_BF16_Q, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, z2],
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
def _load_tile(w_ptrs, x_ptrs, k0, K, TK: tl.constexpr, EVEN_K: tl.constexpr):
    """The packed words and the x tile (TK channels from k0) of one K step of _w4a16_kernel."""
    words = tl.load(w_ptrs, eviction_policy="evict_first")
    if EVEN_K:
        xt = tl.load(x_ptrs, eviction_policy="evict_last")
    else:
        xt = tl.load(x_ptrs, mask=(k0 + tl.arange(0, TK))[:, None] < K, other=0.0, eviction_policy="evict_last")
    return words, xt


@triton.jit
def _tile_operands(words, xt, sv, zv, s_ptr, z_ptr, gidx_ptr, rn, k0, stride_sn, BLOCK_N: tl.constexpr,
                   TK: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
                   DTYPE: tl.constexpr, EMU_BF16: tl.constexpr, USE_ASM: tl.constexpr, SCALED: tl.constexpr):
    """The dot's operands of one K step: the dequantized weight tile in fragment order
    (_dequant_words; SCALED=False: q - z) and x (fp32 under EMU_BF16, see common.py)."""
    n0, n1, n2, n3, n4, n5, n6, n7 = _dequant_words(
        words, sv, zv, s_ptr, z_ptr, gidx_ptr, rn, k0, stride_sn, BLOCK_N, TK, GROUP_SIZE,
        HAS_ZEROS, HAS_GIDX, DTYPE, EMU_BF16, USE_ASM, SCALED)
    w = _fragment_tile(n0, n1, n2, n3, n4, n5, n6, n7, BLOCK_N, TK)
    if EMU_BF16:
        xt = xt.to(tl.float32)
    return w, xt


@triton.jit
def _acc_dot(acc, w, xt, sv, SCALED_PRODUCT: tl.constexpr, ACC_FENCE: tl.constexpr):
    """acc + w @ xt, or with SCALED_PRODUCT (SCALE_ACC, one group per K tile) acc + (w @ xt) * sv
    per row (w then holds q - z). ACC_FENCE (the unscaled form): read the accumulator after its
    wgmmas (an identity asm; _w4a16_kernel's docstring says why)."""
    if SCALED_PRODUCT:
        acc += tl.dot(w, xt) * sv.to(tl.float32)[:, None]
    else:
        acc = tl.dot(w, xt, acc)
        if ACC_FENCE:
            acc = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True,
                                            pack=1)
    return acc


@triton.jit
def _half_product(w_ptrs, x_ptrs, sv, zv, s_ptr, z_ptr, gidx_ptr, rn, k0, K, stride_sn, BLOCK_N: tl.constexpr,
                  HK: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, DTYPE: tl.constexpr,
                  EMU_BF16: tl.constexpr, USE_ASM: tl.constexpr, EVEN_K: tl.constexpr):
    """SCALE_ACC with two groups per K tile (_w4a16_kernel): the unscaled fp32 product of the
    half tile at k0 (HK = GROUP_SIZE channels, one group; sv / zv its group's scales and zero
    points, (BLOCK_N,))."""
    words, xt = _load_tile(w_ptrs, x_ptrs, k0, K, HK, EVEN_K)
    w, xt = _tile_operands(words, xt, sv, zv, s_ptr, z_ptr, gidx_ptr, rn, k0, stride_sn, BLOCK_N, HK, GROUP_SIZE,
                           HAS_ZEROS, False, DTYPE, EMU_BF16, USE_ASM, False)
    return tl.dot(w, xt)


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, bias_ptr, y_ptr, ws_ptr,
    M, N, K, stride_xm, stride_ym, stride_qn, stride_sn,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, EMU_BF16: tl.constexpr,
    USE_ASM: tl.constexpr, PREFETCH_S: tl.constexpr, PAIRED_S: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SCALE_ACC: tl.constexpr = False,
    ACC_FENCE: tl.constexpr = False, PDL_EARLY: tl.constexpr = False,
):
    """x (M, K) row-major; qweight int32 (N, Kp // 8), Kp >= K; scales/zeros (N, Gp); y (M, N).
    PDL_EARLY (split-K): the reduce may launch at once (kernels/common.py).

    SCALE_ACC (no g_idx; BLOCK_K <= GROUP_SIZE or BLOCK_K = 2 * GROUP_SIZE): the tile is
    dequantized to q - z only (exact) and the scale multiplies the fp32 product instead, once
    per group and tile (per channel: once at the end): a multiply per output element instead
    of per weight. With two groups per tile each half (one group, one 128-channel chunk of the
    fragment order: 16 words) is loaded, dequantized and multiplied on its own, and both
    products are scaled into the accumulator after the two dots (the PTX of Triton 3.6 and 3.9
    still waits for each half's wgmmas before the next half's: the gain over BLOCK_K = 128 is
    half the loop iterations and their per-tile overhead; docs/perf_log.md v16).

    ACC_FENCE (GPU, Triton < 3.9: ops/w4a16.py acc_fence): read the accumulator every K tile
    (an identity asm), so that its wgmmas complete inside the tile. Triton 3.6-3.8 leave them
    in flight across the loop's back edge (wgmma.wait_group 7 / 15 / 1) while the next tile's
    dequantization writes registers, and ptxas may give those the registers of the A
    fragments still being read: wrong, nondeterministic outputs, measured on an H200 with
    Triton 3.6 for per-channel tiles (docs/perf_log.md v15; `python -m sailfish.bench.ptx`
    checks the SASS for this).

    Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT_K). With SPLIT_K > 1 the fp32
    partial tile goes to ws (SPLIT_K, M, N) and bias/cast happen in the reduce kernel.
    """
    pdl_release(PDL_EARLY)
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
    # SCALE_ACC with two groups per K tile: the loads and the dot are per half tile (HK channels)
    HALVES: tl.constexpr = SCALE_ACC and GROUP_SIZE != 0 and BLOCK_K > GROUP_SIZE
    HK: tl.constexpr = BLOCK_K // 2 if HALVES else BLOCK_K
    offs_k = tl.arange(0, HK)
    w_ptrs = qw_ptr + rn[:, None] * stride_qn + (kt0 * W + tl.arange(0, HK // 8))[None, :]
    x_ptrs = x_ptr + rm[None, :] * stride_xm + (kt0 * BLOCK_K + offs_k)[:, None]

    tl.static_assert(not (PREFETCH_S and HALVES), "PREFETCH_S needs one group per K tile")
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # PREFETCH_S (one group per K tile, ops/w4a16.prefetch_scales): the scales are loaded one
    # K tile ahead. Zero points stay in the tile that uses them: prefetched, they feed the
    # dequantization from a loop-carried layout and Triton 3.6 sends the tile through shared
    # memory (ldmatrix in the K loop, bf16 asym BM 16 / BN 64; tools/ptx.py).
    if PREFETCH_S:
        s_nxt = _load_groups(s_ptr, rn, kt0 * BLOCK_K, stride_sn, BLOCK_K, GROUP_SIZE)
    for kt in range(kt0, kt1):
        k0 = kt * BLOCK_K
        if HALVES:
            s0 = _load_groups(s_ptr, rn, k0, stride_sn, HK, GROUP_SIZE, PAIRED_S)
            s1 = _load_groups(s_ptr, rn, k0 + HK, stride_sn, HK, GROUP_SIZE, PAIRED_S)
            z0 = _load_groups(z_ptr, rn, k0, stride_sn, HK, GROUP_SIZE, PAIRED_S)
            z1 = _load_groups(z_ptr, rn, k0 + HK, stride_sn, HK, GROUP_SIZE, PAIRED_S)
            p0 = _half_product(w_ptrs, x_ptrs, s0, z0, s_ptr, z_ptr, gidx_ptr, rn, k0, K, stride_sn, BLOCK_N, HK,
                               GROUP_SIZE, HAS_ZEROS, DTYPE, EMU_BF16, USE_ASM, EVEN_K)
            p1 = _half_product(w_ptrs + HK // 8, x_ptrs + HK, s1, z1, s_ptr, z_ptr, gidx_ptr, rn, k0 + HK, K,
                               stride_sn, BLOCK_N, HK, GROUP_SIZE, HAS_ZEROS, DTYPE, EMU_BF16, USE_ASM, EVEN_K)
            acc += p0 * s0.to(tl.float32)[:, None]  # (two FFMAs per element)
            acc += p1 * s1.to(tl.float32)[:, None]
        else:
            words, xt = _load_tile(w_ptrs, x_ptrs, k0, K, BLOCK_K, EVEN_K)
            if PREFETCH_S:  # this tile's scales were loaded one iteration ago (latency hidden)
                sv = s_nxt
                kn = tl.minimum(kt + 1, kt1 - 1) * BLOCK_K
                s_nxt = _load_groups(s_ptr, rn, kn, stride_sn, BLOCK_K, GROUP_SIZE)
            else:
                sv = _load_groups(s_ptr, rn, k0, stride_sn, BLOCK_K, GROUP_SIZE, PAIRED_S)
            zv = _load_groups(z_ptr, rn, k0, stride_sn, BLOCK_K, GROUP_SIZE, PAIRED_S)
            w, xt = _tile_operands(words, xt, sv, zv, s_ptr, z_ptr, gidx_ptr, rn, k0, stride_sn, BLOCK_N, BLOCK_K,
                                   GROUP_SIZE, HAS_ZEROS, HAS_GIDX, DTYPE, EMU_BF16, USE_ASM, not SCALE_ACC)
            acc = _acc_dot(acc, w, xt, sv, SCALE_ACC and GROUP_SIZE != 0, ACC_FENCE)
        w_ptrs += W
        x_ptrs += BLOCK_K
    if SCALE_ACC and GROUP_SIZE == 0:
        acc *= tl.load(s_ptr + rn * stride_sn).to(tl.float32)[:, None]

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
    M, N, K, stride_xm, stride_ym, stride_qn, stride_sn, sync_ptr,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, EMU_BF16: tl.constexpr,
    USE_ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL_EARLY: tl.constexpr = False, FIXUP: tl.constexpr = False,
):
    """Small M (BLOCK_M >= M rows, one program per N tile): y[m, n] = sum_k x[m, k] W[n, k]
    on CUDA cores, fp32 FMAs into a (BLOCK_M, BLOCK_N, BLOCK_K) accumulator reduced once
    at the end. Same dequantization and split-K protocol as _w4a16_kernel (FIXUP, sync_ptr: the
    slices added in the kernel, _gemv_fixup). The weights stay
    in word order (a sum over K does not care about the order); x is read in that order.
    Why a separate path: at M = 1 the FMAs are cheaper than filling a 16-wide MMA
    (8192x57344 on H200: 166 us with tl.dot vs 122 us here, natural-order layout)."""
    pdl_release(PDL_EARLY)
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
        if FIXUP:
            _gemv_fixup(ws_ptr, bias_ptr, y_ptr, sync_ptr, pid_n, M, N, stride_ym, SPLIT_K, HAS_BIAS, EMU_BF16, DTYPE,
                        BLOCK_M, BLOCK_N)


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
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """y[m, n] = sum_s ws[s, m, n] (+ bias[n]), summed in a fixed order. PDL: launched as a
    programmatic dependent of the GEMM (kernels/common.py); waits for its partial sums."""
    pdl_wait(PDL)
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


@triton.jit
def _gemv_fixup(ws_ptr, bias_ptr, y_ptr, sync_ptr, pid_n, M, N, stride_ym, SPLIT_K: tl.constexpr,
                HAS_BIAS: tl.constexpr, EMU_BF16: tl.constexpr, DTYPE: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Split-K without the reduce kernel (FIXUP), for a GEMV program that has stored its partial
    sums of rows n in [pid_n * BLOCK_N, + BLOCK_N) and batch rows m < M <= ROWS (a power of two)
    in the workspace slice pid_k: it counts itself in on the tile's counter (kernels/common.py
    last_slice), and the tile's last slice computes exactly what _splitk_reduce_kernel does for
    these outputs: zero plus slices 0, 1, ..., SPLIT_K - 1 in fp32, plus the bias, cast once
    (sum_slices; bit for bit the same, tests/test_w4a16_gemv.py). The launcher takes this path
    only while M * N < 2**31 (32-bit offsets within a slice)."""
    cnt = sync_ptr + SYNC_TILES + pid_n
    if last_slice(cnt, SPLIT_K):
        offs_m = tl.arange(0, ROWS)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        acc = sum_slices(tl.zeros((ROWS, BLOCK_N), tl.float32), ws_ptr, offs_m[:, None] * N + offs_n[None, :], cnt,
                         tl.cast(M, tl.int64) * N, mask, SPLIT_K)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n % N).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n.to(tl.int64)[None, :], cast_out(acc, DTYPE, EMU_BF16),
                 mask=mask)


# ----------------------------------------------------------------------------------
# M <= 8 GEMV on the tensor cores: mma.sync m16n8k16 straight from the packed words
# ----------------------------------------------------------------------------------
# Why (issue 9, docs/perf_log.md v7/v10): the CUDA-core GEMV spent ~5.4 instructions per
# weight (dequantize, convert to fp32, FFMA), issue-bound at a third of HBM speed, while
# the H200's issue rate allows ~3.9 at the HBM rate. One mma.sync multiplies 8 weights per
# thread exactly (fp16/bf16 products are exact in the fp32 accumulator), so a weight costs
# its share of the 13-instruction dequantization of a word (fp16) plus 1/8 of an mma.
#
# The fragment-order layout (formats.int4.PackedW4) makes every word a register of the
# m16n8k16 A fragment: lane (g, t) of a warp holds, for rows g and g + 8 and each 16-channel
# step, channels 2t + e + 8h; nibble 4e + 2h + r0 of word 16c + 4t + a is channel
# 128c + 32a + 16r0 + 8h + 2t + e. So one mma takes (nibbles 0/4, 2/6) of a word of row g and
# of row g + 8 for the step (c, a, r0 = 0), another (1/5, 3/7) for r0 = 1. B is x: b0, b1 of
# lane (g, t) are the channel pairs 2t and 2t + 8 of the step, in column g. For M = 1 every
# column gets x (the lanes need no row index), for M <= 8 column m gets row m of x, and
# lane (g, t) ends with y[2t], y[2t + 1] of rows g and g + 8 (the C fragment).
#
# The asm is elementwise over 2-D (V, 4) tensors (virtual row = chunk slot, row block, g;
# lane-in-group t), fed from (V, 16) word tiles that Triton loads with 16-byte vectors: a
# 2-D tile can only get 4 lanes along its 16 words and 8 along the rows, so lane 4g + t
# holds words 4t .. 4t + 3 of row g, exactly the fragment's (g, t). (A 3-D (chunk, row, word)
# tile got lanes along the chunks from Triton 3.6: wrong results on an H200.) The mma is a
# warp instruction, so correctness rests on that lane order: tools/ptx.gemv_lane_order checks
# the compiled layout, tests/test_w4a16_gemv.py emulates the asm on the CPU and checks the
# outputs on the GPU. x, scales and zero points are loaded inside the asm, so that the words
# are the only loaded operands whose layout Triton chooses for it.
def _gemv_mma_asm(bf16: bool, zeros: bool, even_k: bool, pairs: int, scale_acc: bool = False) -> str:
    """PTX for one (chunk slot, row block, g, t) element: `pairs` row pairs (g, g + 8) of 16
    rows each, a lane's 4 words per row. scale_acc: the weights enter the mmas as the exact
    q - z and each row pair's chunk product (fp32, in 4 fresh registers) is multiplied by
    the row's scale into the accumulators with one FFMA each: the 4 half2 multiplies per word
    leave the loop (fp16 13 -> 9, bf16 15 -> 11 instructions per word), and the weight is
    s * (q - z) unrounded (PackedW4.dequantize(rounded=False)), as the mma kernel's
    SCALE_ACC. Operands (P = pairs, 4P accumulators):
    $0 .. $4P-1 out: fp32 accumulators (pair p: c0..c3 at 4p)
    then in: 8P words (pair p, row lo/hi, a = 0..3), the x address (pair 64c + t of the
    lane's row of x), 2P scale addresses (pair p lo, hi), the zero-point minus scale
    address difference, the number of x pairs left in the row (masks the K tail unless
    even_k), the 4P accumulators. Everything a lane reads besides its words is loaded here:
    operands loaded by Triton would let the compiler pick their layout for this op, and the
    mma needs the words' lane order (see the block comment)."""
    na = 4 * pairs
    iw = na
    ix = iw + 8 * pairs
    i_s = ix + 1
    iz = i_s + 2 * pairs
    irem = iz + 1
    iacc = irem + 1
    ty = "bf16x2" if bf16 else "f16x2"
    h1 = "bf16" if bf16 else "f16"
    magic = "0x43004300" if bf16 else "0x64006400"
    L = ["{", ".reg .b32 p0, p1, p2, p3, ul, uh, k16, t32;", ".reg .b16 q16, c16;", ".reg .pred px;",
         ".reg .b64 za;",
         ".reg .b32 " + ", ".join(f"x{i}" for i in range(16)) + ";",
         ".reg .b32 " + ", ".join(f"s{r}, zl{r}, zh{r}" for r in range(2 * pairs)) + ";",
         ".reg .f32 " + ", ".join(f"d{i}" for i in range(na)) + ";",
         "mov.b32 k16, 0x2c002c00;"]  # (1/16, 1/16) in fp16
    if scale_acc:  # the chunk products e*, the rows' fp32 scales sf*, a zero
        L += [".reg .f32 fz, " + ", ".join([f"e{i}" for i in range(na)] + [f"sf{r}" for r in range(2 * pairs)]) + ";",
              "mov.f32 fz, 0f00000000;"]
    L += [f"mov.f32 d{i}, ${iacc + i};" for i in range(na)]
    # x: pair 4i past the lane's first one is register i = 4a + 2r0 + h (16 bytes apart)
    for i in range(16):
        if even_k:
            L.append(f"ld.global.nc.b32 x{i}, [${ix} + {16 * i}];")
        else:
            L += [f"mov.b32 x{i}, 0;", f"setp.gt.s32 px, ${irem}, {4 * i};",
                  f"@px ld.global.nc.b32 x{i}, [${ix} + {16 * i}];"]
    # per row: half2 scale, (1024 + z) and -(64 + z) (bf16: 128 + z); symmetric z = 8
    for r in range(2 * pairs):
        L.append(f"ld.global.b16 q16, [${i_s + r}];")
        if scale_acc:
            L.append(f"cvt.f32.{h1} sf{r}, q16;")
        else:
            L.append(f"mov.b32 s{r}, {{q16, q16}};")
        if zeros:
            L += [f"add.s64 za, ${i_s + r}, ${iz};", "ld.global.b16 q16, [za];"]
            L += ["mov.b16 c16, 0x4300;" if bf16 else "mov.b16 c16, 0x6400;",
                  f"add.rn.{h1} c16, q16, c16;", f"mov.b32 zl{r}, {{c16, c16}};"]
            if not bf16:
                L += ["mov.b16 c16, 0xd400;", "sub.rn.f16 c16, c16, q16;", f"mov.b32 zh{r}, {{c16, c16}};"]
        else:
            L.append(f"mov.b32 zl{r}, {'0x43084308' if bf16 else '0x64086408'};")
            if not bf16:
                L.append(f"mov.b32 zh{r}, 0xd480d480;")  # (-72, -72)
    mma = ("mma.sync.aligned.m16n8k16.row.col.f32." + ("bf16.bf16" if bf16 else "f16.f16") + ".f32 "
           "{d%d, d%d, d%d, d%d}, {p0, p1, p2, p3}, {x%d, x%d}, {d%d, d%d, d%d, d%d};")
    mma_e = mma.split(" ")[0] + " %s, {p0, p1, p2, p3}, {x%d, x%d}, %s;"

    def half(dst, src, hi_nibble, r):
        scale = [] if scale_acc else [f"mul.rn.{ty} {dst}, {dst}, s{r};"]
        if not hi_nibble:  # nibbles j, j + 4 in bits 0-3 / 16-19: (1024 + q) - (1024 + z), exact
            return [f"lop3.b32 {dst}, {src}, 0x000f000f, {magic}, 0xea;",
                    f"sub.rn.{ty} {dst}, {dst}, zl{r};"] + scale
        # fp16, bits 4-7 / 20-23: (1024 + 16q) / 16 - (64 + z), one exact fma
        return [f"lop3.b32 {dst}, {src}, 0x00f000f0, {magic}, 0xea;",
                f"fma.rn.{ty} {dst}, {dst}, k16, zh{r};"] + scale

    for a in range(4):
        for p in range(pairs):
            wl, wh = f"${iw + 8 * p + a}", f"${iw + 8 * p + 4 + a}"
            rl, rh = 2 * p, 2 * p + 1
            d = tuple(4 * p + i for i in range(4))
            e = "{" + ", ".join(f"e{i}" for i in d) + "}"  # (scale_acc: the pair's chunk product)
            for r0 in range(2):
                # A fragment: a0 row g, channels 2t + e (h = 0); a1 row g + 8; a2, a3: h = 1
                if bf16:  # 7 mantissa bits: every nibble is shifted down to bits 0-3 first
                    for h in range(2):
                        sh = 4 * (2 * h + r0)  # nibbles 2h + r0 and 2h + r0 + 4
                        for dst, w, u, r in ((f"p{2 * h}", wl, "ul", rl), (f"p{2 * h + 1}", wh, "uh", rh)):
                            if sh:
                                L.append(f"shr.u32 {u}, {w}, {sh};")
                            L += half(dst, u if sh else w, False, r)
                else:
                    if r0 == 0:
                        L += [f"shr.u32 ul, {wl}, 8;", f"shr.u32 uh, {wh}, 8;"]
                    L += half("p0", wl, r0, rl) + half("p1", wh, r0, rh)
                    L += half("p2", "ul", r0, rl) + half("p3", "uh", r0, rh)
                xs = (4 * a + 2 * r0, 4 * a + 2 * r0 + 1)
                if scale_acc:  # the chunk's first mma starts from zero
                    L.append(mma_e % ((e,) + xs + ("{fz, fz, fz, fz}" if a == r0 == 0 else e,)))
                else:
                    L.append(mma % (d + xs + d))
    if scale_acc:  # c0, c1 of a pair: its row g (scale sf{2p}); c2, c3: row g + 8 (sf{2p + 1})
        L += [f"fma.rn.f32 d{i}, e{i}, sf{2 * (i // 4) + (i % 4) // 2}, d{i};" for i in range(na)]
    L += [f"mov.f32 ${i}, d{i};" for i in range(na)] + ["}"]
    return "\n".join(L)


def _gemv_constraints(pairs: int) -> str:
    na = 4 * pairs
    return ",".join(["=f"] * na + ["r"] * (8 * pairs) + ["l"] * (2 + 2 * pairs) + ["r"] + ["f"] * na)


@lru_cache(maxsize=None)
def gemv_asm(bf16: bool, zeros: bool, even_k: bool, pairs: int, scale_acc: bool = False) -> tuple:
    """(PTX, constraints) of `_w4a16_gemv_mma_kernel`'s asm, passed as its constexpr ASM."""
    return _gemv_mma_asm(bf16, zeros, even_k, pairs, scale_acc), _gemv_constraints(pairs)


def gemv_pairs(block_n: int) -> int:
    """Row pairs (16 rows each) per asm element: 2 where BLOCK_N allows (x loaded once for
    32 rows), else 1."""
    return 2 if block_n >= 32 else 1


def gemv_warps(block_n: int, block_k: int, num_warps: int) -> int:
    """num_warps, at most the program's warp-sized work units (chunk slots x row blocks): a
    warp more would only repeat another's work (Triton replicates a tensor smaller than the
    CTA over the extra warps) and, in the compiled code, add shared-memory round trips."""
    units = (block_k // 128) * (block_n // (16 * gemv_pairs(block_n)))
    return max(1, min(num_warps, units))


@triton.jit
def _half_bits(p, SHIFT: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 value of the fp16/bf16 in bits SHIFT .. SHIFT + 15 of the int32 p (exact)."""
    b = (p >> SHIFT) & 0xFFFF
    if DTYPE == tl.float16:
        return b.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return (b << 16).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_split_words(w):
    """(V, 16) words -> 4 tensors (V, 4): word 4t + a of each virtual row, a = 0..3
    (register-local: a thread's 4 words are one 16-byte vector)."""
    w = tl.reshape(w, (w.shape[0], 4, 2, 2))  # (v, t, a1, a0)
    e0, e1 = tl.split(w)
    w0, w2 = tl.split(e0)
    w1, w3 = tl.split(e1)
    return w0, w1, w2, w3


@triton.jit
def _gemv_twin_weights(w0, w1, w2, w3, s_ptrs, z_ptrs, HAS_ZEROS: tl.constexpr, DTYPE: tl.constexpr,
                       EMU_BF16: tl.constexpr, SCALE_ACC: tl.constexpr):
    """The twin's dequantization: words (V, 4) of a = 0..3 -> fp32 (V, 4, 4, 8) [v, t, a, j],
    the weight of nibble j: the exact q - z times the scale, rounded once to DTYPE, as the
    asm's sub/fma + mul do (SCALE_ACC: q - z alone; _gemv_twin scales the sums)."""
    w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (w0.shape[0], 4, 4))
    q = (w[:, :, :, None] >> (4 * tl.arange(0, 8))[None, None, None, :]) & 0xF
    s = tl.load(s_ptrs).to(tl.float32)[:, :, None, None]
    if HAS_ZEROS:
        z = tl.load(z_ptrs).to(tl.float32)[:, :, None, None]
    else:
        z = 8.0
    if SCALE_ACC:
        return q.to(tl.float32) - z
    v = (q.to(tl.float32) - z) * s  # exact in fp32 (<= 16 significant bits)
    if EMU_BF16:
        return round_bf16_emu(v)
    else:
        return v.to(DTYPE).to(tl.float32)


@triton.jit
def _gemv_twin_x(xq, xo, rem, EVEN_K: tl.constexpr, DTYPE: tl.constexpr):
    """The twin's x: the 16 pairs of each lane (register i = pair 4i past xo, masked past K)
    -> fp32 (V, 4, 4, 8) [v, t, a, j]: the channel of nibble j = 4e + 2h + r0 of word a
    (half e of pair 4a + 2r0 + h)."""
    if EVEN_K:
        rem = rem * 0 + 64
    X = tl.join(join8(tl.load(xq + xo, mask=rem > 0, other=0), tl.load(xq + xo + 4, mask=rem > 4, other=0),
                      tl.load(xq + xo + 8, mask=rem > 8, other=0), tl.load(xq + xo + 12, mask=rem > 12, other=0),
                      tl.load(xq + xo + 16, mask=rem > 16, other=0), tl.load(xq + xo + 20, mask=rem > 20, other=0),
                      tl.load(xq + xo + 24, mask=rem > 24, other=0), tl.load(xq + xo + 28, mask=rem > 28, other=0)),
                join8(tl.load(xq + xo + 32, mask=rem > 32, other=0), tl.load(xq + xo + 36, mask=rem > 36, other=0),
                      tl.load(xq + xo + 40, mask=rem > 40, other=0), tl.load(xq + xo + 44, mask=rem > 44, other=0),
                      tl.load(xq + xo + 48, mask=rem > 48, other=0), tl.load(xq + xo + 52, mask=rem > 52, other=0),
                      tl.load(xq + xo + 56, mask=rem > 56, other=0), tl.load(xq + xo + 60, mask=rem > 60, other=0)))
    X = tl.reshape(tl.permute(X, (0, 1, 5, 2, 3, 4)), (xo.shape[0], 4, 4, 2, 2))  # (v, t, a, r0, h)
    X = tl.join(_half_bits(X, 0, DTYPE), _half_bits(X, 16, DTYPE))  # (v, t, a, r0, h, e)
    return tl.reshape(tl.permute(X, (0, 1, 2, 5, 4, 3)), (xo.shape[0], 4, 4, 8))  # (v, t, a, [e, h, r0])


@triton.jit
def _gemv_twin(wl, wh, xq, xo, rem, stride_xm, acc0, acc1, acc2, acc3, t, M, sl, sh, BLOCK_M: tl.constexpr,
               EVEN_K: tl.constexpr, DTYPE: tl.constexpr, SCALE_ACC: tl.constexpr):
    """Pure-Triton twin of the asm's mma for one row pair (what the interpreter runs), on the
    weights wl / wh of `_gemv_twin_weights`: the same exact products, fp32 sums in another
    order (SCALE_ACC: each row's chunk sum times its scale, sl / sh pointers (V, 1)). As in
    the C fragment, lane t of a virtual row gets y[2t] (acc0 / acc2) and y[2t + 1] (acc1 /
    acc3): the sum over the 4 lanes of its row and their 4 words; the other lanes keep
    zeros (M = 1: the asm has y[0] in every t, the store reads t = 0)."""
    for m in tl.static_range(BLOCK_M):
        if m < M:
            X = _gemv_twin_x(xq, xo + m * (stride_xm // 2), rem, EVEN_K, DTYPE)
            s_lo = tl.sum(tl.sum(tl.sum(wl * X, axis=3), axis=2), axis=1, keep_dims=True)
            s_hi = tl.sum(tl.sum(tl.sum(wh * X, axis=3), axis=2), axis=1, keep_dims=True)
            if SCALE_ACC:
                s_lo = s_lo * tl.load(sl).to(tl.float32)
                s_hi = s_hi * tl.load(sh).to(tl.float32)
            sel0 = (2 * t == m)[None, :]
            sel1 = (2 * t + 1 == m)[None, :]
            acc0 += tl.where(sel0, s_lo, 0.0)
            acc1 += tl.where(sel1, s_lo, 0.0)
            acc2 += tl.where(sel0, s_hi, 0.0)
            acc3 += tl.where(sel1, s_hi, 0.0)
    return acc0, acc1, acc2, acc3


@triton.jit
def _gemv_rows(pid_n, P: tl.constexpr, PAIR: tl.constexpr, HI: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (RB * 8,) rows of row pair PAIR, half HI (rows g or g + 8), in each of the RB
    blocks of 16 P rows of this program: entry 8 rb + g."""
    RB: tl.constexpr = BLOCK_N // (16 * P)
    r = tl.arange(0, RB * 8)
    return pid_n * BLOCK_N + 16 * (P * (r // 8) + PAIR) + 8 * HI + r % 8


@triton.jit
def _gemv_store(acc, n, I: tl.constexpr, t, M, N, y_ptr, ws_ptr, bias_ptr, stride_ym, pid_k, C: tl.constexpr,
                HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EMU_BF16: tl.constexpr, DTYPE: tl.constexpr):
    """Sum a (V, 4) accumulator over its C chunk slots and store y[2t + I, n] (rows n:
    (RB * 8,)); with split-K the fp32 partial goes to ws[pid_k] instead."""
    out = tl.sum(tl.reshape(acc, (C, n.shape[0], 4)), axis=0)  # (RB * 8, 4)
    m = (2 * t + I)[None, :]
    on = n.to(tl.int64)[:, None]
    mask = (m < M) & (on < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(bias_ptr + on % N).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + on, cast_out(out, DTYPE, EMU_BF16), mask=mask)
    else:
        tl.store(ws_ptr + (pid_k * M + m) * N + on, out, mask=mask)


@triton.jit
def _gemv_pair_words(wl, wh, ql, qh, dt, PREFETCH: tl.constexpr):
    """This K tile's words of a row pair (rows g at wl, g + 8 at wh), split by a. PREFETCH:
    they are ql, qh (loaded one iteration ago), and the next tile's (at + dt) are returned
    in their place; else they are loaded now and ql, qh pass through."""
    if PREFETCH:
        cl = ql
        ch = qh
        ql = tl.load(wl + dt, eviction_policy="evict_first")
        qh = tl.load(wh + dt, eviction_policy="evict_first")
    else:
        cl = tl.load(wl, eviction_policy="evict_first")
        ch = tl.load(wh, eviction_policy="evict_first")
    a0, a1, a2, a3 = _gemv_split_words(cl)
    b0, b1, b2, b3 = _gemv_split_words(ch)
    return a0, a1, a2, a3, b0, b1, b2, b3, ql, qh


@triton.jit
def _gemv_mma_loop(x_ptr, qw_ptr, s_ptr, z_ptr, n0l, n0h, n1l, n1h, kt0, kt1, M, K, stride_xm, stride_qn, stride_sn,
                   GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, EVEN_K: tl.constexpr, EMU_BF16: tl.constexpr,
                   USE_ASM: tl.constexpr, ASM: tl.constexpr, ASM_CONSTRAINTS: tl.constexpr, PREFETCH: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_ACC: tl.constexpr,
                   RING: tl.constexpr):
    """The K loop of _w4a16_gemv_mma_kernel (see there) over K tiles [kt0, kt1): the 8 (V, 4)
    accumulators of a program whose weight rows are n0l, n0h, n1l, n1h ((RB * 8,) each, as
    _gemv_rows lays them out, already inside the weight: the caller wraps or remaps them; the
    MoE GEMV, kernels/moe.py, puts gate rows at HI 0 and up rows at HI 1)."""
    DTYPE = x_ptr.dtype.element_ty
    C: tl.constexpr = BLOCK_K // 128
    P: tl.constexpr = 2 if BLOCK_N >= 32 else 1
    RB: tl.constexpr = BLOCK_N // (16 * P)
    V: tl.constexpr = C * RB * 8
    v = tl.arange(0, V)
    t = tl.arange(0, 4)
    cw = v // (RB * 8)  # chunk slot of each virtual row
    g = v % 8
    w16 = tl.arange(0, 16)
    # per virtual row: its row and word offset in the K tile kt0 (rows wrapped into the weight
    # by the caller: unmasked loads, results dropped at the store)
    r0l = tl.reshape(tl.broadcast_to(n0l[None, :], (C, RB * 8)), (V,)).to(tl.int64)
    r0h = tl.reshape(tl.broadcast_to(n0h[None, :], (C, RB * 8)), (V,)).to(tl.int64)
    r1l = tl.reshape(tl.broadcast_to(n1l[None, :], (C, RB * 8)), (V,)).to(tl.int64)
    r1h = tl.reshape(tl.broadcast_to(n1h[None, :], (C, RB * 8)), (V,)).to(tl.int64)
    wo = ((kt0 * C + cw) * 16)[:, None] + w16[None, :]
    w0l = qw_ptr + r0l[:, None] * stride_qn + wo
    w0h = qw_ptr + r0h[:, None] * stride_qn + wo
    w1l = qw_ptr + r1l[:, None] * stride_qn + wo
    w1h = qw_ptr + r1h[:, None] * stride_qn + wo
    # x as int32 channel pairs: lane t of chunk c starts at pair 64c + t. M = 1: every B
    # column is x; else column g is row g % M of x (columns >= M are dropped at the store)
    xq = x_ptr.to(tl.pointer_type(tl.int32))
    pk = ((kt0 * C + cw) * 64)[:, None] + t[None, :]  # (V, 4)
    if BLOCK_M > 1:
        xo = pk + ((g % M) * (stride_xm // 2))[:, None]
    else:
        xo = pk
    # zero points: same (N, Gp) strides as the scales, so one distance (in elements) finds them
    zdiff = (z_ptr.to(tl.int64, bitcast=True) - s_ptr.to(tl.int64, bitcast=True)) // 2
    acc0 = tl.zeros((V, 4), tl.float32)
    acc1 = tl.zeros((V, 4), tl.float32)
    acc2 = tl.zeros((V, 4), tl.float32)
    acc3 = tl.zeros((V, 4), tl.float32)
    acc4 = tl.zeros((V, 4), tl.float32)
    acc5 = tl.zeros((V, 4), tl.float32)
    acc6 = tl.zeros((V, 4), tl.float32)
    acc7 = tl.zeros((V, 4), tl.float32)
    if PREFETCH:  # the first tile's words
        # Tile min(kt, kt1 - 1): always a real tile, so no mask (a masked load costs a zeroing
        # move per register); the last iteration reloads its own tile from L2.
        dt = 16 * C * (tl.minimum(kt0, kt1 - 1) - kt0)
        q0l = tl.load(w0l + dt, eviction_policy="evict_first")
        q0h = tl.load(w0h + dt, eviction_policy="evict_first")
        if P == 2:
            q1l = tl.load(w1l + dt, eviction_policy="evict_first")
            q1h = tl.load(w1h + dt, eviction_policy="evict_first")
        else:
            q1l, q1h = q0l, q0h
    else:  # placeholders, passed through unchanged
        q0l, q0h, q1l, q1h = w0l, w0h, w1l, w1h
    for kt in tl.range(kt0, kt1, num_stages=RING):
        kg = (kt * C + cw) * 128  # first channel of each virtual row's chunk
        if GROUP_SIZE == 0:
            grp = kg * 0
        else:
            grp = kg // GROUP_SIZE
        rem = K // 2 - pk  # x pairs left in the row from each lane's first one
        dt = 16 * C * (kt + 1 < kt1).to(tl.int32)  # to the next tile (PREFETCH), if any
        a0, a1, a2, a3, b0, b1, b2, b3, q0l, q0h = _gemv_pair_words(w0l, w0h, q0l, q0h, dt, PREFETCH)
        s0l = s_ptr + (r0l * stride_sn + grp)[:, None]  # (V, 1)
        s0h = s_ptr + (r0h * stride_sn + grp)[:, None]
        if P == 2:
            e0, e1, e2, e3, f0, f1, f2, f3, q1l, q1h = _gemv_pair_words(w1l, w1h, q1l, q1h, dt, PREFETCH)
            s1l = s_ptr + (r1l * stride_sn + grp)[:, None]
            s1h = s_ptr + (r1h * stride_sn + grp)[:, None]
        if USE_ASM:
            # only words, addresses and accumulators as operands: see _gemv_mma_asm
            xa = (xq + xo).to(tl.int64, bitcast=True)
            za = zdiff * 2
            if P == 1:
                acc0, acc1, acc2, acc3 = tl.inline_asm_elementwise(
                    ASM, ASM_CONSTRAINTS,
                    [a0, a1, a2, a3, b0, b1, b2, b3, xa, s0l.to(tl.int64, bitcast=True),
                     s0h.to(tl.int64, bitcast=True), za, rem, acc0, acc1, acc2, acc3],
                    dtype=(tl.float32,) * 4, is_pure=True, pack=1)
            else:
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = tl.inline_asm_elementwise(
                    ASM, ASM_CONSTRAINTS,
                    [a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3, xa,
                     s0l.to(tl.int64, bitcast=True), s0h.to(tl.int64, bitcast=True),
                     s1l.to(tl.int64, bitcast=True), s1h.to(tl.int64, bitcast=True), za, rem,
                     acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7],
                    dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:  # the interpreter's twin
            acc0, acc1, acc2, acc3 = _gemv_twin(
                _gemv_twin_weights(a0, a1, a2, a3, s0l, s0l + zdiff, HAS_ZEROS, DTYPE, EMU_BF16, SCALE_ACC),
                _gemv_twin_weights(b0, b1, b2, b3, s0h, s0h + zdiff, HAS_ZEROS, DTYPE, EMU_BF16, SCALE_ACC),
                xq, pk, rem, stride_xm, acc0, acc1, acc2, acc3, t, M, s0l, s0h, BLOCK_M, EVEN_K, DTYPE, SCALE_ACC)
            if P == 2:
                acc4, acc5, acc6, acc7 = _gemv_twin(
                    _gemv_twin_weights(e0, e1, e2, e3, s1l, s1l + zdiff, HAS_ZEROS, DTYPE, EMU_BF16, SCALE_ACC),
                    _gemv_twin_weights(f0, f1, f2, f3, s1h, s1h + zdiff, HAS_ZEROS, DTYPE, EMU_BF16, SCALE_ACC),
                    xq, pk, rem, stride_xm, acc4, acc5, acc6, acc7, t, M, s1l, s1h, BLOCK_M, EVEN_K, DTYPE,
                    SCALE_ACC)
        w0l += 16 * C
        w0h += 16 * C
        w1l += 16 * C
        w1h += 16 * C
        xo += 64 * C
        pk += 64 * C
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _w4a16_gemv_mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr,
    M, N, K, stride_xm, stride_ym, stride_qn, stride_sn, sync_ptr,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EMU_BF16: tl.constexpr, USE_ASM: tl.constexpr, ASM: tl.constexpr,
    ASM_CONSTRAINTS: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL_EARLY: tl.constexpr = False, SCALE_ACC: tl.constexpr = False,
    RING: tl.constexpr = 1, FIXUP: tl.constexpr = False,
):
    """y (M, N) = x (M, K) @ W^T for M <= BLOCK_M <= 8, on the tensor cores (mma.sync
    m16n8k16, fp32 accumulators) with the weights read straight into registers: see the
    block comment above. A program owns BLOCK_N rows, in RB blocks of 16 P rows (P =
    gemv_pairs(BLOCK_N) row pairs per asm element), and walks its K range in tiles of
    C = BLOCK_K // 128 chunks. Every tensor is 2-D, (V, 16) words or (V, 4) lanes, over
    V = C * RB * 8 "virtual rows" v = (chunk slot, row block, g): with only two dims the
    16-byte word loads can only be laid out as 4 lanes along a row's 16 words and 8 along g
    (lane = 4 g + t, the mma fragment order); 3-D tiles got lanes along the chunk slots from
    Triton 3.6. GROUP_SIZE is 0 (per channel) or a multiple of 128; K is even and x's rows
    4-byte aligned (x is read as channel pairs). ASM, ASM_CONSTRAINTS: gemv_asm(...) for
    this dtype / zeros / EVEN_K / P (unused without USE_ASM). PREFETCH: load the next K
    tile's words one iteration ahead (registers; Triton does not pipeline a loop without a
    dot). RING (> 1, instead of PREFETCH): the K loop is software-pipelined by Triton
    (tl.range num_stages): RING - 1 tiles of words in flight through a cp.async ring in shared
    memory, read back in the same lane order (tools/ptx.gemv_lane_order checks it), at no
    register cost; ncu (H100, 8192x8192 M = 1) put 46% of the loop's stalls on the first use of
    a tile's words with one tile in flight per warp (docs/perf_log.md v24); measured (H100, v26)
    6-12% slower than RING = 1 on the 8 Llama shapes at M = 1-2, so only the offline tuner's
    --experimental offers it. SCALE_ACC: each chunk's fp32 product is scaled once per row (ASM must be the
    gemv_asm(..., scale_acc=True) text). Split-K as _w4a16_kernel; FIXUP (sync_ptr: the
    stream's tile counters) adds the slices in the kernel (_gemv_fixup). Accumulator acc_{4p + i} (V, 4): lane (v, t) holds
    y[2t + i % 2] of row 16 (P rb + p) + g + 8 (i // 2) over chunk slot c."""
    pdl_release(PDL_EARLY)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    kt0, kt1 = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    P: tl.constexpr = 2 if BLOCK_N >= 32 else 1
    C: tl.constexpr = BLOCK_K // 128
    t = tl.arange(0, 4)
    n0l = _gemv_rows(pid_n, P, 0, 0, BLOCK_N)
    n0h = _gemv_rows(pid_n, P, 0, 1, BLOCK_N)
    n1l = _gemv_rows(pid_n, P, P - 1, 0, BLOCK_N)  # (pair 1 if P == 2)
    n1h = _gemv_rows(pid_n, P, P - 1, 1, BLOCK_N)
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _gemv_mma_loop(
        x_ptr, qw_ptr, s_ptr, z_ptr, n0l % N, n0h % N, n1l % N, n1h % N, kt0, kt1, M, K, stride_xm, stride_qn,
        stride_sn, GROUP_SIZE, HAS_ZEROS, EVEN_K, EMU_BF16, USE_ASM, ASM, ASM_CONSTRAINTS, PREFETCH, BLOCK_M,
        BLOCK_N, BLOCK_K, SCALE_ACC, RING)
    DTYPE = x_ptr.dtype.element_ty
    _gemv_store(acc0, n0l, 0, t, M, N, y_ptr, ws_ptr, bias_ptr, stride_ym, pid_k, C, HAS_BIAS, SPLIT_K, EMU_BF16,
                DTYPE)
    _gemv_store(acc1, n0l, 1, t, M, N, y_ptr, ws_ptr, bias_ptr, stride_ym, pid_k, C, HAS_BIAS, SPLIT_K, EMU_BF16,
                DTYPE)
    _gemv_store(acc2, n0h, 0, t, M, N, y_ptr, ws_ptr, bias_ptr, stride_ym, pid_k, C, HAS_BIAS, SPLIT_K, EMU_BF16,
                DTYPE)
    _gemv_store(acc3, n0h, 1, t, M, N, y_ptr, ws_ptr, bias_ptr, stride_ym, pid_k, C, HAS_BIAS, SPLIT_K, EMU_BF16,
                DTYPE)
    if P == 2:
        _gemv_store(acc4, n1l, 0, t, M, N, y_ptr, ws_ptr, bias_ptr, stride_ym, pid_k, C, HAS_BIAS, SPLIT_K,
                    EMU_BF16, DTYPE)
        _gemv_store(acc5, n1l, 1, t, M, N, y_ptr, ws_ptr, bias_ptr, stride_ym, pid_k, C, HAS_BIAS, SPLIT_K,
                    EMU_BF16, DTYPE)
        _gemv_store(acc6, n1h, 0, t, M, N, y_ptr, ws_ptr, bias_ptr, stride_ym, pid_k, C, HAS_BIAS, SPLIT_K,
                    EMU_BF16, DTYPE)
        _gemv_store(acc7, n1h, 1, t, M, N, y_ptr, ws_ptr, bias_ptr, stride_ym, pid_k, C, HAS_BIAS, SPLIT_K,
                    EMU_BF16, DTYPE)
    if SPLIT_K > 1 and FIXUP:  # (rows m < M <= BLOCK_M <= 8)
        _gemv_fixup(ws_ptr, bias_ptr, y_ptr, sync_ptr, pid_n, M, N, stride_ym, SPLIT_K, HAS_BIAS, EMU_BF16, DTYPE, 8,
                    BLOCK_N)
