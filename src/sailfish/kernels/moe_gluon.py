"""The grouped W4A16 MoE GEMMs on Hopper in Gluon: the dense pipe kernel's K loop
(kernels/w4a16_gluon.pipe_mainloop: warp-specialized, x by TMA from a producer warp, each
128-channel chunk dequantized while the previous chunk's wgmmas run) over the routing's blocks
(ops/moe.align_routing), one launch per GEMM. Hopper (sm_90a) and Triton's Gluon only: a
"moe_gluon" config runs its portable Triton twin (kernels/moe._moe_w4a16_kernel, ops/moe.py
gluon_twin) everywhere else, the CPU interpreter included.

Why (docs/perf_log.md v47): at M >= 1024 Mixtral's GEMMs are compute-bound and the Triton kernel,
which feeds wgmma one dequantized K tile at a time, ran 470 TFLOP/s against the bf16 grouped
baseline's 516; the dense pipe kernel ran 530-570 on the same expert shapes (H100, same run).

TMA reads x tiles of contiguous rows, so both GEMMs take their input in routing order (one row
per place of sorted_slots, num_blocks * BLOCK_M rows, padding places included):
- gate_up reads xs, x's rows gathered by the op (xs[p] = x[token of sorted_slots[p]], padding:
  token 0), and writes h in the same order (every place of a used block: padding rows hold a
  finite product, so the down GEMM never reads uninitialized memory); its 64 weight rows per
  consumer warpgroup interleave gate and up rows (_expert_rows) so that a thread holds column c's
  gate and up sums in two registers of the accumulator, and silu(gate) * up is formed there
  (_gated_store: fp32, rounded once, as the Triton kernel's epilogue);
- down reads h by TMA and writes each place's row, times its slot's routing weight (fp32, rounded
  once), to the slot's row of the (T, H) slot rows: kernels/moe._topk_sum_kernel then adds a
  token's top-k rows in the fixed order, as after the Triton kernel.
The group scale goes on the weights (rounded once to x's dtype) and per channel on the product,
as in the dense pipe kernel; the values are the Triton twin's up to the K summation order.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gluon_common import CHUNK, PIPE_CONSUMER_REGS, PIPE_PRODUCER_REGS, STEP_C, WG_ROWS, pipe_copy, pipe_rings
from .w4a16_gluon import pipe_mainloop, pipe_meta, row_words

GATE_COLS = gl.constexpr(32)  # output columns per consumer warpgroup of gate_up (64 weight rows: gate and up)


@gluon.jit
def _moe_program(bexp_ptr, num_blocks, N, K, GATED: gl.constexpr, GROUP_B: gl.constexpr):
    """(block, N tile, expert, K steps) of the program: GROUP_B blocks in a row take every N tile
    before the next GROUP_B blocks start (their xs / h rows stay in L2 while the weight tiles pass;
    blocks of one expert are adjacent, so its weight tile is read about once per group). A block
    past the routing's last one (expert -1) has no K steps."""
    cols: gl.constexpr = 2 * GATE_COLS if GATED else 2 * WG_ROWS
    pid = gl.program_id(0)
    width = GROUP_B * gl.cdiv(N, cols)
    b0 = pid // width * GROUP_B
    size = gl.minimum(num_blocks - b0, GROUP_B)
    b = b0 + (pid % width) % size
    pid_n = (pid % width) // size
    e = gl.load(bexp_ptr + b)
    return b, pid_n, e, gl.where(e >= 0, gl.cdiv(K, STEP_C), 0)


@gluon.jit
def _expert_rows(ptr, pn, N, stride, GATED: gl.constexpr, LAYOUT: gl.constexpr):
    """One pointer per accumulator row r of consumer tile pn (64 rows, LAYOUT's rows) into a
    (rows, ...) matrix of one expert. Down: rows pn * 64 + r (past N: mod N). GATED (N = I, the
    matrix holds gate rows [0, I) then up rows [I, 2I)): r = 16a + 8h + j is column c = pn * 32 +
    8a + j, its gate row (h = 0) or up row (h = 1): in wgmma's accumulator rows r and r + 8 of a
    16-row slice sit in one thread."""
    r = gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, LAYOUT))
    if GATED:
        col = pn * GATE_COLS + 8 * (r // 16) + r % 8
        row = col % N + N * ((r // 8) % 2)
    else:
        row = (pn * WG_ROWS + r) % N
    return ptr + row.to(gl.int64) * stride


@gluon.jit
def _gate_split(v):
    """(64, BLOCK_M) in the gated row order (_expert_rows) -> its gate and up halves, (32, BLOCK_M)
    each, row c the column pn * 32 + c (register moves only: the halves sit in one thread)."""
    v = gl.reshape(v, (4, 2, 8, v.shape[1]))  # (a, h, j, m)
    v = gl.permute(v, (0, 2, 3, 1))  # (a, j, m, h)
    g, u = gl.split(v)
    return gl.reshape(g, (GATE_COLS, v.shape[2])), gl.reshape(u, (GATE_COLS, v.shape[2]))


@gluon.jit
def _gated_store(acc, y_ptr, b, pn, N, stride_ym, BLOCK_M: gl.constexpr, MMA: gl.constexpr):
    """h = silu(gate) * up (fp32, rounded once to y's dtype) of block b's BLOCK_M places (rows
    b * BLOCK_M + m of y, every place) and the warpgroup's 32 columns."""
    r = gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, MMA))
    m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    col = pn * GATE_COLS + 8 * (r // 16) + r % 8
    cols = gl.broadcast(col[:, None], m[None, :])[0]
    off = (b * BLOCK_M + m).to(gl.int64)[None, :] * stride_ym + cols.to(gl.int64)
    g, u = _gate_split(acc)
    off, _ = _gate_split(off)
    cols, _ = _gate_split(cols)
    h = g / (1.0 + gl.exp(-g)) * u
    gl.store(y_ptr + off, h.to(y_ptr.dtype.element_ty), mask=cols < N)


@gluon.jit
def _down_store(acc, y_ptr, sorted_ptr, tw_ptr, b, pn, T, N, stride_ym, BLOCK_M: gl.constexpr, MMA: gl.constexpr):
    """Block b's rows times their slot's routing weight tw[slot] (fp32, rounded once) to the slot
    rows y[slot] (padding places dropped), the warpgroup's 64 columns."""
    slots = gl.load(sorted_ptr + b * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA)))
    valid = slots < T
    slot = gl.where(valid, slots, 0).to(gl.int64)
    wt = gl.load(tw_ptr + slot, mask=valid, other=0.0)
    on = pn * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, MMA))
    ptrs = y_ptr + slot[None, :] * stride_ym + on.to(gl.int64)[:, None]
    gl.store(ptrs, (acc * wt[None, :]).to(y_ptr.dtype.element_ty), mask=valid[None, :] & (on < N)[:, None])


@gluon.jit
def _moe_consumer(qw_ptr, s_ptr, z_ptr, bexp_ptr, sorted_ptr, tw_ptr, y_ptr, T, N, K, num_blocks, stride_ym,
                  stride_qe, stride_qn, stride_se, stride_sn, x0_buf, x1_buf, ready0, ready1, empty0, empty1,
                  HALF: gl.constexpr, GATED: gl.constexpr, GROUP_CHUNKS: gl.constexpr, HAS_ZEROS: gl.constexpr,
                  GROUP_B: gl.constexpr, BLOCK_M: gl.constexpr, S0: gl.constexpr, S1: gl.constexpr,
                  MMA: gl.constexpr, WORDS: gl.constexpr, DOT_A: gl.constexpr, DT: gl.constexpr,
                  HALF_LAST: gl.constexpr):
    """One consumer warpgroup of moe_w4a16_gluon_kernel: its 64 weight rows of the program's
    expert (gate_up: 32 columns' gate and up rows), every K step, and the store."""
    b, pid_n, e, n = _moe_program(bexp_ptr, num_blocks, N, K, GATED, GROUP_B)
    if e >= 0:
        pn = 2 * pid_n + HALF
        e64 = e.to(gl.int64)
        s_e = s_ptr + e64 * stride_se
        w_rows = row_words(_expert_rows(qw_ptr + e64 * stride_qe, pn, N, stride_qn, GATED, WORDS), 0, WORDS)
        s_base = _expert_rows(s_e, pn, N, stride_sn, GATED, WORDS)
        z_base = _expert_rows(z_ptr + e64 * stride_se, pn, N, stride_sn, GATED, WORDS)
        acc = pipe_mainloop(w_rows, s_base, z_base, 0, n, x0_buf, x1_buf, ready0, ready1, empty0, empty1,
                            GROUP_CHUNKS, HAS_ZEROS, BLOCK_M, S0, S1, MMA, DOT_A, DT, HALF_LAST)
        if GROUP_CHUNKS == 0:
            acc = acc * gl.load(_expert_rows(s_e, pn, N, stride_sn, GATED, MMA)).to(gl.float32)[:, None]
        if GATED:
            _gated_store(acc, y_ptr, b, pn, N, stride_ym, BLOCK_M, MMA)
        else:
            _down_store(acc, y_ptr, sorted_ptr, tw_ptr, b, pn, T, N, stride_ym, BLOCK_M, MMA)


@gluon.jit
def _moe_loader(x_desc, bexp_ptr, num_blocks, N, K, x0_buf, x1_buf, ready0, ready1, empty0, empty1,
                GATED: gl.constexpr, GROUP_B: gl.constexpr, BLOCK_M: gl.constexpr, S0: gl.constexpr,
                S1: gl.constexpr):
    """The producer warp: the program's block of x rows (routing order), every K step."""
    b, pid_n, e, n = _moe_program(bexp_ptr, num_blocks, N, K, GATED, GROUP_B)
    pipe_copy(x_desc, b * BLOCK_M, 0, n, x0_buf, x1_buf, ready0, ready1, empty0, empty1, S0, S1)


@gluon.jit
def moe_w4a16_gluon_kernel(x_desc, qw_ptr, s_ptr, z_ptr, bexp_ptr, sorted_ptr, tw_ptr, y_ptr, T, N, K, num_blocks,
                           stride_ym, stride_qe, stride_qn, stride_se, stride_sn, GATED: gl.constexpr,
                           GROUP_CHUNKS: gl.constexpr, HAS_ZEROS: gl.constexpr, GROUP_B: gl.constexpr,
                           BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr, WORDS: gl.constexpr,
                           DOT_A: gl.constexpr, X_SMEM: gl.constexpr, HALF_LAST: gl.constexpr = False):
    """One GEMM of the MoE block over every block of the routing (module docstring). x_desc: the
    input in routing order (num_blocks * BLOCK_M rows: xs, or h), block (BLOCK_M, 128). qw_ptr /
    s_ptr / z_ptr: the stacked experts (E, rows, Kp // 8) / (E, rows, groups), K = Kp, whole
    128-channel chunks; HALF_LAST: an odd number of them (DeepSeek-V2-Lite's 1408 = 11 x 128), the
    last 256-channel step half past K (kernels/w4a16_gluon._pipe_words). bexp_ptr / sorted_ptr: the
    routing's block_expert / sorted_slots (T slots). GATED: N = I, y = h (num_blocks * BLOCK_M, I); else N = H, y the slot rows (T, H)
    and tw_ptr the slots' routing weights (fp32, T). Grid: num_blocks * cdiv(N, 64 if GATED else
    128) programs, each two consumer warpgroups and a TMA producer warp (the dense pipe kernel's
    launch: w4a16_gluon.pipe_meta)."""
    DT: gl.constexpr = y_ptr.dtype.element_ty
    S1: gl.constexpr = STAGES + 1
    x0_buf, x1_buf, ready0, ready1, empty0, empty1 = pipe_rings(DT, BLOCK_M, STAGES, X_SMEM)
    gl.warp_specialize([
        (_moe_consumer, (qw_ptr, s_ptr, z_ptr, bexp_ptr, sorted_ptr, tw_ptr, y_ptr, T, N, K, num_blocks, stride_ym,
                         stride_qe, stride_qn, stride_se, stride_sn, x0_buf, x1_buf, ready0, ready1, empty0, empty1,
                         0, GATED, GROUP_CHUNKS, HAS_ZEROS, GROUP_B, BLOCK_M, STAGES, S1, MMA, WORDS, DOT_A, DT,
                         HALF_LAST)),
        (_moe_consumer, (qw_ptr, s_ptr, z_ptr, bexp_ptr, sorted_ptr, tw_ptr, y_ptr, T, N, K, num_blocks, stride_ym,
                         stride_qe, stride_qn, stride_se, stride_sn, x0_buf, x1_buf, ready0, ready1, empty0, empty1,
                         1, GATED, GROUP_CHUNKS, HAS_ZEROS, GROUP_B, BLOCK_M, STAGES, S1, MMA, WORDS, DOT_A, DT,
                         HALF_LAST)),
        (_moe_loader, (x_desc, bexp_ptr, num_blocks, N, K, x0_buf, x1_buf, ready0, ready1, empty0, empty1, GATED,
                       GROUP_B, BLOCK_M, STAGES, S1)),
    ], [4, 1], [PIPE_CONSUMER_REGS, PIPE_PRODUCER_REGS])


def compile_moe_sm90(gated: bool = True, BLOCK_M: int = 128, STAGES: int = 3, group_size: int = 128,
                     dtype: str = "bf16", has_zeros: bool = False, GROUP_B: int = 8, half_last: bool = False):
    """triton.compile of moe_w4a16_gluon_kernel for sm_90a without a GPU (PTX checks, tests).
    Needs a process in which the Triton interpreter has not run (it patches the frontend)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    meta = pipe_meta(BLOCK_M)
    options = {"num_warps": meta.pop("num_warps"), "maxnreg": meta.pop("maxnreg")}
    ty = "*fp16" if dtype == "fp16" else "*bf16"
    sig = {"x_desc": f"tensordesc<{dtype}[{BLOCK_M},{CHUNK}],{meta['X_SMEM']!r}>", "qw_ptr": "*i32", "s_ptr": ty,
           "z_ptr": ty, "bexp_ptr": "*i32", "sorted_ptr": "*i32", "tw_ptr": "*fp32", "y_ptr": ty, "T": "i32",
           "N": "i32", "K": "i32", "num_blocks": "i32", "stride_ym": "i32", "stride_qe": "i32", "stride_qn": "i32",
           "stride_se": "i32", "stride_sn": "i32"}
    consts = dict(GATED=gated, GROUP_CHUNKS=0 if group_size == -1 else group_size // CHUNK, HAS_ZEROS=has_zeros,
                  GROUP_B=GROUP_B, BLOCK_M=BLOCK_M, STAGES=STAGES, **meta, HALF_LAST=half_last)
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    aligned = ("qw_ptr", "s_ptr", "z_ptr", "bexp_ptr", "sorted_ptr", "tw_ptr", "y_ptr", "N", "K", "stride_ym",
               "stride_qe", "stride_qn")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn=moe_w4a16_gluon_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
