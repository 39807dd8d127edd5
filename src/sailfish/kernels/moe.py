"""Grouped W4A16 mixture-of-experts kernels (ops/moe.py launches them).

A MoE block routes each token m to TOPK experts; the M * TOPK (token, k) pairs are the
"slots" t = m * TOPK + k. SHARED > 0 (DeepSeek's shared experts, run as experts of the routed
width that every token takes with weight 1): a token has KS = TOPK + SHARED slots t = m * KS + k,
slot k < TOPK its routed expert ids[m * TOPK + k], slot TOPK + j the shared expert E + j (the
shared experts stacked after the E routed ones; `_slot_expert`, `_slot_weight`), so both GEMMs,
the routing and the top-k sum treat them as any other slot (T = M * KS slots in all).
ops/moe.align_routing sorts the slots by expert and pads every expert's run to whole BLOCK_M
blocks (`sorted_slots`, sentinel T for padding) and
gives each block its expert (`block_expert`, -1 past the last used block). One launch of
`_moe_w4a16_kernel` then computes every (block, N tile[, K split]) program of one GEMM from the
stacked 4-bit experts (formats/experts.PackedExperts), with the dense kernel's tile machinery:
the fragment-order words are dequantized in registers (kernels/w4a16._tile_operands) and the
transposed tile y^T = W x^T goes through tl.dot ("swap AB": the weight is the left operand,
the few rows of a block the MMA's N dimension).

- GATED (gate_up): the program reads the gate rows [n0, n0 + BLOCK_N) and the matching up
  rows I + n0 .. of its expert's (2I, H) weight and writes h = silu(gate) * up for its slots
  (fp32 epilogue, one rounding to the activation dtype); x rows are gathered by token
  (slot // TOPK).
- not GATED (down): x is h, one row per slot; the epilogue multiplies by the slot's routing
  weight (fp32) and writes the per-slot row, rounded once; `_topk_sum_kernel` then adds a
  token's TOPK rows in the fixed order k = 0, 1, ... in fp32 (no atomics: deterministic).
- SPLIT_K > 1 (decode: few slots, long K): fp32 partial sums to a workspace (SPLIT_K, T, N),
  summed in a fixed order by `_gated_reduce_kernel` (silu * up after the sum) or
  `_topk_sum_kernel` (routing weight after the sum).
- FUSED (config kernel "moe_fused", decode): those sums inside the GEMM's launch, by the last
  program to finish, found with int32 counters (the dense W4A8 split-K "fixup",
  kernels/w4a8._add_slices; zero between launches, one buffer per stream: ops/w4a8.sync_buffer).
  gate_up: the last K split of each (block, N tile) sums the tile's SPLIT_K partials and applies
  silu * up (`_gated_sum`); down: the last of all num_blocks * SPLIT_K programs of an N tile does
  the top-k sum of every token over that tile (`_topk_sum`). The same helpers, the same fixed
  orders and roundings as the separate kernels: the same bits, two launches fewer. The counters
  only pick which program sums; no atomic touches a value.
- ROUTE (decode, few slots): every program computes its own block's expert and slots from the
  expert ids with the routing kernels' arithmetic (`_route_block`): no routing launch at all.
- HAS_PERM (act-order experts, GPTQ desc_act): x (h) is gathered along K through the expert's
  permutation of its input channels (formats/experts.py); without it the kernels compile as
  before (the same sm_90a PTX instructions).
Rows of padding read slot 0 (unmasked loads) and are dropped at the store; K tiles past K
are masked on x (the weight codes there are 0 with scale 0).
"""
import triton
import triton.language as tl

from .common import SYNC_TILES, arrive_last, cast_out, grouped_tile, pdl_release, pdl_wait, split_k_range
from .w4a16 import _acc_dot, _gemv_mma_loop, _gemv_rows, _load_groups, _tile_operands


@triton.jit
def _slot_expert(ids_ptr, slot, mask, E, TOPK: tl.constexpr, SHARED: tl.constexpr):
    """The expert of slot(s) `slot` (int64) of the block (module docstring): -1 where mask is off
    or the routed id lies outside [0, E) (transformers passes E for a slot no local expert takes),
    E + j for shared slot TOPK + j."""
    if SHARED == 0:
        eid = tl.load(ids_ptr + slot, mask=mask, other=-1)
        return tl.where((eid >= 0) & (eid < E), eid.to(tl.int32), -1)  # (compared before the cast)
    else:
        k = slot % (TOPK + SHARED)
        routed = k < TOPK
        eid = tl.load(ids_ptr + slot // (TOPK + SHARED) * TOPK + k, mask=mask & routed, other=-1)
        eid = tl.where((eid >= 0) & (eid < E), eid.to(tl.int32), -1)
        return tl.where(routed, eid, tl.where(mask, E + (k - TOPK).to(tl.int32), -1))


@triton.jit
def _slot_weight(tw_ptr, slot, mask, TOPK: tl.constexpr, SHARED: tl.constexpr):
    """The routing weight (fp32) of slot(s) `slot`: tw[m * TOPK + k] for a routed slot, 1 for a
    shared one (0 where mask is off)."""
    if SHARED == 0:
        return tl.load(tw_ptr + slot, mask=mask, other=0.0)
    else:
        k = slot % (TOPK + SHARED)
        routed = k < TOPK
        w = tl.load(tw_ptr + slot // (TOPK + SHARED) * TOPK + k, mask=mask & routed, other=0.0)
        return tl.where(routed, w, tl.where(mask, 1.0, 0.0))


@triton.jit
def _dot_tile(acc, w_ptrs, xt, s_e, z_e, rn, k0, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, DTYPE: tl.constexpr, EMU_BF16: tl.constexpr,
              USE_ASM: tl.constexpr, ACC_FENCE: tl.constexpr, SCALE_ACC: tl.constexpr = False):
    """acc (BLOCK_N, BLOCK_M) += W[rn, k0 : k0 + BLOCK_K] @ xt: w_ptrs (BLOCK_N, BLOCK_K // 8) the
    tile's packed words, xt (BLOCK_K, BLOCK_M) its x, s_e / z_e the expert's scales and zero
    points. ACC_FENCE: the dense kernel's guard against Triton < 3.9 leaving wgmmas in flight
    across the loop's back edge (kernels/w4a16._w4a16_kernel). SCALE_ACC (the dense kernel's, one
    group per K tile: BLOCK_K divides GROUP_SIZE, or per channel): the tile dequantized to q - z
    only and the group scale multiplies the fp32 product (per channel: the caller scales the
    accumulator after the loop), a multiply per output element instead of per weight."""
    words = tl.load(w_ptrs, eviction_policy="evict_first")
    sv = _load_groups(s_e, rn, k0, stride_sn, BLOCK_K, GROUP_SIZE)
    zv = _load_groups(z_e, rn, k0, stride_sn, BLOCK_K, GROUP_SIZE)
    w, xt = _tile_operands(words, xt, sv, zv, s_e, z_e, s_e, rn, k0, stride_sn, BLOCK_N, BLOCK_K,
                           GROUP_SIZE, HAS_ZEROS, False, DTYPE, EMU_BF16, USE_ASM, not SCALE_ACC)
    return _acc_dot(acc, w, xt, sv, SCALE_ACC and GROUP_SIZE != 0, ACC_FENCE)


@triton.jit
def _gated_sum(ws_ptr, t, n, mask, T, N, SPLIT_K: tl.constexpr, UNROLL: tl.constexpr):
    """silu(g) * u in fp32, g = sum_s ws[s, t, n], u = sum_s ws[s, t, N + n] in the fixed order
    s = 0, 1, ...; ws (SPLIT_K, T, 2N) fp32; t, n, mask: int64 index tensors of one shape.
    UNROLL: the loop unrolled (the reduce kernel: every load in flight at once), else a loop (the
    fused GEMM, whose registers are allocated for its peak: unrolled, the Qwen3 M = 1 down tile
    took 180 instead of 140 registers; sm_90a compile, docs/perf_log.md v42). Either way the same
    sum. (.cg: the fused path reads other programs' partials, which L1 may hold stale.)"""
    src = t * (2 * N) + n
    g = tl.zeros(src.shape, dtype=tl.float32)
    u = tl.zeros(src.shape, dtype=tl.float32)
    for s in tl.range(0, SPLIT_K, num_stages=1, loop_unroll_factor=SPLIT_K if UNROLL else 1):
        g += tl.load(ws_ptr + s * 2 * T * N + src, mask=mask, other=0.0, cache_modifier=".cg")
        u += tl.load(ws_ptr + s * 2 * T * N + src + N, mask=mask, other=0.0, cache_modifier=".cg")
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _topk_sum(src_ptr, ids_ptr, tw_ptr, m, n, mask, M, N, E, TOPK: tl.constexpr, SPLIT_K: tl.constexpr,
              WEIGHTED: tl.constexpr, UNROLL: tl.constexpr, SHARED: tl.constexpr = 0):
    """sum_k c_k * sum_s src[s, m * KS + k, n] in fp32, in the fixed order k = 0, 1, ..., KS - 1
    (and s = 0, 1, ...), KS = TOPK + SHARED: _topk_sum_kernel's value (see there); m, n int64
    index tensors that broadcast to mask's shape. UNROLL: as _gated_sum's."""
    KS: tl.constexpr = TOPK + SHARED
    acc = tl.zeros(mask.shape, dtype=tl.float32)
    for k in tl.range(0, KS, num_stages=1, loop_unroll_factor=KS if UNROLL else 1):
        row = m * KS + k
        live = mask & (_slot_expert(ids_ptr, row, mask, E, TOPK, SHARED) >= 0)
        part = tl.zeros(mask.shape, dtype=tl.float32)
        for s in tl.range(0, SPLIT_K, num_stages=1, loop_unroll_factor=SPLIT_K if UNROLL else 1):
            part += tl.load(src_ptr + (s * M * KS + row) * N + n, mask=live, other=0.0,
                            cache_modifier=".cg").to(tl.float32)
        if WEIGHTED:
            acc += part
        else:
            acc += part * _slot_weight(tw_ptr, row, mask, TOPK, SHARED)
    return acc


@triton.jit
def _topk_tile(y_ptr, ws_ptr, ids_ptr, tw_ptr, out_ptr, on, T, N, E, TOPK: tl.constexpr, SPLIT_K: tl.constexpr,
               BLOCK_M: tl.constexpr, DTYPE: tl.constexpr, EMU_BF16: tl.constexpr, SHARED: tl.constexpr = 0):
    """The down GEMM's fused top-k sum over one N tile (columns on, (BLOCK_N, 1) int64), by the
    tile's last program: every token's out row from its slot rows (y: weighted, rounded; or the
    fp32 split-K partials in ws), BLOCK_M tokens at a time (_topk_sum)."""
    M = T // (TOPK + SHARED)
    src = y_ptr if SPLIT_K == 1 else ws_ptr
    nmask = on < N
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M).to(tl.int64)[None, :]
        tmask = nmask & (m < M)
        v = _topk_sum(src, ids_ptr, tw_ptr, m, on, tmask, M, N, E, TOPK, SPLIT_K, SPLIT_K == 1, False, SHARED)
        tl.store(out_ptr + m * N + on, cast_out(v, DTYPE, EMU_BF16), mask=tmask)


@triton.jit
def _moe_w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, sorted_ptr, bexp_ptr, tw_ptr, y_ptr, ws_ptr, ids_ptr, out_ptr, sync_ptr, perm_ptr,
    T, N, K, E, num_blocks, stride_xm, stride_ym, stride_qe, stride_qn, stride_se, stride_sn,
    TOPK: tl.constexpr, GATED: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr,
    EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, EMU_BF16: tl.constexpr, USE_ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACC_FENCE: tl.constexpr = False, FUSED: tl.constexpr = False, ROUTE: tl.constexpr = False,
    E_POW2: tl.constexpr = 16, T_POW2: tl.constexpr = 16, PDL_EARLY: tl.constexpr = False,
    PDL: tl.constexpr = False, HAS_PERM: tl.constexpr = False, SHARED: tl.constexpr = 0,
    SCALE_ACC: tl.constexpr = False,
):
    """One GEMM of a MoE block over all experts (module docstring): E routed experts (SHARED shared
    ones stacked after them), T = M * (TOPK + SHARED) slots. N: output columns (GATED:
    I, the weight has 2I rows); K: input channels (x / h row length). qweight (E, N_w, Kp // 8),
    scales / zeros (E, N_w, Gp) with equal strides. y: GATED h (T, I), else the weighted slot
    rows (T, N); ws: (SPLIT_K, T, N_w) fp32 when SPLIT_K > 1.
    FUSED (module docstring): sync_ptr the counters; GATED (with SPLIT_K > 1) writes h itself;
    not GATED, y_ptr / ws_ptr hold the slot rows / partial sums as above, ids_ptr the (M, TOPK)
    expert ids, and the block's output (M = T / TOPK, N) goes to out_ptr (contiguous).
    ROUTE: the program computes its block's expert and slots from the ids (ids_ptr; _route_block,
    T <= T_POW2, E <= E_POW2) instead of reading the routing kernels' sorted_ptr / bexp_ptr.
    PDL_EARLY (gate_up) / PDL (down, launched as its programmatic dependent; kernels/common.py):
    the down GEMM's programs launch while gate_up's last wave runs, route themselves and set up,
    and wait for h (and for the counters to be back at zero) before their K loop.
    Grid: (num_blocks * cdiv(N, BLOCK_N), SPLIT_K), GROUP_M blocks in a row sharing each weight
    tile while it is in L2 (blocks of one expert are adjacent).
    HAS_PERM (act-order experts): perm_ptr int32 (E, K), each expert's permutation of its input
    channels (the weight's K rows were sorted by group, formats/experts.py): the x tile is
    gathered through it, A[slot, k] = x[row(slot), perm_e[k]]; else perm_ptr is unread (None)."""
    pdl_release(PDL_EARLY)
    DTYPE = x_ptr.dtype.element_ty
    TOPK_SUM: tl.constexpr = FUSED and not GATED
    pid_b, pid_n = grouped_tile(tl.program_id(0), num_blocks * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    if ROUTE:
        e, slots = _route_block(ids_ptr, pid_b, T, E, BLOCK_M, E_POW2, T_POW2, TOPK, SHARED)
    else:
        e = tl.load(bexp_ptr + pid_b)
    if not TOPK_SUM:
        if e < 0:  # a block past the routing's last one (the grid is sized for the worst case)
            return
    # (TOPK_SUM: such a block still counts in at its N tile's counter, with no K tiles and no rows)
    if not ROUTE:
        slots = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < T
    slot = tl.where(valid, slots, 0).to(tl.int64)
    rows = slot // (TOPK + SHARED) if GATED else slot  # x rows: tokens (gate_up) or slots (down: h)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = (offs_n % N).to(tl.int64)
    kt0, kt1 = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    if TOPK_SUM:
        kt1 = tl.where(e < 0, kt0, kt1)
    e64 = tl.maximum(e, 0).to(tl.int64)
    s_e = s_ptr + e64 * stride_se
    z_e = z_ptr + e64 * stride_se
    wq = qw_ptr + e64 * stride_qe + (kt0 * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8))[None, :]
    x_ptrs = x_ptr + rows[None, :] * stride_xm + (kt0 * BLOCK_K + tl.arange(0, BLOCK_K))[:, None]
    w_ptrs = wq + rn[:, None] * stride_qn
    u_ptrs = wq + (rn + N)[:, None] * stride_qn  # GATED: the up rows I + n of the same expert
    offs_k = tl.arange(0, BLOCK_K)
    if HAS_PERM:  # act-order: x's channels of a K tile through the expert's permutation
        x_rows = x_ptr + rows[None, :] * stride_xm
        p_ptrs = perm_ptr + e64 * K + kt0 * BLOCK_K + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if GATED:
        up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    pdl_wait(PDL)  # (every program that reads h or counts in: the e < 0 ones above read nothing)
    # one K loop for both tiles of a gated program: x is loaded once per K tile
    for kt in range(kt0, kt1):
        k0 = kt * BLOCK_K
        if HAS_PERM:
            if EVEN_K:
                xt = tl.load(x_rows + tl.load(p_ptrs)[:, None])
            else:
                kin = (k0 + offs_k) < K
                xt = tl.load(x_rows + tl.load(p_ptrs, mask=kin, other=0)[:, None], mask=kin[:, None], other=0.0)
            p_ptrs += BLOCK_K
        elif EVEN_K:
            xt = tl.load(x_ptrs)
        else:
            xt = tl.load(x_ptrs, mask=(k0 + offs_k)[:, None] < K, other=0.0)
        acc = _dot_tile(acc, w_ptrs, xt, s_e, z_e, rn, k0, stride_sn, BLOCK_N, BLOCK_K, GROUP_SIZE, HAS_ZEROS,
                        DTYPE, EMU_BF16, USE_ASM, ACC_FENCE, SCALE_ACC)
        if GATED:
            up = _dot_tile(up, u_ptrs, xt, s_e, z_e, rn + N, k0, stride_sn, BLOCK_N, BLOCK_K, GROUP_SIZE,
                           HAS_ZEROS, DTYPE, EMU_BF16, USE_ASM, ACC_FENCE, SCALE_ACC)
        w_ptrs += BLOCK_K // 8
        u_ptrs += BLOCK_K // 8
        x_ptrs += BLOCK_K
    if SCALE_ACC and GROUP_SIZE == 0:  # per channel: the scale once, after the K loop
        acc *= tl.load(s_e + rn * stride_sn).to(tl.float32)[:, None]
        if GATED:
            up *= tl.load(s_e + (rn + N) * stride_sn).to(tl.float32)[:, None]
    om = slot[None, :]
    on = offs_n.to(tl.int64)[:, None]
    mask = valid[None, :] & (on < N)
    if GATED:
        if SPLIT_K == 1:
            h = acc / (1.0 + tl.exp(-acc)) * up  # silu(gate) * up in fp32, rounded once
            tl.store(y_ptr + om * stride_ym + on, cast_out(h, DTYPE, EMU_BF16), mask=mask)
        else:
            base = ws_ptr + (pid_k * T + om) * (2 * N) + on
            tl.store(base, acc, mask=mask)
            tl.store(base + N, up, mask=mask)
            if FUSED:  # the tile's last K split sums the splits (as _gated_reduce_kernel)
                if arrive_last(sync_ptr + SYNC_TILES + tl.program_id(0), SPLIT_K):
                    h = _gated_sum(ws_ptr, om, on, mask, T, N, SPLIT_K, False)
                    tl.store(y_ptr + om * stride_ym + on, cast_out(h, DTYPE, EMU_BF16), mask=mask)
    else:
        if SPLIT_K == 1:
            wt = _slot_weight(tw_ptr, slot, valid, TOPK, SHARED)  # the slot's routing weight (fp32)
            tl.store(y_ptr + om * stride_ym + on, cast_out(acc * wt[None, :], DTYPE, EMU_BF16), mask=mask)
        else:
            tl.store(ws_ptr + (pid_k * T + om) * N + on, acc, mask=mask)
        if TOPK_SUM:  # the N tile's last program adds the top-k rows of every token (as _topk_sum_kernel)
            if arrive_last(sync_ptr + SYNC_TILES + pid_n, num_blocks * SPLIT_K):
                _topk_tile(y_ptr, ws_ptr, ids_ptr, tw_ptr, out_ptr, on, T, N, E, TOPK, SPLIT_K, BLOCK_M, DTYPE,
                           EMU_BF16, SHARED)


# ----------------------------------------------------------------------------------
# Decode with about one slot per expert: a GEMV per slot on the tensor cores
# ----------------------------------------------------------------------------------
# At M = 1-4 of a many-expert model each routed expert gets one slot, so a BLOCK_M 16 tl.dot tile
# is 1/16 used and the weights pass through the tl.dot dequantization; the dense M = 1 path
# (kernels/w4a16._w4a16_gemv_mma_kernel: mma.sync straight from the packed words) is the fastest
# W4A16 code there is. `_moe_gemv_kernel` runs its K loop (_gemv_mma_loop) for one slot per
# program, on the slot's expert: no routing at all (the ids give the expert), no padding.
@triton.jit
def _gemv_slot_rows(pid_n, N, P: tl.constexpr, PAIR: tl.constexpr, HI: tl.constexpr, BLOCK_N: tl.constexpr,
                    GATED: tl.constexpr):
    """(weight rows, output columns) of _gemv_rows' entries (PAIR, HI), (RB * 8,) each. GATED: a
    program holds BLOCK_N // 2 output columns, their gate rows at HI 0 and up rows (N + column) at
    HI 1, so one lane ends with a column's gate and up sums; else BLOCK_N columns, rows = columns.
    Rows wrapped into the weight (columns past N are dropped at the store)."""
    r = _gemv_rows(0, P, PAIR, HI, BLOCK_N)  # the program's local rows
    if GATED:
        col = pid_n * (BLOCK_N // 2) + 8 * (r // 16) + r % 8
        return col % N + HI * N, col
    else:
        col = pid_n * BLOCK_N + r
        return col % N, col


@triton.jit
def _slot_sum(acc, C: tl.constexpr):
    """A (V, 4) accumulator of a one-row GEMV summed over its C chunk slots: (RB * 8, 4), the
    product in lane t = 0 (kernels/w4a16._gemv_store's M = 1 case)."""
    return tl.sum(tl.reshape(acc, (C, acc.shape[0] // C, 4)), axis=0)


@triton.jit
def _gated_store(g, u, col, slot, t, T, N, y_ptr, ws_ptr, pid_k, SPLIT_K: tl.constexpr, EMU_BF16: tl.constexpr,
                 DTYPE: tl.constexpr):
    """A gated GEMV's (RB * 8, 4) gate and up sums of columns col: h = silu(g) * u (fp32, rounded
    once) to y[slot], or with split-K the partials to ws (SPLIT_K, T, 2N) as _gated_sum reads them."""
    c = col.to(tl.int64)[:, None] + (t * 0)[None, :]  # ((RB * 8, 4): the accumulators' shape)
    mask = (t == 0)[None, :] & (c < N)
    if SPLIT_K == 1:
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(y_ptr + slot * N + c, cast_out(h, DTYPE, EMU_BF16), mask=mask)
    else:
        base = ws_ptr + (pid_k * T + slot) * (2 * N) + c
        tl.store(base, g, mask=mask)
        tl.store(base + N, u, mask=mask)


@triton.jit
def _down_store(acc, col, slot, wt, t, T, N, y_ptr, ws_ptr, pid_k, SPLIT_K: tl.constexpr, EMU_BF16: tl.constexpr,
                DTYPE: tl.constexpr):
    """A down GEMV's (RB * 8, 4) sums of columns col: the slot's row times its routing weight wt,
    rounded once, to y (T, N), or with split-K the fp32 partial to ws (SPLIT_K, T, N)."""
    c = col.to(tl.int64)[:, None] + (t * 0)[None, :]  # ((RB * 8, 4): the accumulators' shape)
    mask = (t == 0)[None, :] & (c < N)
    if SPLIT_K == 1:
        tl.store(y_ptr + slot * N + c, cast_out(acc * wt, DTYPE, EMU_BF16), mask=mask)
    else:
        tl.store(ws_ptr + (pid_k * T + slot) * N + c, acc, mask=mask)


@triton.jit
def _moe_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, ids_ptr, tw_ptr, y_ptr, ws_ptr, out_ptr, sync_ptr,
    T, N, K, E, stride_xm, stride_qe, stride_qn, stride_se, stride_sn,
    TOPK: tl.constexpr, GATED: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr,
    EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, EMU_BF16: tl.constexpr, USE_ASM: tl.constexpr,
    ASM: tl.constexpr, ASM_CONSTRAINTS: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SCALE_ACC: tl.constexpr = False, RING: tl.constexpr = 1,
    PDL_EARLY: tl.constexpr = False, PDL: tl.constexpr = False, SHARED: tl.constexpr = 0,
):
    """One GEMM of a MoE block as one GEMV per slot (the comment above); T = M * (TOPK + SHARED)
    slots (module docstring: the shared experts). Grid (T, N tiles,
    SPLIT_K): program (slot, pid_n, pid_k); slot-major, so the slots of one N tile run side by side
    (two slots of one expert read its tile once from HBM). Expert e = _slot_expert's; a routed id
    outside [0, E) computes nothing.
    - GATED (gate_up; N = I, the weight (E, 2I, Kp // 8)): BLOCK_N // 2 columns of h = silu(gate) *
      up for the slot, x row slot // TOPK; SPLIT_K > 1: fp32 partials to ws (SPLIT_K, T, 2I), and
      the (slot, N tile)'s last split sums them (_gated_sum; counters sync_ptr, SYNC_TILES +
      slot * N tiles + pid_n).
    - down (N = H): x is h, row slot; the slot's row times its routing weight tw[slot] to y (T, H)
      (or fp32 partials to ws), and the N tile's last of its T * SPLIT_K programs adds every token's
      top-k rows in the fixed order to out (M, H) (_topk_tile, counter SYNC_TILES + pid_n).
    The values are kernel "moe_fused"'s (ops/moe.py's numerics) up to the K summation order.
    ASM, ASM_CONSTRAINTS, PREFETCH, RING, SCALE_ACC: kernels/w4a16._w4a16_gemv_mma_kernel's."""
    pdl_release(PDL_EARLY)
    DTYPE = x_ptr.dtype.element_ty
    slot = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    e = _slot_expert(ids_ptr, slot, slot >= 0, E, TOPK, SHARED).to(tl.int64)
    live = e >= 0
    if GATED:
        if not live:  # (h's row is never read: the down GEMM skips the slot too)
            return
    P: tl.constexpr = 2 if BLOCK_N >= 32 else 1
    C: tl.constexpr = BLOCK_K // 128
    t = tl.arange(0, 4)
    r0l, c0 = _gemv_slot_rows(pid_n, N, P, 0, 0, BLOCK_N, GATED)
    r0h, c0h = _gemv_slot_rows(pid_n, N, P, 0, 1, BLOCK_N, GATED)
    r1l, c1 = _gemv_slot_rows(pid_n, N, P, P - 1, 0, BLOCK_N, GATED)  # (pair 1 if P == 2)
    r1h, c1h = _gemv_slot_rows(pid_n, N, P, P - 1, 1, BLOCK_N, GATED)
    kt0, kt1 = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
    e = tl.maximum(e, 0)
    pdl_wait(PDL)  # (down: h, and the counters back at zero)
    if live:
        row = slot // (TOPK + SHARED) if GATED else slot
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _gemv_mma_loop(
            x_ptr + row * stride_xm, qw_ptr + e * stride_qe, s_ptr + e * stride_se, z_ptr + e * stride_se,
            r0l, r0h, r1l, r1h, kt0, kt1, 1, K, stride_xm, stride_qn, stride_sn, GROUP_SIZE, HAS_ZEROS, EVEN_K,
            EMU_BF16, USE_ASM, ASM, ASM_CONSTRAINTS, PREFETCH, 1, BLOCK_N, BLOCK_K, SCALE_ACC, RING)
        # (one row: the I = 1 accumulators acc1, acc3, acc5, acc7 hold nothing)
        if GATED:
            _gated_store(_slot_sum(acc0, C), _slot_sum(acc2, C), c0, slot, t, T, N, y_ptr, ws_ptr, pid_k, SPLIT_K,
                         EMU_BF16, DTYPE)
            if P == 2:
                _gated_store(_slot_sum(acc4, C), _slot_sum(acc6, C), c1, slot, t, T, N, y_ptr, ws_ptr, pid_k,
                             SPLIT_K, EMU_BF16, DTYPE)
        else:
            wt = _slot_weight(tw_ptr, slot, slot >= 0, TOPK, SHARED)  # the slot's routing weight (fp32)
            _down_store(_slot_sum(acc0, C), c0, slot, wt, t, T, N, y_ptr, ws_ptr, pid_k, SPLIT_K, EMU_BF16, DTYPE)
            _down_store(_slot_sum(acc2, C), c0h, slot, wt, t, T, N, y_ptr, ws_ptr, pid_k, SPLIT_K, EMU_BF16, DTYPE)
            if P == 2:
                _down_store(_slot_sum(acc4, C), c1, slot, wt, t, T, N, y_ptr, ws_ptr, pid_k, SPLIT_K, EMU_BF16,
                            DTYPE)
                _down_store(_slot_sum(acc6, C), c1h, slot, wt, t, T, N, y_ptr, ws_ptr, pid_k, SPLIT_K, EMU_BF16,
                            DTYPE)
    if GATED:
        if SPLIT_K > 1:  # the (slot, N tile)'s last split: h from the partials
            if arrive_last(sync_ptr + SYNC_TILES + slot * tl.num_programs(1) + pid_n, SPLIT_K):
                n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2).to(tl.int64)
                mask = n < N
                h = _gated_sum(ws_ptr, slot + n * 0, n, mask, T, N, SPLIT_K, False)
                tl.store(y_ptr + slot * N + n, cast_out(h, DTYPE, EMU_BF16), mask=mask)
    else:  # every program counts in (dead slots too): the N tile's last does the top-k sum
        if arrive_last(sync_ptr + SYNC_TILES + pid_n, T * SPLIT_K):
            on = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]
            _topk_tile(y_ptr, ws_ptr, ids_ptr, tw_ptr, out_ptr, on, T, N, E, TOPK, SPLIT_K, 16, DTYPE, EMU_BF16,
                       SHARED)


@triton.jit
def _gated_reduce_kernel(ws_ptr, h_ptr, T, N, SPLIT_K: tl.constexpr, EMU_BF16: tl.constexpr,
                         BLOCK: tl.constexpr):
    """h[t, n] = silu(g) * u, g = sum_s ws[s, t, n], u = sum_s ws[s, t, N + n], each sum in
    the fixed order s = 0, 1, ... (_gated_sum); ws (SPLIT_K, T, 2N) fp32, h (T, N) contiguous."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < (offs * 0 + T) * N
    h = _gated_sum(ws_ptr, offs // N, offs % N, mask, T, N, SPLIT_K, True)
    tl.store(h_ptr + offs, cast_out(h, h_ptr.dtype.element_ty, EMU_BF16), mask=mask)


@triton.jit
def _topk_sum_kernel(src_ptr, ids_ptr, tw_ptr, y_ptr, M, N, E, TOPK: tl.constexpr, SPLIT_K: tl.constexpr,
                     WEIGHTED: tl.constexpr, EMU_BF16: tl.constexpr, BLOCK: tl.constexpr, SHARED: tl.constexpr = 0):
    """y[m, n] = sum_k c_k * sum_s src[s, m * KS + k, n], in the fixed order k = 0, 1, ...
    (and s = 0, 1, ...) in fp32, rounded once to y's dtype (_topk_sum). src (SPLIT_K, M * KS, N),
    KS = TOPK + SHARED: the down GEMM's slot rows, already weighted (WEIGHTED: c_k = 1) or fp32
    partial sums (c_k = the slot's routing weight, _slot_weight). Slots whose id (ids, (M * TOPK,))
    is outside [0, E) were not computed: their rows are skipped. y (M, N) contiguous."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < (offs * 0 + M) * N
    acc = _topk_sum(src_ptr, ids_ptr, tw_ptr, offs // N, offs % N, mask, M, N, E, TOPK, SPLIT_K, WEIGHTED, True,
                    SHARED)
    tl.store(y_ptr + offs, cast_out(acc, y_ptr.dtype.element_ty, EMU_BF16), mask=mask)


# ----------------------------------------------------------------------------------
# Routing prep in two launches (ops/moe.align_routing is the PyTorch twin): ~30 small torch
# kernels would cost a decode step more than the experts' GEMMs (a launch is ~2-3 us even in a
# CUDA graph, the Qwen3-30B-A3B block at its HBM limit ~6 us). Chunk c of BLOCK_T slots is
# program c of both kernels; integer counts and fixed ranks: deterministic.
# ----------------------------------------------------------------------------------
@triton.jit
def _onehot(ids_ptr, t0, T, E, E_POW2: tl.constexpr, BLOCK_T: tl.constexpr, TOPK: tl.constexpr = 1,
            SHARED: tl.constexpr = 0):
    """(slots (BLOCK_T,), live (BLOCK_T,), onehot int32 (BLOCK_T, E_POW2)) of the chunk at t0:
    live = a real slot with an expert (_slot_expert: routed ids in [0, E), the shared E + j)."""
    offs = t0 + tl.arange(0, BLOCK_T)
    ids = _slot_expert(ids_ptr, offs.to(tl.int64), offs < T, E, TOPK, SHARED)
    live = ids >= 0
    return offs, live, (ids[:, None] == tl.arange(0, E_POW2)[None, :]).to(tl.int32)


@triton.jit
def _placement(onehot, counts, before, BLOCK_M: tl.constexpr):
    """(ends (E_POW2,), dest (BLOCK_T,)): ends the inclusive prefix sum of the experts' counts
    padded to whole BLOCK_M blocks (expert e's run is [ends[e] - padded[e], ends[e])), dest each
    slot's place: its expert's run start + `before` (its expert's slots in earlier chunks) + its
    rank among its expert's slots in the chunk."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    rank = tl.sum((tl.cumsum(onehot, 0) - 1) * onehot, axis=1)  # earlier slots of its expert in the chunk
    return ends, tl.sum(onehot * (ends - padded + before)[None, :], axis=1) + rank


@triton.jit
def _block_expert(ends, b, E, BLOCK_M: tl.constexpr):
    """The expert of block(s) b: the experts whose run ends at or before the block's start (-1
    past the last used block)."""
    e_of = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    return tl.where(e_of < E, e_of, -1)


@triton.jit
def _route_block(ids_ptr, b, T, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, T_POW2: tl.constexpr,
                 TOPK: tl.constexpr = 1, SHARED: tl.constexpr = 0):
    """(expert, slots (BLOCK_M,) int64) of block b of the routing, computed from the T <= T_POW2
    expert ids in one chunk: what the routing kernels would have written for it (block_expert[b]
    and sorted_slots[b * BLOCK_M:][:BLOCK_M], padding T), by their arithmetic (ROUTE: decode's
    GEMMs route themselves, ops/moe.py ROUTE_TILE)."""
    offs, live, onehot = _onehot(ids_ptr, 0, T, E, E_POW2, T_POW2, TOPK, SHARED)
    counts = tl.sum(onehot, axis=0)
    ends, dest = _placement(onehot, counts, counts * 0, BLOCK_M)
    e = tl.sum(_block_expert(ends, b + tl.arange(0, 1), E + SHARED, BLOCK_M), axis=0)
    pos = b * BLOCK_M + tl.arange(0, BLOCK_M)
    match = (dest[:, None] == pos[None, :]) & live[:, None]  # at most one slot per place
    found = tl.max(match.to(tl.int32), axis=0) > 0
    slots = tl.where(found, tl.sum(tl.where(match, offs[:, None], 0), axis=0), T)
    return e, slots


@triton.jit
def _route_count_kernel(ids_ptr, hist_ptr, sorted_ptr, T, E, S, E_POW2: tl.constexpr, BLOCK_T: tl.constexpr,
                        TOPK: tl.constexpr = 1, SHARED: tl.constexpr = 0):
    """hist[c, e] = the slots of chunk c routed to expert e; and sorted_slots (S entries) filled
    with the padding value T, a slice per program (the placing kernel runs after this one)."""
    c = tl.program_id(0)
    _, _, onehot = _onehot(ids_ptr, c * BLOCK_T, T, E, E_POW2, BLOCK_T, TOPK, SHARED)
    tl.store(hist_ptr + c * E_POW2 + tl.arange(0, E_POW2), tl.sum(onehot, axis=0))
    per = tl.cdiv(S, tl.num_programs(0))
    for s0 in range(c * per, tl.minimum(S, (c + 1) * per), BLOCK_T):
        offs = s0 + tl.arange(0, BLOCK_T)
        tl.store(sorted_ptr + offs, offs * 0 + T, mask=offs < tl.minimum(S, (c + 1) * per))


@triton.jit
def _route_place_kernel(ids_ptr, hist_ptr, sorted_ptr, bexp_ptr, T, E, NB, BLOCK_M: tl.constexpr,
                        E_POW2: tl.constexpr, BLOCK_T: tl.constexpr, ONE_CHUNK: tl.constexpr = False,
                        TOPK: tl.constexpr = 1, SHARED: tl.constexpr = 0):
    """Place chunk c's slots: slot t of expert e goes to starts[e] + (slots of e before it), starts
    the exclusive prefix sum of the experts' counts padded to whole BLOCK_M blocks; and the experts
    of the blocks b = c, c + chunks, ... (-1 past the last used block).
    ONE_CHUNK (all slots in one chunk: decode): one program does the counting kernel's work too
    (no hist; sorted_slots filled with T first, a CTA barrier before the placing): one launch less."""
    c = tl.program_id(0)
    chunks = tl.num_programs(0)
    e_idx = tl.arange(0, E_POW2)
    offs, live, onehot = _onehot(ids_ptr, c * BLOCK_T, T, E, E_POW2, BLOCK_T, TOPK, SHARED)
    if ONE_CHUNK:
        counts = tl.sum(onehot, axis=0)
        before = counts * 0
        for s0 in range(0, NB * BLOCK_M, BLOCK_T):
            so = s0 + tl.arange(0, BLOCK_T)
            tl.store(sorted_ptr + so, so * 0 + T, mask=so < NB * BLOCK_M)
        tl.debug_barrier()  # (the fill and the placing below may touch one address from two threads)
    else:
        counts = tl.zeros((E_POW2,), tl.int32)
        before = tl.zeros((E_POW2,), tl.int32)  # slots of each expert in chunks < c
        for j in range(0, chunks):
            h = tl.load(hist_ptr + j * E_POW2 + e_idx)
            counts += h
            before += tl.where(j < c, h, 0)
    ends, dest = _placement(onehot, counts, before, BLOCK_M)
    tl.store(sorted_ptr + dest, offs, mask=live)
    for b0 in range(c * BLOCK_T, NB, chunks * BLOCK_T):
        b = b0 + tl.arange(0, BLOCK_T)
        tl.store(bexp_ptr + b, _block_expert(ends, b, E + SHARED, BLOCK_M), mask=b < NB)
