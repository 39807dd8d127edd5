"""Probe (not part of the package; Hopper GPU; Triton 3.6 and 3.9): the M = 1 GEMV with its packed
words fed by TMA instead of each warp's own loads (docs/perf_log.md v35, issue 9). The shipped
GEMV (kernels/w4a16._w4a16_gemv_mma_kernel) keeps one K tile of words in flight per warp and waits
for it; here a program of 16 P rows walks its K range in stages of CW chunks (128 channels each,
one chunk per warp), each stage one 3-D TMA box (chunk, row, word) into a ring of STAGES slots
guarded by mbarriers, and every warp reads its chunk's words back from shared memory in the mma
fragment order and runs the shipped asm (kernels/w4a16.gemv_asm: dequantization, mma.sync, x and
scales loaded inside). The CW partial sums meet once at the end. Three forms:
  w  warp-specialized: a one-warp TMA producer (padded to a warpgroup by Triton) and CW consumers;
  r  ring: no specialization, the CTA refills a slot after one barrier once every warp has read it;
  x  ring with the next stage's x pairs loaded one stage ahead into registers and handed to the
     asm as operands (xreg_asm), unmasked when K is a multiple of 128 CW.

    PYTHONPATH=src python benchmarks/probes/gemv_tma_ring_probe.py compile   # no GPU: registers, spills
    PYTHONPATH=src python benchmarks/probes/gemv_tma_ring_probe.py ab g128,chan,bf16asym [KxN,...] [TILES]
    PYTHONPATH=src python benchmarks/probes/gemv_tma_ring_probe.py bound [KxN,...]

TILES: comma-separated FORM P/CW/STAGES/SPLIT[/MAXNREG], e.g. x1/4/4/1/64,r1/8/4/1,w2/4/4/1. 'ab'
checks every output against the dequantized reference and the shipped path (QuantLinear forward,
its table config) and times both with the decode-step method; 'bound' times the ring with its
arithmetic replaced by an xor of the words, and a flat reader of the same bytes.

What it showed (NVIDIA H200, torch 2.11, Triton 3.6; docs/perf_log.md v35): errors equal to the
shipped GEMV's; the shipped GEMV's time over the best tile of each form, fp16 g128: warp-specialized
0.72-0.89x, ring 0.82-0.96x, ring + x 0.89-1.01x. The ring without arithmetic streams at the flat
reader's rate (8192x8192 11.0 us against 10.6-11.0), so the memory side is solved and the consumers
are the bound: ncu (8192x8192) put the ring's stalls on the mma waiting for x (41% of samples), and
the ring + x form at 7.6 cycles per issued instruction (shipped 18.2) but with 31% more
instructions and half the shipped kernel's warps per SM.
"""
import copy
import re
import sys
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from sailfish.kernels.w4a16 import _gemv_constraints, _gemv_mma_asm, gemv_asm

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
PRODUCER_REGS = gl.constexpr(24)


@lru_cache(maxsize=None)
def layouts(CW: int, P: int) -> dict:
    """WL: a stage's (CW, 16 P, 16) words, warp w owning chunk w, lane 4g + t the words 4t..4t+3
    of rows g, g + 8 (+16: P = 2) as the mma A fragment wants them; W_SMEM: no swizzle (rows of 64
    bytes: the 8 rows one quarter-warp reads fall in different banks)."""
    reg = [[0, 0, 1], [0, 0, 2], [0, 8, 0]] + ([[0, 16, 0]] if P == 2 else [])
    wl = gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                    warp_bases=[[1 << i, 0, 0] for i in range(CW.bit_length() - 1)],
                                    block_bases=[], shape=[CW, 16 * P, 16])
    return dict(WL=wl, W_SMEM=gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3))


@gluon.jit
def _ph(v):
    """(.., p, h) -> ((p0h0, p0h1), (p1h0, p1h1))."""
    h0, h1 = gl.split(v)
    p0h0, p1h0 = gl.split(h0)
    p0h1, p1h1 = gl.split(h1)
    return (p0h0, p0h1), (p1h0, p1h1)


@gluon.jit
def _pieces(v, P: gl.constexpr):
    """(CW, 16 P, 16) in WL -> the asm's 16 word operands (CW, 8, 4): rows g, g + 8 of pair 0
    (a = 0..3 each), then of pair 1 (P = 2; else pair 0 again). Register-only: every split axis
    is a register axis of WL."""
    CW: gl.constexpr = v.shape[0]
    v = gl.permute(gl.reshape(v, (CW, 2 * P, 8, 4, 4)), (0, 2, 3, 1, 4))   # (w, g, t, hp, a)
    if P == 1:
        e, o = gl.split(gl.reshape(v, (CW, 8, 4, 2, 2, 2)))               # a_lo
        e0, e1 = gl.split(e)
        o0, o1 = gl.split(o)
        l0, h0 = gl.split(e0)
        l2, h2 = gl.split(e1)
        l1, h1 = gl.split(o0)
        l3, h3 = gl.split(o1)
        return l0, l1, l2, l3, h0, h1, h2, h3, l0, l1, l2, l3, h0, h1, h2, h3
    else:
        e, o = gl.split(gl.reshape(v, (CW, 8, 4, 2, 2, 2, 2)))            # (p, h, a_hi, a_lo)
        e0, e1 = gl.split(e)
        o0, o1 = gl.split(o)
        a0p, a0q = _ph(e0)
        a2p, a2q = _ph(e1)
        a1p, a1q = _ph(o0)
        a3p, a3q = _ph(o1)
        return (a0p[0], a1p[0], a2p[0], a3p[0], a0p[1], a1p[1], a2p[1], a3p[1],
                a0q[0], a1q[0], a2q[0], a3q[0], a0q[1], a1q[1], a2q[1], a3q[1])


@gluon.jit
def _lanes(pid_n, N, P: gl.constexpr, CW: gl.constexpr, WL: gl.constexpr):
    """Per asm element: its chunk slot w, lane-in-group t, and rows (pair 0 g / g + 8, pair 1),
    split like the words so that every operand has their layout."""
    ROWS: gl.constexpr = 16 * P
    wi = gl.arange(0, CW, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))[:, None, None]
    ri = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))[None, :, None]
    ci = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))[None, None, :]
    zero = gl.zeros((CW, ROWS, 16), gl.int32, layout=WL)
    (w_, _, _, _, _, _, _, _, _, _, _, _, _, _, _, _) = _pieces(zero + wi, P)
    (t_, _, _, _, _, _, _, _, _, _, _, _, _, _, _, _) = _pieces(zero + ci // 4, P)
    (n0l, _, _, _, n0h, _, _, _, n1l, _, _, _, n1h, _, _, _) = _pieces(zero + ri + pid_n * ROWS, P)
    return w_, t_, n0l, n0h, n1l, n1h


@gluon.jit
def _wrap(n, N):
    """Rows past N read row n % N's scales (their outputs are dropped). Once, before the K loop:
    with the modulo inside it the ring forms were 11-14% slower (8192x8192, H200)."""
    return (n % N).to(gl.int64)


@gluon.jit
def _scale_ptr(s_ptr, r, stride_sn, grp):
    return (s_ptr + r * stride_sn + grp).to(gl.int64, bitcast=True)


@gluon.jit
def _addresses(ch, t_, r0l, r0h, r1l, r1h, xq, K, KCH, s_ptr, stride_sn, GROUP_SIZE: gl.constexpr, P: gl.constexpr):
    """The asm's other operands for chunk ch: x's address (the lane's first pair), the pairs left
    in the row, the rows' scale addresses (pair 1's: P = 2, else pair 0's again)."""
    pk = ch * 64 + t_
    if GROUP_SIZE == 0:
        grp = ch * 0
    else:
        grp = (gl.minimum(ch, KCH - 1) * 128) // GROUP_SIZE
    s0l = _scale_ptr(s_ptr, r0l, stride_sn, grp)
    s0h = _scale_ptr(s_ptr, r0h, stride_sn, grp)
    if P == 2:
        s1l = _scale_ptr(s_ptr, r1l, stride_sn, grp)
        s1h = _scale_ptr(s_ptr, r1h, stride_sn, grp)
    else:
        s1l = s0l
        s1h = s0h
    return (xq + pk).to(gl.int64, bitcast=True), K // 2 - pk, s0l, s0h, s1l, s1h


@gluon.jit
def _product(q, ch, t_, r0l, r0h, r1l, r1h, xq, K, KCH, s_ptr, stride_sn, za, acc0, acc1, acc2, acc3, acc4, acc5,
             acc6, acc7, GROUP_SIZE: gl.constexpr, P: gl.constexpr, ASM: gl.constexpr, ASM_CONSTRAINTS: gl.constexpr,
             NOCOMP: gl.constexpr):
    """One stage's chunk per warp into the accumulators with the shipped asm (NOCOMP: an xor of
    the words instead, a bound with wrong outputs)."""
    xa, rem, s0l, s0h, s1l, s1h = _addresses(ch, t_, r0l, r0h, r1l, r1h, xq, K, KCH, s_ptr, stride_sn, GROUP_SIZE, P)
    a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3 = _pieces(q, P)
    if NOCOMP:
        acc0 += (a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1 ^ b2 ^ b3).to(gl.float32)
    elif P == 1:
        acc0, acc1, acc2, acc3 = gl.inline_asm_elementwise(
            ASM, ASM_CONSTRAINTS, [a0, a1, a2, a3, b0, b1, b2, b3, xa, s0l, s0h, za, rem, acc0, acc1, acc2, acc3],
            dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    else:
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = gl.inline_asm_elementwise(
            ASM, ASM_CONSTRAINTS,
            [a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3, xa, s0l, s0h, s1l, s1h, za, rem,
             acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7],
            dtype=(gl.float32,) * 8, is_pure=True, pack=1)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@gluon.jit
def _store(acc, rows, t_, N, y_ptr, ws_ptr, pid_k, SPLIT_K: gl.constexpr):
    """Column 0 (lanes t = 0) of a (CW, 8, 4) accumulator, summed over the CW chunk slots."""
    out = gl.sum(acc, axis=0)
    rr = gl.max(rows, axis=0)
    mask = (gl.max(t_, axis=0) == 0) & (rr < N)
    if SPLIT_K == 1:
        gl.store(y_ptr + rr, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        gl.store(ws_ptr + pid_k * N + rr, out, mask=mask)


@gluon.jit
def _store_all(acc0, acc2, acc4, acc6, n0l, n0h, n1l, n1h, t_, N, y_ptr, ws_ptr, pid_k, P: gl.constexpr,
               SPLIT_K: gl.constexpr):
    _store(acc0, n0l, t_, N, y_ptr, ws_ptr, pid_k, SPLIT_K)
    _store(acc2, n0h, t_, N, y_ptr, ws_ptr, pid_k, SPLIT_K)
    if P == 2:
        _store(acc4, n1l, t_, N, y_ptr, ws_ptr, pid_k, SPLIT_K)
        _store(acc6, n1h, t_, N, y_ptr, ws_ptr, pid_k, SPLIT_K)


@gluon.jit
def _stages(KCH, CW: gl.constexpr, SPLIT_K: gl.constexpr):
    """This program's first stage and stage count (stages of CW chunks, split-K over them)."""
    total = gl.cdiv(KCH, CW)
    per = gl.cdiv(total, SPLIT_K)
    first = gl.program_id(1) * per
    return first, gl.minimum(per, total - first)


@gluon.jit
def _issue(w_desc, words, ready, pid_n, j, s, CW: gl.constexpr, ROWS: gl.constexpr):
    """Stage j's words (one box of CW chunks x ROWS rows) into slot s."""
    mbarrier.expect(ready.index(s), CW * ROWS * 64)
    _tma_load(w_desc, [j * CW, pid_n * ROWS, 0], ready.index(s), words.index(s))


@gluon.jit
def _ring(STAGES: gl.constexpr, CW: gl.constexpr, ROWS: gl.constexpr, W_SMEM: gl.constexpr,
          EMPTY: gl.constexpr = False):
    """The words' ring and its 'ready' mbarriers; EMPTY: also the 'empty' ones a separate producer
    waits on (the ring forms refill after a CTA barrier instead)."""
    words = gl.allocate_shared_memory(gl.int32, [STAGES, CW, ROWS, 16], W_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    if EMPTY:
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(empty.index(i), count=1)
        return words, ready, empty
    return words, ready, ready


@gluon.jit
def _setup(x_ptr, s_ptr, z_ptr, pid_n, N, P: gl.constexpr, CW: gl.constexpr, WL: gl.constexpr):
    """What every form needs before its K loop: _lanes, the wrapped rows, x as int32 pairs, the
    zero-point address offset and a zero accumulator in the operands' layout."""
    w_, t_, n0l, n0h, n1l, n1h = _lanes(pid_n, N, P, CW, WL)
    L3: gl.constexpr = w_.type.layout
    za = gl.zeros((CW, 8, 4), gl.int64, layout=L3) + (z_ptr.to(gl.int64, bitcast=True) - s_ptr.to(gl.int64, bitcast=True))
    return (w_, t_, n0l, n0h, n1l, n1h, _wrap(n0l, N), _wrap(n0h, N), _wrap(n1l, N), _wrap(n1h, N),
            x_ptr.to(gl.pointer_type(gl.int32)), za, gl.zeros((CW, 8, 4), gl.float32, layout=L3))


@gluon.jit
def _take(words, ready, j, STAGES: gl.constexpr, WL: gl.constexpr):
    """Stage j's slot, once its words have landed, and the words in the fragment order."""
    s = j % STAGES
    mbarrier.wait(ready.index(s), (j // STAGES) & 1)
    return s, words.index(s).load(WL)


@gluon.jit
def _producer(w_desc, words, ready, empty, pid_n, first, n, CW: gl.constexpr, ROWS: gl.constexpr,
              STAGES: gl.constexpr):
    for j in range(n):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        _issue(w_desc, words, ready, pid_n, first + j, s, CW, ROWS)


@gluon.jit
def _consumer(x_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, N, K, KCH, stride_sn, words, ready, empty, pid_n, first, n,
              GROUP_SIZE: gl.constexpr, SPLIT_K: gl.constexpr, ASM: gl.constexpr, ASM_CONSTRAINTS: gl.constexpr,
              P: gl.constexpr, CW: gl.constexpr, STAGES: gl.constexpr, WL: gl.constexpr):
    w_, t_, n0l, n0h, n1l, n1h, r0l, r0h, r1l, r1h, xq, za, acc0 = _setup(x_ptr, s_ptr, z_ptr, pid_n, N, P, CW, WL)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    for j in range(n):
        s, q = _take(words, ready, j, STAGES, WL)
        mbarrier.arrive(empty.index(s), count=1)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _product(
            q, (first + j) * CW + w_, t_, r0l, r0h, r1l, r1h, xq, K, KCH, s_ptr, stride_sn, za, acc0, acc1, acc2,
            acc3, acc4, acc5, acc6, acc7, GROUP_SIZE, P, ASM, ASM_CONSTRAINTS, False)
    _store_all(acc0, acc2, acc4, acc6, n0l, n0h, n1l, n1h, t_, N, y_ptr, ws_ptr, gl.program_id(1), P, SPLIT_K)


@gluon.jit
def gemv_ws_kernel(x_ptr, w_desc, s_ptr, z_ptr, y_ptr, ws_ptr, N, K, KCH, stride_sn, GROUP_SIZE: gl.constexpr,
                   SPLIT_K: gl.constexpr, ASM: gl.constexpr, ASM_CONSTRAINTS: gl.constexpr, P: gl.constexpr,
                   CW: gl.constexpr, STAGES: gl.constexpr, WL: gl.constexpr, W_SMEM: gl.constexpr):
    """Form 'w': a one-warp TMA producer, CW consumer warps (the kernel's num_warps)."""
    pid_n = gl.program_id(0)
    first, n = _stages(KCH, CW, SPLIT_K)
    words, ready, empty = _ring(STAGES, CW, 16 * P, W_SMEM, True)
    gl.warp_specialize([
        (_consumer, (x_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, N, K, KCH, stride_sn, words, ready, empty, pid_n, first, n,
                     GROUP_SIZE, SPLIT_K, ASM, ASM_CONSTRAINTS, P, CW, STAGES, WL)),
        (_producer, (w_desc, words, ready, empty, pid_n, first, n, CW, 16 * P, STAGES)),
    ], [1], [PRODUCER_REGS])


@gluon.jit
def _filled_ring(w_desc, pid_n, KCH, SPLIT_K: gl.constexpr, CW: gl.constexpr, ROWS: gl.constexpr,
                 STAGES: gl.constexpr, W_SMEM: gl.constexpr):
    """The ring forms' start: the stages, the ring, its first STAGES stages in flight."""
    first, n = _stages(KCH, CW, SPLIT_K)
    words, ready, _ = _ring(STAGES, CW, ROWS, W_SMEM)
    for i in gl.static_range(STAGES):
        if i < n:
            _issue(w_desc, words, ready, pid_n, first + i, i, CW, ROWS)
    return first, n, words, ready


@gluon.jit
def gemv_ring_kernel(x_ptr, w_desc, s_ptr, z_ptr, y_ptr, ws_ptr, N, K, KCH, stride_sn, GROUP_SIZE: gl.constexpr,
                     SPLIT_K: gl.constexpr, ASM: gl.constexpr, ASM_CONSTRAINTS: gl.constexpr, P: gl.constexpr,
                     CW: gl.constexpr, STAGES: gl.constexpr, WL: gl.constexpr, W_SMEM: gl.constexpr,
                     NOCOMP: gl.constexpr):
    """Form 'r': the CTA refills its own ring (one barrier per stage after every warp read its
    words); NOCOMP: the bound without arithmetic."""
    ROWS: gl.constexpr = 16 * P
    pid_n = gl.program_id(0)
    first, n, words, ready = _filled_ring(w_desc, pid_n, KCH, SPLIT_K, CW, ROWS, STAGES, W_SMEM)
    w_, t_, n0l, n0h, n1l, n1h, r0l, r0h, r1l, r1h, xq, za, acc0 = _setup(x_ptr, s_ptr, z_ptr, pid_n, N, P, CW, WL)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    for j in range(n):
        sl, q = _take(words, ready, j, STAGES, WL)
        _barrier()  # every warp holds its words of slot sl: refill it
        if j + STAGES < n:
            _issue(w_desc, words, ready, pid_n, first + j + STAGES, sl, CW, ROWS)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _product(
            q, (first + j) * CW + w_, t_, r0l, r0h, r1l, r1h, xq, K, KCH, s_ptr, stride_sn, za, acc0, acc1, acc2,
            acc3, acc4, acc5, acc6, acc7, GROUP_SIZE, P, ASM, ASM_CONSTRAINTS, NOCOMP)
    _store_all(acc0, acc2, acc4, acc6, n0l, n0h, n1l, n1h, t_, N, y_ptr, ws_ptr, gl.program_id(1), P, SPLIT_K)


@lru_cache(maxsize=None)
def xreg_asm(bf16: bool, zeros: bool, pairs: int, scale_acc: bool = True, strip: bool = False):
    """The shipped GEMV asm with x from 16 register operands appended after the accumulators
    instead of its own loads. strip: without the zero-point subtractions and the high nibbles'
    fma (4 of 9 instructions per word; wrong outputs, a bound)."""
    text = _gemv_mma_asm(bf16, zeros, True, pairs, scale_acc)
    first = 4 * pairs + 8 * pairs + 1 + 2 * pairs + 1 + 1 + 4 * pairs  # the shipped operands
    text, n = re.subn(r"ld\.global\.nc\.b32 x(\d+), \[\$\d+ \+ \d+\];",
                      lambda m: f"mov.b32 x{m.group(1)}, ${first + int(m.group(1))};", text)
    assert n == 16, n
    if strip:
        text = "\n".join(ln for ln in text.split("\n")
                         if not (ln.startswith("sub.rn.") or (ln.startswith("fma.rn.") and "k16" in ln)))
    return text, _gemv_constraints(pairs) + ",r" * 16


@gluon.jit
def _xload(xq, pk, KH, EVEN: gl.constexpr):
    """x pairs pk + 4i (i = 0..15) of each lane; 0 past the row's KH pairs unless EVEN."""
    p = xq + pk
    if EVEN:
        return (gl.load(p), gl.load(p + 4), gl.load(p + 8), gl.load(p + 12), gl.load(p + 16), gl.load(p + 20),
                gl.load(p + 24), gl.load(p + 28), gl.load(p + 32), gl.load(p + 36), gl.load(p + 40), gl.load(p + 44),
                gl.load(p + 48), gl.load(p + 52), gl.load(p + 56), gl.load(p + 60))
    return (gl.load(p, mask=pk < KH, other=0), gl.load(p + 4, mask=pk + 4 < KH, other=0),
            gl.load(p + 8, mask=pk + 8 < KH, other=0), gl.load(p + 12, mask=pk + 12 < KH, other=0),
            gl.load(p + 16, mask=pk + 16 < KH, other=0), gl.load(p + 20, mask=pk + 20 < KH, other=0),
            gl.load(p + 24, mask=pk + 24 < KH, other=0), gl.load(p + 28, mask=pk + 28 < KH, other=0),
            gl.load(p + 32, mask=pk + 32 < KH, other=0), gl.load(p + 36, mask=pk + 36 < KH, other=0),
            gl.load(p + 40, mask=pk + 40 < KH, other=0), gl.load(p + 44, mask=pk + 44 < KH, other=0),
            gl.load(p + 48, mask=pk + 48 < KH, other=0), gl.load(p + 52, mask=pk + 52 < KH, other=0),
            gl.load(p + 56, mask=pk + 56 < KH, other=0), gl.load(p + 60, mask=pk + 60 < KH, other=0))


@gluon.jit
def gemv_ringx_kernel(x_ptr, w_desc, s_ptr, z_ptr, y_ptr, ws_ptr, N, K, KCH, stride_sn, GROUP_SIZE: gl.constexpr,
                      SPLIT_K: gl.constexpr, ASM: gl.constexpr, ASM_CONSTRAINTS: gl.constexpr, P: gl.constexpr,
                      CW: gl.constexpr, STAGES: gl.constexpr, WL: gl.constexpr, W_SMEM: gl.constexpr,
                      EVEN: gl.constexpr):
    """Form 'x': the ring with x one stage ahead in registers (ASM: xreg_asm)."""
    ROWS: gl.constexpr = 16 * P
    pid_n = gl.program_id(0)
    first, n, words, ready = _filled_ring(w_desc, pid_n, KCH, SPLIT_K, CW, ROWS, STAGES, W_SMEM)
    w_, t_, n0l, n0h, n1l, n1h, r0l, r0h, r1l, r1h, xq, za, acc0 = _setup(x_ptr, s_ptr, z_ptr, pid_n, N, P, CW, WL)
    KH = K // 2
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _xload(xq, (first * CW + w_) * 64 + t_, KH,
                                                                                  EVEN)
    for j in range(n):
        ch = (first + j) * CW + w_
        pk = ch * 64 + t_
        pn = pk + CW * 64
        if EVEN:  # (the last stage reads its own x again: in bounds)
            pn = gl.where(j + 1 < n, pn, pk)
        y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _xload(xq, pn, KH, EVEN)
        sl, q = _take(words, ready, j, STAGES, WL)
        _barrier()
        if j + STAGES < n:
            _issue(w_desc, words, ready, pid_n, first + j + STAGES, sl, CW, ROWS)
        xa, rem, s0l, s0h, s1l, s1h = _addresses(ch, t_, r0l, r0h, r1l, r1h, xq, K, KCH, s_ptr, stride_sn,
                                                 GROUP_SIZE, P)
        a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3 = _pieces(q, P)
        if P == 1:
            acc0, acc1, acc2, acc3 = gl.inline_asm_elementwise(
                ASM, ASM_CONSTRAINTS, [a0, a1, a2, a3, b0, b1, b2, b3, xa, s0l, s0h, za, rem, acc0, acc1, acc2, acc3,
                                       x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15],
                dtype=(gl.float32,) * 4, is_pure=True, pack=1)
        else:
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = gl.inline_asm_elementwise(
                ASM, ASM_CONSTRAINTS,
                [a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3, xa, s0l, s0h, s1l, s1h, za, rem,
                 acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                 x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15],
                dtype=(gl.float32,) * 8, is_pure=True, pack=1)
        x0, x1, x2, x3, x4, x5, x6, x7 = y0, y1, y2, y3, y4, y5, y6, y7
        x8, x9, x10, x11, x12, x13, x14, x15 = y8, y9, y10, y11, y12, y13, y14, y15
    _store_all(acc0, acc2, acc4, acc6, n0l, n0h, n1l, n1h, t_, N, y_ptr, ws_ptr, gl.program_id(1), P, SPLIT_K)


KERNELS = {"w": gemv_ws_kernel, "r": gemv_ring_kernel, "x": gemv_ringx_kernel}


def _meta(form, P, CW, STAGES, group_size, bf16, zeros, even, split_k, nocomp=False, strip=False, scale_acc=True):
    asm, cons = (xreg_asm(bf16, zeros, P, scale_acc, strip) if form == "x"
                 else gemv_asm(bf16, zeros, even, P, scale_acc))
    meta = dict(GROUP_SIZE=0 if group_size == -1 else group_size, SPLIT_K=split_k, ASM=asm, ASM_CONSTRAINTS=cons,
                P=P, CW=CW, STAGES=STAGES, **layouts(CW, P))
    if form == "r":
        meta["NOCOMP"] = nocomp
    if form == "x":
        meta["EVEN"] = even
    return meta


def launch(form, x, qweight, scales, zeros, in_features, group_size, P=1, CW=4, STAGES=4, split_k=1, maxnreg=48,
           y=None, ws=None, nocomp=False, strip=False):
    """y (1, N) for x (1, K), K even and a multiple of 128 for form 'x' unmasked."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    N, K, KCH = qweight.shape[0], in_features, qweight.shape[1] // 16
    qv = qweight.view(N, KCH, 16).permute(1, 0, 2)  # (chunk, row, word): one box per stage
    desc = TensorDescriptor(qv, list(qv.shape), list(qv.stride()), [CW, 16 * P, 16], layouts(CW, P)["W_SMEM"])
    y = torch.empty(1, N, dtype=x.dtype, device=x.device) if y is None else y
    if split_k > 1 and ws is None:
        ws = torch.empty(split_k, N, dtype=torch.float32, device=x.device)
    meta = _meta(form, P, CW, STAGES, group_size, x.dtype == torch.bfloat16, zeros is not None,
                 K % (128 * CW) == 0, split_k, nocomp, strip)
    KERNELS[form][(triton.cdiv(N, 16 * P), split_k)](
        x, desc, scales, scales if zeros is None else zeros, y, ws if split_k > 1 else None, N, K, KCH,
        scales.stride(0), num_warps=CW, maxnreg=maxnreg, **meta)
    return ws.sum(0, keepdim=True).to(x.dtype) if split_k > 1 else y  # (probe: a torch reduce)


def compile_sm90(form, P=1, CW=4, STAGES=4, group_size=128, dtype="fp16", has_zeros=False, split_k=1, even_k=True,
                 maxnreg=48):
    """triton.compile for sm_90a without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    ty = "*fp16" if dtype == "fp16" else "*bf16"
    meta = _meta(form, P, CW, STAGES, group_size, dtype == "bf16", has_zeros, even_k, split_k)
    sig = {"x_ptr": ty, "w_desc": f"tensordesc<i32[{CW},{16 * P},16],{meta['W_SMEM']!r}>", "s_ptr": ty, "z_ptr": ty,
           "y_ptr": ty, "ws_ptr": "*fp32" if split_k > 1 else "constexpr", "N": "i32", "K": "i32", "KCH": "i32",
           "stride_sn": "i32"}
    consts = dict(meta)
    if split_k == 1:
        consts["ws_ptr"] = None
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("x_ptr", "s_ptr", "z_ptr", "y_ptr", "N", "K")}
    src = GluonASTSource(fn=KERNELS[form], signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": CW, "maxnreg": maxnreg})


SHAPES = [(4096, 4096), (4096, 6144), (4096, 28672), (14336, 4096), (8192, 8192), (8192, 10240), (28672, 8192),
          (8192, 57344)]
FORMATS = {"g128": (torch.float16, 128, True), "chan": (torch.float16, -1, True),
           "bf16asym": (torch.bfloat16, 128, False)}
TILES = "w1/4/4/1/48,w1/8/4/1/48,w2/4/4/1/48,r1/4/4/1,r1/8/4/1,r2/8/3/1/64,x1/4/4/1/64,x2/4/4/1/96"


def _copies(K, N, dt, gs, sym):
    from sailfish import QuantLinear
    from sailfish.bench.timing import copies_needed

    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=False, dtype=dt, device="cuda")
    layer = QuantLinear.from_linear(lin, group_size=gs, sym=sym)
    r = copies_needed(layer.qweight.numel() * 4 + layer.scales.numel() * 2)
    return [layer] + [copy.deepcopy(layer) for _ in range(r - 1)]


def _ab(fmts, shapes, tiles):
    from sailfish.bench.timing import graph_time_us

    for f in fmts:
        dt, gs, sym = FORMATS[f]
        for K, N in shapes:
            ls = _copies(K, N, dt, gs, sym)
            x = torch.randn(1, K, dtype=dt, device="cuda")
            with torch.no_grad():
                y_ship = ls[0](x)
                ship = graph_time_us([lambda layer=layer: layer(x) for layer in ls])
            ref = x.float() @ ls[0].dequantize().float().t()
            top = ref.abs().max().item()
            res = []
            for tile in tiles:
                form, parts = tile[0], [int(v) for v in tile[1:].split("/")]
                P, CW, ST, SK = parts[:4]
                kw = dict(P=P, CW=CW, STAGES=ST, split_k=SK, maxnreg=parts[4] if len(parts) > 4 else 48)
                ys = [torch.empty(1, N, dtype=dt, device="cuda") for _ in ls]
                call = (lambda i, kw=kw, form=form, ys=ys:
                        launch(form, x, ls[i].qweight, ls[i].scales, ls[i].zeros, K, gs, y=ys[i], **kw))
                y = call(0)
                err = (y.float() - ref).abs().max().item() / top
                t = graph_time_us([lambda i=i: call(i) for i in range(len(ls))])
                res.append((t, f"{tile}:{t:.2f}us err {err:.1e}{' =' if torch.equal(y, y_ship) else ''}"))
            best = min(res)[0]
            err0 = (y_ship.float() - ref).abs().max().item() / top
            print(f"{f} {K}x{N} shipped {ship:.2f} us (err {err0:.1e}), shipped / best {ship / best:.3f} | "
                  + "  ".join(r[1] for r in res), flush=True)


@triton.jit
def _flat_reader(p, out, n_vec, VEC: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Reads n_vec vectors of VEC int32, one contiguous range per program (as v24's reader)."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK, VEC), tl.int32)
    per = tl.cdiv(n_vec, tl.num_programs(0) * BLOCK * UNROLL) * BLOCK * UNROLL
    start = pid * per
    offs = tl.arange(0, BLOCK)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    for i in range(start, tl.minimum(start + per, n_vec), BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            o = (i + u * BLOCK) * VEC + offs
            acc ^= tl.load(p + o, mask=o < n_vec * VEC, other=0, eviction_policy="evict_first")
    tl.store(out + pid * BLOCK * VEC + offs, acc)


def _bound(shapes):
    """fp16 g128: the shipped path, the ring with and without its arithmetic, the ring + x asm
    with and without its subtractions, and the flat reader of the same words."""
    from sailfish.bench.timing import graph_time_us

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sink = torch.empty(sms * 8 * 512 * 4, dtype=torch.int32, device="cuda")
    for K, N in shapes:
        ls = _copies(K, N, torch.float16, 128, True)
        x = torch.randn(1, K, dtype=torch.float16, device="cuda")
        with torch.no_grad():
            out = {"shipped": graph_time_us([lambda layer=layer: layer(x) for layer in ls])}
        ys = [torch.empty(1, N, dtype=torch.float16, device="cuda") for _ in ls]
        for tag, form, kw in [("ring", "r", {}), ("ring_no_arith", "r", dict(nocomp=True)),
                              ("ring+x", "x", dict(maxnreg=64)), ("ring+x_no_sub", "x", dict(maxnreg=64, strip=True))]:
            f = (lambda i, form=form, kw=kw:
                 launch(form, x, ls[i].qweight, ls[i].scales, None, K, 128, P=1, CW=4, STAGES=4, y=ys[i], **kw))
            f(0)
            out[tag] = graph_time_us([lambda i=i: f(i) for i in range(len(ls))])
        n_vec = ls[0].qweight.numel() // 4
        f = lambda i: _flat_reader[(4 * sms,)](ls[i].qweight, sink, n_vec, VEC=4, BLOCK=256, UNROLL=4, num_warps=8)
        f(0)
        out["flat_reader"] = graph_time_us([lambda i=i: f(i) for i in range(len(ls))])
        print(f"{K}x{N} " + "  ".join(f"{k} {v:.2f}" for k, v in out.items()), flush=True)


def _compile():
    from sailfish.tools.ptx import ptxas_report

    for form, kw in [("w", dict(P=1, CW=8)), ("w", dict(P=2, CW=4)), ("r", dict(P=1, CW=4)), ("r", dict(P=1, CW=8)),
                     ("r", dict(P=1, CW=4, dtype="bf16", has_zeros=True)), ("x", dict(P=1, CW=4, maxnreg=64)),
                     ("x", dict(P=2, CW=4, maxnreg=96)), ("x", dict(P=1, CW=4, maxnreg=64, even_k=False, split_k=2))]:
        k = compile_sm90(form, **kw)
        rep = ptxas_report(k.asm["ptx"])
        print(form, kw, "registers", re.findall(r"Used (\d+) registers", rep), "spill bytes",
              re.findall(r"(\d+) bytes spill stores", rep), "shared", k.metadata.shared, flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "compile"
    arg = sys.argv[2:] + [None, None, None]

    def shapes_of(a):
        return [tuple(int(v) for v in s.split("x")) for s in a.split(",")] if a else SHAPES

    if mode == "compile":
        _compile()
    elif mode == "ab":
        _ab((arg[0] or "g128").split(","), shapes_of(arg[1]), (arg[2] or TILES).split(","))
    elif mode == "bound":
        _bound(shapes_of(arg[0]))
    else:
        raise SystemExit(f"mode must be compile, ab or bound, got {mode!r}")
