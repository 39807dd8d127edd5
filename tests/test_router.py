"""sailfish::router_topk (ops/router.py, kernels/router.py) against transformers' router formula
(router_topk_reference): the ids exactly where the reference's probabilities are distinct, the
weights per element within the bound the module doc derives, ties, NaN / Inf rows, bad input,
and registration (opcheck, torch.compile fullgraph, CUDA plans and graphs)."""
import math

import pytest
import torch
import torch.nn.functional as F

from sailfish.ops import router as R
from sailfish.runtime.device import use_triton
from sailfish.ops.router import router_topk, router_topk_reference

U = 2.0 ** -24  # fp32 unit roundoff
HALF_ULP = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 0.0}  # relative, one rounding
SUBNORMAL = {torch.float16: 2.0 ** -25, torch.bfloat16: 0.0, torch.float32: 0.0}  # half fp16's smallest step


def distinct_logits(T, E, dtype, device):
    """Rows of E distinct logits, exact in every dtype: a random permutation of (n - E/2) / 16
    times a per-row power of two (bf16 holds them for E <= 512, fp16 for E <= 4096); fp32 rows
    are random normals (distinct; test_matches_reference checks the reference has no ties)."""
    if dtype == torch.float32:
        return (torch.randn(T, E) * 3 + torch.randn(T, 1)).to(device)
    n = torch.stack([torch.randperm(E) for _ in range(T)]).float() - E // 2
    x = n / 16 * torch.exp2(torch.randint(-2, 2, (T, 1)).float())
    assert torch.equal(x.to(dtype).float(), x)
    return x.to(device, dtype)


def near_exact(logits, ids, renormalize):
    """The weights at `ids` computed exactly (float64) from d = x - max(x) rounded to fp32, as the
    kernel and torch both compute it (the same IEEE subtraction): what is left to differ is exp,
    the sums and the divisions."""
    x = logits.cpu().float()
    e = torch.exp((x - x.max(dim=-1, keepdim=True).values).double())
    p = (e / e.sum(dim=-1, keepdim=True)).gather(-1, ids.cpu())
    return p / p.sum(dim=-1, keepdim=True) if renormalize else p


def kernel_bound(logits, top_k, renormalize):
    """Relative bound (per row) of the kernel's fp32 weights against near_exact: each e = exp(d)
    within a = (c + R_gpu) ulps, c = 4 (numpy's float32 exp; the GPU's ex2.approx, 2^-22), R_gpu =
    1.5 max |d| on the GPU only (exp there is ex2(d * log2e): the rounded product costs |d| ulps,
    log2e rounded to fp32 another |d| / 2); the sum of the row's E values by tl.sum (numpy's
    pairwise sum under the interpreter, a per-thread then lane-tree reduction on the GPU) within
    S = BLOCK_E / 8 + log2(BLOCK_E) ulps (BLOCK_E - 1 for rows up to 8); then p = e / s:
    2a + S + 1 ulps. Renormalized, s cancels (every p shares it):
    e_i, the sum of k values and three divisions, 2a + k + 2 ulps."""
    x = logits.cpu().float()
    block = R.next_pow2(x.shape[-1])
    r = (x - x.max(dim=-1, keepdim=True).values).abs().amax(dim=-1, keepdim=True).double()
    r_gpu = 1.5 * r if logits.is_cuda else torch.zeros_like(r)
    a = 4 + r_gpu
    sum_ulps = block - 1 if block <= 8 else block / 8 + math.log2(block)
    return (2 * a + (top_k + 2 if renormalize else sum_ulps + 1)) * U


def check_against_reference(logits, top_k, renormalize, fp32_weights):
    """ids: the reference's exactly; weights: within kernel_bound of near_exact before the cast,
    plus one rounding to the output dtype."""
    w, ids = router_topk(logits, top_k, renormalize, fp32_weights)
    w_ref, ids_ref = router_topk_reference(logits, top_k, renormalize, fp32_weights)
    assert w.dtype == w_ref.dtype and ids.dtype == torch.int64 and w.shape == ids.shape == (logits.shape[0], top_k)
    assert torch.equal(ids, ids_ref)
    check_weights(w, ids, logits, top_k, renormalize)


def check_weights(w, ids, logits, top_k, renormalize):
    """The kernel's weights at ids: within kernel_bound of near_exact, plus one rounding to w's dtype."""
    exact = near_exact(logits, ids, renormalize)
    b = kernel_bound(logits, top_k, renormalize)
    err = (w.cpu().double() - exact).abs()
    tol = exact * (b + HALF_ULP[w.dtype] * (1 + b)) + SUBNORMAL[w.dtype]
    assert (err <= tol).all(), ((err / exact).max().item() / U, (b / U).max())


@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
@pytest.mark.parametrize("E", [8, 60, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_matches_reference(dtype, E, top_k, device):
    """Every T (1, one program of several rows, several programs) and flag: ids equal, weights per
    element within weight_tolerance (Qwen: weights in the logits' dtype; Mixtral: float32)."""
    for T in (1, 5, 33):
        logits = distinct_logits(T, E, dtype, device)
        probs = torch.softmax(logits.cpu().float(), -1).sort(-1, descending=True).values[:, :top_k + 1]
        assert (probs[:, 1:] < probs[:, :-1]).all()  # (the data: no ties the test could not decide)
        for renormalize in (True, False):
            for fp32_weights in (False, True):
                check_against_reference(logits, top_k, renormalize, fp32_weights)


@pytest.mark.parametrize("E,top_k", [(512, 8), (1000, 10), (1, 1)])
def test_wide_and_narrow_rows(E, top_k, device):
    """Qwen3-Next's 512 experts, a row near ROUTER_MAX_EXPERTS (not a power of two), one expert."""
    check_against_reference(distinct_logits(3, E, torch.bfloat16 if E <= 512 else torch.float16, device), top_k,
                            True, False)
    check_against_reference(distinct_logits(2, E, torch.float32, device), top_k, False, False)


def test_ties_take_the_lowest_index(device):
    """Equal logits: the kernel takes the lowest index first (torch.topk leaves the order, and which
    of the tied ones it takes, open): the set of ids torch must take is taken, the weights equal."""
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 2.0, -1.0, 1.0, 0.0],
                           [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]], device=device).half()
    w, ids = router_topk(logits, 4, True)
    assert ids.tolist() == [[1, 3, 4, 2], [0, 1, 2, 3]]
    w_ref, ids_ref = router_topk_reference(logits, 4, True)
    assert set(ids_ref[0, :3].tolist()) == {1, 3, 4} and ids_ref[0, 3] in (2, 6)  # (row 1: any 4 of 8)
    assert torch.equal(w, w_ref) and w[1].tolist() == [0.25] * 4


def test_nonfinite_rows(device):
    """As torch's softmax: a row with a NaN or +Inf logit, or all -Inf, gives NaN weights; -Inf
    logits in a finite row are weight 0, ranked last. The ids stay distinct columns, NaN first,
    then +Inf, then the rest by logit."""
    x = distinct_logits(5, 16, torch.float32, device)
    x[0, 3] = float("nan")
    x[1, 2] = float("inf")
    x[2] = float("-inf")
    x[3, 5] = float("nan")
    x[3, 9] = float("inf")
    x[4, 1:] = float("-inf")
    for renormalize in (True, False):
        w, ids = router_topk(x.half(), 4, renormalize)
        w_ref, _ = router_topk_reference(x.half(), 4, renormalize)
        assert torch.equal(w[:4].isnan(), w_ref[:4].isnan()) and bool(w[:4].isnan().all())
        assert ids[0, 0] == 3 and ids[1, 0] == 2 and ids[2].tolist() == [0, 1, 2, 3]
        assert ids[3, :2].tolist() == [5, 9] and ids[4].tolist() == [0, 1, 2, 3]
        assert all(len(set(r)) == 4 for r in ids.tolist())
        assert w[4].tolist() == [1.0, 0.0, 0.0, 0.0] and torch.equal(w[4], w_ref[4])


def test_empty_and_strided_rows(device):
    w, ids = router_topk(torch.empty(0, 8, device=device, dtype=torch.bfloat16), 2, True)
    assert w.shape == ids.shape == (0, 2) and w.dtype == torch.bfloat16
    big = distinct_logits(4, 96, torch.float16, device)
    view = big[:, 16:76]  # rows 96 apart
    check_against_reference(view, 6, True, False)
    assert torch.equal(router_topk(view, 6, True)[1], router_topk(view.contiguous(), 6, True)[1])


def _bad_cases(device):
    x = distinct_logits(3, 16, torch.float16, device)
    return [
        ((x.int(), 2, True), TypeError, "logits dtype torch.int32 is not supported; allowed: float16, bfloat16, float32"),
        ((x[0], 2, True), ValueError, r"logits must have shape \(T, E\) with 1 <= E <= 1024, got \(16,\)"),
        ((torch.zeros(2, 1025, device=device).half(), 2, True), ValueError, r"1 <= E <= 1024, got \(2, 1025\)"),
        ((x.t().contiguous().t(), 2, True), ValueError, r"contiguous last dimension \(stride 1\), got strides \(1, 3\)"),
        ((x, 0, True), ValueError, r"top_k=0 is not supported; allowed: an int in \[1, 16\]"),
        ((x, 17, True), ValueError, r"top_k=17 is not supported; allowed: an int in \[1, 16\]"),
        ((x, 2, 1), TypeError, r"renormalize=1 must be a bool"),
        ((x, 2, True, None), TypeError, r"fp32_weights=None must be a bool"),
        ((x.to("meta"), 2, True), ValueError, "logits on meta"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_bad_input_is_refused(case, device):
    args, err, match = _bad_cases(device)[case]
    with pytest.raises(err, match=match):
        R.router_topk_impl(*args)
    if case < 6:  # (the dispatcher refuses a non-bool itself; meta tensors go to the fake kernel)
        with pytest.raises(err, match=match):
            router_topk(*args)
    if case == 0:
        with pytest.raises(ValueError, match=r"top_k=2.0 is not supported"):
            R.router_topk_impl(args[0].half(), 2.0, True)


def test_opcheck(device):
    x = distinct_logits(5, 60, torch.bfloat16, device)
    for args in ((x, 6, True), (x, 2, True, True), (x.float(), 8, False)):
        result = torch.library.opcheck(torch.ops.sailfish.router_topk.default, args)
        assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("linear", [False, True], ids=["router_topk", "router_linear_topk"])
def test_torch_compile_fullgraph(linear, device):
    """The op traces through its fake implementation (fullgraph: no break) and gives eager's output."""
    h = torch.randn(5, 32, device=device).half()
    weight = torch.randn(60, 32, device=device).half()

    def router(h):
        if linear:
            return R.router_linear_topk(h * 2, weight, 6, True)
        logits = F.linear(h, weight)
        w, ids = router_topk(logits, 6, True)
        return logits, w, ids

    backend = "inductor" if device == "cuda" else "aot_eager"
    torch._dynamo.reset()
    try:
        got = torch.compile(router, fullgraph=True, backend=backend)(h)
    finally:
        torch._dynamo.reset()
    for a, b in zip(got, router(h)):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kept_plans_and_cuda_graphs():
    """CUDA: the first call keeps its bound kernel, later calls (other T too) launch it directly
    and compute the same; a CUDA graph replays the direct launch on new data."""
    x = distinct_logits(16, 128, torch.bfloat16, "cuda")
    R._RouterPlans.plans.clear()
    w, ids = router_topk(x, 8, True)
    assert len(R._RouterPlans.plans) == 1
    for got, want in zip(router_topk(x[2:3], 8, True), (w[2:3], ids[2:3])):
        assert torch.equal(got, want)
    assert len(R._RouterPlans.plans) == 1
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = router_topk(static, 8, True)
    new = distinct_logits(16, 128, torch.bfloat16, "cuda")
    static.copy_(new)
    graph.replay()
    for got, want in zip(outs, router_topk(new, 8, True)):
        assert torch.equal(got, want)


_SM90_CHILD = r"""
import triton
from triton.backends.compiler import GPUTarget
from sailfish.kernels.router import router_topk_kernel
from sailfish.ops.router import _tile
from sailfish.tools.ptx import ast_source

for dt, out, E, K, renorm in [("*bf16", "*bf16", 128, 8, True), ("*fp16", "*fp32", 8, 2, True),
                              ("*fp32", "*fp32", 1000, 6, False), ("*fp16", "*fp16", 60, 1, False)]:
    sig = {"x_ptr": dt, "w_ptr": out, "id_ptr": "*i64", "T": "i32", "E": "i32", "stride_xt": "i32"}
    meta = dict(_tile(E, K))
    nw = meta.pop("num_warps")
    consts = dict(meta, K=K, RENORM=renorm, EMU_BF16=False)
    ptx = triton.compile(ast_source(router_topk_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": nw}).asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full" not in ptx, consts  # IEEE divisions, as torch's

from sailfish.kernels.router import router_linear_topk_kernel
from sailfish.ops.router import _linear_tile

for dt, out, T, E, H, K, renorm in [("*bf16", "*bf16", 1, 128, 2048, 8, True),
                                    ("*bf16", "*fp32", 64, 8, 4096, 2, True),
                                    ("*fp16", "*fp16", 16, 60, 2048, 4, False),
                                    ("*fp32", "*fp32", 5, 512, 1024, 10, True)]:
    sig = {"x_ptr": dt, "g_ptr": dt, "l_ptr": dt, "w_ptr": out, "id_ptr": "*i64", "cnt_ptr": "*i32", "T": "i32",
           "E": "i32", "H": "i32", "stride_xt": "i32", "stride_ge": "i32"}
    meta = dict(_linear_tile(T, E, H, K))
    nw = meta.pop("num_warps")
    consts = dict(meta, K=K, RENORM=renorm, EMU_BF16=False, EMU_LOGITS=False)
    names = list(sig)  # (what a launch specializes: aligned pointers, sizes and strides multiples of 16)
    aligned = [a for a in names if a.endswith("_ptr") or a in ("H", "stride_xt", "stride_ge")]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    ptx = triton.compile(ast_source(router_linear_topk_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": nw}).asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full" not in ptx, consts
    # the counter protocol: an acq_rel arrival, the logits of other programs read past L1
    assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx, consts
    # the weight streamed in 16-byte loads; a K loop of several steps pipelined
    assert ("cp.async" in ptx) == (meta["STAGES"] > 1) and ("ld.global.v4" in ptx or meta["STAGES"] > 1), consts
print("checked")
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernel itself")
def test_kernel_compiles_for_sm90(tmp_path):
    """The interpreter does not run Triton's compiler: compile both kernels' variants for sm_90."""
    from helpers import run_compile_child
    run_compile_child(_SM90_CHILD, tmp_path)


# ----------------------------------------------------------------------------------
# sailfish::router_linear_topk: the router's F.linear in the same launch
# ----------------------------------------------------------------------------------
def check_logits(logits, x, weight):
    """Each logit against the exact dot product (float64): the fp32 sum of H products (exact for
    fp16 / bf16 operands; fp32 ones round once more, u |p| each) in any order is within
    gamma_{H-1} * sum |x_h w_h| (gamma_n = n u / (1 - n u)), then one rounding to the dtype."""
    xd, wd = x.cpu().double(), weight.cpu().double()
    exact = xd @ wd.T
    n = x.shape[1] - 1 + (x.dtype == torch.float32)
    g = n * U / (1 - n * U)
    s = g * (xd.abs() @ wd.abs().T)
    tol = s + HALF_ULP[logits.dtype] * (exact.abs() + s) + SUBNORMAL[logits.dtype]
    err = (logits.cpu().double() - exact).abs()
    assert logits.dtype == x.dtype and (err <= tol).all(), (err - tol).max().item()


def check_linear_topk(x, weight, top_k, renormalize, fp32_weights):
    """The op's logits within check_logits's bound, its ids router_topk's on those logits, its
    weights router_topk's bits under the interpreter (the same @triton.jit code on the same logits
    and tile; on the GPU the two kernels' warps may sum a row in another order: the bound)."""
    T, E = x.shape[0], weight.shape[0]
    if T > R.LINEAR_MAX_T and T and use_triton(x):  # (the op takes two launches: the kernel's token blocks too)
        got = R.router_linear_topk_launch(x.contiguous(), weight.contiguous(), top_k, renormalize, fp32_weights)
        check_logits(got[0], x, weight)
        check_topk_of(*got, top_k, renormalize, fp32_weights)
    logits, w, ids = R.router_linear_topk(x, weight, top_k, renormalize, fp32_weights)
    assert logits.shape == (T, E) and w.shape == ids.shape == (T, top_k)
    check_logits(logits, x, weight)
    check_topk_of(logits, w, ids, top_k, renormalize, fp32_weights)
    return logits, w, ids


def check_topk_of(logits, w, ids, top_k, renormalize, fp32_weights):
    """(w, ids) are router_topk's of logits: the ids exactly, the weights bit for bit under the
    interpreter, within its bound on the GPU (check_linear_topk)."""
    w_op, ids_op = router_topk(logits, top_k, renormalize, fp32_weights)
    assert w.dtype == w_op.dtype and torch.equal(ids, ids_op)
    if logits.is_cuda:
        check_weights(w, ids, logits, top_k, renormalize)
    else:
        assert torch.equal(w, w_op)


@pytest.mark.parametrize("T,E,H,top_k,renormalize,fp32_weights", [
    (1, 128, 256, 8, True, False),  # Qwen3-MoE's router at decode (H cut down)
    (5, 60, 96, 6, False, False),  # E not a power of two (Qwen2-MoE's 60 experts)
    (33, 8, 64, 2, True, True),  # Mixtral's formula, three token blocks (the last partial)
    (20, 16, 40, 1, True, False),  # H not a multiple of the K step, top_k 1
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_linear_topk_matches_linear_then_topk(dtype, T, E, H, top_k, renormalize, fp32_weights, device):
    x = torch.randn(T, H, device=device).to(dtype)
    weight = torch.randn(E, H, device=device).to(dtype)
    logits, w, ids = check_linear_topk(x, weight, top_k, renormalize, fp32_weights)
    again = R.router_linear_topk(x, weight, top_k, renormalize, fp32_weights)  # (the counters were reset)
    assert all(torch.equal(a, b) for a, b in zip(again, (logits, w, ids)))
    assert not R.sync_buffer(x.device, x.get_device()).any(), "token-block counters left non-zero"


def test_linear_topk_every_top_k(device):
    x = torch.randn(2, 32, device=device).bfloat16()
    weight = torch.randn(60, 32, device=device).bfloat16()
    for top_k in range(1, 9):
        check_linear_topk(x, weight, top_k, top_k % 2 == 0, top_k > 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_linear_logits_are_rounded_once(dtype, device):
    """Operands k / 8, |k| <= 64 (exact in both dtypes), H = 96: every partial sum is a multiple of
    2^-6 below 2^13, exact in fp32 in any order, so the logits are the exact dot products rounded
    once (to nearest even) to the dtype, bit for bit, as F.linear's; a second rounding or a lost
    term would show."""
    x = (torch.randint(-64, 65, (17, 96)) / 8).to(device, dtype)
    weight = (torch.randint(-64, 65, (24, 96)) / 8).to(device, dtype)
    exact = (x.double() @ weight.double().T).float()  # (exact in fp32: no double rounding below)
    logits, _, _ = R.router_linear_topk(x, weight, 4, True)
    assert not torch.equal(exact.to(dtype).double(), exact.double())  # (the data: the rounding matters)
    assert torch.equal(logits, exact.to(dtype)) and torch.equal(logits, F.linear(x, weight))


@pytest.mark.parametrize("T", [0, 4, 5, 64])
def test_linear_topk_token_counts(T, device):
    """No tokens; LINEAR_MAX_T (the one launch); more (F.linear, then router_topk's launch): the
    same contract."""
    x = torch.randn(T, 48, device=device).half()
    weight = torch.randn(24, 48, device=device).half()
    if T == 0:
        logits, w, ids = R.router_linear_topk(x, weight, 3, True)
        assert logits.shape == (0, 24) and w.shape == ids.shape == (0, 3)
        return
    assert (T > R.LINEAR_MAX_T) == (T >= 5)
    check_linear_topk(x, weight, 3, True, False)


def test_linear_topk_strided_rows(device):
    """x and weight rows further apart than H (views into wider tensors): read through their strides."""
    x = torch.randn(6, 80, device=device).bfloat16()[:, 8:56]
    weight = torch.randn(60, 64, device=device).bfloat16()[:, 16:]
    assert x.stride(0) == 80 and weight.stride(0) == 64
    got = check_linear_topk(x, weight, 6, True, False)
    for a, b in zip(got, R.router_linear_topk(x.contiguous(), weight.contiguous(), 6, True)):
        assert torch.equal(a, b)


def test_fused_router_takes_a_strided_input(device):
    """SailfishTopKRouter hands the op unit-stride rows (F.linear took any input)."""
    from sailfish.fuse import fuse_row_ops

    holder = torch.nn.Module()
    holder.gate = tiny_moe_model("qwen3_moe").model.layers[0].mlp.gate.to(device)
    assert fuse_row_ops(holder)["routers"] == ["gate"]
    h = torch.randn(64, 5, device=device).bfloat16().t()  # (5, 64), strides (1, 5)
    with torch.no_grad():
        logits, w, ids = holder.gate(h)
    check_logits(logits, h, holder.gate.weight)
    check_topk_of(logits, w, ids, 2, True, False)


def test_linear_topk_reference_is_the_formula():
    """The reference (and the CPU path without the interpreter): F.linear, then router_topk_reference."""
    x = torch.randn(3, 32).bfloat16()
    weight = torch.randn(16, 32).bfloat16()
    logits, w, ids = R.router_linear_topk_reference(x, weight, 4, False, True)
    assert torch.equal(logits, F.linear(x, weight))
    for a, b in zip((w, ids), router_topk_reference(logits, 4, False, True)):
        assert torch.equal(a, b)


def _linear_bad_cases(device):
    x = torch.randn(3, 32, device=device).half()
    w = torch.randn(16, 32, device=device).half()
    return [
        ((x.int(), w, 2, True), TypeError, "x dtype torch.int32 is not supported; allowed: float16, bfloat16, float32"),
        ((x[0], w, 2, True), ValueError, r"x must have shape \(T, H\), got \(32,\)"),
        ((x.t().contiguous().t(), w, 2, True), ValueError, r"x must have a contiguous last dimension"),
        ((x, w.float(), 2, True), TypeError, r"weight dtype torch.float32 must be x's dtype torch.float16"),
        ((x, w[:, :16], 2, True), ValueError, r"weight must have shape \(E, H\) with 1 <= E <= 1024 and H = 32 "
                                                r"\(x's last dim\), got \(16, 16\)"),
        ((x, torch.zeros(1025, 32, device=device).half(), 2, True), ValueError, r"got \(1025, 32\)"),
        ((x, w.t().contiguous().t(), 2, True), ValueError,
         r"weight must have a contiguous last dimension"),
        ((x, w, 17, True), ValueError, r"top_k=17 is not supported; allowed: an int in \[1, 16\]"),
        ((x, w, 2, 1), TypeError, r"renormalize=1 must be a bool"),
        ((x, w.to("meta"), 2, True), ValueError, "x on .*, weight on meta"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_linear_bad_input_is_refused(case, device):
    args, err, match = _linear_bad_cases(device)[case]
    with pytest.raises(err, match=match):
        R.router_linear_topk_impl(*args)
    if case < 8:  # (the dispatcher refuses a non-bool itself; mixed devices fail in dispatch)
        with pytest.raises(err, match=match):
            R.router_linear_topk(*args)


def test_linear_opcheck(device):
    x = torch.randn(5, 32, device=device).bfloat16()
    w = torch.randn(60, 32, device=device).bfloat16()
    for args in ((x, w, 6, True), (x, w, 2, True, True), (x.float(), w.float(), 8, False)):
        result = torch.library.opcheck(torch.ops.sailfish.router_linear_topk.default, args)
        assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_linear_kept_plans_and_cuda_graphs():
    """CUDA: the first call keeps its bound kernel, later calls launch it directly and compute the
    same; a CUDA graph replays the direct launch on new data (the counters left at zero)."""
    x = torch.randn(R.LINEAR_MAX_T, 2048, device="cuda").bfloat16()
    w = torch.randn(128, 2048, device="cuda").bfloat16()
    R._RouterLinearPlans.plans.clear()
    first = R.router_linear_topk(x, w, 8, True)
    assert len(R._RouterLinearPlans.plans) == 1
    for got, want in zip(R.router_linear_topk(x, w, 8, True), first):
        assert torch.equal(got, want)
    assert len(R._RouterLinearPlans.plans) == 1
    static = x[:1].clone()
    R.router_linear_topk(static, w, 8, True)  # (T = 1's plan bound before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = R.router_linear_topk(static, w, 8, True)
    new = torch.randn(1, 2048, device="cuda").bfloat16()
    static.copy_(new)
    graph.replay()
    for got, want in zip(outs, R.router_linear_topk(new, w, 8, True)):
        assert torch.equal(got, want)
    check_linear_topk(new, w, 8, True, False)


# ----------------------------------------------------------------------------------
# The router module in transformers models (sailfish.fuse.SailfishTopKRouter, fuse_row_ops)
# ----------------------------------------------------------------------------------
MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]


def tiny_moe_model(arch, dtype=torch.bfloat16):
    """A tiny random MoE causal LM: 2 layers, 8 experts, top 2 (Qwen3-MoE renormalizing, Qwen2-MoE
    not: both norm_topk_prob values; Mixtral always renormalizes, float32 weights)."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  num_experts_per_tok=2, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=32, num_local_experts=8, **common)
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=32, num_experts=8, head_dim=32, norm_topk_prob=True,
                                          **common)
    else:
        cfg = transformers.Qwen2MoeConfig(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
                                          norm_topk_prob=False, **common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():  # routers far from uniform, experts that matter (transformers' init: 0.02)
        for n, p in model.named_parameters():
            if "mlp.gate." in n or "experts" in n:
                p.normal_(0, 0.5 if "gate" in n else 0.3)
    return model


def _generate(model, ids):
    return model.generate(ids, max_new_tokens=3, do_sample=False, disable_compile=True,
                          return_dict_in_generate=True, output_logits=True)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fused_moe_model_equals_unfused(arch, monkeypatch):
    """quantize_model replaces every router (report "routers"), keeping its weight under its key
    and the router class (isinstance: transformers' router-logits recorder still finds it). On
    the CPU reference path (the op runs router_topk_reference with the flags the module chose)
    the fused model equals the unfused one bit for bit: logits, greedy tokens, router logits and
    the auxiliary loss; so the flags are transformers' for each formula."""
    import copy

    import sailfish
    from sailfish.fuse import SailfishTopKRouter

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # (the kernel: test_in_model_routers_run_the_kernel)
    model = tiny_moe_model(arch)
    gate_cls = type(model.model.layers[0].mlp.gate)
    fused = sailfish.quantize_model(copy.deepcopy(model), group_size=32)
    unfused = sailfish.quantize_model(model, group_size=32, fuse=False)
    routers = [f"model.layers.{i}.mlp.gate" for i in range(2)]
    assert fused.sailfish_report["row_ops"]["routers"] == routers
    for name in routers:
        gate = fused.get_submodule(name)
        assert isinstance(gate, SailfishTopKRouter) and isinstance(gate, gate_cls)
        assert (gate.renormalize, gate.fp32_weights) == {"qwen3_moe": (True, False), "qwen2_moe": (False, False),
                                                         "mixtral": (True, True)}[arch]
    a, b = fused.state_dict(), unfused.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(1, 128, (2, 5))
    with torch.no_grad():
        out_f = fused(ids, output_router_logits=True)
        out_u = unfused(ids, output_router_logits=True)
        assert torch.equal(out_f.logits, out_u.logits)
        assert len(out_f.router_logits) == 2 and all(torch.equal(x, y) for x, y in
                                                     zip(out_f.router_logits, out_u.router_logits))
        assert torch.equal(out_f.aux_loss, out_u.aux_loss)
        g_f, g_u = _generate(fused, ids), _generate(unfused, ids)
    assert torch.equal(g_f.sequences, g_u.sequences)
    assert all(torch.equal(x, y) for x, y in zip(g_f.logits, g_u.logits))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_in_model_routers_run_the_kernel(arch, device):
    """With the interpreter (CPU) or on the GPU the fused routers run the kernel: in a forward of
    the model with every row op (fuse_row_ops), each router call's logits are within the linear's
    bound, its ids equal transformers' formula on the same logits and its weights are within the
    op's per-element bound; greedy decoding gives the unfused model's tokens."""
    import copy

    from sailfish.fuse import fuse_row_ops

    model = tiny_moe_model(arch).to(device)
    fused = copy.deepcopy(model)
    rows = fuse_row_ops(fused)
    assert rows["routers"] == [f"model.layers.{i}.mlp.gate" for i in range(2)]
    calls = []
    for i in range(2):
        fused.model.layers[i].mlp.gate.register_forward_hook(lambda m, args, out: calls.append((m, args[0], out)))
    ids = torch.randint(1, 128, (1, 6), device=device)
    with torch.no_grad():
        g_f, g_u = _generate(fused, ids), _generate(model, ids)
    assert torch.equal(g_f.sequences, g_u.sequences)
    assert len(calls) == 2 * 3  # (the prompt, then two decode steps)
    for gate, h, (logits, w, top) in calls:
        assert logits.dtype == torch.bfloat16 and w.dtype == (torch.float32 if arch == "mixtral" else torch.bfloat16)
        check_logits(logits, h.reshape(-1, gate.hidden_dim), gate.weight)
        check_topk_of(logits, w, top, gate.top_k, gate.renormalize, gate.fp32_weights)
        check_against_reference(logits, gate.top_k, gate.renormalize, gate.fp32_weights)


def _late_router_class():
    """A transformers-module router class whose forward takes the softmax after the top-k."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    class Qwen3MoeTopKRouterLate(Qwen3MoeTopKRouter):
        def forward(self, hidden_states):
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            router_logits = F.linear(hidden_states, self.weight)
            router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)
            router_top_value = torch.nn.functional.softmax(router_top_value, dtype=torch.float, dim=-1)
            router_top_value = router_top_value.to(router_logits.dtype)
            router_scores = router_top_value
            return router_logits, router_scores, router_indices

    Qwen3MoeTopKRouterLate.__module__ = Qwen3MoeTopKRouter.__module__
    return Qwen3MoeTopKRouterLate


def test_router_of_another_formula_is_left_alone(monkeypatch):
    """A router class whose forward differs from the known formulas (here: the softmax after the
    top-k, as some models do) keeps its own module; the module refused for hooks too; fusing a
    fused model again changes nothing; a whole-model pickle keeps the fused routers."""
    import io

    from sailfish.fuse import SailfishTopKRouter, fuse_row_ops

    model = tiny_moe_model("qwen3_moe")
    late = _late_router_class()(model.config)
    model.model.layers[0].mlp.gate = late
    hooked = model.model.layers[1].mlp.gate
    hooked.register_forward_hook(lambda *a: None)
    assert fuse_row_ops(model)["routers"] == []
    assert model.model.layers[0].mlp.gate is late and model.model.layers[1].mlp.gate is hooked
    hooked._forward_hooks.clear()
    assert fuse_row_ops(model)["routers"] == ["model.layers.1.mlp.gate"]
    assert fuse_row_ops(model)["routers"] == []  # (idempotent)
    model.model.layers[0].mlp.gate = hooked  # (a class local to a test does not pickle)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    gate = loaded.model.layers[1].mlp.gate
    assert type(gate) is type(model.model.layers[1].mlp.gate) and isinstance(gate, SailfishTopKRouter)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ids = torch.randint(1, 128, (1, 4))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_router_with_a_gradient_runs_the_formula():
    """The op has no derivative: with a gradient to compute the module runs transformers' formula
    (gradients reach the router weight as they would unfused)."""
    import copy

    from sailfish.fuse import fuse_row_ops

    model = tiny_moe_model("qwen3_moe", dtype=torch.float32)
    gate = model.model.layers[0].mlp.gate
    fused_gate = copy.deepcopy(gate)
    holder = torch.nn.Module()
    holder.gate = fused_gate
    assert fuse_row_ops(holder)["routers"] == ["gate"]
    h = torch.randn(5, 64)
    for g in (gate, holder.gate):
        _, w, _ = g(h)
        w.sum().backward()
    assert torch.equal(gate.weight.grad, holder.gate.weight.grad)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fused_moe_model_compiles_without_graph_breaks(arch, monkeypatch):
    """torch.compile(fullgraph=True) traces the routers through the op's fake implementation (a
    graph break raises) and the compiled model gives the eager model's logits."""
    import sailfish
    from helpers import assert_compiles_to_eager_logits
    from sailfish.fuse import SailfishTopKRouter

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = sailfish.quantize_model(tiny_moe_model(arch), group_size=32)
    assert isinstance(model.model.layers[0].mlp.gate, SailfishTopKRouter)
    assert_compiles_to_eager_logits(model, torch.randint(1, 128, (2, 5)), backend="aot_eager")


def test_load_quantized_fuses_the_routers(tmp_path, monkeypatch):
    """save_quantized writes the router weight under its own key from a fused model;
    load_quantized (fuse=True by default) fuses the routers again and gives the saved model's
    logits (CPU reference path); fuse=False keeps transformers' routers."""
    import sailfish
    from sailfish.fuse import SailfishTopKRouter

    pytest.importorskip("safetensors")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = sailfish.quantize_model(tiny_moe_model("mixtral"), group_size=32)
    sailfish.save_quantized(model, str(tmp_path))
    loaded = sailfish.load_quantized(str(tmp_path))
    assert loaded.sailfish_report["row_ops"]["routers"] == [f"model.layers.{i}.mlp.gate" for i in range(2)]
    assert isinstance(loaded.model.layers[1].mlp.gate, SailfishTopKRouter)
    plain = sailfish.load_quantized(str(tmp_path), fuse=False)
    assert not isinstance(plain.model.layers[1].mlp.gate, SailfishTopKRouter)
    ids = torch.randint(1, 128, (2, 5))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
        assert torch.equal(plain(ids).logits, model(ids).logits)


@pytest.mark.parametrize("arch,cls_name,cfg_name,flags", [
    ("olmoe", "OlmoeTopKRouter", "OlmoeConfig", (True, False)),
    ("minimax", "MiniMaxTopKRouter", "MiniMaxConfig", (True, True)),
    ("qwen3_vl_moe", "Qwen3VLMoeTextTopKRouter", "Qwen3VLMoeTextConfig", (True, False)),
])
def test_routers_of_other_models_sharing_a_formula(arch, cls_name, cfg_name, flags, device):
    """Routers of other architectures whose forward is one of the formulas (by source, whatever
    the class name) are replaced with that formula's flags: the router's own outputs are the
    reference's bit for bit, and the fused router's are the op's (its logits F.linear's within
    the linear's bound: the sums run in another order)."""
    import copy
    import importlib

    from sailfish.fuse import SailfishTopKRouter, fuse_row_ops

    mod = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    cfg = getattr(mod, cfg_name)(hidden_size=64, num_experts=8, num_local_experts=8, num_experts_per_tok=2,
                                 norm_topk_prob=True)
    router = getattr(mod, cls_name)(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    router = router.to(device, torch.bfloat16)
    holder = torch.nn.Module()
    holder.gate = copy.deepcopy(router)
    assert fuse_row_ops(holder)["routers"] == ["gate"]
    gate = holder.gate
    assert isinstance(gate, SailfishTopKRouter) and (gate.renormalize, gate.fp32_weights) == flags
    h = torch.randn(5, 64, device=device).bfloat16()
    with torch.no_grad():
        logits, w, ids = router(h)
        f_logits, f_w, f_ids = gate(h)
    w_ref, ids_ref = router_topk_reference(logits, 2, *flags)
    assert torch.equal(w, w_ref) and torch.equal(ids, ids_ref)
    check_logits(f_logits, h, router.weight)
    check_topk_of(f_logits, f_w, f_ids, 2, *flags)
