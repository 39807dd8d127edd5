"""DeepSeek-V2 / V3 shared experts run inside the QuantExperts block (sailfish.fuse.fold_shared_experts,
QuantExperts(num_shared=S)): tiny random transformers models (nothing downloaded), the folded model
against the unfolded one (quantize_model(fuse=False)) per element, its state_dict and checkpoint the
unfolded model's, and the blocks that must stay unfolded; QuantExperts holding shared experts on its
own, and the input-feature concatenation that puts the shared down projection back together."""
import copy
import json

import pytest
import torch
from torch import nn

from helpers import UNIT_ROUNDOFF, assert_compiles_to_eager_logits, desc_act_g_idx, random_quantized
from test_moe import assert_moe_close, moe_bound, with_shared
import sailfish
from sailfish import QuantExperts, QuantLinear, load_quantized, save_quantized
from sailfish.formats.experts import stack
from sailfish.formats.shard import concat_quantized, slice_quantized
from sailfish.fuse import SharedExpertsMoE, fuse_projections, unfused_layers

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

F16, BF16 = torch.float16, torch.bfloat16
H, I, E, S, TOPK, VOCAB = 64, 32, 6, 2, 2, 64


@pytest.fixture
def reference_ops(monkeypatch):
    """Whole models on the CPU run the ops' PyTorch references (the kernels have their own tests,
    test_moe's shared-experts cases among them), not the Triton interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def tiny_deepseek(arch: str, dtype):
    """A 2-layer DeepSeek-V2 / V3 model, both layers MoE with S shared experts, random weights."""
    common = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=2 * I, moe_intermediate_size=I,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=E,
                  num_experts_per_tok=TOPK, n_shared_experts=S, first_k_dense_replace=0, kv_lora_rank=16,
                  q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, pad_token_id=0,
                  eos_token_id=None, bos_token_id=None)
    if arch == "deepseek_v2":
        cfg = transformers.DeepseekV2Config(**common)
    else:
        cfg = transformers.DeepseekV3Config(n_group=2, topk_group=1, **common)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # (norms of 1: block inputs and outputs of order 1)
            p.fill_(1) if "norm" in name else p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.01)
    return model


def folded_and_unfolded(arch, dtype, **quant):
    model = tiny_deepseek(arch, dtype)
    folded = sailfish.quantize_model(copy.deepcopy(model), **quant)
    return folded, sailfish.quantize_model(model, fuse=False, **quant)


BLOCKS = ["model.layers.0.mlp", "model.layers.1.mlp"]
CASES = [("deepseek_v2", F16, 32, True, "gptq"), ("deepseek_v3", BF16, -1, False, "compressed-tensors")]


def unfolded_bound(block, x, ids, tw):
    """(ref, bound): the float64 block on the unfolded block's dequantized weights (the routed
    experts' sum plus the shared MLP) and the largest error the unfolded block can make: the
    routed block's bound (test_moe.moe_bound), the shared MLP's as a one-expert block whose gate
    and up layers, silu and product each round to the dtype, and their 16-bit sum."""
    # (exact weights, each one's rounding in the bound: the kernels' scale_acc configs multiply
    # s * (q - z) exactly, the others rounded; moe_bound's weights_rounded)
    w13, w2 = (w.double() for w in block.experts.dequantize(rounded=False))
    mlp = block.shared_experts
    routed, d_routed = moe_bound(x, ids, tw, w13, w2, x.dtype, weights_rounded=True)
    exact = lambda layer: layer.quantized_weight().dequantize(rounded=False).double()  # noqa: E731
    gate_up = torch.cat([exact(mlp.gate_proj), exact(mlp.up_proj)])[None]
    m = x.shape[0]
    shared, d_shared = moe_bound(x, torch.zeros(m, 1, dtype=torch.long), torch.ones(m, 1), gate_up,
                                 exact(mlp.down_proj)[None], x.dtype, silu_rounded=True, gate_up_rounded=True,
                                 weights_rounded=True)
    ref, d = routed + shared, d_routed + d_shared
    return ref, d + UNIT_ROUNDOFF[x.dtype] * (ref.abs() + d)


@pytest.mark.parametrize("arch,dtype,gs,sym,fmt", CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_folded_model_equals_unfolded(arch, dtype, gs, sym, fmt, reference_ops, tmp_path):
    folded, unfolded = folded_and_unfolded(arch, dtype, group_size=gs, sym=sym)
    report = folded.sailfish_report
    assert report["shared_experts_folded"] == BLOCKS and report["not_fused"] == {}
    for name in BLOCKS:
        block = folded.get_submodule(name)
        assert isinstance(block, SharedExpertsMoE) and isinstance(block, type(unfolded.get_submodule(name)))
        assert "shared_experts" not in block._modules and block.experts.num_shared == S
        assert block.experts.w13_qweight.shape[0] == E + S and "num_shared=2" in repr(block.experts)

    # the state dict: the unfolded model's keys, shapes, dtypes and values
    a, b = folded.state_dict(), unfolded.state_dict()
    assert sorted(a) == sorted(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert sorted(unfused_layers(folded)) == sorted(unfused_layers(unfolded))

    # each MoE block, on the input the folded model gives it: both blocks within their bounds of the
    # float64 block (the folded one rounds every shared expert's row once and adds all rows in fp32;
    # the unfolded one rounds gate, up, silu, the product, the shared MLP's and the routed output and
    # their sum), so they differ by at most the two bounds
    seen = {}
    hooks = [folded.get_submodule(n).register_forward_hook(
        lambda m, args, out, n=n: seen.__setitem__(n, (args[0], out))) for n in BLOCKS]
    ids = torch.randint(1, VOCAB, (2, 5))
    with torch.no_grad():
        logits = folded(ids).logits
        for h in hooks:
            h.remove()
        for name in BLOCKS:
            x, y_folded = seen[name]
            block, twin = folded.get_submodule(name), unfolded.get_submodule(name)
            y_unfolded = twin(x)
            x = x.reshape(-1, H)
            _, tw, top = twin.gate(x)
            ref, bound = unfolded_bound(twin, x, top, tw.float())
            w13, w2 = block.experts.dequantize(rounded=False)
            _, bound_folded = moe_bound(x, *with_shared(top, tw.float(), E, S), w13, w2, dtype, weights_rounded=True)
            y_folded, y_unfolded = y_folded.reshape(-1, H), y_unfolded.reshape(-1, H)
            assert_moe_close(y_folded, ref, bound_folded)
            assert_moe_close(y_unfolded, ref, bound)
            assert_moe_close(y_folded, y_unfolded.double(), bound_folded + bound)

    # load_state_dict of the unfolded model's state dict fills a folded model
    other = folded_and_unfolded(arch, dtype, group_size=gs, sym=sym)[0]
    with torch.no_grad():
        for name in BLOCKS:  # (the shared experts included)
            for buf in other.get_submodule(name).experts.buffers():
                buf.zero_()
    other.load_state_dict(b)
    with torch.no_grad():
        assert torch.equal(other(ids).logits, logits)

    # save_quantized writes the unfolded model's checkpoint; it loads folded, with the same logits
    save_quantized(folded, str(tmp_path / "folded"), format=fmt)
    save_quantized(unfolded, str(tmp_path / "unfolded"), format=fmt)
    ta, tb = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("folded", "unfolded"))
    assert sorted(ta) == sorted(tb) and all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in tb)
    assert "model.layers.1.mlp.shared_experts.down_proj." + ("qweight" if fmt == "gptq" else "weight_packed") in ta
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("folded", "unfolded")]
    assert configs[0] == configs[1]
    loaded = load_quantized(str(tmp_path / "folded"))
    assert loaded.sailfish_report["shared_experts_folded"] == BLOCKS
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)


def test_blocks_that_stay_unfolded(reference_ops):
    """A shared MLP of another group size, one with act-order, and a block whose forward differs
    stay as they are, each with its reason; the others fold."""
    model = sailfish.quantize_model(tiny_deepseek("deepseek_v2", F16), group_size=32, fuse=False)
    blocks = [model.get_submodule(n) for n in BLOCKS]
    # layer 0: down_proj with groups of 64
    down = blocks[0].shared_experts.down_proj
    linear = nn.Linear(down.in_features, H, bias=False, dtype=F16)
    with torch.no_grad():
        linear.weight.copy_(down.dequantize())
    blocks[0].shared_experts.down_proj = QuantLinear.from_linear(linear, group_size=64)
    # layer 1: a forward of its own
    cls = type(blocks[1])

    class Scaled(cls):
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    blocks[1].__class__ = Scaled
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model)
    reasons = model.sailfish_report["not_fused"]
    assert model.sailfish_report["shared_experts_folded"] == []
    assert "down_proj has (group_size, sym, dtype) (64," in reasons["model.layers.0.mlp.shared_experts"]
    assert "Scaled.forward is not transformers' DeepSeek-V2 / V3 MoE forward" in \
        reasons["model.layers.1.mlp.shared_experts"]
    assert all(type(b) is not SharedExpertsMoE and b.experts.num_shared == 0 for b in blocks)
    after = model.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], v) for k, v in before.items())

    # act-order shared projections (GPTQ desc_act), and experts with act-order
    model = sailfish.quantize_model(tiny_deepseek("deepseek_v2", F16), group_size=32, fuse=False)
    mlp = model.model.layers[0].mlp.shared_experts
    mlp.up_proj = QuantLinear.from_quantized(random_quantized(H, S * I, 32, True, F16, desc_act_g_idx(H, 32)))
    layer1 = model.model.layers[1].mlp
    layer1.experts = QuantExperts(E, H, I, group_size=32, act_order=True)
    fuse_projections(model)
    reasons = model.sailfish_report["not_fused"]
    assert "up_proj has (group_size, sym, dtype) (32, True, torch.float16), act-order" in \
        reasons["model.layers.0.mlp.shared_experts"]
    assert "the experts have act-order" in reasons["model.layers.1.mlp.shared_experts"]

    # rank 0's tensor-parallel shard of the shared MLP (width S * I / 2 = I): one shared expert of
    # the routed width, but only part of the sum (its down_proj's output is summed over the ranks)
    model = sailfish.quantize_model(tiny_deepseek("deepseek_v2", F16), group_size=32, fuse=False)
    mlp = model.model.layers[0].mlp.shared_experts
    for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        setattr(mlp, name, getattr(mlp, name).shard(0, 2, dim))
    fuse_projections(model)
    assert model.sailfish_report["shared_experts_folded"] == ["model.layers.1.mlp"]
    assert "has width 32, not config.n_shared_experts=2 times the experts' intermediate size 32" in \
        model.sailfish_report["not_fused"]["model.layers.0.mlp.shared_experts"]


def test_quant_experts_with_shared_state_dict():
    """A QuantExperts holding shared experts on its own: its state_dict holds the routed experts
    under its keys and the shared MLP's projections under `shared_experts.*`, which load back
    (strictly: a missing or stray shared key is reported)."""
    torch.manual_seed(1)
    routed = QuantExperts.from_packed(stack([random_quantized(H, 2 * I, 32, False, BF16) for _ in range(E)]),
                                      stack([random_quantized(I, H, 32, False, BF16) for _ in range(E)]))
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
    y = layer(x, ids, tw)  # (the kernels, or the interpreter) with the shared experts at weight 1
    assert_moe_close(y, *moe_bound(x, *with_shared(ids, tw, E, S), *layer.dequantize(rounded=False), BF16,
                                   weights_rounded=True))
    assert torch.equal(fresh(x, ids, tw), y)
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


def test_folded_model_compiles_and_pickles(reference_ops, tmp_path):
    """The folded block runs under torch.compile(fullgraph=True) (a graph break raises) with the
    eager logits; deepcopy and torch.save of the whole model keep it folded."""
    model = sailfish.quantize_model(tiny_deepseek("deepseek_v2", F16), group_size=32)
    ids = torch.randint(1, VOCAB, (2, 5))
    assert_compiles_to_eager_logits(model, ids)
    with torch.no_grad():
        want = model(ids).logits
    torch.save(model, tmp_path / "m.pt")
    for twin in (copy.deepcopy(model), torch.load(tmp_path / "m.pt", weights_only=False)):
        assert isinstance(twin.model.layers[1].mlp, SharedExpertsMoE)
        with torch.no_grad():
            assert torch.equal(twin(ids).logits, want)


def test_dequantized_reference_unfolds(reference_ops):
    """bench.llama.dequantized_reference of a folded model is that of the unfolded one: transformers'
    block with its shared MLP, the same nn.Linear weights, the same logits."""
    from sailfish.bench.llama import dequantized_reference

    base = tiny_deepseek("deepseek_v2", F16)
    folded = sailfish.quantize_model(copy.deepcopy(base), group_size=32)
    unfolded = sailfish.quantize_model(copy.deepcopy(base), group_size=32, fuse=False)
    ref_f, ref_u = dequantized_reference(folded, base), dequantized_reference(unfolded, base)
    assert isinstance(folded.model.layers[0].mlp, SharedExpertsMoE)  # (the model is left as it was)
    assert type(ref_f.model.layers[0].mlp) is type(unfolded.model.layers[0].mlp)
    a, b = ref_f.state_dict(), ref_u.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)
    ids = torch.randint(1, VOCAB, (2, 5))
    with torch.no_grad():
        assert torch.equal(ref_f(ids).logits, ref_u(ids).logits)
