"""W4A16 on Hopper in Gluon: 4-bit weights, symmetric or with zero points, per channel or in
groups of 128, 256, ...; fp16/bf16 activations; the weight as wgmma's register A operand with
every layout and every wgmma wait explicit. Hopper (sm_90a) and Triton's Gluon only:
ops/w4a16.py runs the portable Triton mma kernel (its twin, kernels/w4a16._w4a16_kernel with
SCALE_ACC) everywhere else, including the CPU interpreter, which does not run Gluon.

Why a second kernel (docs/perf_log.md v17/v18): in plain Triton a grouped tile either
multiplies every dequantized weight by its scale (4 of the 13 fp16 asm instructions per
word) or waits for each K tile's own wgmma before scaling its product in, and the compiler
chooses the waits. Here one K step is two 128-channel chunks: both chunks' wgmmas are issued
(A = the chunk's weights from registers, B = x from shared memory), then one wait(0), then
acc += p0 * s0 + p1 * s1. The two wgmmas overlap each other and, because nothing reads an
accumulator of a wgmma in flight, ptxas keeps them asynchronous (one chunk per wait, with the
previous product scaled in after wait(1), was serialized by ptxas, C7514: probe
benchmarks/probes/gluon_w4a16_probe.py). Measured with the probe's pair variant on an H200,
M = 16 g128, same run: 8192x57344 94.6 -> 81.5 us, 28672x8192 56.0 -> 46.2 us against the
re-tuned Triton tiles.

Data path per K step (no shared-memory trip of the dequantized tile):
- cp.async ring of STAGES steps: per chunk, the (BLOCK_N, 16) packed words (fragment order,
  formats.int4.PackedW4, evict-first) and the (BLOCK_M, 128) x tile (128-byte swizzle, wgmma's
  B operand as it is);
- the words are read back from shared memory in WORDS, a linear layout that gives lane
  4g + t of warp w the words 4t..4t+3 of rows 16w + g and 16w + 8 + g, which is where wgmma's
  A fragment wants their 32 channels; the unscaled asm dequantization (q - 8 exactly, as the
  Triton kernel's SCALE_ACC path) then a join / reshape / permute that the compiler lowers to
  register renames, and a convert_layout to the A operand layout that is register-only (the
  compile test checks the PTX loop for shared stores);
- zero points: a chunk lies inside one group, so its zero point per row enters the asm's magic
  constants (q - z exactly, no extra instruction). H200, 8192x57344 M = 16 bf16 asymmetric
  against fp16 symmetric at 84-85 us: the q - 8 product plus (8 - z) * sum_k x, the x sums
  taken from the shared x tile, 132 us; (q - 8) + (8 - z) added to the dequantized values,
  103 us; the constants, 96 us (docs/perf_log.md v18);
- per channel the two wgmmas chain into the accumulator and the scale multiplies it once at
  the end.
Output: y in x's dtype (+ bias), or with SPLIT_K > 1 fp32 partial sums for the package's
fixed-order reduce (kernels/w4a16._splitk_reduce_kernel), as the Triton kernel.

w4a16_gluon_overlap_kernel ('gluon_overlap' configs) computes the same with two K steps' wgmmas
in flight, each step dequantized while the previous one's run (its docstring says what ptxas
needs for that; docs/perf_log.md v25). H100: up to 9% faster than the other tiles at M = 16-64 on
about half the Llama shapes; ncu puts its remaining time on the per-step CTA barrier of the
cp.async ring and the words' shared-memory loads (v26). WORDS_IN_REGS ('gluon_overlap_regs'
configs) takes the words from global memory straight into registers, two steps ahead, and the
ring holds x only.

w4a16_gluon_pipe_kernel ('gluon_pipe' configs, M >= 33) overlaps at the granularity of a chunk
instead: each chunk is dequantized while the previous chunk's wgmmas run, which keeps the
one-step kernel's register count at BLOCK_M 128 (docs/perf_log.md v30); it is warp-specialized,
x coming by TMA from a producer warp through mbarrier-guarded rings (v32).
"""
from __future__ import annotations

from functools import lru_cache

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                             warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
from triton.language.extra.cuda import gdc_launch_dependents

from .gluon_common import (CHUNK, CHUNK_C, CTA_RESERVED_SHARED, PIPE_CONSUMER_REGS, PIPE_MAXNREG, PIPE_PRODUCER_REGS,
                           SM_REGISTERS, SM_SHARED_BYTES, STEP_C, WG_ROWS, pipe_loader, pipe_rings, program, rows)
from .common import SYNC_TILES
from .w4a16 import _ASM_BF16, _ASM_BF16_Q, _ASM_F16, _ASM_F16_Q

# names that differ between Triton 3.6 and 3.9
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

NUM_WARPS = 4  # one warpgroup; 8: two, sharing the x tile (BLOCK_N >= 128; M = 33..64 tiles)
MIN_CAP = 128  # max_registers' floor


@lru_cache(maxsize=None)
def layouts(BLOCK_M: int, BLOCK_N: int, num_warps: int = NUM_WARPS) -> dict:
    """The kernel's layout constexprs for a (BLOCK_N, BLOCK_M) accumulator over num_warps // 4
    warpgroups (each multiplies its own 64-row slices by the one x tile)."""
    groups = num_warps // 4
    R = BLOCK_N // (64 * groups)  # 64-row slices per warpgroup
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
    # registers: words +1, +2 of a lane, row +8, then the row slices; lanes: words +4, +8 (t),
    # rows +1, +2, +4 (g); warps: rows +16, +32, then the warpgroups (+64, ...)
    reg = [[0, 1], [0, 2], [8, 0]] + [[(64 * groups) << i, 0] for i in range(R.bit_length() - 1)]
    warps = [[16, 0], [32, 0]] + [[64 << i, 0] for i in range(groups.bit_length() - 1)]
    words = gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                       warp_bases=warps, block_bases=[], shape=[BLOCK_N, 16])
    return dict(
        MMA=mma, WORDS=words,
        DOT_A=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        X_BLK=gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[num_warps, 1],
                               order=[1, 0]),
        X_SMEM=gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2),
        W_BLK=gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4], warps_per_cta=[num_warps, 1],
                               order=[1, 0]),
        W_SMEM=gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]),
    )


def shared_bytes(BLOCK_M: int, BLOCK_N: int, STAGES: int, words: bool = True) -> int:
    """The kernel's shared memory: a ring of STAGES K steps, each two chunks of the 2-byte x
    tile (BLOCK_M, 128) and (unless `words` is False: WORDS_IN_REGS) of the packed words
    (BLOCK_N, 16) int32."""
    return 2 * STAGES * (BLOCK_M * CHUNK * 2 + (BLOCK_N * 16 * 4 if words else 0))


def max_registers(BLOCK_M: int, BLOCK_N: int, STAGES: int, num_warps: int = NUM_WARPS, has_zeros: bool = True):
    """The register cap per thread (ptxas maxnreg) at which registers allow as many CTAs per SM
    as shared memory does, or None: without zero points (measured no gain), or where that is
    the hardware's 255 anyway. With zero points ptxas takes a few registers more than fit and
    costs a CTA: BM 16 / BN 64 / 3 stages (4 CTAs by shared memory) compiled to 130 registers for
    fp16 and 141 for bf16 (3 CTAs), BM 32 to 160 / 182 (168 fit 3); capped, nothing spills in the K
    loop (sm_90a, Triton 3.6 and 3.9; 3.6 spills one register of the split-K tiles, stored and
    loaded once per program; the compile test checks every shipped tile's K loop). H200, the
    8 Llama-3 shapes, same process (docs/perf_log.md v22): fp16 with zero points 1.10-1.12x
    faster on average at M = 8-16 (up to 1.26x), bf16 with zero points 1.00-1.02x (its extra
    shifts, not occupancy, decide); symmetric tiles (100-127 registers) came out 0.97-1.00x
    capped, so they are left alone. Never below MIN_CAP: the BM 8 tiles' shared memory allows 6
    CTAs, whose 80 registers spilled 92 bytes in the K loop (fp16 with zero points, 3 stages)."""
    if not has_zeros:
        return None
    ctas = SM_SHARED_BYTES // (shared_bytes(BLOCK_M, BLOCK_N, STAGES) + CTA_RESERVED_SHARED)
    ctas = min(ctas, SM_REGISTERS // (MIN_CAP * 32 * num_warps))
    if ctas < 1:
        return None
    cap = SM_REGISTERS // (ctas * 32 * num_warps) // 8 * 8
    return cap if cap < 255 else None


@gluon.jit
def _join8(n0, n1, n2, n3, n4, n5, n6, n7):
    return gl.join(gl.join(gl.join(n0, n4), gl.join(n2, n6)), gl.join(gl.join(n1, n5), gl.join(n3, n7)))


@gluon.jit
def _pair16(v):
    """(2-byte float tensor) -> int32 with its bits in both halves (the asm's x2 operands)."""
    b = v.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return b | (b << 16)


@gluon.jit
def _chunk_weights(words, DT: gl.constexpr, BLOCK_N: gl.constexpr, DOT_A: gl.constexpr, z=None, s=None):
    """(BLOCK_N, 16) packed words of one chunk -> (BLOCK_N, 128) q - z in DOT_A, exact
    (|q - z| <= 16); z: None (8) or the chunk's zero point per row (BLOCK_N,) fp32 in the rows
    of the words' layout, which enters the asm's magic constants (no extra instruction).
    s: None, or the chunk's scale per row (fp32, exact in x's dtype; the words' rows): s * (q - z) rounded
    once to x's dtype (the scaled asm, kernels/w4a16._ASM_F16 / _ASM_BF16: one mul.x2 more
    per pair)."""
    if s is not None:  # the (s, s) pair of each word's row
        s2 = gl.broadcast(_pair16(s.to(DT))[:, None], words)[0]
    if DT == gl.float16:
        if z is None:
            z2 = gl.full(words.shape, 0x64086408, gl.int32, layout=words.type.layout)
            z16 = gl.full(words.shape, -729754496, gl.int32, layout=words.type.layout)
        else:  # (1024 + z) pair and the odd nibbles' -(64 + z) pair, as kernels/w4a16._dequant_words
            z2 = gl.broadcast(_pair16((z + 1024.0).to(gl.float16))[:, None], words)[0]
            z16 = gl.broadcast(_pair16((-64.0 - z).to(gl.float16))[:, None], words)[0]
        if s is None:
            n0, n1, n2, n3, n4, n5, n6, n7 = gl.inline_asm_elementwise(
                _ASM_F16_Q, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, z2, z16],
                dtype=(gl.float16,) * 8, is_pure=True, pack=1)
        else:
            n0, n1, n2, n3, n4, n5, n6, n7 = gl.inline_asm_elementwise(
                _ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r", [words, s2, z2, z16],
                dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    else:
        if z is None:
            z2 = gl.full(words.shape, 0x43084308, gl.int32, layout=words.type.layout)
        else:  # (128 + z) pair in bf16
            z2 = gl.broadcast(_pair16((z + 128.0).to(gl.bfloat16))[:, None], words)[0]
        if s is None:
            n0, n1, n2, n3, n4, n5, n6, n7 = gl.inline_asm_elementwise(
                _ASM_BF16_Q, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, z2],
                dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            n0, n1, n2, n3, n4, n5, n6, n7 = gl.inline_asm_elementwise(
                _ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, s2, z2],
                dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
    # nibble 4e + 2h + r0 of word 16c + 4t + a is channel 32a + 16r0 + 8h + 2t + e of chunk c
    q = _join8(n0, n1, n2, n3, n4, n5, n6, n7)           # (n, w, e, h, r0)
    q = gl.reshape(q, (BLOCK_N, 4, 4, 2, 2, 2))          # (n, t, a, e, h, r0)
    q = gl.permute(q, (0, 2, 5, 4, 1, 3))                # (n, a, r0, h, t, e)
    q = gl.reshape(q, (BLOCK_N, CHUNK_C))
    return gl.convert_layout(q, DOT_A)


@gluon.jit
def _load_step(w_buf, x_buf, slot, w_ptrs, x_ptrs, step, ok, WITH_WORDS: gl.constexpr = True):
    """cp.async the two chunks of K step `step` into ring slot `slot` (one commit group): x's, and
    the words' unless WITH_WORDS is False (they go to registers, _words)."""
    if WITH_WORDS:
        _async_load(w_buf.index(2 * slot), w_ptrs + step * 32, mask=ok, eviction_policy="evict_first")
        _async_load(w_buf.index(2 * slot + 1), w_ptrs + (step * 32 + 16), mask=ok, eviction_policy="evict_first")
    _async_load(x_buf.index(2 * slot), x_ptrs + step * STEP_C, mask=ok)
    _async_load(x_buf.index(2 * slot + 1), x_ptrs + (step * STEP_C + CHUNK_C), mask=ok)
    async_copy.commit_group()


@gluon.jit
def _word_rows(qw_ptr, pid_n, N, stride_qn, first, BLOCK_N: gl.constexpr, WORDS: gl.constexpr):
    """(BLOCK_N, 16) pointers to the program's first step's words in the WORDS layout, for _words."""
    return row_words(rows(qw_ptr, pid_n, N, stride_qn, BLOCK_N, WORDS), first, WORDS)


@gluon.jit
def row_words(row_ptrs, first, WORDS: gl.constexpr):
    """_word_rows from one pointer per row (SliceLayout(1, WORDS)): step `first`'s 16 words of each row."""
    return row_ptrs[:, None] + (first * 32 + gl.arange(0, 16, layout=gl.SliceLayout(0, WORDS)))[None, :]


@gluon.jit
def _words(w_rows, step):
    """The two chunks' words of K step `step` straight from global memory, in the WORDS layout
    (w_rows: (BLOCK_N, 16) pointers of the program's first step)."""
    q0 = gl.load(w_rows + step * 32, eviction_policy="evict_first")
    q1 = gl.load(w_rows + (step * 32 + 16), eviction_policy="evict_first")
    return q0, q1


@gluon.jit
def _step_scales(base, step, GROUP_CHUNKS: gl.constexpr, PAIRED: gl.constexpr = False):
    """The scales or zero points of the two chunks of K step `step` as loaded (base: one pointer
    per row, in the layout the caller wants them in; _scale_values converts them where they are
    used: an instruction on a loaded value makes the warp wait for the load there). Per channel
    (GROUP_CHUNKS 0) the row's one. PAIRED (GROUP_CHUNKS 1, rows 4-byte aligned: the launcher
    checks): both chunks' values in one int32 load, returned twice."""
    if PAIRED:
        gl.static_assert(GROUP_CHUNKS == 1, "PAIRED loads need group size 128 (one chunk per group)")
        p = gl.load((base + 2 * step).to(gl.pointer_type(gl.int32), bitcast=True))
        return p, p
    elif GROUP_CHUNKS > 0:
        return gl.load(base + (2 * step) // GROUP_CHUNKS), gl.load(base + (2 * step + 1) // GROUP_CHUNKS)
    else:
        v = gl.load(base)
        return v, v


@gluon.jit
def _scale_values(r0, r1, DT: gl.constexpr, PAIRED: gl.constexpr = False):
    """_step_scales' values -> the two chunks' fp32 values (exact)."""
    if PAIRED:
        return ((r0 & 0xFFFF).to(gl.int16).to(DT, bitcast=True).to(gl.float32),
                (r0 >> 16).to(gl.int16).to(DT, bitcast=True).to(gl.float32))
    else:
        return r0.to(gl.float32), r1.to(gl.float32)


@gluon.jit
def _operands(x_ptr, qw_ptr, M, N, K, stride_xm, stride_qn, SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, X_BLK: gl.constexpr, W_BLK: gl.constexpr):
    """_program's tile, split and K steps, and the pointers of the first step's words (16 per row
    and chunk, 16 bytes per thread) and x tile. Rows past N read row n % N, rows past M row m % M
    (their outputs are masked)."""
    pid_n, pid_m, pid_k, first, n = program(M, K, SPLIT_K, BLOCK_M)
    wn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, W_BLK))
    wn = (wn % N).to(gl.int64)
    ww = gl.arange(0, 16, layout=gl.SliceLayout(0, W_BLK))
    w_ptrs = qw_ptr + wn[:, None] * stride_qn + (first * 32 + ww)[None, :]
    xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_BLK))
    xm = (xm % M).to(gl.int64)
    xk = gl.arange(0, CHUNK_C, layout=gl.SliceLayout(0, X_BLK))
    x_ptrs = x_ptr + xm[:, None] * stride_xm + (first * STEP_C + xk)[None, :]
    return pid_m, pid_n, pid_k, first, n, w_ptrs, x_ptrs


@gluon.jit
def _scaled_operands(x_ptr, qw_ptr, s_ptr, z_ptr, M, N, K, stride_xm, stride_qn, stride_sn, SPLIT_K: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PDL_EARLY: gl.constexpr, X_BLK: gl.constexpr,
                     W_BLK: gl.constexpr, WORDS: gl.constexpr):
    """The start of the overlap kernels (which scale the weights): the split-K reduce released
    (PDL_EARLY), _operands, and one scale and zero-point pointer per row in the words' rows."""
    if PDL_EARLY:  # split-K: the reduce may launch now, it waits for the partial sums (kernels/common.py)
        gdc_launch_dependents()
    pid_m, pid_n, pid_k, first, n, w_ptrs, x_ptrs = _operands(x_ptr, qw_ptr, M, N, K, stride_xm, stride_qn, SPLIT_K,
                                                              BLOCK_M, BLOCK_N, X_BLK, W_BLK)
    return (pid_m, pid_n, pid_k, first, n, w_ptrs, x_ptrs, rows(s_ptr, pid_n, N, stride_sn, BLOCK_N, WORDS),
            rows(z_ptr, pid_n, N, stride_sn, BLOCK_N, WORDS))


@gluon.jit
def _store(acc, y_ptr, ws_ptr, bias_ptr, pid_m, pid_n, pid_k, M, N, stride_ym, HAS_BIAS: gl.constexpr,
           SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MMA: gl.constexpr,
           sync_ptr=None, FIXUP: gl.constexpr = False):
    """acc^T (BLOCK_N, BLOCK_M) fp32 -> y in x's dtype (+ bias), or with SPLIT_K > 1 the fp32
    partial sums of split pid_k for the fixed-order reduce (kernels/w4a16._splitk_reduce_kernel).
    FIXUP (SPLIT_K > 1): the tile's last slice to arrive (its counter in sync_ptr, zero between
    launches; M * N < 2**31: the launcher checks) adds the slices itself, zero plus slices 0, 1,
    ... in fp32, plus the bias, cast once: what the reduce kernel computes, bit for bit.
    (Its own branch: the split store folded into one branch with it compiled on Triton 3.9 but
    failed in Triton 3.6's make_llir, docs/perf_log.md v50.)"""
    an = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    om = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    mask = (om < M)[None, :] & (an < N)[:, None]
    offs = om[None, :] * N + an[:, None]  # (FIXUP: 32-bit offsets within a slice)
    om = om.to(gl.int64)
    on = an.to(gl.int64)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += gl.load(bias_ptr + an, mask=an < N, other=0.0).to(gl.float32)[:, None]
        gl.store(y_ptr + om[None, :] * stride_ym + on[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)
    elif FIXUP:
        cnt_ptr = sync_ptr + SYNC_TILES + gl.program_id(0)
        mn = M.to(gl.int64) * N
        gl.store(ws_ptr + pid_k.to(gl.int64) * mn + offs, acc, mask=mask)
        _barrier()  # every thread's part stored before the release
        if gl.atomic_add(cnt_ptr, 1, sem="acq_rel") == SPLIT_K - 1:
            _barrier()
            total = gl.zeros_like(acc)
            for s in range(SPLIT_K):  # (one slice a step: the loads of all of them would hold registers)
                total += gl.load(ws_ptr + s * mn + offs, mask=mask, other=0.0, cache_modifier=".cg")
            gl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
            if HAS_BIAS:
                total += gl.load(bias_ptr + an, mask=an < N, other=0.0).to(gl.float32)[:, None]
            gl.store(y_ptr + om[None, :] * stride_ym + on[:, None], total.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        gl.store(ws_ptr + (pid_k * M + om[None, :]) * N + on[:, None], acc, mask=mask)


@gluon.jit
def w4a16_gluon_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, stride_xm, stride_ym,
                       stride_qn, stride_sn, GROUP_CHUNKS: gl.constexpr, HAS_ZEROS: gl.constexpr,
                       HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PDL_EARLY: gl.constexpr,
                       MMA: gl.constexpr, WORDS: gl.constexpr, DOT_A: gl.constexpr, X_BLK: gl.constexpr,
                       X_SMEM: gl.constexpr, W_BLK: gl.constexpr, W_SMEM: gl.constexpr):
    """y (M, N) = x (M, K) @ W^T for W = scale * (q - z), z = 8 or (HAS_ZEROS) the group's zero
    point. GROUP_CHUNKS: chunks per scale group (0: per channel). K % 256 == 0; split k takes
    K steps [k * ceil(steps / SPLIT_K), ...), none empty (the launcher checks both); program
    (tile, split)."""
    if PDL_EARLY:  # split-K: the reduce may launch now, it waits for the partial sums (kernels/common.py)
        gdc_launch_dependents()
    DT: gl.constexpr = x_ptr.dtype.element_ty
    pid_m, pid_n, pid_k, first, n, w_ptrs, x_ptrs = _operands(x_ptr, qw_ptr, M, N, K, stride_xm, stride_qn, SPLIT_K,
                                                              BLOCK_M, BLOCK_N, X_BLK, W_BLK)
    s_base = rows(s_ptr, pid_n, N, stride_sn, BLOCK_N, MMA)  # scales: rows of the accumulator
    if HAS_ZEROS:  # zero points (the scales' shape), rows of the words' layout
        z_base = rows(z_ptr, pid_n, N, stride_sn, BLOCK_N, WORDS)
        zn0, zn1 = _step_scales(z_base, first, GROUP_CHUNKS)
    x_buf = gl.allocate_shared_memory(DT, [2 * STAGES, BLOCK_M, CHUNK_C], X_SMEM)
    w_buf = gl.allocate_shared_memory(gl.int32, [2 * STAGES, BLOCK_N, 16], W_SMEM)
    for s in gl.static_range(STAGES - 1):
        _load_step(w_buf, x_buf, s, w_ptrs, x_ptrs, s, s < n)

    acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=MMA)
    if GROUP_CHUNKS > 0:
        zero = warpgroup_mma_init(gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=MMA))
        sn0, sn1 = _step_scales(s_base, first, GROUP_CHUNKS)
    for i in range(n):
        async_copy.wait_group(STAGES - 2)  # step i's group has landed
        _barrier()  # ... for every thread, and every thread is done with step i - 1's slot
        # refill step i - 1's slot (its wgmmas retired in step i - 1's wait(0))
        nxt = i + STAGES - 1
        _load_step(w_buf, x_buf, nxt % STAGES, w_ptrs, x_ptrs, nxt, nxt < n)
        slot = i % STAGES
        z0 = None
        z1 = None
        if HAS_ZEROS:
            z0, z1 = _scale_values(zn0, zn1, DT)
            # the next step's zero points, a step early (as the scales)
            zn0, zn1 = _step_scales(z_base, first + gl.minimum(i + 1, n - 1), GROUP_CHUNKS)
        w0 = _chunk_weights(w_buf.index(2 * slot).load(WORDS), DT, BLOCK_N, DOT_A, z0)
        w1 = _chunk_weights(w_buf.index(2 * slot + 1).load(WORDS), DT, BLOCK_N, DOT_A, z1)
        fence_async_shared()
        x0 = x_buf.index(2 * slot).permute((1, 0))
        x1 = x_buf.index(2 * slot + 1).permute((1, 0))
        if GROUP_CHUNKS > 0:
            s0, s1 = _scale_values(sn0, sn1, DT)
            # the next step's scales, a step early (a 2-byte load stalls the step that uses it)
            sn0, sn1 = _step_scales(s_base, first + gl.minimum(i + 1, n - 1), GROUP_CHUNKS)
            p0 = warpgroup_mma(w0, x0, zero, use_acc=False, is_async=True)
            p1 = warpgroup_mma(w1, x1, zero, use_acc=False, is_async=True)
            p0, p1, w0, w1 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, p1, w0, w1))
            acc += p0 * s0[:, None] + p1 * s1[:, None]
        else:
            acc = warpgroup_mma(w0, x0, acc, is_async=True)
            acc = warpgroup_mma(w1, x1, acc, is_async=True)
            acc, w0, w1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w0, w1))
    async_copy.wait_group(0)
    if GROUP_CHUNKS == 0:
        acc = acc * gl.load(s_base).to(gl.float32)[:, None]

    _store(acc, y_ptr, ws_ptr, bias_ptr, pid_m, pid_n, pid_k, M, N, stride_ym, HAS_BIAS, SPLIT_K, BLOCK_M, BLOCK_N,
           MMA)


@gluon.jit
def _overlap_step(i, n, first, acc, w0, w1, q0, q1, rs0, rs1, rz0, rz1, s_base, z_base, w_buf, x_buf, w_ptrs,
                  x_ptrs, w_rows, GROUP_CHUNKS: gl.constexpr, HAS_ZEROS: gl.constexpr, PAIRED: gl.constexpr,
                  STAGES: gl.constexpr, RETIRE: gl.constexpr, WORDS_IN_REGS: gl.constexpr, DT: gl.constexpr,
                  BLOCK_N: gl.constexpr, DOT_A: gl.constexpr, WORDS: gl.constexpr):
    """K step i of w4a16_gluon_overlap_kernel. w0, w1: the A operands of step i - 2 (RETIRE:
    its wgmmas are retired first, which frees their registers and ring slot, while step i - 1's
    stay in flight); q0, q1 (WORDS_IN_REGS): step i's words, and rs0, rs1, rz0, rz1 its scales and
    zero points as loaded (_step_scales), all loaded two steps earlier. Returns the accumulator
    with step i's wgmmas issued, their A operands, and step i + 2's words, scales and zero points."""
    if RETIRE:
        acc, w0, w1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, w0, w1))
    async_copy.wait_group(STAGES - 3)  # step i's group has landed
    _barrier()  # ... for every thread, and every warpgroup is past step i - 2's wgmmas
    nxt = i + STAGES - 2  # into step i - 2's slot
    _load_step(w_buf, x_buf, nxt % STAGES, w_ptrs, x_ptrs, nxt, nxt < n, not WORDS_IN_REGS)
    slot = i % STAGES
    if WORDS_IN_REGS:
        k0 = q0
        k1 = q1
    else:
        k0 = w_buf.index(2 * slot).load(WORDS)
        k1 = w_buf.index(2 * slot + 1).load(WORDS)
    s0 = None
    s1 = None
    z0 = None
    z1 = None
    if GROUP_CHUNKS > 0:
        s0, s1 = _scale_values(rs0, rs1, DT, PAIRED)
    if HAS_ZEROS:
        z0, z1 = _scale_values(rz0, rz1, DT, PAIRED)
    v0 = _chunk_weights(k0, DT, BLOCK_N, DOT_A, z0, s0)
    v1 = _chunk_weights(k1, DT, BLOCK_N, DOT_A, z1, s1)
    # step i + 2's words, scales and zero points (the last step's again past the end: no mask, an
    # L2 hit). Two steps early: ptxas starts a step's dequantization among the previous step's
    # wgmma issues, so scales loaded one step early were waited for there (ncu, v28: bf16's
    # scale / zero point pairing, ~21% of the stall samples). H100, table tiles, 3 rounds
    # (docs/perf_log.md v29): bf16 asymmetric 2-6% faster at M = 32-128, fp16 symmetric -5..+3%
    ahead = gl.minimum(i + 2, n - 1)
    if WORDS_IN_REGS:
        q0, q1 = _words(w_rows, ahead)
    if GROUP_CHUNKS > 0:
        rs0, rs1 = _step_scales(s_base, first + ahead, GROUP_CHUNKS, PAIRED)
        if HAS_ZEROS:
            rz0, rz1 = _step_scales(z_base, first + ahead, GROUP_CHUNKS, PAIRED)
    fence_async_shared()
    acc = warpgroup_mma(v0, x_buf.index(2 * slot).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(v1, x_buf.index(2 * slot + 1).permute((1, 0)), acc, is_async=True)
    return acc, v0, v1, q0, q1, rs0, rs1, rz0, rz1


@gluon.jit
def w4a16_gluon_overlap_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, stride_xm, stride_ym,
                               stride_qn, stride_sn, sync_ptr, GROUP_CHUNKS: gl.constexpr, HAS_ZEROS: gl.constexpr,
                               HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PDL_EARLY: gl.constexpr,
                               MMA: gl.constexpr, WORDS: gl.constexpr, DOT_A: gl.constexpr, X_BLK: gl.constexpr,
                               X_SMEM: gl.constexpr, W_BLK: gl.constexpr, W_SMEM: gl.constexpr,
                               WORDS_IN_REGS: gl.constexpr = False, PAIRED: gl.constexpr = False,
                               FIXUP: gl.constexpr = False):
    """w4a16_gluon_kernel's product with each step's dequantization overlapping the previous
    step's wgmmas (same arguments, and sync_ptr: the split-K tile counters with FIXUP, else None;
    STAGES >= 3, every split an even number of K steps: the launcher checks,
    ops/common.gluon_overlap_split_ok). FIXUP: the tile's last split-K slice adds the slices
    (_store), no reduce kernel: one launch a call, for eager calls (ops/w4a16.py _GemmPlan).

    Two steps' wgmmas are in flight: step i waits until only step i - 1's two wgmma groups (one
    per chunk) are outstanding, which retires step i - 2's and frees its A registers, then
    dequantizes step i. The loop is unrolled twice so that the two steps' A operands are
    different values: compiled for sm_90a
    (ptxas 12.8 and 13.4) as one loop with a wait per step, ptxas gave them the same registers
    and moved each wait above the next step's dequantization (no overlap left); unrolled, the
    32 wgmmas of two steps read 32 different register quads and the waits stay 'wait(2)'.
    No product is read while a wgmma runs (ptxas serializes every wgmma otherwise: C7514 /
    C7515, measured with the per-chunk scaled products of w4a16_gluon_kernel), so the group
    scale is applied to the weights, rounded once to x's dtype (as the Triton tiles without
    SCALE_ACC), and every chunk chains into one accumulator; per channel the scale multiplies
    the accumulator at the end. The ring holds the in-flight step, the one being dequantized
    and STAGES - 2 prefetched ones. (An odd step count would need one step after the loop: its
    in-flight operands merged with the loop's cost ~40 registers, and a final wait in each
    branch made ptxas serialize every wgmma, C7513; so the splits are even instead.)
    WORDS_IN_REGS: the words skip the ring; each step loads step i + 2's (16-byte loads in the
    WORDS layout, 16 registers per step and thread at BLOCK_N 16 * num_warps) after dequantizing
    its own, so the shared-memory round trip of the words and a third of the ring go (+20-30
    registers, no spill; sm_90a, Triton 3.6). The scales and zero points are loaded two steps
    early too; PAIRED (group size 128, rows 4-byte aligned: the launcher checks): each row's pair
    of a step in one int32 load."""
    DT: gl.constexpr = x_ptr.dtype.element_ty
    pid_m, pid_n, pid_k, first, n, w_ptrs, x_ptrs, s_base, z_base = _scaled_operands(
        x_ptr, qw_ptr, s_ptr, z_ptr, M, N, K, stride_xm, stride_qn, stride_sn, SPLIT_K, BLOCK_M, BLOCK_N, PDL_EARLY,
        X_BLK, W_BLK, WORDS)
    # the scales and zero points as loaded (_step_scales) of the even (a) and odd (b) steps
    sa0, sa1 = _step_scales(s_base, first, GROUP_CHUNKS, PAIRED)
    sb0, sb1 = _step_scales(s_base, first + 1, GROUP_CHUNKS, PAIRED)  # (n >= 2)
    za0 = sa0  # (symmetric: unused)
    za1 = sa1
    zb0 = sb0
    zb1 = sb1
    if HAS_ZEROS:
        za0, za1 = _step_scales(z_base, first, GROUP_CHUNKS, PAIRED)
        zb0, zb1 = _step_scales(z_base, first + 1, GROUP_CHUNKS, PAIRED)
    x_buf = gl.allocate_shared_memory(DT, [2 * STAGES, BLOCK_M, CHUNK_C], X_SMEM)
    w_buf = None
    w_rows = None
    qa0 = 0  # the words of the even (qa) and odd (qb) steps, WORDS_IN_REGS (else unused constants:
    qa1 = 0  # a jit function cannot return None)
    qb0 = 0
    qb1 = 0
    if WORDS_IN_REGS:
        w_rows = _word_rows(qw_ptr, pid_n, N, stride_qn, first, BLOCK_N, WORDS)
        qa0, qa1 = _words(w_rows, 0)
        qb0, qb1 = _words(w_rows, 1)
    else:
        w_buf = gl.allocate_shared_memory(gl.int32, [2 * STAGES, BLOCK_N, 16], W_SMEM)
    for s in gl.static_range(STAGES - 2):
        _load_step(w_buf, x_buf, s, w_ptrs, x_ptrs, s, s < n, not WORDS_IN_REGS)
    acc = warpgroup_mma_init(gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=MMA))
    # steps 0 and 1 retire nothing; then two steps per iteration, A operands (w0, w1) and (u0, u1)
    # (n is even)
    acc, w0, w1, qa0, qa1, sa0, sa1, za0, za1 = _overlap_step(
        0, n, first, acc, None, None, qa0, qa1, sa0, sa1, za0, za1, s_base, z_base, w_buf, x_buf, w_ptrs, x_ptrs,
        w_rows, GROUP_CHUNKS, HAS_ZEROS, PAIRED, STAGES, False, WORDS_IN_REGS, DT, BLOCK_N, DOT_A, WORDS)
    acc, u0, u1, qb0, qb1, sb0, sb1, zb0, zb1 = _overlap_step(
        1, n, first, acc, None, None, qb0, qb1, sb0, sb1, zb0, zb1, s_base, z_base, w_buf, x_buf, w_ptrs, x_ptrs,
        w_rows, GROUP_CHUNKS, HAS_ZEROS, PAIRED, STAGES, False, WORDS_IN_REGS, DT, BLOCK_N, DOT_A, WORDS)
    for j in range(1, n // 2):
        acc, w0, w1, qa0, qa1, sa0, sa1, za0, za1 = _overlap_step(
            2 * j, n, first, acc, w0, w1, qa0, qa1, sa0, sa1, za0, za1, s_base, z_base, w_buf, x_buf, w_ptrs,
            x_ptrs, w_rows, GROUP_CHUNKS, HAS_ZEROS, PAIRED, STAGES, True, WORDS_IN_REGS, DT, BLOCK_N, DOT_A, WORDS)
        acc, u0, u1, qb0, qb1, sb0, sb1, zb0, zb1 = _overlap_step(
            2 * j + 1, n, first, acc, u0, u1, qb0, qb1, sb0, sb1, zb0, zb1, s_base, z_base, w_buf, x_buf, w_ptrs,
            x_ptrs, w_rows, GROUP_CHUNKS, HAS_ZEROS, PAIRED, STAGES, True, WORDS_IN_REGS, DT, BLOCK_N, DOT_A, WORDS)
    acc, w0, w1, u0, u1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w0, w1, u0, u1))
    async_copy.wait_group(0)
    if GROUP_CHUNKS == 0:
        acc = acc * gl.load(rows(s_ptr, pid_n, N, stride_sn, BLOCK_N, MMA)).to(gl.float32)[:, None]
    _store(acc, y_ptr, ws_ptr, bias_ptr, pid_m, pid_n, pid_k, M, N, stride_ym, HAS_BIAS, SPLIT_K, BLOCK_M, BLOCK_N,
           MMA, sync_ptr, FIXUP)


@gluon.jit
def _pipe_words(w_rows, step, last, HALF_LAST: gl.constexpr):
    """_words of step `step`. HALF_LAST (K an odd number of 128-channel chunks: the last step,
    `last`, has chunk 0 only): that step's chunk 1 words are chunk 0's again, inside the row (the
    producer's TMA fills x there with zeros, so they add nothing)."""
    if HALF_LAST:
        q0 = gl.load(w_rows + step * 32, eviction_policy="evict_first")
        q1 = gl.load(w_rows + (step * 32 + 16 - 16 * (step == last).to(gl.int32)), eviction_policy="evict_first")
        return q0, q1
    else:
        return _words(w_rows, step)


@gluon.jit
def _pipe_scales(base, step, last, GROUP_CHUNKS: gl.constexpr, HALF_LAST: gl.constexpr):
    """_step_scales of step `step`; HALF_LAST: the last step's chunk 1 takes chunk 0's group (the
    row has no group past K; _pipe_words)."""
    if HALF_LAST and GROUP_CHUNKS > 0:
        c1 = 2 * step + 1 - (step == last).to(gl.int32)
        return gl.load(base + (2 * step) // GROUP_CHUNKS), gl.load(base + c1 // GROUP_CHUNKS)
    else:
        return _step_scales(base, step, GROUP_CHUNKS)


@gluon.jit
def _pipe_step(i, n, first, acc, w1, qa0, qa1, qb0, qb1, sn0, sn1, zn0, zn1, s_base, z_base, w_rows, x0_buf, x1_buf,
               ready0, ready1, empty0, empty1, GROUP_CHUNKS: gl.constexpr, HAS_ZEROS: gl.constexpr,
               S0: gl.constexpr, S1: gl.constexpr, DT: gl.constexpr, DOT_A: gl.constexpr,
               RELEASE: gl.constexpr, HALF_LAST: gl.constexpr = False):
    """K step i of one consumer warpgroup of w4a16_gluon_pipe_kernel. On entry chunk 1 of step
    i - 1 is in flight (w1 its A operand; RELEASE: there is one); qa / qb: the words of steps i
    and i + 1, sn / zn step i's scales and zero points, as loaded. Each chunk's x slot is waited
    for (ready) before its weights are made, so no wait loop sits between an A operand's
    definition and its wgmma (which made ptxas serialize them, docs/perf_log.md v27), and
    released (empty) once its wgmmas retired. Returns the same one step on. HALF_LAST: K ends
    half-way through the last step (_pipe_words)."""
    q0 = qa0
    q1 = qa1
    qa0 = qb0
    qa1 = qb1
    # (past the end: the last step again, an L2 hit)
    qb0, qb1 = _pipe_words(w_rows, gl.minimum(i + 2, n - 1), n - 1, HALF_LAST)
    s0 = None
    s1 = None
    z0 = None
    z1 = None
    ahead = first + gl.minimum(i + 1, n - 1)
    if GROUP_CHUNKS > 0:
        s0, s1 = _scale_values(sn0, sn1, DT)
        sn0, sn1 = _pipe_scales(s_base, ahead, first + n - 1, GROUP_CHUNKS, HALF_LAST)
    if HAS_ZEROS:
        z0, z1 = _scale_values(zn0, zn1, DT)
        zn0, zn1 = _pipe_scales(z_base, ahead, first + n - 1, GROUP_CHUNKS, HALF_LAST)
    a = i % S0
    b = i % S1
    mbarrier.wait(ready0.index(a), (i // S0) & 1)
    w0 = _chunk_weights(q0, DT, WG_ROWS, DOT_A, z0, s0)
    fence_async_shared()
    acc = warpgroup_mma(w0, x0_buf.index(a).permute((1, 0)), acc, is_async=True)
    acc, w1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w1))  # chunk 1 of step i - 1 retired
    if RELEASE:
        mbarrier.arrive(empty1.index((i + S1 - 1) % S1), count=1)
    mbarrier.wait(ready1.index(b), (i // S1) & 1)
    w1 = _chunk_weights(q1, DT, WG_ROWS, DOT_A, z1, s1)
    fence_async_shared()
    acc = warpgroup_mma(w1, x1_buf.index(b).permute((1, 0)), acc, is_async=True)
    acc, w0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w0))  # chunk 0 of step i retired
    mbarrier.arrive(empty0.index(a), count=1)
    return acc, w1, qa0, qa1, qb0, qb1, sn0, sn1, zn0, zn1


@gluon.jit
def pipe_mainloop(w_rows, s_base, z_base, first, n, x0_buf, x1_buf, ready0, ready1, empty0, empty1,
                  GROUP_CHUNKS: gl.constexpr, HAS_ZEROS: gl.constexpr, BLOCK_M: gl.constexpr, S0: gl.constexpr,
                  S1: gl.constexpr, MMA: gl.constexpr, DOT_A: gl.constexpr, DT: gl.constexpr,
                  HALF_LAST: gl.constexpr = False):
    """One consumer warpgroup's K loop (n >= 1 steps from `first`) of the pipe kernels: the
    (64, BLOCK_M) fp32 product of the 64 weight rows whose words start at w_rows (row_words;
    scales and zero points one pointer per row, s_base / z_base in the words' rows) and the x
    chunks the producer puts in the rings, every wgmma retired; per channel still unscaled.
    HALF_LAST: the last step has chunk 0 only (K an odd number of chunks; _pipe_words)."""
    qa0, qa1 = _pipe_words(w_rows, 0, n - 1, HALF_LAST)
    qb0, qb1 = _pipe_words(w_rows, gl.minimum(1, n - 1), n - 1, HALF_LAST)
    sn0, sn1 = _pipe_scales(s_base, first, first + n - 1, GROUP_CHUNKS, HALF_LAST)
    zn0 = sn0  # (symmetric: unused)
    zn1 = sn1
    if HAS_ZEROS:
        zn0, zn1 = _pipe_scales(z_base, first, first + n - 1, GROUP_CHUNKS, HALF_LAST)
    acc = warpgroup_mma_init(gl.zeros((WG_ROWS, BLOCK_M), gl.float32, layout=MMA))
    w1 = gl.zeros((WG_ROWS, CHUNK_C), DT, layout=DOT_A)
    # step 0 outside the loop: the loop carries an accumulator with a chunk in flight
    acc, w1, qa0, qa1, qb0, qb1, sn0, sn1, zn0, zn1 = _pipe_step(
        0, n, first, acc, w1, qa0, qa1, qb0, qb1, sn0, sn1, zn0, zn1, s_base, z_base, w_rows, x0_buf, x1_buf,
        ready0, ready1, empty0, empty1, GROUP_CHUNKS, HAS_ZEROS, S0, S1, DT, DOT_A, False, HALF_LAST)
    for i in range(1, n):
        acc, w1, qa0, qa1, qb0, qb1, sn0, sn1, zn0, zn1 = _pipe_step(
            i, n, first, acc, w1, qa0, qa1, qb0, qb1, sn0, sn1, zn0, zn1, s_base, z_base, w_rows, x0_buf, x1_buf,
            ready0, ready1, empty0, empty1, GROUP_CHUNKS, HAS_ZEROS, S0, S1, DT, DOT_A, True, HALF_LAST)
    acc, w1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w1))
    return acc


@gluon.jit
def _pipe_consumer(qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, stride_ym, stride_qn, stride_sn,
                   x0_buf, x1_buf, ready0, ready1, empty0, empty1, HALF: gl.constexpr, GROUP_CHUNKS: gl.constexpr,
                   HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr,
                   S0: gl.constexpr, S1: gl.constexpr, MMA: gl.constexpr, WORDS: gl.constexpr,
                   DOT_A: gl.constexpr, DT: gl.constexpr):
    """One consumer warpgroup of w4a16_gluon_pipe_kernel: rows HALF * 64 .. + 64 of the N tile,
    all of its K steps, and their store."""
    pid_n, pid_m, pid_k, first, n = program(M, K, SPLIT_K, BLOCK_M)
    pn = 2 * pid_n + HALF  # this warpgroup's 64 rows, as an N tile of 64
    w_rows = _word_rows(qw_ptr, pn, N, stride_qn, first, WG_ROWS, WORDS)
    s_base = rows(s_ptr, pn, N, stride_sn, WG_ROWS, WORDS)
    z_base = rows(z_ptr, pn, N, stride_sn, WG_ROWS, WORDS)
    acc = pipe_mainloop(w_rows, s_base, z_base, first, n, x0_buf, x1_buf, ready0, ready1, empty0, empty1,
                        GROUP_CHUNKS, HAS_ZEROS, BLOCK_M, S0, S1, MMA, DOT_A, DT)
    if GROUP_CHUNKS == 0:
        acc = acc * gl.load(rows(s_ptr, pn, N, stride_sn, WG_ROWS, MMA)).to(gl.float32)[:, None]
    _store(acc, y_ptr, ws_ptr, bias_ptr, pid_m, pn, pid_k, M, N, stride_ym, HAS_BIAS, SPLIT_K, BLOCK_M, WG_ROWS, MMA)


@gluon.jit
def w4a16_gluon_pipe_kernel(x_ptr, x_desc, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, stride_xm,
                            stride_ym, stride_qn, stride_sn, GROUP_CHUNKS: gl.constexpr, HAS_ZEROS: gl.constexpr,
                            HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr,
                            STAGES: gl.constexpr, PDL_EARLY: gl.constexpr, MMA: gl.constexpr, WORDS: gl.constexpr,
                            DOT_A: gl.constexpr, X_SMEM: gl.constexpr):
    """w4a16_gluon_kernel's product for large M ('gluon_pipe' configs: BLOCK_N 128, 8 warps of
    consumers, STAGES >= 3; x_desc: x's TMA descriptor, block (BLOCK_M, 128) in X_SMEM),
    warp-specialized. Two consumer warpgroups (two partitions: an mbarrier arrive is one thread's
    per partition, so each warpgroup releases its slots itself) each run a chunk pipeline on
    their 64 rows: each 128-channel chunk is dequantized while the previous chunk's wgmmas run
    (wait(1) after each issue), with only two chunks' A operands live, the words two steps ahead
    in registers straight from global memory and the scales one step ahead; the group scale goes
    on the weights (rounded once to x's dtype, as the overlap kernels) and every chunk chains
    into one accumulator; per channel the scale multiplies it at the end. A one-warp producer
    copies x's chunks by TMA into two rings (STAGES slots for chunk 0, STAGES + 1 for chunk 1)
    with per-slot ready / empty mbarriers, so the K loop has no CTA-wide barrier: the chunk
    pipeline with one, filled by cp.async (v30-v31), had the two warpgroups meet at it for
    12-16% of its stall samples, and a 4-warp cp.async producer could not keep x ahead (its
    copy addresses spilled; the consumers waited on 'ready' for ~20% of samples). Registers:
    PIPE_MAXNREG per thread at launch, setmaxnreg 232 / 232 / 40 (no spill, sm_90a, Triton 3.6
    and 3.9). H200, same process (docs/perf_log.md v32): 1.04-1.24x the chunk pipeline with the
    barrier at M = 200-512 on 5 of 6 shapes, 0.90-1.10x dequantize + cuBLAS at M = 1024; ncu
    (28672x8192, M = 512): tensor pipe 79% of elapsed cycles against 64%."""
    if PDL_EARLY:  # split-K: the reduce may launch now, it waits for the partial sums (kernels/common.py)
        gdc_launch_dependents()
    DT: gl.constexpr = x_ptr.dtype.element_ty
    S1: gl.constexpr = STAGES + 1
    x0_buf, x1_buf, ready0, ready1, empty0, empty1 = pipe_rings(DT, BLOCK_M, STAGES, X_SMEM)
    gl.warp_specialize([
        (_pipe_consumer, (qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, stride_ym, stride_qn, stride_sn,
                          x0_buf, x1_buf, ready0, ready1, empty0, empty1, 0, GROUP_CHUNKS, HAS_ZEROS, HAS_BIAS,
                          SPLIT_K, BLOCK_M, STAGES, S1, MMA, WORDS, DOT_A, DT)),
        (_pipe_consumer, (qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, stride_ym, stride_qn, stride_sn,
                          x0_buf, x1_buf, ready0, ready1, empty0, empty1, 1, GROUP_CHUNKS, HAS_ZEROS, HAS_BIAS,
                          SPLIT_K, BLOCK_M, STAGES, S1, MMA, WORDS, DOT_A, DT)),
        (pipe_loader, (x_desc, M, K, x0_buf, x1_buf, ready0, ready1, empty0, empty1, SPLIT_K, BLOCK_M, STAGES,
                       S1)),
    ], [4, 1], [PIPE_CONSUMER_REGS, PIPE_PRODUCER_REGS])


def pipe_meta(BLOCK_M: int) -> dict:
    """w4a16_gluon_pipe_kernel's layout constexprs and launch options: each partition is one
    warpgroup (layouts of a 64-row tile over 4 warps), 12 warps at PIPE_MAXNREG registers."""
    lay = layouts(BLOCK_M, 64, 4)
    return dict(MMA=lay["MMA"], WORDS=lay["WORDS"], DOT_A=lay["DOT_A"], X_SMEM=lay["X_SMEM"], num_warps=4,
                maxnreg=PIPE_MAXNREG)


def pipe_descriptor(x, BLOCK_M: int):
    """x's TMA descriptor for w4a16_gluon_pipe_kernel (x contiguous (M, K), 16-byte aligned)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(x, [BLOCK_M, CHUNK], layouts(BLOCK_M, 64, 4)["X_SMEM"])


def compile_sm90(BLOCK_M: int = 16, BLOCK_N: int = 64, STAGES: int = 3, group_size: int = 128, SPLIT_K: int = 1,
                 dtype: str = "fp16", has_bias: bool = False, num_warps: int = NUM_WARPS, pdl_early: bool = False,
                 has_zeros: bool = False, overlap: bool = False, words_in_regs: bool = False,
                 paired: bool = False, pipe: bool = False, fixup: bool = False):
    """triton.compile of the kernel (overlap: w4a16_gluon_overlap_kernel, words_in_regs: its
    WORDS_IN_REGS form, paired: its PAIRED scale loads at group size 128, fixup: its FIXUP split-K;
    pipe: w4a16_gluon_pipe_kernel) for sm_90a without a GPU (PTX / SASS checks, tests).
    Needs a process in which the Triton interpreter has not run (it patches the frontend)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    ty = "*fp16" if dtype == "fp16" else "*bf16"
    sig = {"x_ptr": ty}
    if pipe:  # x's TMA descriptor (pipe_descriptor)
        sig["x_desc"] = f"tensordesc<{dtype}[{BLOCK_M},{CHUNK}],{layouts(BLOCK_M, 64, 4)['X_SMEM']!r}>"
    sig |= {"qw_ptr": "*i32", "s_ptr": ty, "z_ptr": ty, "bias_ptr": ty if has_bias else "constexpr",
           "y_ptr": ty, "ws_ptr": "*fp32" if SPLIT_K > 1 else "constexpr", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_ym": "i32", "stride_qn": "i32", "stride_sn": "i32"}
    if overlap:
        sig["sync_ptr"] = "*i32" if fixup else "constexpr"
    consts = dict(GROUP_CHUNKS=0 if group_size == -1 else group_size // CHUNK, HAS_ZEROS=has_zeros,
                  HAS_BIAS=has_bias, SPLIT_K=SPLIT_K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES,
                  PDL_EARLY=pdl_early, **layouts(BLOCK_M, BLOCK_N, num_warps))
    options = {"num_warps": num_warps}
    if pipe:  # (BLOCK_N 128 over two consumer partitions of 4 warps: pipe_meta)
        assert BLOCK_N == 128 and num_warps == 8, "gluon_pipe: BLOCK_N 128, 8 consumer warps"
        meta = pipe_meta(BLOCK_M)
        options = {"num_warps": meta.pop("num_warps"), "maxnreg": meta.pop("maxnreg")}
        consts = {k: v for k, v in consts.items() if k not in ("BLOCK_N", "X_BLK", "W_BLK", "W_SMEM")} | meta
    if overlap:
        assert not fixup or SPLIT_K > 1, "fixup: a split-K kernel"
        consts["WORDS_IN_REGS"] = words_in_regs
        consts["PAIRED"] = paired and group_size == CHUNK
        consts["FIXUP"] = fixup
        if not fixup:
            consts["sync_ptr"] = None
    if not has_bias:
        consts["bias_ptr"] = None
    if SPLIT_K == 1:
        consts["ws_ptr"] = None
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    aligned = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "bias_ptr", "y_ptr", "ws_ptr", "N", "K", "stride_xm", "stride_ym",
               "stride_qn")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned if sig[a] != "constexpr"}
    fn = w4a16_gluon_pipe_kernel if pipe else w4a16_gluon_overlap_kernel if overlap else w4a16_gluon_kernel
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    cap = None if overlap or pipe else max_registers(BLOCK_M, BLOCK_N, STAGES, num_warps, has_zeros)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={**options, **({"maxnreg": cap} if cap else {})})
