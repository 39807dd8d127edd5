"""W4A8 (int8 activations, QQQ weights) on Hopper in Gluon: for large M the int8 form of
kernels/w4a16_gluon.w4a16_gluon_pipe_kernel (w4a8_gluon_pipe_kernel, config 'gluon_pipe'), for
decode sizes that of w4a16_gluon_overlap_kernel (w4a8_gluon_overlap_kernel, 'gluon_overlap', its
own section below). Hopper (sm_90a) and Triton's Gluon only; ops/w4a8.py runs the portable Triton
kernel (kernels/w4a8._w4a8_kernel, the 'mma' twin of either config) everywhere else, including the
CPU interpreter.

Why (docs/perf_log.md v33): the Triton tile's K loop meets the CTA barrier of its cp.async
ring every K tile, the structure the W4A16 pipe kernel replaced (tensor pipe 64% -> 79% of the
cycles, v32), and int8 wgmma runs at twice the fp16 rate, so the unpack is a larger share of each
chunk. H200, tuner (GEMM alone), best of this kernel's tiles over the previous choice: g128 1.12-1.69x
at M = 128 and 1.00-1.30x at M = 1024 (8 of 8 Llama-3 shapes), per channel 1.01-1.48x at M = 128
and 1.04-1.62x at M = 256 on 6 of 8; per channel at M >= 1024 the Triton tile stays level or ahead.

Structure (as the W4A16 pipe kernel; its docstring says why each piece is there):
- a program owns 128 weight rows (two consumer warpgroups of 64, each its own warp_specialize
  partition) and BLOCK_M tokens; a one-warp producer copies x_q's 128-channel chunks by TMA
  into two mbarrier-guarded rings (STAGES and STAGES + 1 slots), one per chunk of a 256-channel
  K step;
- each consumer reads its packed words (formats.qqq.PackedQQQ: a chunk is 16 words per row)
  two steps ahead from global memory straight into registers, 16 contiguous bytes per row and
  thread, in WORDS: lane 4g + t of warp w holds words 4t .. 4t + 3 of rows 16w + g and
  16w + 8 + g, which after the unpack are that thread's int8 A-fragment registers (channels
  4t + e and 16 + 4t + e of each k32 step) with no data movement (the compile test checks the
  loop for shared stores and byte permutes);
- the unpack is kernels/w4a8's asm on whole words (`_ASM_CHAN`: q - 8, 7 instructions per 8
  weights; `_ASM_GROUP1`: QQQ's round(s_g * (q - 8)) to int8, 15 without the clamp, the group
  scale one step ahead);
- the waits name the accumulator only: Triton's lowering rejects an 8-bit A operand among a
  wait's deps; the compile test checks the SASS for writes to an in-flight wgmma's A registers;
- each chunk's int8 wgmma (s8.s8.s32, A from registers, B = the x_q chunk in shared memory)
  is issued while the next chunk is unpacked (wait(1)); int32 accumulation, exact;
- epilogue y = (float(acc) * s_ch[n]) * s_tok[m] (+ bias), as kernels/w4a8._epilogue; RAW
  the int32 accumulator; SPLIT_K > 1 the int32 partial sums for kernels/w4a8's reduce kernel.
"""
from __future__ import annotations

from functools import lru_cache

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                             warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
from triton.language.extra.cuda import gdc_launch_dependents

from .gluon_common import (CHUNK, CHUNK_C, PIPE_CONSUMER_REGS, PIPE_MAXNREG, PIPE_PRODUCER_REGS, STEP_C, WG_ROWS,
                           pipe_loader, pipe_rings, program, rows)
from .w4a16_gluon import _barrier, _load_step, _words, row_words
from .common import SYNC_TILES
from .w4a8 import _ASM_CHAN, _ASM_GROUP, _ASM_GROUP_NOCLAMP


def _one_scale_pair(asm: str) -> str:
    """kernels/w4a8's group unpack for one 32-bit word whose four bytes share one scale: $3 is
    the (s, s) pair itself, so the two prmt that gather per-byte pairs (s02, s13) go (15 / 23
    instructions per word)."""
    for ln in ("prmt.b32 s02, $3, $5, 0x5410;\n", "prmt.b32 s13, $4, $6, 0x5410;\n"):
        assert ln in asm
        asm = asm.replace(ln, "")
    return asm.replace(" s02, s13,", "").replace("s02", "$3").replace("s13", "$3")


_ASM_GROUP1 = gl.constexpr(_one_scale_pair(_ASM_GROUP.value))
_ASM_GROUP1_NOCLAMP = gl.constexpr(_one_scale_pair(_ASM_GROUP_NOCLAMP.value))


@lru_cache(maxsize=None)
def layouts(BLOCK_M: int) -> dict:
    """The layout constexprs of one consumer warpgroup: its (64, BLOCK_M) int32 accumulator
    (MMA), the int8 A operand (DOT_A), the packed words (WORDS: lane 4g + t of warp w holds words
    4t .. 4t + 3 of rows 16w + g and 16w + 8 + g of a chunk, 16 contiguous bytes per row, which
    unpack into exactly that thread's A-fragment registers), WJ: DOT_A as (64, 32, 4) (4-channel
    group, channel in it), and x_q's TMA block (X_SMEM)."""
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, min(BLOCK_M, 128), 32])
    words = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                       lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                       warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16])
    # DOT_A (k_width 4): registers channel +1, +2, row +8, channel +16, +32, +64; lanes channel
    # +4, +8, rows +1, +2, +4; warps rows +16, +32
    wj = gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0], [0, 4, 0], [0, 8, 0], [0, 16, 0]],
                                    lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                    warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 32, 4])
    return dict(MMA=mma, WORDS=words, WJ=wj, DOT_A=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4),
                X_SMEM=gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))


def pipe_meta(BLOCK_M: int) -> dict:
    """w4a8_gluon_pipe_kernel's layout constexprs and launch options (12 warps, PIPE_MAXNREG)."""
    return dict(layouts(BLOCK_M), num_warps=4, maxnreg=PIPE_MAXNREG)


def pipe_descriptor(x_q, BLOCK_M: int):
    """x_q's TMA descriptor for w4a8_gluon_pipe_kernel (int8, contiguous (M, K), 16-byte aligned)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(x_q, [BLOCK_M, CHUNK], layouts(BLOCK_M)["X_SMEM"])


@gluon.jit
def _chunk_int8(w, s2, GROUPED: gl.constexpr, CLAMP: gl.constexpr, WJ: gl.constexpr, DOT_A: gl.constexpr):
    """(64, 16) packed words of one chunk (WORDS) -> the (64, 128) int8 weights w8 in DOT_A:
    q - 8 per channel, or round(s_g * (q - 8)) per group (s2: the row's fp16 group scale in both
    halves of an int32, WORDS; CLAMP: clamp to +-127, kernels/w4a8._int8_pair)."""
    if GROUPED:
        lo, hi = gl.inline_asm_elementwise(_ASM_GROUP1 if CLAMP else _ASM_GROUP1_NOCLAMP, "=r,=r,r,r", [w, s2],
                                           dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    else:
        lo, hi = gl.inline_asm_elementwise(_ASM_CHAN, "=r,=r,r", [w], dtype=(gl.int32, gl.int32), is_pure=True,
                                           pack=1)
    # word 4t + s gives lo: channels 32s + 4t + e, hi: 32s + 16 + 4t + e (kernels/w4a8._fragment_tile).
    # The words are permuted as 32-bit values (register renaming) and only then viewed as their
    # bytes: joining and permuting the int8 values themselves compiled to ~18 PRMT per word.
    q = gl.join(lo, hi)                           # (n, w, h)
    q = gl.reshape(q, (64, 4, 4, 2))              # (n, t, s, h)
    q = gl.permute(q, (0, 2, 3, 1))               # (n, s, h, t)
    q = gl.reshape(q, (64, 32))                   # 4-channel group j = 8s + 4h + t
    q = gl.convert_layout(q, gl.SliceLayout(2, WJ))
    q = gl.broadcast(gl.expand_dims(q, 2), gl.zeros((64, 32, 4), gl.int32, layout=WJ))[0]
    q = gl.reshape(q, (64, CHUNK_C))              # channel 4j + e: its group's word, four times
    q = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [q], dtype=gl.int8, is_pure=True, pack=4)
    return gl.convert_layout(q, DOT_A)


@gluon.jit
def _group_pairs(s_rows, step, WORDS: gl.constexpr):
    """The two chunks' group scales of K step `step` (s_rows: one pointer per row, in WORDS' rows,
    at the program's first group), each as an int32 holding the fp16 bits twice, over the words."""
    g0 = gl.load(s_rows + 2 * step).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    g1 = gl.load(s_rows + (2 * step + 1)).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    z = gl.zeros((64, 16), gl.int32, layout=WORDS)
    return z + (g0 | (g0 << 16))[:, None], z + (g1 | (g1 << 16))[:, None]



@gluon.jit
def _store8(acc, pn, pid_m, pid_k, xs_ptr, sch_ptr, bias_ptr, y_ptr, ws_ptr, sync_ptr, M, N, stride_ym,
            HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, RAW: gl.constexpr, FIXUP: gl.constexpr,
            BLOCK_M: gl.constexpr, MMA: gl.constexpr):
    """Store one warpgroup's retired (64, BLOCK_M) int32 accumulator (MMA) of weight rows pn * 64 ..
    and tokens pid_m * BLOCK_M ..: SPLIT_K > 1 slice pid_k of the int32 workspace (SPLIT_K, M, N) in
    y_ptr; with FIXUP in ws_ptr instead, and the tile's last slice to arrive (its counter in sync_ptr,
    zero between launches: kernels/w4a8._add_slices' protocol) adds the slices in slice order
    (int32: exact) and stores y. Then RAW the accumulator; else the epilogue
    y = (float(acc) * s_ch[n]) * s_tok[m] (+ bias), in kernels/w4a8._epilogue's order, in y's dtype."""
    an = pn * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, MMA))
    om = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    mask = (om < M)[None, :] & (an < N)[:, None]
    on = an.to(gl.int64)
    last = True
    if SPLIT_K > 1 and FIXUP:  # (M * N < 2**31: the launcher's fixup_fits)
        cnt_ptr = sync_ptr + SYNC_TILES + gl.program_id(0)
        offs = om[None, :] * N + an[:, None]
        mn = M.to(gl.int64) * N
        gl.store(ws_ptr + pid_k.to(gl.int64) * mn + offs, acc, mask=mask)
        _barrier()  # every thread's part stored before the release
        last = gl.atomic_add(cnt_ptr, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            _barrier()
            acc = gl.zeros_like(acc)
            for s in range(SPLIT_K):  # (one slice a step: the loads of all of them would hold registers)
                acc += gl.load(ws_ptr + s * mn + offs, mask=mask, other=0, cache_modifier=".cg")
            gl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
    if SPLIT_K > 1 and not FIXUP:
        gl.store(y_ptr + (pid_k * M + om.to(gl.int64)[None, :]) * N + on[:, None], acc, mask=mask)
    elif last:
        y_ptrs = y_ptr + om.to(gl.int64)[None, :] * stride_ym + on[:, None]
        if RAW:
            gl.store(y_ptrs, acc, mask=mask)
        else:
            s_ch = gl.load(sch_ptr + an % N)
            s_tok = gl.load(xs_ptr + om % M)
            y = (acc.to(gl.float32) * s_ch[:, None]) * s_tok[None, :]
            if HAS_BIAS:
                y = y + gl.load(bias_ptr + an % N).to(gl.float32)[:, None]
            gl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _pipe_step8(i, n, acc, w1, qa0, qa1, qb0, qb1, sn0, sn1, s_rows, w_rows, x0_buf, x1_buf, ready0, ready1,
                empty0, empty1, GROUPED: gl.constexpr, CLAMP: gl.constexpr, S0: gl.constexpr, S1: gl.constexpr,
                WORDS: gl.constexpr, WJ: gl.constexpr, DOT_A: gl.constexpr, RELEASE: gl.constexpr):
    """K step i of one consumer warpgroup (kernels/w4a16_gluon._pipe_step's schedule): on entry
    chunk 1 of step i - 1 is in flight (w1 its A operand; RELEASE: there is one); qa / qb the
    bytes of steps i and i + 1, sn step i's group scales. Returns the same one step on."""
    q0 = qa0
    q1 = qa1
    qa0 = qb0
    qa1 = qb1
    qb0, qb1 = _words(w_rows, gl.minimum(i + 2, n - 1))  # (past the end: the last step again, an L2 hit)
    s0 = sn0
    s1 = sn1
    if GROUPED:
        sn0, sn1 = _group_pairs(s_rows, gl.minimum(i + 1, n - 1), WORDS)
    a = i % S0
    b = i % S1
    mbarrier.wait(ready0.index(a), (i // S0) & 1)
    w0 = _chunk_int8(q0, s0, GROUPED, CLAMP, WJ, DOT_A)
    fence_async_shared()
    acc = warpgroup_mma(w0, x0_buf.index(a).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # chunk 1 of step i - 1 retired
    if RELEASE:
        mbarrier.arrive(empty1.index((i + S1 - 1) % S1), count=1)
    mbarrier.wait(ready1.index(b), (i // S1) & 1)
    w1 = _chunk_int8(q1, s1, GROUPED, CLAMP, WJ, DOT_A)
    fence_async_shared()
    acc = warpgroup_mma(w1, x1_buf.index(b).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # chunk 0 of step i retired
    mbarrier.arrive(empty0.index(a), count=1)
    return acc, w1, qa0, qa1, qb0, qb1, sn0, sn1


@gluon.jit
def _pipe_consumer8(xs_ptr, qb_ptr, sch_ptr, sg_ptr, bias_ptr, y_ptr, M, N, K, stride_ym, stride_qn, stride_gn,
                    x0_buf, x1_buf, ready0, ready1, empty0, empty1, HALF: gl.constexpr, GROUPED: gl.constexpr,
                    CLAMP: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, RAW: gl.constexpr,
                    BLOCK_M: gl.constexpr, S0: gl.constexpr, S1: gl.constexpr, MMA: gl.constexpr,
                    WORDS: gl.constexpr, WJ: gl.constexpr, DOT_A: gl.constexpr):
    """One consumer warpgroup: rows HALF * 64 .. + 64 of the program's 128, all of its K steps,
    and their store."""
    pid_n, pid_m, pid_k, first, n = program(M, K, SPLIT_K, BLOCK_M)
    pn = 2 * pid_n + HALF  # this warpgroup's 64 rows, as an N tile of 64
    w_rows = row_words(rows(qb_ptr, pn, N, stride_qn, WG_ROWS, WORDS), first, WORDS)
    qa0, qa1 = _words(w_rows, 0)
    qb0, qb1 = _words(w_rows, gl.minimum(1, n - 1))
    if GROUPED:
        s_rows = rows(sg_ptr, pn, N, stride_gn, WG_ROWS, WORDS) + 2 * first
        sn0, sn1 = _group_pairs(s_rows, 0, WORDS)
    else:  # (unused; sg_ptr may be None)
        s_rows = w_rows
        sn0 = qa0
        sn1 = qa1
    acc = warpgroup_mma_init(gl.zeros((WG_ROWS, BLOCK_M), gl.int32, layout=MMA))
    w1 = gl.zeros((WG_ROWS, CHUNK_C), gl.int8, layout=DOT_A)
    # step 0 outside the loop: the loop carries an accumulator with a chunk in flight
    acc, w1, qa0, qa1, qb0, qb1, sn0, sn1 = _pipe_step8(
        0, n, acc, w1, qa0, qa1, qb0, qb1, sn0, sn1, s_rows, w_rows, x0_buf, x1_buf, ready0, ready1, empty0,
        empty1, GROUPED, CLAMP, S0, S1, WORDS, WJ, DOT_A, False)
    for i in range(1, n):
        acc, w1, qa0, qa1, qb0, qb1, sn0, sn1 = _pipe_step8(
            i, n, acc, w1, qa0, qa1, qb0, qb1, sn0, sn1, s_rows, w_rows, x0_buf, x1_buf, ready0, ready1, empty0,
            empty1, GROUPED, CLAMP, S0, S1, WORDS, WJ, DOT_A, True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _store8(acc, pn, pid_m, pid_k, xs_ptr, sch_ptr, bias_ptr, y_ptr, None, None, M, N, stride_ym, HAS_BIAS, SPLIT_K,
            RAW, False, BLOCK_M, MMA)


@gluon.jit
def w4a8_gluon_pipe_kernel(x_desc, xs_ptr, qb_ptr, sch_ptr, sg_ptr, bias_ptr, y_ptr, M, N, K, stride_ym, stride_qn,
                           stride_gn, GROUPED: gl.constexpr, CLAMP: gl.constexpr, HAS_BIAS: gl.constexpr,
                           SPLIT_K: gl.constexpr, RAW: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                           PDL_EARLY: gl.constexpr, MMA: gl.constexpr, WORDS: gl.constexpr, WJ: gl.constexpr,
                           DOT_A: gl.constexpr,
                           X_SMEM: gl.constexpr):
    """y (M, N) = W4A8 product of x_q (x_desc: int8 (M, K), block (BLOCK_M, 128) in X_SMEM),
    s_tok (xs_ptr, float32 (M,)) and a PackedQQQ weight (qb_ptr: its int32 words (N, Kp / 8), stride_qn
    in words; sch_ptr float32 (N,); sg_ptr float16 (N, Kp / 128), GROUPED) (+ bias), in y's dtype;
    RAW: the int32 accumulator; SPLIT_K > 1: y_ptr is the int32 workspace (SPLIT_K, M, N).
    Grid (cdiv(N, 128) * cdiv(M, BLOCK_M), SPLIT_K); K a multiple of 256, every split at least
    one K step (the launcher checks)."""
    if PDL_EARLY:  # split-K: the reduce may launch now, it waits for the partial sums (kernels/common.py)
        gdc_launch_dependents()
    S1: gl.constexpr = STAGES + 1
    x0_buf, x1_buf, ready0, ready1, empty0, empty1 = pipe_rings(gl.int8, BLOCK_M, STAGES, X_SMEM)
    gl.warp_specialize([
        (_pipe_consumer8, (xs_ptr, qb_ptr, sch_ptr, sg_ptr, bias_ptr, y_ptr, M, N, K, stride_ym, stride_qn,
                           stride_gn, x0_buf, x1_buf, ready0, ready1, empty0, empty1, 0, GROUPED, CLAMP, HAS_BIAS,
                           SPLIT_K, RAW, BLOCK_M, STAGES, S1, MMA, WORDS, WJ, DOT_A)),
        (_pipe_consumer8, (xs_ptr, qb_ptr, sch_ptr, sg_ptr, bias_ptr, y_ptr, M, N, K, stride_ym, stride_qn,
                           stride_gn, x0_buf, x1_buf, ready0, ready1, empty0, empty1, 1, GROUPED, CLAMP, HAS_BIAS,
                           SPLIT_K, RAW, BLOCK_M, STAGES, S1, MMA, WORDS, WJ, DOT_A)),
        (pipe_loader, (x_desc, M, K, x0_buf, x1_buf, ready0, ready1, empty0, empty1, SPLIT_K, BLOCK_M, STAGES,
                       S1)),
    ], [4, 1], [PIPE_CONSUMER_REGS, PIPE_PRODUCER_REGS])


# ----------------------------------------------------------------------------------
# decode sizes (M <= 32): one warpgroup, no warp specialization
# ----------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def overlap_meta(BLOCK_M: int) -> dict:
    """w4a8_gluon_overlap_kernel's layout constexprs and launch options: layouts(BLOCK_M)'s and x_q's
    cp.async layout (X_BLK: 16 bytes a thread, 8 threads a 128-channel row), one warpgroup."""
    x_blk = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[4, 1], order=[1, 0])
    return dict(layouts(BLOCK_M), X_BLK=x_blk, num_warps=4)


@gluon.jit
def _overlap_step8(i, n, acc, q0, q1, g0, g1, s_rows, w_rows, x_buf, x_ptrs, GROUPED: gl.constexpr,
                   CLAMP: gl.constexpr, STAGES: gl.constexpr, RETIRE: gl.constexpr, WORDS: gl.constexpr,
                   WJ: gl.constexpr, DOT_A: gl.constexpr):
    """K step i: retire step i - 2's wgmmas (RETIRE), refill its ring slot with x_q's chunks of step
    i + STAGES - 2, unpack step i (q0, q1 its words, g0, g1 its group scales, loaded two steps
    earlier) while step i - 1's wgmmas run, issue step i's two. Returns the accumulator and step
    i + 2's words and scales."""
    if RETIRE:
        acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
    async_copy.wait_group(STAGES - 3)  # step i's group has landed
    _barrier()  # ... for every thread, and every warp is past step i - 2's wgmmas
    nxt = i + STAGES - 2  # into step i - 2's slot
    _load_step(None, x_buf, nxt % STAGES, None, x_ptrs, nxt, nxt < n, False)
    slot = i % STAGES
    v0 = _chunk_int8(q0, g0, GROUPED, CLAMP, WJ, DOT_A)
    v1 = _chunk_int8(q1, g1, GROUPED, CLAMP, WJ, DOT_A)
    ahead = gl.minimum(i + 2, n - 1)  # (past the end: the last step again, an L2 hit)
    q0, q1 = _words(w_rows, ahead)
    if GROUPED:
        g0, g1 = _group_pairs(s_rows, ahead, WORDS)
    fence_async_shared()
    acc = warpgroup_mma(v0, x_buf.index(2 * slot).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(v1, x_buf.index(2 * slot + 1).permute((1, 0)), acc, is_async=True)
    return acc, q0, q1, g0, g1


@gluon.jit
def w4a8_gluon_overlap_kernel(x_ptr, xs_ptr, qb_ptr, sch_ptr, sg_ptr, bias_ptr, y_ptr, ws_ptr, sync_ptr, M, N, K,
                              stride_xm, stride_ym, stride_qn, stride_gn, GROUPED: gl.constexpr, CLAMP: gl.constexpr,
                              HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, RAW: gl.constexpr, FIXUP: gl.constexpr,
                              BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr, WORDS: gl.constexpr,
                              WJ: gl.constexpr, DOT_A: gl.constexpr, X_SMEM: gl.constexpr, X_BLK: gl.constexpr,
                              PDL_EARLY: gl.constexpr = False):
    """The product of w4a8_gluon_pipe_kernel for decode sizes, from x_q itself (x_ptr int8 (M, K),
    rows stride_xm): a program owns 64 weight rows (one warpgroup) and BLOCK_M tokens. x_q's two
    chunks of a K step come through a cp.async ring of STAGES steps; the packed words and group
    scales go from global memory straight into registers two steps ahead; each step is unpacked while
    the previous step's two int8 wgmmas run (wait(2): two steps in flight, the loop unrolled twice so
    that their A operands are different registers), the int8 form of
    kernels/w4a16_gluon.w4a16_gluon_overlap_kernel. Split-K: y_ptr the int32 workspace for the reduce
    kernel, or FIXUP: the workspace ws_ptr and the tiles' counters sync_ptr (ops/common.sync_buffer),
    the last slice of a tile writes y (_store8). Grid (cdiv(N, 64) * cdiv(M, BLOCK_M), SPLIT_K); K a
    multiple of 256, every split an even number of K steps >= 2, STAGES >= 3 (the launcher checks).
    PDL_EARLY: the next grid (a row kernel launched as a programmatic dependent, which waits
    itself) may launch at once.
    Why (docs/perf_log.md v50): at M = 16 the warp-specialized pipe's 128 rows and producer warp are
    too much machinery for 16 tokens."""
    if PDL_EARLY:
        gdc_launch_dependents()
    pid_n, pid_m, pid_k, first, n = program(M, K, SPLIT_K, BLOCK_M)
    w_rows = row_words(rows(qb_ptr, pid_n, N, stride_qn, WG_ROWS, WORDS), first, WORDS)
    xm = (pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_BLK))) % M
    xk = gl.arange(0, CHUNK_C, layout=gl.SliceLayout(0, X_BLK))
    x_ptrs = x_ptr + xm.to(gl.int64)[:, None] * stride_xm + (first * STEP_C + xk)[None, :]
    # the words and group scales of the even (a) and odd (b) steps, two steps ahead
    qa0, qa1 = _words(w_rows, 0)
    qb0, qb1 = _words(w_rows, 1)
    if GROUPED:
        s_rows = rows(sg_ptr, pid_n, N, stride_gn, WG_ROWS, WORDS) + 2 * first
        ga0, ga1 = _group_pairs(s_rows, 0, WORDS)
        gb0, gb1 = _group_pairs(s_rows, 1, WORDS)
    else:  # (unused; sg_ptr may be None)
        s_rows = w_rows
        ga0 = qa0
        ga1 = qa1
        gb0 = qb0
        gb1 = qb1
    x_buf = gl.allocate_shared_memory(gl.int8, [2 * STAGES, BLOCK_M, CHUNK_C], X_SMEM)
    for s in gl.static_range(STAGES - 2):
        _load_step(None, x_buf, s, None, x_ptrs, s, s < n, False)
    acc = warpgroup_mma_init(gl.zeros((WG_ROWS, BLOCK_M), gl.int32, layout=MMA))
    acc, qa0, qa1, ga0, ga1 = _overlap_step8(0, n, acc, qa0, qa1, ga0, ga1, s_rows, w_rows, x_buf, x_ptrs, GROUPED,
                                             CLAMP, STAGES, False, WORDS, WJ, DOT_A)
    acc, qb0, qb1, gb0, gb1 = _overlap_step8(1, n, acc, qb0, qb1, gb0, gb1, s_rows, w_rows, x_buf, x_ptrs, GROUPED,
                                             CLAMP, STAGES, False, WORDS, WJ, DOT_A)
    for j in range(1, n // 2):
        acc, qa0, qa1, ga0, ga1 = _overlap_step8(2 * j, n, acc, qa0, qa1, ga0, ga1, s_rows, w_rows, x_buf, x_ptrs,
                                                 GROUPED, CLAMP, STAGES, True, WORDS, WJ, DOT_A)
        acc, qb0, qb1, gb0, gb1 = _overlap_step8(2 * j + 1, n, acc, qb0, qb1, gb0, gb1, s_rows, w_rows, x_buf,
                                                 x_ptrs, GROUPED, CLAMP, STAGES, True, WORDS, WJ, DOT_A)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)
    _store8(acc, pid_n, pid_m, pid_k, xs_ptr, sch_ptr, bias_ptr, y_ptr, ws_ptr, sync_ptr, M, N, stride_ym,
            HAS_BIAS, SPLIT_K, RAW, FIXUP, BLOCK_M, MMA)


def compile_sm90(BLOCK_M: int = 128, STAGES: int = 3, group_size: int = -1, SPLIT_K: int = 1,
                 out_dtype: str = "fp16", has_bias: bool = False, raw: bool = False, clamp: bool = True,
                 pdl_early: bool = False, kernel: str = "gluon_pipe", fixup: bool = False):
    """triton.compile of w4a8_gluon_pipe_kernel (kernel "gluon_overlap": w4a8_gluon_overlap_kernel)
    for sm_90a without a GPU (PTX / SASS checks, tests). Needs a process in which the Triton
    interpreter has not run."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    overlap = kernel == "gluon_overlap"
    yt = "*i32" if raw or (SPLIT_K > 1 and not fixup) else "*fp16" if out_dtype == "fp16" else "*bf16"
    meta = overlap_meta(BLOCK_M) if overlap else pipe_meta(BLOCK_M)
    x = {"x_ptr": "*i8"} if overlap else {"x_desc": f"tensordesc<i8[{BLOCK_M},{CHUNK}],{meta['X_SMEM']!r}>"}
    sig = {**x, "xs_ptr": "*fp32", "qb_ptr": "*i32", "sch_ptr": "*fp32",
           "sg_ptr": "*fp16" if group_size != -1 else "constexpr", "bias_ptr": "*fp16" if has_bias else "constexpr",
           "y_ptr": yt, **({"ws_ptr": "*i32" if fixup else "constexpr", "sync_ptr": "*i32" if fixup else "constexpr"}
                           if overlap else {}),
           "M": "i32", "N": "i32", "K": "i32", **({"stride_xm": "i32"} if overlap else {}),
           "stride_ym": "i32", "stride_qn": "i32", "stride_gn": "i32"}
    consts = dict(GROUPED=group_size != -1, CLAMP=clamp, HAS_BIAS=has_bias, SPLIT_K=SPLIT_K, RAW=raw,
                  BLOCK_M=BLOCK_M, STAGES=STAGES, PDL_EARLY=pdl_early, **({"FIXUP": fixup} if overlap else {}),
                  **{k: v for k, v in meta.items() if k not in ("num_warps", "maxnreg")})
    if not has_bias:
        consts["bias_ptr"] = None
    if group_size == -1:
        consts["sg_ptr"] = None
    if overlap and not fixup:
        consts.update(ws_ptr=None, sync_ptr=None)
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    aligned = ("x_ptr", "qb_ptr", "sch_ptr", "sg_ptr", "y_ptr", "N", "K", "stride_xm", "stride_ym", "stride_qn")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned if sig.get(a, "constexpr") != "constexpr"}
    src = GluonASTSource(fn=w4a8_gluon_overlap_kernel if overlap else w4a8_gluon_pipe_kernel, signature=sig,
                         constexprs=consts, attrs=attrs)
    options = {"num_warps": meta["num_warps"], **({"maxnreg": meta["maxnreg"]} if "maxnreg" in meta else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
