"""Property tests (hypothesis): QuantLinear and QuantLinearW4A8 against their independent
references over random small shapes, group sizes, sym/asym, act-order, dtypes and bias.

Bounded (max_examples) and derandomized so that CI, on the CPU interpreter, runs the same
few examples in a predictable time; each example checks every output element.
"""
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import assert_close_per_element, make_g_idx, random_quantized
from sailfish import GROUP_SIZES, GROUP_SIZES_W4A8, QuantLinear, QuantLinearW4A8
from sailfish.formats.qqq import quantize_activations, quantize_qqq

DTYPES = (torch.float16, torch.bfloat16)
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
    layer = QuantLinearW4A8.from_quantized(qw, bias)
    x = torch.randn(case["m"], k, device=device).to(dtype)
    # reference: the per-token int8 activations (formats) times the effective weight, in
    # float64; the layer's result is that product rounded once (plus fp32 epilogue error)
    x_q, s_tok = quantize_activations(x)
    x_deq = x_q.double() * s_tok.double()[:, None]
    assert_close_per_element(layer(x), x_deq, qw.dequantize(), bias)
