"""Fused projections (sailfish.fuse): concatenation of weights along N (formats/shard.py),
the fused layers (segments, per-projection state dicts, per-segment tensor-parallel shards)
and transformers models run through them.

Exactness: concatenation and slicing are checked bit for bit; a fused layer's output
against the float64 product of the stacked parts' weights within the per-element bound of
an fp32-accumulating kernel (helpers.elementwise_bound), since the fused GEMM has another
shape than the parts' and may sum in another order. Whole models: with the fused layer's
GEMM computed per segment (the parts' shapes), the fused model must equal the unfused one
bit for bit, which checks everything fusion changes except that summation order."""
import pytest
import torch

from helpers import assert_close_per_element, make_g_idx, random_quantized
from sailfish.formats.qqq import quantize_qqq
from sailfish.formats.shard import concat_qqq, concat_quantized, concat_weight, slice_weight

F16, BF16 = torch.float16, torch.bfloat16
WIDTHS = (64, 32, 32)  # q, k, v of a GQA layer (or gate, up with two)


def w4a16_parts(k, gs, sym, gidx, dtype, widths=WIDTHS):
    g_idx = make_g_idx(gidx, k, gs)  # one g_idx for all parts: projections of one input
    return [random_quantized(k, n, gs, sym, dtype, g_idx) for n in widths]


def w4a8_parts(k, gs, widths=WIDTHS):
    return [quantize_qqq(torch.randn(n, k), gs) for n in widths]


def assert_same_weight(a, b):
    for f in ("qweight", "scales", "zeros", "g_idx", "s_ch", "s_g"):
        x, y = getattr(a, f, None), getattr(b, f, None)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), f
    assert a.group_size == b.group_size


def unstack(fused, widths):
    out, start = [], 0
    for n in widths:
        out.append(slice_weight(fused, 0, start, start + n))
        start += n
    return out


# ----------------------------------------------------------------------------------
# 1. Concatenation along N: the exact inverse of slice_weight along N
# ----------------------------------------------------------------------------------
W4A16_FORMATS = [(gs, sym, gidx) for gs in (32, 64, 128, 256, -1) for sym in (True, False)
                 for gidx in (("none",) if gs == -1 else ("none", "descact", "gidx"))]


@pytest.mark.parametrize("gs,sym,gidx", W4A16_FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_concat_w4a16_exact(gs, sym, gidx, dtype):
    k = 320  # ragged last group for 64 / 128 / 256
    parts = w4a16_parts(k, gs, sym, gidx, dtype)
    fused = concat_quantized(parts)
    assert fused.out_features == sum(WIDTHS) and fused.sym == sym and fused.dtype == dtype
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert torch.equal(fused.dequantize(rounded=False), torch.cat([p.dequantize(rounded=False) for p in parts]))
    for got, want in zip(unstack(fused, WIDTHS), parts):
        assert_same_weight(got, want)
    assert concat_weight(parts).qweight.shape == fused.qweight.shape


@pytest.mark.parametrize("gs", [-1, 128])
def test_concat_w4a8_exact(gs):
    parts = w4a8_parts(320, gs)
    fused = concat_qqq(parts)
    assert torch.equal(fused.int8_weight(), torch.cat([p.int8_weight() for p in parts]))
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    for got, want in zip(unstack(fused, WIDTHS), parts):
        assert_same_weight(got, want)
    assert concat_weight(parts).s_ch.shape == (sum(WIDTHS),)


def test_concat_errors():
    a = random_quantized(256, 64, 128, True, F16)
    with pytest.raises(ValueError, match=r"parts must be a non-empty list of QuantizedWeights"):
        concat_quantized([])
    with pytest.raises(TypeError, match=r"parts\[1\] must be a QuantizedWeight, got QQQWeight"):
        concat_quantized([a, quantize_qqq(torch.randn(64, 256), 128)])
    cases = [
        (random_quantized(512, 64, 128, True, F16), r"parts\[1\] has in_features=512 but parts\[0\] has in_features=256"),
        (random_quantized(256, 64, 64, True, F16), r"group_size=64 but parts\[0\] has group_size=128"),
        (random_quantized(256, 64, 128, True, BF16), r"dtype=torch.bfloat16 but parts\[0\] has dtype=torch.float16"),
        (random_quantized(256, 64, 128, False, F16), r"sym=False but parts\[0\] has sym=True"),
        (random_quantized(256, 64, 128, True, F16, make_g_idx("descact", 256, 128)),
         r"act-order \(g_idx given\)=True but parts\[0\] has act-order \(g_idx given\)=False"),
    ]
    for b, match in cases:
        with pytest.raises(ValueError, match=match):
            concat_quantized([a, b])
    # act-order parts join only with the same g_idx
    g1, g2 = make_g_idx("descact", 256, 128), make_g_idx("descact", 256, 128)
    assert not torch.equal(g1, g2)
    with pytest.raises(ValueError, match=r"parts\[1\] has a different g_idx than parts\[0\]"):
        concat_quantized([random_quantized(256, 64, 128, True, F16, g1), random_quantized(256, 64, 128, True, F16, g2)])
    with pytest.raises(ValueError, match=r"parts\[1\] has group_size=128 but parts\[0\] has group_size=-1"):
        concat_qqq([quantize_qqq(torch.randn(64, 256), -1), quantize_qqq(torch.randn(64, 256), 128)])
