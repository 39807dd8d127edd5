"""Property tests (hypothesis): QuantLinear and QuantLinearW4A8 against their independent
references over random small shapes, group sizes, sym/asym, act-order, dtypes and bias
(W4A8: int8 and fp8 activations).

Bounded (max_examples) and derandomized so that CI, on the CPU interpreter, runs the same
few examples in a predictable time; each example checks every output element.
"""
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import U32, UNIT_ROUNDOFF, assert_close_per_element, make_g_idx, random_quantized
from sailfish import GROUP_SIZES, GROUP_SIZES_W4A8, QuantLinear, QuantLinearW4A8
from sailfish.formats.qqq import fp8_weight, quantize_activations, quantize_qqq
from test_w4a8_fp8 import acc_bound

DTYPES = (torch.float16, torch.bfloat16)
# fp8 (e4m3) activations need sm_89+ on a GPU; the CPU interpreter runs them anywhere
ACT_DTYPES = ("int8", "fp8") if not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 9) \
    else ("int8",)
# the largest K tile of the W4A8 configs (ops/w4a8.py): acc_bound for it holds for smaller ones
W4A8_MAX_BLOCK_K = 256
PROFILE = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow])


@st.composite
def w4a16_cases(draw):
    gs = draw(st.sampled_from(GROUP_SIZES))
    return dict(
        m=draw(st.integers(1, 20)),
        k=16 * draw(st.integers(1, 40)),     # up to 640: not always a tile or group multiple
        n=8 * draw(st.integers(1, 24)),
        gs=gs,
        sym=draw(st.booleans()),
        gidx=draw(st.sampled_from(["none"] if gs == -1 else ["none", "descact", "gidx"])),
        dtype=draw(st.sampled_from(DTYPES)),
        bias=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@PROFILE
@given(case=w4a16_cases())
def test_quantlinear_matches_reference(case, device):
    torch.manual_seed(case["seed"])
    k, n, gs, dtype = case["k"], case["n"], case["gs"], case["dtype"]
    qw = random_quantized(k, n, gs, case["sym"], dtype, make_g_idx(case["gidx"], k, gs, device), device)
    bias = torch.randn(n, device=device).to(dtype) if case["bias"] else None
    layer = QuantLinear.from_quantized(qw, bias)
    # the layer stores exactly the weight it was given
    assert torch.equal(layer.dequantize(), qw.dequantize())
    x = torch.randn(case["m"], k, device=device).to(dtype)
    assert_close_per_element(layer(x), x, qw.dequantize(), bias)


@st.composite
def w4a8_cases(draw):
    return dict(
        m=draw(st.integers(1, 20)),
        k=16 * draw(st.integers(1, 40)),
        n=8 * draw(st.integers(1, 24)),
        gs=draw(st.sampled_from(GROUP_SIZES_W4A8)),
        act_dtype=draw(st.sampled_from(ACT_DTYPES)),
        dtype=draw(st.sampled_from(DTYPES)),
        bias=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@PROFILE
@given(case=w4a8_cases())
def test_quantlinear_w4a8_matches_reference(case, device):
    torch.manual_seed(case["seed"])
    k, n, dtype = case["k"], case["n"], case["dtype"]
    qw = quantize_qqq(torch.randn(n, k, device=device), case["gs"])
    bias = torch.randn(n, device=device) if case["bias"] else None
    layer = QuantLinearW4A8.from_quantized(qw, bias, act_dtype=case["act_dtype"])
    x = torch.randn(case["m"], k, device=device).to(dtype)
    x_q, s_tok = quantize_activations(x, case["act_dtype"])
    y = layer(x)
    if case["act_dtype"] == "int8":
        # reference: the per-token int8 activations (formats) times the effective weight, in
        # float64; the layer's result is that product rounded once (plus fp32 epilogue error)
        x_deq = x_q.double() * s_tok.double()[:, None]
        assert_close_per_element(y, x_deq, qw.dequantize(), bias)
        return
    # fp8: the e4m3 activations times formats.qqq.fp8_weight, accumulated in the tensor cores'
    # precision (test_w4a8_fp8.acc_bound), scaled, then rounded once to the output dtype
    w = fp8_weight(qw)
    ref = (s_tok.double()[:, None] * (x_q.double() @ w.double().T) * qw.s_ch.double()[None, :]
           + (0 if bias is None else bias.double()))
    slack = acc_bound(x_q, w, W4A8_MAX_BLOCK_K, device) * (s_tok.double()[:, None] * qw.s_ch.double().abs()[None, :])
    # (+ the fp32 epilogue: two scale products and the bias addition, one rounding each of a
    # value at most |ref| + |bias| + slack)
    slack = slack + 3 * U32 * (ref.abs() + slack + (0 if bias is None else bias.double().abs()))
    u = UNIT_ROUNDOFF[dtype]
    bound = slack + u * (ref.abs() + slack)
    assert ((y.double() - ref).abs() <= bound).all()
