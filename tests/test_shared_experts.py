"""QuantExperts holding DeepSeek's shared experts (num_shared): the shared MLP's projections packed
after the routed experts and back, exactly; its state_dict."""
import pytest
import torch

from helpers import random_quantized
from sailfish import QuantExperts
from sailfish.formats.shard import concat_quantized, slice_quantized

F16, BF16 = torch.float16, torch.bfloat16
H, I, E, S, TOPK = 64, 32, 6, 2, 2


def test_quant_experts_with_shared_state_dict():
    """A QuantExperts holding shared experts on its own: its state_dict holds the routed experts
    under its keys and the shared MLP's projections under `shared_experts.*`, which load back
    (strictly: a missing or stray shared key is reported)."""
    torch.manual_seed(1)
    routed = QuantExperts(E, H, I, group_size=32, sym=False, dtype=BF16)
    for name, b in routed.named_buffers():
        b.copy_(torch.randint(0, 16, b.shape) if b.dtype == torch.int32 else torch.rand(b.shape))
    weights = (random_quantized(H, S * I, 32, False, BF16), random_quantized(H, S * I, 32, False, BF16),
               random_quantized(S * I, H, 32, False, BF16))
    layer = routed.with_shared(*weights)
    assert layer.num_shared == S and layer.num_experts == E
    got = layer.shared_weights()
    for qw, want in zip(got, weights):  # exactly what went in
        assert torch.equal(qw.qweight, want.qweight) and torch.equal(qw.scales, want.scales)
        assert torch.equal(qw.zeros, want.zeros) and qw.g_idx is None
    sd = layer.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items() if not k.startswith("shared_experts.")} == \
        {k: tuple(v.shape) for k, v in routed.state_dict().items()}
    assert all(torch.equal(v, routed.state_dict()[k]) for k, v in sd.items() if not k.startswith("shared_experts."))
    assert {"shared_experts.gate_proj.qweight", "shared_experts.down_proj.zeros"} <= set(sd)
    fresh = QuantExperts(E, H, I, group_size=32, sym=False, dtype=BF16, num_shared=S)
    fresh.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(fresh.buffers(), layer.buffers()))
    x = torch.randn(3, H).to(BF16)
    ids, tw = torch.tensor([[0, 1], [2, 5], [4, 3]]), torch.rand(3, TOPK)
    assert torch.equal(fresh(x, ids, tw), layer(x, ids, tw))
    del sd["shared_experts.up_proj.scales"]
    sd["shared_experts.extra.weight"] = torch.zeros(1)
    result = fresh.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["shared_experts.up_proj.scales"]
    assert result.unexpected_keys == ["shared_experts.extra.weight"]


def test_quant_experts_num_shared_checks():
    with pytest.raises(ValueError, match=r"num_shared=-1 must be an int >= 0"):
        QuantExperts(E, H, I, num_shared=-1)
    with pytest.raises(ValueError, match=r"num_shared=2 needs act_order=False"):
        QuantExperts(E, H, I, act_order=True, num_shared=2)
    routed = QuantExperts(E, H, I, group_size=32)
    gate, down = random_quantized(H, S * I, 32, True, F16), random_quantized(S * I, H, 32, True, F16)
    with pytest.raises(ValueError, match=r"gate_proj has 40 output features, not a multiple of .* 32"):
        routed.with_shared(random_quantized(H, 40, 32, True, F16), gate, down)
    with pytest.raises(ValueError, match=r"down_proj has .* \(64, 64, 64, torch.float16, True, True\); 2 shared "
                                         r"experts of these experts need \(64, 64, 32,"):
        routed.with_shared(gate, gate, random_quantized(S * I, H, 64, True, F16))
    with pytest.raises(ValueError, match=r"holds no shared experts"):
        routed.shared_weights()


@pytest.mark.parametrize("gs,sym", [(32, False), (-1, False), (64, True)])
def test_concat_along_input_features(gs, sym):
    """concat_quantized(dim=1) is the exact inverse of input-feature slices on group boundaries."""
    qw = random_quantized(192, 48, gs, sym, F16)
    parts = [slice_quantized(qw, 1, lo, lo + 64) for lo in (0, 64, 128)]
    back = concat_quantized(parts, dim=1)
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.scales, qw.scales)
    assert (back.zeros is None) == sym and (sym or torch.equal(back.zeros, qw.zeros))
    assert torch.equal(back.dequantize(), qw.dequantize())


def test_concat_along_input_features_refuses():
    a, b = random_quantized(96, 48, 64, True, F16), random_quantized(64, 48, 64, True, F16)
    with pytest.raises(ValueError, match=r"parts\[0\] has in_features=96, not a multiple of group_size=64"):
        concat_quantized([a, b], dim=1)
    c, d = random_quantized(64, 48, -1, True, F16), random_quantized(64, 48, -1, True, F16)
    with pytest.raises(ValueError, match=r"parts\[1\] has a different scales than parts\[0\]: a concatenation "
                                         r"along input features"):
        concat_quantized([c, d], dim=1)
    with pytest.raises(ValueError, match=r"parts\[1\] has out_features=32 but parts\[0\] has out_features=48"):
        concat_quantized([b, random_quantized(64, 32, 64, True, F16)], dim=1)
    with pytest.raises(ValueError, match=r"dim=2 is not supported"):
        concat_quantized([b, b], dim=2)
