"""sailfish::router_topk (ops/router.py, kernels/router.py) against transformers' router formula
(router_topk_reference): the ids exactly where the reference's probabilities are distinct, the
weights per element within the bound the module doc derives, ties, NaN / Inf rows, bad input,
and registration (opcheck, torch.compile fullgraph, CUDA plans and graphs)."""
import pytest
import torch

from sailfish.ops import router as R
from sailfish.ops.router import router_topk, router_topk_reference

U = 2.0 ** -24  # fp32 unit roundoff
EXP_ULPS = 4  # c of the bound: the GPU's ex2.approx (the interpreter's numpy exp: < 1)
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


def weight_tolerance(logits, ref32, top_k, out_dtype):
    """Per element: twice the module doc's bound (4R + 2c + E + k + 3) fp32 ulps of |ref32| (both
    sides may be that far from the exact value), plus one rounding to out_dtype."""
    x = logits.float()
    R_ = (x - x.max(dim=-1, keepdim=True).values).abs().amax(dim=-1, keepdim=True)
    b = 2 * (4 * R_ + 2 * EXP_ULPS + x.shape[-1] + top_k + 3) * U
    return ref32.abs() * (b + HALF_ULP[out_dtype] * (1 + b)) + SUBNORMAL[out_dtype]


def check_against_reference(logits, top_k, renormalize, fp32_weights):
    w, ids = router_topk(logits, top_k, renormalize, fp32_weights)
    w_ref, ids_ref = router_topk_reference(logits, top_k, renormalize, fp32_weights)
    ref32, _ = router_topk_reference(logits.cpu(), top_k, renormalize, True)
    assert w.dtype == w_ref.dtype and ids.dtype == torch.int64 and w.shape == ids.shape == (logits.shape[0], top_k)
    assert torch.equal(ids, ids_ref)
    err = (w.cpu().float() - ref32).abs()
    tol = weight_tolerance(logits.cpu(), ref32, top_k, w.dtype)
    assert (err <= tol).all(), (err / ref32.abs()).max().item() / U


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


def test_torch_compile_fullgraph(device):
    """The op traces through its fake implementation (fullgraph: no break) and gives eager's output."""
    from torch.nn import functional as F

    h = torch.randn(5, 32, device=device).half()
    weight = torch.randn(60, 32, device=device).half()

    def router(h):
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
print("checked")
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernel itself")
def test_kernel_compiles_for_sm90(tmp_path):
    """The interpreter does not run Triton's compiler: compile the kernel's variants for sm_90."""
    from helpers import run_compile_child
    run_compile_child(_SM90_CHILD, tmp_path)
