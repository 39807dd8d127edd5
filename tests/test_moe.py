"""Mixture-of-experts with 4-bit experts: the stacked format (formats/experts.py), the routing
prep, the grouped kernels against a float64 per-element bound (ops/moe.py, kernels/moe.py),
the op (fake, torch.compile) and bad input. On CPU the kernels run in Triton's interpreter."""
from dataclasses import replace

import pytest
import torch

from helpers import (DTYPE_NAMES, U32, UNIT_ROUNDOFF, accumulation_constant, desc_act_g_idx, general_g_idx,
                     random_quantized)
from sailfish import Config
from sailfish.formats.experts import PackedExperts, padded_k_experts, quantize_experts, stack
from sailfish.formats.int4 import QuantizedWeight, quantize
from sailfish.ops.moe import Router, align_routing, max_blocks, moe_w4a16_launch, moe_w4a16_reference

F16, BF16 = torch.float16, torch.bfloat16
SILU_SLOPE = 1.1  # max |silu'(x)| = 1.0998...: a gate error d moves silu(gate) by at most 1.1 |d|


# ----------------------------------------------------------------------------------
# Stacked format
# ----------------------------------------------------------------------------------
def random_experts(E, n, k, gs, sym, dtype, device="cpu", act_order=False):
    """act_order: GPTQ desc_act g_idx for every expert but the first (which keeps k // group_size)."""
    return [random_quantized(k, n, gs, sym, dtype, device=device,
                             g_idx=desc_act_g_idx(k, gs, device) if act_order and e else None) for e in range(E)]


@pytest.mark.parametrize("gs,sym,dtype,k", [(32, True, F16, 96), (64, False, BF16, 320), (128, True, BF16, 1408),
                                            (256, False, F16, 2880), (-1, False, F16, 200)])
def test_stack_unstack_exact(gs, sym, dtype, k):
    qws = random_experts(3, 24, k, gs, sym, dtype)
    p = stack(qws)
    assert p.qweight.shape == (3, 24, padded_k_experts(k) // 8)
    assert padded_k_experts(k) == -(-k // 128) * 128  # only to the format's own chunk
    for a, b in zip(p.unstack(), qws):
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
        assert (a.zeros is None) == sym and (sym or torch.equal(a.zeros, b.zeros))
    assert torch.equal(p.dequantize(), torch.stack([qw.dequantize() for qw in qws]))


@pytest.mark.parametrize("gs,sym,k", [(32, False, 96), (128, True, 1408)])
def test_stack_unstack_act_order_exact(gs, sym, k):
    """GPTQ desc_act experts: each one's channels sorted by group (perm: the identity for the
    expert without act-order), and back exactly, g_idx included."""
    qws = random_experts(3, 24, k, gs, sym, F16, act_order=True)
    p = stack(qws)
    assert p.perm.shape == (3, k) and p.perm.dtype == torch.int32
    assert torch.equal(p.perm[0], torch.arange(k, dtype=torch.int32))
    for e, (a, b) in enumerate(zip(p.unstack(), qws)):
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
        assert (a.g_idx is None) == (e == 0) and (e == 0 or torch.equal(a.g_idx, b.g_idx))
        assert torch.equal(b.group_index()[p.perm[e].long()], torch.arange(k) // gs)  # groups contiguous
    assert torch.equal(p.dequantize(), torch.stack([qw.dequantize() for qw in qws]))


def test_expert_widths_of_real_models_are_not_padded():
    for width in (768, 1408, 1536, 2048, 14336):
        assert padded_k_experts(width) == width


def test_quantize_experts_is_per_expert_rtn():
    w = torch.randn(3, 32, 160)
    p = quantize_experts(w, group_size=32, sym=False, dtype=BF16)
    for e, qw in enumerate(p.unstack()):
        ref = quantize(w[e], group_size=32, sym=False, dtype=BF16)
        assert torch.equal(qw.qweight, ref.qweight) and torch.equal(qw.scales, ref.scales)
        assert torch.equal(qw.zeros, ref.zeros)


def test_stack_refuses_bad_experts():
    qws = random_experts(2, 16, 128, 64, True, F16)
    with pytest.raises(ValueError, match="empty"):
        stack([])
    with pytest.raises(ValueError, match=r"weights\[1\] has group_size"):
        stack([qws[0], random_quantized(128, 16, 32, True, F16)])
    gidx = general_g_idx(128, 64)
    with pytest.raises(ValueError, match=r"weights\[0\] has a g_idx whose sorted values are not k // group_size"):
        stack([QuantizedWeight(qws[0].qweight, random_quantized(128, 16, 64, True, F16).scales, None, gidx, 64)])
    w = torch.randn(2, 16, 64)
    w[1, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="expert 1: .*non-finite"):
        quantize_experts(w)
    with pytest.raises(ValueError, match="3-D"):
        quantize_experts(torch.randn(16, 64))


# ----------------------------------------------------------------------------------
# Routing prep
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("M,topk,E,bm", [(1, 2, 4, 16), (7, 3, 5, 16), (40, 2, 3, 32), (9, 4, 8, 16)])
def test_align_routing(M, topk, E, bm):
    ids = torch.stack([torch.randperm(E)[:topk] for _ in range(M)])
    ids[0, 0] = E  # transformers' "no local expert": left out
    slots, bexp = align_routing(ids, E, bm)
    T = M * topk
    nb = max_blocks(T, E, bm)
    assert slots.shape == (nb * bm,) and bexp.shape == (nb,)
    flat = ids.reshape(-1)
    seen = []
    for b in range(nb):
        blk = slots[b * bm:(b + 1) * bm]
        if bexp[b] < 0:
            assert bool((blk == T).all())
            continue
        real = blk[blk < T]
        assert len(real) and bool((flat[real.long()] == bexp[b]).all())
        seen += real.tolist()
    assert sorted(seen) == [t for t in range(T) if flat[t] < E]
    assert seen == sorted(seen, key=lambda t: (int(flat[t]), t))  # expert order, slots in order
    used = bexp[bexp >= 0]
    assert bool((used[1:] >= used[:-1]).all()) and bool((bexp[len(used):] == -1).all())
    again = align_routing(ids, E, bm)
    assert torch.equal(again[0], slots) and torch.equal(again[1], bexp)


@pytest.mark.parametrize("M,topk,E,bm", [(1, 2, 4, 16), (7, 3, 5, 16), (40, 2, 3, 32), (9, 4, 8, 16),
                                         (300, 8, 128, 16), (64, 6, 64, 64), (3, 1, 700, 16)])
def test_routing_kernels_match_torch(M, topk, E, bm, device):
    """The routing kernels (one chunk: the single-launch form; several chunks, one-hot tiles of
    16-128 slots) give align_routing's integers exactly, ids outside [0, E) included."""
    ids = torch.stack([torch.randperm(E)[:topk] for _ in range(M)])
    ids[0, 0] = E
    ids[-1, -1] = -1
    want = align_routing(ids, E, bm)
    got = Router(E, bm, -1 if device == "cpu" else 0)(ids.to(device).int())
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


# ----------------------------------------------------------------------------------
# Kernels against the float64 per-element bound
# ----------------------------------------------------------------------------------
def moe_bound(x, ids, tw, w13, w2, out_dtype, intermediate_dtype=None, silu_rounded=False, gate_up_rounded=False,
              weights_rounded=False):
    """(ref, bound): the float64 MoE block y = sum_k w_k down(silu(gate) * up) on the exact
    operands (w13 (E, 2I, H), w2 (E, H, I) the dequantized weights) and the largest |y - ref| a
    correct implementation can give per element: fp32 accumulation (accumulation_constant) in
    both GEMMs, fp32 silu / products (16 u32 relative), h rounded to intermediate_dtype (default
    out_dtype; its error propagated through the down GEMM), the weighted (token, k) rows rounded
    once to it, the fp32 top-k sum and the final rounding to out_dtype. silu_rounded: silu(gate)
    is also rounded to intermediate_dtype before the product (transformers', vLLM's silu_and_mul).
    gate_up_rounded: gate and up are rounded to intermediate_dtype before silu (a dense MLP of
    separate layers: each layer's output).
    weights_rounded: w13 / w2 are the exact s * (q - z) (dequantize(rounded=False)) and a kernel may
    multiply them either so (SCALE_ACC: the scale on the fp32 product) or rounded to out_dtype (the
    per-weight scaling): each weight's rounding, u |w|, joins both GEMMs' bounds."""
    mid = out_dtype if intermediate_dtype is None else intermediate_dtype
    u, um = UNIT_ROUNDOFF[out_dtype], UNIT_ROUNDOFF[mid]
    M, topk = ids.shape
    E, two_i, H = w13.shape
    I = two_i // 2
    flat = ids.reshape(-1).long()
    live = ((flat >= 0) & (flat < E)).double()[:, None]
    e = flat.clamp(0, E - 1)
    xs = x.double().repeat_interleave(topk, 0)  # (T, H): slot t reads token t // topk
    a13, a2 = w13.double()[e], w2.double()[e]  # (T, 2I, H), (T, H, I)
    gu = torch.einsum("th,tnh->tn", xs, a13)
    mag = torch.einsum("th,tnh->tn", xs.abs(), a13.abs())
    uw = u if weights_rounded else 0.0
    d = (accumulation_constant(H) + uw) * mag
    if gate_up_rounded:
        d = d + um * (gu.abs() + d)
    g, up, dg, du = gu[:, :I], gu[:, I:], d[:, :I], d[:, I:]
    s = torch.nn.functional.silu(g)
    h = s * up
    ds = SILU_SLOPE * dg
    if silu_rounded:
        ds = ds + um * (s.abs() + ds)
    dh = ds * (up.abs() + du) + s.abs() * du + 16 * U32 * h.abs()
    dh = dh + um * (h.abs() + dh)  # rounded to the intermediate dtype
    w = tw.double().reshape(-1, 1) * live
    o = torch.einsum("ti,thi->th", h, a2) * w
    hmax = h.abs() + dh
    do = (torch.einsum("ti,thi->th", dh, a2.abs()) + (accumulation_constant(I) + uw)
          * torch.einsum("ti,thi->th", hmax, a2.abs()) + 2 * U32 * torch.einsum("ti,thi->th", hmax, a2.abs())) * w.abs()
    do = do + um * (o.abs() + do)  # the weighted row, rounded once
    y = o.view(M, topk, H).sum(1)
    dy = do.view(M, topk, H).sum(1)
    dy = dy + topk * U32 * (o.abs() + do).view(M, topk, H).sum(1)
    return y, dy + u * (y.abs() + dy) + 2.0 ** -24


def assert_moe_close(y, ref, bound):
    err = (y.double() - ref).abs()
    bad = ~(err <= bound)
    assert not bool(bad.any()), (f"{int(bad.sum())} of {y.numel()} elements over the bound; worst ratio "
                                 f"{float((err / bound).max()):.3g}, max |err| {float(err.max()):.3g}")


def make_problem(E, topk, M, H, I, gs, sym, dtype, device, skew=False, act_order=False):
    """act_order: GPTQ desc_act experts (the op's w13_perm / w2_perm arguments)."""
    w13 = stack(random_experts(E, 2 * I, H, gs, sym, dtype, device, act_order))
    w2 = stack(random_experts(E, H, I, gs, sym, dtype, device, act_order))
    x = torch.randn(M, H, device=device).to(dtype)
    if skew:  # every token's first choice is expert 0
        ids = torch.stack([torch.cat([torch.tensor([0]), 1 + torch.randperm(E - 1)[:topk - 1]]) for _ in range(M)])
    else:
        ids = torch.stack([torch.randperm(E)[:topk] for _ in range(M)])
    tw = torch.softmax(torch.randn(M, topk), -1)
    args = (x, ids.to(device), tw.to(device), w13.qweight, w13.scales, w13.zeros, w2.qweight, w2.scales, w2.zeros, gs)
    if act_order:
        args += (w13.perm, w2.perm)
    return args, w13, w2


#   E  topk M   H    I    gs    sym    dtype skew
CASES = [
    (4, 2, 1, 256, 96, 64, False, BF16, False),     # decode, split-K gate_up, ragged I
    (8, 2, 5, 384, 128, 128, True, F16, False),
    (6, 3, 7, 256, 160, -1, True, BF16, True),       # per channel, skewed routing
    (3, 1, 4, 320, 64, 32, False, F16, False),       # K = 320: masked K tail (padded to 384)
    (5, 4, 6, 256, 128, 256, True, F16, False),      # group 256 > the 128-channel K tile
    (4, 2, 40, 128, 64, 128, False, BF16, False),    # 20 slots per expert: BLOCK_M 32
    (2, 2, 3, 128, 32, 32, True, BF16, False),       # top-k = E
    (2, 1, 1, 2880, 32, 128, True, F16, False),      # K = N = 2880 (gpt-oss width; Marlin MoE's crash,
    (2, 1, 1, 128, 2880, 64, False, BF16, False),    # vLLM #38022): padded to 2944, masked
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "E{}-k{}-M{}-H{}-I{}-g{}-{}-{}{}".format(
    *c[:6], "sym" if c[6] else "asym", DTYPE_NAMES[c[7]], "-skew" if c[8] else ""))
def test_moe_kernel_per_element(case, device):
    E, topk, M, H, I, gs, sym, dtype, skew = case
    args, w13, w2 = make_problem(E, topk, M, H, I, gs, sym, dtype, device, skew)
    ref, bound = moe_bound(args[0].cpu(), args[1].cpu(), args[2].cpu(), w13.dequantize().cpu(),
                           w2.dequantize().cpu(), dtype)
    y = moe_w4a16_launch(*args)
    assert y.shape == (M, H) and y.dtype == dtype
    assert_moe_close(y.cpu(), ref, bound)
    assert_moe_close(moe_w4a16_reference(*args).cpu(), ref, bound)  # (the reference obeys it too)


#   kind         split H    I    gs  sym    dtype  M
ACT_ORDER_CASES = [
    ("moe", 1, 256, 160, 32, False, BF16, 3),       # ragged I: the down GEMM's masked K tail
    ("moe", 2, 320, 256, 64, True, F16, 5),         # ragged H, split K
    ("moe_fused", 2, 256, 128, 128, False, F16, 3),  # the decode path (inline routing, sums in the launch)
    ("moe_fused", 1, 384, 96, 32, True, BF16, 2),
    (None, 1, 128, 64, 32, False, F16, 40),         # the heuristic's tiles, BLOCK_M 32
]


@pytest.mark.parametrize("case", ACT_ORDER_CASES, ids=lambda c: "{}-s{}-H{}-I{}-g{}-{}-{}-M{}".format(
    c[0] or "heuristic", *c[1:5], "sym" if c[5] else "asym", DTYPE_NAMES[c[6]], c[7]))
def test_moe_act_order_per_element(case, device):
    """GPTQ desc_act experts (each expert's own permutation of H for gate_up and of I for down;
    expert 0 without act-order): the kernel gathers x / h through them, within the bound of the
    block on the effective weights in x's channel order; a token with no routed expert gets zeros."""
    kind, split, H, I, gs, sym, dtype, M = case
    args, w13, w2 = make_problem(4, 2, M, H, I, gs, sym, dtype, device, act_order=True)
    args[1][1, :] = 4  # token 1: no local expert
    ref, bound = moe_bound(args[0].cpu(), args[1].cpu(), args[2].cpu(), w13.dequantize().cpu(),
                           w2.dequantize().cpu(), dtype)
    cfgs = None if kind is None else tuple(Config(16, 64, 128, min(split, -(-k // 128)), 8, 4, 3, kernel=kind)
                                           for k in (H, I))
    y = moe_w4a16_launch(*args, configs=cfgs)
    assert_moe_close(y.cpu(), ref, bound)
    assert not bool(y[1].any())
    assert_moe_close(moe_w4a16_reference(*args).cpu(), ref, bound)  # (the reference obeys it too)


@pytest.mark.parametrize("split13,split2,bk2", [(1, 1, 128), (2, 2, 128), (1, 1, 256)])
def test_moe_kernel_configs(split13, split2, bk2, device):
    """Forced configs: no split / split in both GEMMs / BLOCK_K 256 (one per H, with sentinel ids)."""
    args, w13, w2 = make_problem(4, 2, 3, 256, 256, 64, False, F16, device)
    args[1][1, 1] = 4  # not routed (transformers' "no local expert" id)
    ref, bound = moe_bound(args[0].cpu(), args[1].cpu(), args[2].cpu(), w13.dequantize().cpu(),
                           w2.dequantize().cpu(), F16)
    cfgs = (Config(16, 64, 128, split13, 8, 4, 3, kernel="moe"), Config(16, 64, bk2, split2, 8, 4, 3, kernel="moe"))
    assert_moe_close(moe_w4a16_launch(*args, configs=cfgs).cpu(), ref, bound)


@pytest.mark.parametrize("gs,sym,dtype,I,act_order", [(128, True, BF16, 128, False), (-1, False, F16, 160, False),
                                                      (256, False, F16, 128, True), (64, True, F16, 128, False)])
def test_moe_scale_acc_per_element(gs, sym, dtype, I, act_order, device):
    """Configs with scale_acc (kernels/moe._dot_tile: q - z dequantized, the group scale on the fp32
    product; per channel the scale after the K loop) in both GEMMs, a ragged I (160: the down
    GEMM's masked K tail) and act-order included, within the bound; group 64 under a 128-channel K
    tile does not fit (scale_acc_fits) and runs the per-weight scaling instead."""
    from sailfish.ops.moe import scale_acc_fits

    assert scale_acc_fits(128, 128) and scale_acc_fits(-1, 256) and scale_acc_fits(256, 128)
    assert not scale_acc_fits(64, 128) and not scale_acc_fits(128, 256)
    args, w13, w2 = make_problem(4, 2, 24, 256, I, gs, sym, dtype, device, act_order=act_order)
    ref, bound = moe_bound(args[0].cpu(), args[1].cpu(), args[2].cpu(), w13.dequantize(False).cpu(),
                           w2.dequantize(False).cpu(), dtype, weights_rounded=True)
    cfgs = tuple(Config(32, 64, 128, 1, 8, 4, 4, kernel="moe", scale_acc=True) for _ in range(2))
    assert_moe_close(moe_w4a16_launch(*args, configs=cfgs).cpu(), ref, bound)


@pytest.mark.parametrize("M,split13,split2,bk2", [(3, 2, 2, 128), (3, 1, 1, 256), (20, 2, 1, 128)])
def test_moe_fused_decode_path_matches_separate_launches(M, split13, split2, bk2, device):
    """kernel "moe_fused" (gate_up's split-K sum and the top-k sum by the last program to finish,
    kernels/moe.py FUSED; the GEMMs routing themselves, ROUTE) gives the bits of the routing
    kernels and the separate reduce launches at the same tiles (the same sums in the same order),
    within the bound; a token with no routed expert gets zeros (no program owns it); called again,
    the same bits (the counters are left at zero). M = 20: the top-k sum's token loop takes two
    BLOCK_M chunks, and expert 0 (every token's first choice) two blocks."""
    from sailfish.ops.moe import SYNC_CAP, route_inline, sync_buffer

    args, w13, w2 = make_problem(4, 2, M, 256, 256, 64, False, F16, device, skew=M > 16)
    args[1][1, :] = 4  # token 1: no local expert for any k
    args[1][2, 1] = 4
    ref, bound = moe_bound(args[0].cpu(), args[1].cpu(), args[2].cpu(), w13.dequantize().cpu(),
                           w2.dequantize().cpu(), F16)
    separate, fused = ((Config(16, 64, 128, split13, 8, 4, 3, kernel=k),
                        Config(16, 64, bk2, split2, 8, 4, 3, kernel=k)) for k in ("moe", "moe_fused"))
    assert route_inline(M, 2, 4, fused[1]) and not route_inline(M, 2, 4, separate[1])
    want = moe_w4a16_launch(*args, configs=separate)
    got = moe_w4a16_launch(*args, configs=fused)
    assert_moe_close(got.cpu(), ref, bound)
    assert torch.equal(got, want)
    assert not bool(got[1].any())
    assert torch.equal(moe_w4a16_launch(*args, configs=fused), got)
    sync = sync_buffer(got.device, -1 if device == "cpu" else got.get_device())
    assert sync.shape[0] > SYNC_CAP and not bool(sync.any())


#   E  topk M  H    I    gs   sym    dtype  BLOCK_N BLOCK_K split13 split2 stages
GEMV_CASES = [
    (4, 2, 1, 256, 128, 128, True, F16, 16, 128, 1, 1, 1),
    (4, 2, 2, 256, 100, 128, False, BF16, 32, 128, 2, 1, 2),   # ragged I (100 = 6 tiles of 16 + 4)
    (8, 2, 3, 320, 256, -1, True, F16, 64, 128, 3, 2, 1),      # per channel, K tail of x (320 of 384)
    (4, 1, 3, 256, 256, 256, False, BF16, 16, 256, 1, 1, 2),   # group 256, BLOCK_K 256
]


@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: "E{}-k{}-M{}-H{}-I{}-g{}-{}-{}-bn{}-bk{}-s{}{}-st{}".format(
    *c[:6], "sym" if c[6] else "asym", DTYPE_NAMES[c[7]], *c[8:]))
def test_moe_gemv_per_element(case, device):
    """kernel "moe_gemv" (one tensor-core GEMV per slot, kernels/moe._moe_gemv_kernel; on the CPU
    its portable twin): the block within the bound, with a slot of no local expert (id E), a token
    whose two slots share an expert's N tiles, split K in either GEMM (the last split sums, as
    the top-k sum, inside the launch); called again, the same bits (the counters left at zero)."""
    E, topk, M, H, I, gs, sym, dtype, bn, bk, s13, s2, stages = case
    args, w13, w2 = make_problem(E, topk, M, H, I, gs, sym, dtype, device)
    args[1][0, topk - 1] = E  # not routed
    ref, bound = moe_bound(args[0].cpu(), args[1].cpu(), args[2].cpu(), w13.dequantize(False).cpu(),
                           w2.dequantize(False).cpu(), dtype, weights_rounded=True)  # (scale_acc or not)
    cfgs = (Config(1, bn, bk, s13, 8, 4, stages, kernel="moe_gemv", scale_acc=True),
            Config(1, bn, 128, s2, 8, 4, stages, kernel="moe_gemv", scale_acc=stages == 1))
    y = moe_w4a16_launch(*args, configs=cfgs)
    assert_moe_close(y.cpu(), ref, bound)
    assert torch.equal(moe_w4a16_launch(*args, configs=cfgs), y)


# ----------------------------------------------------------------------------------
# Shared experts (num_shared: DeepSeek's, stacked after the routed ones, taken by every token)
# ----------------------------------------------------------------------------------
def with_shared(ids, tw, E, S):
    """The block's slots with S shared experts as (M, k + S) ids / weights of E + S experts: the
    routed ids (-1 outside [0, E)), then E .. E + S - 1 at weight 1 (the op's definition)."""
    M = ids.shape[0]
    ids = torch.where((ids >= 0) & (ids < E), ids, -1)
    return (torch.cat([ids, torch.arange(E, E + S).expand(M, S)], 1),
            torch.cat([tw, torch.ones(M, S)], 1))


#   config kind   M   E  S  topk H    I    gs   sym    dtype
SHARED_CASES = [
    (None, 1, 6, 2, 2, 256, 128, 128, True, BF16),       # the heuristic: "moe_gemv" (DeepSeek's decode)
    ("moe_gemv", 3, 4, 1, 2, 256, 128, -1, False, F16),  # split gate_up, per channel
    ("moe_fused", 3, 4, 2, 2, 256, 128, 64, False, F16),  # the GEMMs route themselves, sums inside
    ("moe", 5, 4, 2, 3, 384, 96, 32, True, BF16),        # the routing launch, ragged I
    (None, 40, 4, 2, 2, 128, 64, 64, False, F16),        # BLOCK_M 32, the routing in two chunks
]


@pytest.mark.parametrize("case", SHARED_CASES, ids=lambda c: "{}-M{}-E{}-S{}-k{}-H{}-I{}-g{}-{}-{}".format(
    c[0] or "heuristic", *c[1:8], "sym" if c[8] else "asym", DTYPE_NAMES[c[9]]))
def test_moe_shared_experts_per_element(case, device):
    """num_shared S: the last S experts of the weights run for every token at weight 1 after its
    top-k, in every kernel kind, within the bound of the block with those slots; a routed id E (no
    local expert) is left out, not taken for the first shared expert."""
    kind, M, E, S, topk, H, I, gs, sym, dtype = case
    args, w13, w2 = make_problem(E + S, topk, M, H, I, gs, sym, dtype, device)
    ids = torch.stack([torch.randperm(E)[:topk] for _ in range(M)])
    ids[0, topk - 1] = E
    args = (args[0], ids.to(device)) + args[2:]
    ext_ids, ext_tw = with_shared(ids, args[2].cpu(), E, S)
    ref, bound = moe_bound(args[0].cpu(), ext_ids, ext_tw, w13.dequantize(False).cpu(), w2.dequantize(False).cpu(),
                           dtype, weights_rounded=True)  # (the GEMV's scale_acc or the per-weight scaling)
    cfgs = None
    if kind == "moe_gemv":
        cfgs = (Config(1, 16, 128, 2, 8, 4, 1, kernel=kind, scale_acc=True),
                Config(1, 32, 128, 1, 8, 4, 1, kernel=kind, scale_acc=True))
    elif kind is not None:
        cfgs = (Config(16, 64, 128, 2, 8, 4, 3, kernel=kind), Config(16, 64, 128, 1, 8, 4, 3, kernel=kind))
    y = moe_w4a16_launch(*args, num_shared=S, configs=cfgs)
    assert_moe_close(y.cpu(), ref, bound)
    assert_moe_close(moe_w4a16_reference(*args, num_shared=S).cpu(), ref, bound)
    if kind is None and M == 1:
        from sailfish.ops.moe import moe_config, moe_gemv_format

        pair = moe_config(torch.device("cpu"), M, topk + S, E + S, I, H, H, I,
                          gemv_format=moe_gemv_format(gs, H, I, (False, False)))
        assert pair[0].kernel == "moe_gemv"


@pytest.mark.parametrize("M,topk,E,S,bm", [(1, 2, 4, 1, 16), (9, 4, 8, 2, 16), (300, 6, 64, 2, 16), (70, 2, 6, 2, 32)])
def test_routing_with_shared_experts(M, topk, E, S, bm, device):
    """align_routing with shared experts is align_routing of the (M, k + S) slots with_shared gives,
    and the routing kernels (one chunk and several) give its integers exactly."""
    ids = torch.stack([torch.randperm(E)[:topk] for _ in range(M)])
    ids[0, 0] = E
    want = align_routing(ids, E, bm, S)
    ext, _ = with_shared(ids, torch.ones(M, topk), E, S)
    plain = align_routing(ext, E + S, bm)
    assert torch.equal(want[0], plain[0]) and torch.equal(want[1], plain[1])
    got = Router(E, bm, -1 if device == "cpu" else 0, topk, S)(ids.to(device).int())
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_op_shared_experts_opcheck(device):
    """num_shared through the op's schema, fake implementation and AOT dispatch."""
    args, _, _ = make_problem(5, 2, 3, 128, 64, 64, True, F16, device)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(3)]).to(device)
    args = (args[0], ids) + args[2:] + (None, None, 1)
    torch.library.opcheck(torch.ops.sailfish.moe_w4a16.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_op_shared_experts_bad_input():
    args = zero_problem(E=4, topk=2)
    for S, match in ((-1, r"num_shared=-1 must be an int in \[0, E=4\)"), (4, r"num_shared=4 must be"),
                     (3, r"top_k=2 .* min\(routed experts=1, 32 - num_shared=3\)")):
        with pytest.raises(ValueError, match=match):
            torch.ops.sailfish.moe_w4a16(*args, None, None, S)
    torch.ops.sailfish.moe_w4a16(*args, None, None, 2)


def test_moe_gemv_heuristic_and_checks():
    """The launcher takes "moe_gemv" (BLOCK_M 1, no routing) at decode where the slots are at most
    3/4 of the experts (1/4 for experts too large for L2 to serve a second read) and the format is the dense GEMV's (groups of whole 128-channel chunks, no
    act-order, even widths); a "moe_gemv" config elsewhere, or mixed with a BLOCK_M 16 one, is
    refused by name."""
    from sailfish.ops.moe import moe_config, moe_gemv_applies, moe_gemv_format

    cpu = torch.device("cpu")
    assert moe_gemv_format(128, 2048, 768, (False, False)) and moe_gemv_format(-1, 2048, 1408, (False, False))
    assert not moe_gemv_format(64, 2048, 768, (False, False)) and not moe_gemv_format(128, 2048, 768, (True, True))
    assert not moe_gemv_format(128, 2048, 97, (False, False))
    assert [moe_gemv_applies(M, 8, 128, 2048, 768, True) for M in (1, 8, 12, 13)] == [True] * 3 + [False]  # Qwen3
    assert [moe_gemv_applies(M, 6, 64, 2048, 1408, True) for M in (1, 8, 9)] == [True, True, False]  # DeepSeek
    assert [moe_gemv_applies(M, 2, 8, 4096, 14336, True) for M in (1, 2)] == [True, False]  # Mixtral: large experts
    assert not moe_gemv_applies(1, 8, 128, 2048, 768, False)
    pair = moe_config(cpu, 1, 8, 128, 768, 2048, 2048, 768, gemv_format=True)
    assert [c.kernel for c in pair] == ["moe_gemv"] * 2 and [c.BLOCK_M for c in pair] == [1, 1]
    assert [c.kernel for c in moe_config(cpu, 1, 8, 128, 768, 2048, 2048, 768)] == ["moe_fused"] * 2
    args = zero_problem(H=256, I=256, gs=64)
    gemv = Config(1, 16, 128, 1, 8, 4, 1, kernel="moe_gemv", scale_acc=True)
    with pytest.raises(ValueError, match="kernel='moe_gemv' does not take group_size=64"):
        moe_w4a16_launch(*args, configs=(gemv, gemv))
    args = zero_problem(H=256, I=256, gs=128)
    with pytest.raises(ValueError, match="down config BLOCK_M=16 must be the routing's BLOCK_M=1"):
        moe_w4a16_launch(*args, configs=(gemv, Config(16, 64, 128, 1, kernel="moe")))
    with pytest.raises(ValueError, match="down config BLOCK_M=1 must be >= 16"):
        moe_w4a16_launch(*args, configs=(gemv, replace(gemv, kernel="moe")))


def test_moe_heuristic_takes_the_fused_decode_path():
    """Decode (BLOCK_M 16, M <= 16): the down GEMM does the top-k sum, a split gate_up its split-K
    sum, inside their launches (and both route themselves at few slots x experts); BLOCK_M 16 at
    M = 256 (Qwen3: 16 slots per expert) and prefill keep the separate launches, and so does an
    unsplit gate_up (nothing to fold)."""
    from sailfish.ops.moe import moe_block_m, moe_heuristic, route_inline

    cpu = torch.device("cpu")  # (132 SMs, an H100's)

    def kinds(M, H, I, E, topk):
        bm = moe_block_m(M, topk, E)
        return tuple((c.kernel, c.SPLIT_K > 1) for c in (
            moe_heuristic(device=cpu, M=M, topk=topk, E=E, N=N, Kp=K, gated=g, block_m=bm)
            for g, N, K in ((True, I, H), (False, H, I))))

    assert kinds(1, 2048, 768, 128, 8) == (("moe_fused", True), ("moe_fused", True))  # Qwen3-30B-A3B
    assert kinds(1, 2048, 1408, 64, 6)[1][0] == "moe_fused"  # DeepSeek-V2-Lite
    assert kinds(4, 4096, 14336, 8, 2) == (("moe", False), ("moe", False))  # Mixtral: K past FUSED_MAX_K
    assert kinds(4, 2048, 768, 128, 8) == (("moe", False), ("moe_fused", False))  # (unsplit gate_up: no reduce)
    assert kinds(1, 4096, 14336, 8, 2)[1] == ("moe_fused", True)  # (split down: its reduce folds)
    assert kinds(16, 2048, 768, 128, 8)[1][0] == "moe"  # past FUSED_MAX_M
    assert kinds(256, 2048, 768, 128, 8) == (("moe", False), ("moe", False))
    assert kinds(1024, 2048, 1408, 64, 6) == (("moe", False), ("moe", False))
    # and the GEMMs route themselves where the (slots x experts) one-hot tile is small
    fused, separate = Config(16, 128, 128, 1, kernel="moe_fused"), Config(16, 128, 128, 1, kernel="moe")
    assert [route_inline(M, 8, 128, fused) for M in (1, 4, 8)] == [True, True, False]  # Qwen3
    assert [route_inline(M, 6, 64, fused) for M in (8, 16)] == [True, False]  # DeepSeek-V2-Lite
    assert route_inline(16, 2, 8, fused) and not route_inline(1, 2, 8, separate)  # Mixtral; the chain before


@pytest.mark.parametrize("cfgs,match", [
    ((Config(16, 64, 128, 1, kernel="moe"), Config(32, 64, 128, 1, kernel="moe")),
     "down config BLOCK_M=32 must be the routing's BLOCK_M=16: gate_up and down BLOCK_M must agree"),
    ((Config(16, 64, 64, 1, kernel="moe"), Config(16, 64, 128, 1, kernel="moe")),
     "gate_up config BLOCK_K=64 must be a multiple of 128"),
    ((Config(16, 48, 128, 1, kernel="moe"), Config(16, 64, 128, 1, kernel="moe")), "BLOCK_N=48 must be a power"),
    ((Config(16, 64, 128, 1, kernel="moe"), Config(16, 64, 128, 3, kernel="moe")), r"SPLIT_K=3 must lie in \[1, 2\]"),
    ((Config(8, 64, 128, 1, kernel="moe"), Config(8, 64, 128, 1, kernel="moe")), "BLOCK_M=8 must be >= 16"),
    ((Config(16, 64, 128, 1), Config(16, 64, 128, 1, kernel="moe")), "kernel='mma' is not one of 'moe'"),
])
def test_moe_explicit_configs_are_checked(cfgs, match):
    args = zero_problem(H=256, I=256)
    with pytest.raises(ValueError, match=match):
        moe_w4a16_launch(*args, configs=cfgs)


def test_moe_fused_config_needs_its_counters():
    """kernel "moe_fused" takes one counter per gate_up tile (blocks x N tiles): a problem with more
    than SYNC_CAP is refused, naming the config and the alternative; "moe" takes it."""
    from sailfish.ops.moe import SYNC_CAP, check_moe_config, max_blocks

    p = dict(M=16384, topk=1, E=1024, N=512, Kp=128, block_m=16, gated=True)
    assert max_blocks(16384, 1024, 16) * 512 // 32 > SYNC_CAP
    with pytest.raises(ValueError, match=r"gate_up config kernel='moe_fused' with BLOCK_N=32 needs 32768 tile "
                                         r"counters for M=16384, more than the 16384 there are; use kernel='moe'"):
        check_moe_config(Config(16, 32, 128, 1, kernel="moe_fused"), **p)
    check_moe_config(Config(16, 32, 128, 1, kernel="moe"), **p)
    check_moe_config(Config(16, 32, 128, 1, kernel="moe_fused"), **{**p, "gated": False})  # (down: per N tile)


def test_moe_tuner_heuristic_candidates_and_clear_caches():
    """The family's tuner: per GEMM the heuristic's config at the routing's BLOCK_M, cached
    (one per problem and device) until clear_caches; every candidate passes the check and
    keeps the routing's BLOCK_M (so any gate_up / down pair the tuner picks agrees)."""
    from sailfish.ops.moe import MOE_TUNER, check_moe_config, moe_block_m, moe_candidates, moe_config, moe_heuristic
    from sailfish.tuning import clear_caches

    cpu = torch.device("cpu")
    clear_caches()
    for M, topk, E, I, H in ((1, 8, 128, 768, 2048), (256, 2, 8, 14336, 4096), (1024, 6, 64, 1408, 2048)):
        bm = moe_block_m(M, topk, E)
        pair = moe_config(cpu, M, topk, E, I, H, H, I)
        for cfg, gated, N, Kp in ((pair[0], True, I, H), (pair[1], False, H, I)):
            p = dict(device=cpu, M=M, topk=topk, E=E, N=N, Kp=Kp, gated=gated, block_m=bm)
            assert cfg == moe_heuristic(**p) and cfg.BLOCK_M == bm
            cands = list(moe_candidates(**p))
            assert cands[0] == cfg and len(cands) >= 3 and all(c.BLOCK_M == bm for c in cands)
            for c in cands:
                check_moe_config(c, M=M, topk=topk, E=E, N=N, Kp=Kp, block_m=bm, gated=gated)
        assert moe_config(cpu, M, topk, E, I, H, H, I) == pair
    assert len(MOE_TUNER.cache) == 6
    clear_caches()
    assert MOE_TUNER.cache == {}


# ----------------------------------------------------------------------------------
# The op: fake implementation, torch.compile, bad input
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("act_order", [False, True])
def test_op_opcheck_and_compile(act_order, device):
    args, _, _ = make_problem(4, 2, 3, 128, 64, 64, True, F16, device, act_order=act_order)
    torch.library.opcheck(torch.ops.sailfish.moe_w4a16.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    weights = args[3:]

    def block(x, ids, w):
        return torch.ops.sailfish.moe_w4a16(x, ids, w, *weights) * 2

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    y = compiled(*args[:3])
    assert torch.equal(y, block(*args[:3]))  # (the same problem computed twice)


def zero_problem(E=4, topk=2, M=3, H=128, I=64, gs=64, dtype=F16):
    kp = lambda k: padded_k_experts(k)  # noqa: E731
    g = lambda k: 1 if gs == -1 else -(-kp(k) // gs)  # noqa: E731
    return [torch.zeros(M, H, dtype=dtype), torch.zeros(M, topk, dtype=torch.long), torch.ones(M, topk),
            torch.zeros(E, 2 * I, kp(H) // 8, dtype=torch.int32), torch.ones(E, 2 * I, g(H), dtype=dtype), None,
            torch.zeros(E, H, kp(I) // 8, dtype=torch.int32), torch.ones(E, H, g(I), dtype=dtype), None, gs]


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.__setitem__(2, torch.ones(3, 5)), ValueError, "topk_weights must be"),
    (lambda a: a.__setitem__(1, torch.zeros(3, 2)), ValueError, "topk_ids must be an integer"),
    (lambda a: a.__setitem__(0, torch.zeros(3, 192, dtype=F16)), ValueError, r"w13_qweight.shape\[2\]=16 does not "
                                                                               "fit hidden=192"),
    (lambda a: a.__setitem__(0, torch.zeros(3, 128)), TypeError, "x dtype torch.float32"),
    (lambda a: a.__setitem__(9, 48), ValueError, "group_size=48"),
    (lambda a: a.__setitem__(4, a[4].bfloat16()), ValueError, "w13_scales must be torch.float16"),
    (lambda a: a.__setitem__(3, a[3][:0]), ValueError, r"expert count E=0 .* \[1, 1024\]"),
    (lambda a: a.__setitem__(6, a[6][:, :, :4]), ValueError, "w2_qweight must be int32"),
    (lambda a: a.__setitem__(4, a[4].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "w13_scales must be contiguous"),
])
def test_op_bad_input(change, error, match):
    args = zero_problem()
    change(args)
    with pytest.raises(error, match=match):
        torch.ops.sailfish.moe_w4a16(*args)


def test_op_bad_perms():
    """w13_perm / w2_perm: int32 (E, K) rows that are permutations (values checked on the CPU)."""
    args = zero_problem() + [torch.arange(128, dtype=torch.int32).repeat(4, 1), None]
    torch.ops.sailfish.moe_w4a16(*args)
    bad = args[10].clone()
    bad[2, 5] = 6  # channel 6 twice, 5 never
    for perm, match in ((bad, r"w13_perm\[2\] is not a permutation of 0 .. 127"),
                        (args[10].long(), r"w13_perm must be an int32 \(E=4, K=128\) tensor .* got torch.int64"),
                        (args[10][:, :64], r"w13_perm must be an int32 \(E=4, K=128\) .* got torch.int32 \(4, 64\)")):
        with pytest.raises(ValueError, match=match):
            torch.ops.sailfish.moe_w4a16(*args[:10], perm, None)
    with pytest.raises(ValueError, match=r"w2_perm must be an int32 \(E=4, K=64\)"):
        torch.ops.sailfish.moe_w4a16(*args[:10], None, args[10])


def test_op_expert_count_limit():
    with pytest.raises(ValueError, match=r"expert count E=1025 \(w13_qweight.shape\[0\]\) must lie in \[1, 1024\]"):
        torch.ops.sailfish.moe_w4a16(*zero_problem(E=1025, I=16))


def test_op_top_k_limit():
    with pytest.raises(ValueError, match=r"top_k=33 .* min\(routed experts=40, 32 - num_shared=0\)"):
        torch.ops.sailfish.moe_w4a16(*zero_problem(E=40, topk=33))
    args = zero_problem()
    args[1:3] = [torch.zeros(3, 5, dtype=torch.long), torch.ones(3, 5)]
    with pytest.raises(ValueError, match=r"top_k=5 .* min\(routed experts=4, 32 - num_shared=0\)"):
        torch.ops.sailfish.moe_w4a16(*args)


# ----------------------------------------------------------------------------------
# The benchmark's code path, and the kernel compiled for Hopper
# ----------------------------------------------------------------------------------
def test_bench_moe_smoke(tmp_path):
    import json

    from sailfish.bench import moe as bench

    out = tmp_path / "moe.json"
    # (the loop's shared experts: QuantLinears joined from the same codes; a second quantization failed its check)
    assert bench.main(["--smoke", "--routing", "skewed", "--kernels",
                       "sailfish-moe-w4a16,grouped,sailfish-quantlinear-loop", "--models", "tiny-shared", "--m", "3",
                       "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {r["kernel"] for r in doc["rows"]} == {"sailfish-moe-w4a16", "bf16-grouped", "sailfish-quantlinear-loop"}
    assert {r["M"] for r in doc["rows"]} == {3} and all(c["ok"] for c in doc["checks"])
    for r in doc["rows"]:
        assert set(r) == {"model", "kernel", "M", "time_us", "limit_fraction", "dtype", "group_size"}
        assert r["time_us"] > 0 and r["limit_fraction"] is None and r["model"].endswith("skewed")
    # a second run into the same file replaces its own rows and keeps the others
    assert bench.main(["--smoke", "--routing", "skewed", "--kernels", "grouped", "--models", "tiny-shared", "--m",
                       "3", "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert len(again["runs"]) == 2 and len(again["rows"]) == len(doc["rows"])
    assert [r for r in again["rows"] if r["kernel"] != "bf16-grouped"] == \
        [r for r in doc["rows"] if r["kernel"] != "bf16-grouped"]
    assert all(c["ok"] for c in again["checks"])


_SM90_CHILD = r"""
import triton
from triton.backends.compiler import GPUTarget
from sailfish.tools.ptx import ast_source, k_loop_stats, sass, wgmma_register_hazard
from sailfish.kernels.moe import _moe_w4a16_kernel
import torch
from sailfish.ops.moe import route_tile, acc_fence, moe_block_m, moe_heuristic, route_inline

INTS = ("T", "N", "K", "E", "num_blocks", "stride_xm", "stride_ym", "stride_qe", "stride_qn", "stride_se",
        "stride_sn")
ALIGNED = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "sorted_ptr", "bexp_ptr", "tw_ptr", "y_ptr", "ws_ptr", "ids_ptr",
           "out_ptr", "sync_ptr", "N", "K", "stride_xm", "stride_ym", "stride_qe", "stride_qn")
bad, n = [], 0
# the distinct configs the launcher picks for the benchmark's models at decode and prefill
# (M = 1, 4: "moe_fused", the split-K and top-k sums inside the launch, down a programmatic
# dependent of gate_up; where the GEMMs route themselves, with their routing tile)
cpu = torch.device("cpu")  # (132 SMs, an H100's)
tiles = set()
# (DeepSeek-V2-Lite with its 2 shared experts in the block: top-(6 + 2) slots over 66 experts)
MODELS = ((2048, 768, 128, 8, 0), (4096, 14336, 8, 2, 0), (2048, 1408, 64, 6, 2))
for (H, I, E, topk, S) in MODELS:
    for M in (1, 4, 16, 256, 4096):
        ks, es = topk + S, E + S
        pair = [moe_heuristic(device=cpu, M=M, topk=ks, E=es, N=N, Kp=K, gated=gated,
                              block_m=moe_block_m(M, ks, es)) for gated, N, K in ((True, I, H), (False, H, I))]
        route = tuple(sorted(route_tile(M * ks, es).items())) if route_inline(M, ks, es, pair[1]) else ()
        chained = pair[1].kernel == "moe_fused"
        tiles |= {(True, pair[0], route, chained, S), (False, pair[1], route, chained, S)}
# act-order (HAS_PERM: x gathered through a permutation) on one gate_up and one down tile of each kind
perm_tiles = {min((t for t in tiles if t[0] == g and t[1].kernel == kd), key=str, default=None)
              for g in (True, False) for kd in ("moe", "moe_fused")}
for gated, cfg, route, chained, S in sorted(tiles, key=str):
    for dtype, zeros, gs, perm in (("fp16", False, 128, False), ("bf16", True, 0, False), ("fp16", True, 128, True)):
        if perm and (gated, cfg, route, chained, S) not in perm_tiles:
            continue
        ty = "*" + dtype
        sig = {"x_ptr": ty, "qw_ptr": "*i32", "s_ptr": ty, "z_ptr": ty, "sorted_ptr": "*i32",
               "bexp_ptr": "*i32", "tw_ptr": "*fp32", "y_ptr": ty, "ws_ptr": "*fp32", "ids_ptr": "*i64",
               "out_ptr": ty, "sync_ptr": "*i32", "perm_ptr": "*i32" if perm else "constexpr",
               **{k: "i32" for k in INTS}}
        # (8 slots a token, any shared ones included)
        consts = dict(TOPK=8 - S, **(dict(SHARED=S) if S else {}), GATED=gated, GROUP_SIZE=gs, HAS_ZEROS=zeros,
                      EVEN_K=True, SPLIT_K=cfg.SPLIT_K, EMU_BF16=False, USE_ASM=True, BLOCK_M=cfg.BLOCK_M,
                      BLOCK_N=cfg.BLOCK_N,
                      BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, ACC_FENCE=acc_fence(),
                      FUSED=cfg.kernel == "moe_fused", **(dict(ROUTE=True, **dict(route)) if route else {}),
                      **(dict(SCALE_ACC=True) if cfg.scale_acc else {}),
                      **({} if not chained else dict(PDL_EARLY=True) if gated else dict(PDL=True)),
                      **(dict(HAS_PERM=True) if perm else dict(perm_ptr=None)))
        names = list(sig)
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED + (("perm_ptr",) if perm else ())}
        k = triton.compile(ast_source(_moe_w4a16_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options=cfg.launch())
        st = k_loop_stats(k.asm["ptx"])
        n += 1
        if st is None or not st.wgmma_a_in_registers or wgmma_register_hazard(sass(k.asm["cubin"])):
            bad.append((gated, cfg, route, dtype, zeros, gs, perm, st))
# the routing kernels, as Router sizes them for 128 / 16 / 1024 experts (they must compile)
from sailfish.kernels.moe import _route_count_kernel, _route_place_kernel
for ep, bt, shared in ((128, 64, {}), (16, 128, {}), (1024, 16, {}), (128, 64, dict(TOPK=6, SHARED=2))):
    for fn, sig, consts in ((_route_count_kernel, ("hist_ptr", "sorted_ptr", "T", "E", "S"), {}),
                            (_route_place_kernel, ("hist_ptr", "sorted_ptr", "bexp_ptr", "T", "E", "NB"),
                             {"BLOCK_M": 16}),
                            (_route_place_kernel, ("hist_ptr", "sorted_ptr", "bexp_ptr", "T", "E", "NB"),
                             {"BLOCK_M": 16, "ONE_CHUNK": True})):
        sig = {"ids_ptr": "*i64", **{a: ("*i32" if a.endswith("ptr") else "i32") for a in sig}}
        triton.compile(ast_source(fn, sig, dict(E_POW2=ep, BLOCK_T=bt, **consts, **shared)),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
        n += 1
# the one-GEMV-per-slot kernel ("moe_gemv") at the heuristic's tiles where the launcher takes it:
# it compiles, and its mma asm runs in the lane order the fragment layout needs
from sailfish.kernels.moe import _moe_gemv_kernel
from sailfish.kernels.w4a16 import gemv_asm, gemv_pairs, gemv_warps
from sailfish.ops.moe import moe_gemv_applies
from sailfish.ops.w4a16 import gemv_stages
from sailfish.tools.ptx import gemv_lane_order
GINTS = ("T", "N", "K", "E", "stride_xm", "stride_qe", "stride_qn", "stride_se", "stride_sn")
GALIGNED = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "ids_ptr", "tw_ptr", "y_ptr", "ws_ptr", "out_ptr", "sync_ptr", "N",
            "K", "stride_xm", "stride_qe", "stride_qn")
for (H, I, E, topk, S) in MODELS:
    for gated, N, K in ((True, I, H), (False, H, I)):
        if not moe_gemv_applies(1, topk + S, E + S, H, I, True):
            continue
        cfg = moe_heuristic(device=cpu, M=1, topk=topk + S, E=E + S, N=N, Kp=K, gated=gated, block_m=1)
        dtype, zeros = ("fp16", False) if gated else ("bf16", True)
        ty = "*" + dtype
        text, cons = gemv_asm(dtype == "bf16", zeros, True, gemv_pairs(cfg.BLOCK_N), cfg.scale_acc)
        sig = {"x_ptr": ty, "qw_ptr": "*i32", "s_ptr": ty, "z_ptr": ty, "ids_ptr": "*i64", "tw_ptr": "*fp32",
               "y_ptr": ty, "ws_ptr": "*fp32", "out_ptr": ty, "sync_ptr": "*i32", **{k: "i32" for k in GINTS}}
        consts = dict(TOPK=topk, **(dict(SHARED=S) if S else {}), GATED=gated, GROUP_SIZE=128, HAS_ZEROS=zeros,
                      EVEN_K=True, SPLIT_K=cfg.SPLIT_K, EMU_BF16=False, USE_ASM=True, ASM=text,
                      ASM_CONSTRAINTS=cons, BLOCK_N=cfg.BLOCK_N,
                      BLOCK_K=cfg.BLOCK_K, SCALE_ACC=cfg.scale_acc, **gemv_stages(cfg.num_stages),
                      **(dict(PDL_EARLY=True) if gated else dict(PDL=True)))
        names = list(sig)
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in GALIGNED}
        k = triton.compile(ast_source(_moe_gemv_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": gemv_warps(cfg.BLOCK_N, cfg.BLOCK_K, cfg.num_warps), "num_stages": 1})
        n += 1
        if not gemv_lane_order(k.asm["ttgir"]):
            bad.append(("moe_gemv", gated, cfg, "lane order"))
print("checked", n)
raise SystemExit(f"not wgmma from registers, or a register hazard: {bad}" if bad else 0)
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check for machines without a GPU")
def test_moe_kernel_compiles_for_hopper(tmp_path):
    """The launcher's configs for the benchmark shapes (the decode path's fused sums and inline
    routing included, and act-order on a few) compile for sm_90a with the dequantized tile
    fed to wgmma from registers (the fragment-order layout's point) and no wgmma register hazard;
    the "moe_gemv" kernel's with its mma asm in the lane order it needs."""
    from helpers import run_compile_child

    run_compile_child(_SM90_CHILD, tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 16, 300, 600])
def test_moe_cuda_graph_and_determinism(M):
    """On the GPU: the block replayed from a CUDA graph gives the eager bits, and repeated eager
    calls give the same bits (no atomics); the per-element bound holds. M = 600 (150 slots per
    expert, BLOCK_M 128): on Hopper the "moe_gluon" GEMMs (gather, TMA descriptors, the routing
    order) inside the graph."""
    args, w13, w2 = make_problem(16, 4, M, 512, 256, 128, False, BF16, "cuda")
    op = torch.ops.sailfish.moe_w4a16
    eager = op(*args)
    assert torch.equal(op(*args), eager)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(*args)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    ref, bound = moe_bound(args[0].cpu(), args[1].cpu(), args[2].cpu(), w13.dequantize(False).cpu(),
                           w2.dequantize(False).cpu(), BF16, weights_rounded=True)  # (M = 1: the GEMV's scale_acc)
    assert_moe_close(eager.cpu(), ref, bound)


# ----------------------------------------------------------------------------------
# "moe_gluon": the Hopper Gluon GEMMs (kernels/moe_gluon.py); elsewhere their Triton twin
# ----------------------------------------------------------------------------------
#   bm   M    E  S  topk H    I    gs   sym    dtype  skew
GLUON_CASES = [
    (64, 40, 4, 0, 2, 256, 256, 128, True, BF16, False),
    (64, 70, 3, 1, 2, 512, 256, -1, False, F16, True),     # per channel, asymmetric, a shared expert, skewed
    (128, 150, 2, 0, 2, 256, 512, 256, False, BF16, False),  # group 256, BLOCK_M 128, expert 0's three blocks
    (64, 33, 4, 0, 2, 320, 384, 128, True, F16, False),     # 3 chunks of K in both GEMMs (H ragged): a half last step
    (128, 140, 2, 1, 2, 256, 640, -1, False, BF16, False),  # down over 5 chunks, per channel, a shared expert
]


@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: "bm{}-M{}-E{}-S{}-k{}-H{}-I{}-g{}-{}-{}{}".format(
    *c[:8], "sym" if c[8] else "asym", DTYPE_NAMES[c[9]], "-skew" if c[10] else ""))
def test_moe_gluon_config_per_element(case, device):
    """"moe_gluon" configs in both GEMMs (the Gluon kernels on a Hopper GPU where the format takes
    them, gluon_moe_format; their Triton twin elsewhere) within the bound of the block: the group
    scale on the weights or per channel on the product, a routed id E (no local expert) left out,
    shared experts; on Hopper the plan is the Gluon one where the format allows."""
    from sailfish.ops.moe import MoEPlan, gluon_config, gluon_moe_format

    bm, M, E, S, topk, H, I, gs, sym, dtype, skew = case
    args, w13, w2 = make_problem(E + S, topk, M, H, I, gs, sym, dtype, device, skew)
    ids = args[1].cpu().clone()
    ids[ids >= E] = 0 if skew else ids[ids >= E] % E  # (routed ids in [0, E))
    ids[1, -1] = E
    args = (args[0], ids.to(device)) + args[2:]
    ext_ids, ext_tw = with_shared(ids, args[2].cpu(), E, S)
    ref, bound = moe_bound(args[0].cpu(), ext_ids, ext_tw, w13.dequantize(False).cpu(), w2.dequantize(False).cpu(),
                           dtype, weights_rounded=True)
    cfgs = (gluon_config(bm, True), gluon_config(bm, False))
    y = moe_w4a16_launch(*args, num_shared=S, configs=cfgs)
    assert_moe_close(y.cpu(), ref, bound)
    kp13, kp2 = padded_k_experts(H), padded_k_experts(I)
    gluon = gluon_moe_format(gs, H, I, kp13, kp2, (False, False), torch.device(device))
    plan = MoEPlan(*cfgs, torch.device(device), dtype, M, topk, E, I, H, gs, not sym, not sym, shared=S, gluon=gluon)
    assert plan.kind == ("moe_gluon" if gluon else "moe")
    if device == "cuda" and torch.cuda.get_device_capability() == (9, 0):
        assert gluon, "a Hopper GPU and a format the Gluon kernels take"


def test_moe_gluon_pairing_heuristic_and_checks():
    """Both GEMMs run the Gluon kernels or neither (pair_gluon: h's routing order is theirs); the
    heuristic takes them at BLOCK_M 64 / 128 where the format allows (gluon) and not at decode's
    BLOCK_M 16; a "moe_gluon" config other than its tile is refused, naming what it takes."""
    from sailfish.ops.moe import check_moe_config, gluon_config, gluon_twin, moe_heuristic, pair_gluon

    g13, g2 = gluon_config(128, True), gluon_config(128, False)
    assert (g13.BLOCK_N, g2.BLOCK_N, g13.BLOCK_K, g13.num_stages, gluon_config(64, True).num_stages) == (64, 128, 256,
                                                                                                        3, 4)
    assert pair_gluon(g13, g2, 128, True) == (g13, g2)
    assert pair_gluon(g13, g2, 128, False) == (gluon_twin(g13, 128), gluon_twin(g2, 128))
    other = Config(128, 128, 128, 1, 8, 8, 3, kernel="moe")
    assert pair_gluon(g13, other, 128, True) == (gluon_twin(g13, 128), other)
    twin = gluon_twin(g2, -1)
    assert (twin.kernel, twin.BLOCK_K, twin.scale_acc, gluon_twin(g2, 128).scale_acc) == ("moe", 128, True, False)
    cpu = torch.device("cpu")
    p = dict(device=cpu, M=4096, topk=2, E=8, N=14336, Kp=4096, gated=True)
    assert moe_heuristic(**p, block_m=128, gluon=True) == g13
    assert moe_heuristic(**p, block_m=128).kernel == "moe"
    assert moe_heuristic(**{**p, "M": 1}, block_m=16, gluon=True).kernel != "moe_gluon"
    assert moe_heuristic(**{**p, "M": 256}, block_m=64, gluon=True) == gluon_config(64, True)  # (large experts)
    small = dict(p, M=1024, E=128, topk=8, N=768, Kp=2048)  # Qwen3-30B-A3B: BLOCK_M 64 keeps the Triton tiles
    assert moe_heuristic(**small, block_m=64, gluon=True).kernel == "moe"
    assert moe_heuristic(**small, block_m=128, gluon=True) == g13
    # moe_config: large experts at 17-48 slots an expert take BLOCK_M 64 (its Gluon tiles) where the
    # format allows, 32 (the Triton tiles) otherwise; small experts keep 32
    from sailfish.ops.moe import moe_config
    assert [c.BLOCK_M for c in moe_config(cpu, 128, 2, 8, 14336, 4096, 4096, 14336, gluon=True)] == [64, 64]
    assert [c.kernel for c in moe_config(cpu, 128, 2, 8, 14336, 4096, 4096, 14336, gluon=True)] == ["moe_gluon"] * 2
    assert [c.BLOCK_M for c in moe_config(cpu, 128, 2, 8, 14336, 4096, 4096, 14336)] == [32, 32]
    assert [c.BLOCK_M for c in moe_config(cpu, 512, 8, 128, 768, 2048, 2048, 768, gluon=True)] == [32, 32]
    chk = dict(M=4096, topk=2, E=8, N=14336, Kp=4096, block_m=128, gated=True)
    check_moe_config(g13, **chk)
    for bad, match in ((replace(g13, BLOCK_N=128), "BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, num_warps=8"),
                       (replace(g13, num_stages=4), "num_stages=4: the x rings of BLOCK_M=128 take 3 to 3"),
                       (replace(g13, BLOCK_M=32), r"takes BLOCK_M in \(64, 128\)"),
                       (replace(g13, SPLIT_K=2), "SPLIT_K=1")):
        with pytest.raises(ValueError, match=match):
            check_moe_config(bad, **{**chk, "block_m": bad.BLOCK_M})


_GLUON_MOE_CHILD = r"""
import re
import triton
from sailfish.kernels.gluon_common import pipe_shared_bytes
from sailfish.kernels.moe_gluon import compile_moe_sm90
cases = [dict(gated=True), dict(gated=False), dict(gated=True, dtype="bf16", has_zeros=True),
         dict(gated=False, group_size=-1, has_zeros=True, dtype="fp16"),
         dict(gated=True, BLOCK_M=64, STAGES=4, group_size=256), dict(gated=False, BLOCK_M=64, STAGES=4),
         # K an odd number of 128-channel chunks (the last step's second chunk past K)
         dict(gated=False, half_last=True), dict(gated=True, half_last=True, has_zeros=True, dtype="fp16")]
bad = []
for kw in cases:
    k = compile_moe_sm90(**kw)
    why, _ = pipe_problems(k, pipe_shared_bytes(kw.get("BLOCK_M", 128), kw.get("STAGES", 3)))
    # gate_up's silu(gate) * up from registers: the epilogue adds no shared-memory trip
    if k.asm["ptx"].count("st.shared") != 2:
        why.append(f"{k.asm['ptx'].count('st.shared')} st.shared (the mbarrier setup has 2)")
    if why:
        bad.append((kw, why))
assert not bad, bad
print("checked", triton.__version__, len(cases))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check for machines without a GPU")
def test_moe_gluon_kernel_compiles_for_sm90(tmp_path):
    """The "moe_gluon" GEMMs on the compiler's output for sm_90a (both GEMMs, formats, BLOCK_M 64 /
    128): the dense pipe kernel's checks (A in registers, waits 1 and 0, no serialization, spill or
    wgmma register hazard, the rings' shared memory, warp-specialized TMA) and gate_up's epilogue
    without a shared-memory trip."""
    from helpers import PIPE_PROBLEMS, run_compile_child

    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    run_compile_child(_GLUON_MOE_CHILD.replace("bad = []", PIPE_PROBLEMS + "bad = []", 1), tmp_path)


def test_moe_gluon_compile_failure_falls_back_to_the_twin(monkeypatch, device):
    """A Triton whose Gluon does not compile the MoE kernel gives a warning and the Triton twin's
    result (both GEMMs), and Gluon is not tried again; other errors are raised."""
    import warnings

    import sailfish.kernels.moe_gluon as mg
    import sailfish.ops.moe as opsmoe
    from helpers import StandInKernel, incompatible_gluon
    from sailfish.runtime.flags import FLAGS

    monkeypatch.setattr(mg, "moe_w4a16_gluon_kernel", StandInKernel(incompatible_gluon()))
    monkeypatch.setattr(FLAGS, "gluon", True)
    monkeypatch.setattr(opsmoe, "gluon_moe_format", lambda *a: FLAGS.gluon)
    args, _, _ = make_problem(3, 2, 20, 256, 256, 128, True, F16, device)
    cfgs = (opsmoe.gluon_config(64, True), opsmoe.gluon_config(64, False))
    with pytest.warns(RuntimeWarning, match="Gluon MoE W4A16 kernel does not compile"):
        y = moe_w4a16_launch(*args, configs=cfgs)
    assert not FLAGS.gluon
    twins = tuple(opsmoe.gluon_twin(c, 128) for c in cfgs)
    assert torch.equal(y, moe_w4a16_launch(*args, configs=twins))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second attempt, no second warning
        assert torch.equal(moe_w4a16_launch(*args, configs=cfgs), y)

    monkeypatch.setattr(mg, "moe_w4a16_gluon_kernel", StandInKernel(RuntimeError("a launch error")))
    monkeypatch.setattr(FLAGS, "gluon", True)
    with pytest.raises(RuntimeError, match="a launch error"):
        moe_w4a16_launch(*args, configs=cfgs)
