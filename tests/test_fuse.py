"""Fused projections (sailfish.fuse): concatenation of weights along N (formats/shard.py),
the fused layers (segments, per-projection state dicts, per-segment tensor-parallel shards)
and transformers models run through them.

Exactness: concatenation and slicing are checked bit for bit; a fused layer's output
against the float64 product of the stacked parts' weights within the per-element bound of
an fp32-accumulating kernel (helpers.elementwise_bound), since the fused GEMM has another
shape than the parts' and may sum in another order. Whole models: with the fused layer's
GEMM computed per segment (the parts' shapes), the fused model must equal the unfused one
bit for bit, which checks everything fusion changes except that summation order."""
import copy
import io
import re

import pytest
import torch

from helpers import assert_close_per_element, assert_compiles_to_eager_logits, make_g_idx, random_quantized
import sailfish
from sailfish import QuantLinear, QuantLinearW4A8
from sailfish.formats.qqq import quantize_activations, quantize_qqq
from sailfish.formats.shard import concat_qqq, concat_quantized, concat_weight, slice_weight
from sailfish.fuse import FusedOutput, FusedQuantLinear, FusedQuantLinearW4A8, _input_only_through

transformers = pytest.importorskip("transformers")  # the hf extra (part of the test extra)

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


# ----------------------------------------------------------------------------------
# 2. Fused layers: output, per-projection state dicts, tensor-parallel shards
# ----------------------------------------------------------------------------------

NAMES = ("q_proj", "k_proj", "v_proj")
LAYER_CASES = [(128, True, "none", F16, True), (64, False, "descact", BF16, False), (-1, False, "none", F16, False),
               (32, True, "gidx", F16, True)]


def w4a16_layers(k, gs, sym, gidx, dtype, bias, device="cpu"):
    return [QuantLinear.from_quantized(p.__class__(*(t.to(device) if isinstance(t, torch.Tensor) else t
                                                     for t in (p.qweight, p.scales, p.zeros, p.g_idx)),
                                                   p.group_size),
                                       torch.randn(p.out_features, device=device).to(dtype) if bias else None)
            for p in w4a16_parts(k, gs, sym, gidx, dtype)]


def w4a8_layers(k, gs, bias, act_dtype="int8"):
    return [QuantLinearW4A8.from_quantized(p, torch.randn(p.out_features) if bias else None, act_dtype=act_dtype)
            for p in w4a8_parts(k, gs)]


def fuse(layers):
    cls = FusedQuantLinear if isinstance(layers[0], QuantLinear) else FusedQuantLinearW4A8
    return cls.from_layers(layers, NAMES)


def stacked(layers):
    w = torch.cat([m.dequantize() for m in layers])
    b = torch.cat([m.bias for m in layers]) if layers[0].bias is not None else None
    return w, b


def unfused_state(layers):
    return {f"{n}.{k}": v for n, m in zip(NAMES, layers) for k, v in m.state_dict().items()}


def assert_same_state(a, b):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("gs,sym,gidx,dtype,bias", LAYER_CASES, ids=lambda v: str(v))
def test_fused_w4a16_layer(gs, sym, gidx, dtype, bias, device):
    k = 256
    layers = w4a16_layers(k, gs, sym, gidx, dtype, bias, device)
    fused = fuse(layers)
    assert type(fused) is FusedQuantLinear and isinstance(fused, QuantLinear)
    assert fused.segments == tuple(zip(NAMES, WIDTHS)) and fused.out_features == sum(WIDTHS)
    assert fused.act_order == (gidx != "none")
    w, b = stacked(layers)
    assert torch.equal(fused.dequantize(), w)
    x = torch.randn(2, 3, k, device=device).to(dtype)
    assert_close_per_element(fused(x), x, w, b)  # the parts' weights, any summation order
    for (name, part), layer in zip(fused.parts(), layers):
        assert type(part) is QuantLinear
        assert_same_state(part.state_dict(), layer.state_dict())
    # state dict: the unfused layers' tensors under their names, and back
    state = fused.state_dict()
    assert_same_state(state, unfused_state(layers))
    again = fuse(w4a16_layers(k, gs, sym, gidx, dtype, bias, device))
    again.load_state_dict(state)
    assert_same_state(again.state_dict(), state) and torch.equal(again.dequantize(), w)
    for n, layer in zip(NAMES, w4a16_layers(k, gs, sym, gidx, dtype, bias, device)):
        layer.load_state_dict({key[len(n) + 1:]: v for key, v in state.items() if key.startswith(n + ".")})
        assert_same_state(layer.state_dict(), dict(fused.parts())[n].state_dict())


@pytest.mark.parametrize("gs,bias,act_dtype", [(-1, True, "int8"), (128, False, "int8"), (128, True, "fp8")])
def test_fused_w4a8_layer(gs, bias, act_dtype):
    k = 256
    layers = w4a8_layers(k, gs, bias, act_dtype)
    fused = fuse(layers)
    assert type(fused) is FusedQuantLinearW4A8 and fused.act_dtype == act_dtype
    w, b = stacked(layers)
    assert torch.equal(fused.dequantize(), w)
    assert_same_state(fused.state_dict(), unfused_state(layers))
    assert all(p.act_dtype == act_dtype for _, p in fused.parts())
    if act_dtype == "int8":  # one quantization of x for all segments: the unfused layers' x_q
        x = torch.randn(3, k).to(F16)
        x_q, s = quantize_activations(x)
        assert_close_per_element(fused(x), s[:, None] * x_q.float(), w, b)


def test_fused_layer_errors():
    a, b = w4a16_layers(256, 128, True, "none", F16, False)[:2]
    c = QuantLinear.from_quantized(random_quantized(256, 32, 128, True, F16), torch.zeros(32).half())
    with pytest.raises(ValueError, match=r"q_proj have a bias and k_proj do not"):
        FusedQuantLinear.from_layers([c, a], NAMES[:2])
    d = QuantLinear.from_quantized(random_quantized(256, 32, 64, True, F16))
    with pytest.raises(ValueError, match=r"k_proj has group_size=64 but q_proj has group_size=128"):
        FusedQuantLinear.from_layers([a, d], NAMES[:2])
    with pytest.raises(TypeError, match=r"k_proj is a QuantLinearW4A8; FusedQuantLinear stacks QuantLinear"):
        FusedQuantLinear.from_layers([a, w4a8_layers(256, -1, False)[0]], NAMES[:2])
    with pytest.raises(ValueError, match=r"must have the same length >= 2"):
        FusedQuantLinear.from_layers([a], NAMES[:1])
    g = [QuantLinear.from_quantized(random_quantized(256, 32, 128, True, F16, make_g_idx("descact", 256, 128)))
         for _ in range(2)]
    with pytest.raises(ValueError, match=r"k_proj has a different g_idx than q_proj"):
        FusedQuantLinear.from_layers(g, NAMES[:2])
    # a state dict whose projections cannot be fused (different g_idx) is a load error
    fused = FusedQuantLinear.from_layers([g[0], g[0]], NAMES[:2])
    state = {**{f"q_proj.{k}": v for k, v in g[0].state_dict().items()},
             **{f"k_proj.{k}": v for k, v in g[1].state_dict().items()}}
    with pytest.raises(RuntimeError, match=r"\{q_proj,k_proj\}: these projections cannot be fused: k_proj has a different g_idx"):
        fused.load_state_dict(state)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*k_proj.qweight"):
        fused.load_state_dict({k: v for k, v in state.items() if k != "k_proj.qweight"})
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*\"qkv_proj.qweight\""):
        torch.nn.ModuleDict({"qkv_proj": fused}).load_state_dict({**state, "qkv_proj.qweight": g[0].qweight})
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*\"q_proj.stray\""):
        fused.load_state_dict({**state, "q_proj.stray": g[0].qweight})


@pytest.mark.parametrize("fmt", ["w4a16-g128-bias", "w4a16-descact", "w4a8-g128", "w4a8-fp8"])
def test_fused_layer_shards_per_segment(fmt):
    k, world = 256, 2
    layers = {"w4a16-g128-bias": lambda: w4a16_layers(k, 128, True, "none", F16, True),
              "w4a16-descact": lambda: w4a16_layers(k, 64, False, "descact", BF16, False),
              "w4a8-g128": lambda: w4a8_layers(k, 128, True),
              "w4a8-fp8": lambda: w4a8_layers(k, -1, False, "fp8")}[fmt]()
    fused = fuse(layers)
    for r in range(world):  # column parallel: rank r holds q_r, k_r, v_r = the unfused shards
        shard = fused.shard(r, world, 0)
        assert type(shard) is type(fused) and shard.segments == tuple((n, w // world) for n, w in zip(NAMES, WIDTHS))
        assert_same_state(shard.state_dict(), unfused_state([m.shard(r, world, 0) for m in layers]))
        assert getattr(shard, "act_dtype", None) == getattr(fused, "act_dtype", None)
    rows = [fused.shard(r, world, 1) for r in range(world)]  # row parallel: K split, segments kept
    assert all(s.segments == fused.segments and s.in_features == k // world for s in rows)
    assert torch.equal(torch.cat([s.dequantize() for s in rows], dim=1), fused.dequantize())
    assert [s.bias is not None for s in rows] == [fused.bias is not None, False]


def test_fused_layer_colwise_style_in_place():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from sailfish.parallel import SailfishColwiseParallel
    fused = fuse(w4a16_layers(256, 128, True, "none", F16, True))
    state = fused.state_dict()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert parallelize_module(fused, init_device_mesh("cpu", (1,)), SailfishColwiseParallel()) is fused
    finally:
        dist.destroy_process_group()
    assert fused.segments == tuple(zip(NAMES, WIDTHS))
    assert_same_state(fused.state_dict(), state)


# ----------------------------------------------------------------------------------
# 3. transformers models run through the fused layers
# ----------------------------------------------------------------------------------
VOCAB = 300


def tiny_config(arch: str):
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    return {"llama": lambda: transformers.LlamaConfig(**common),
            "llama-bias": lambda: transformers.LlamaConfig(attention_bias=True, mlp_bias=True, **common),
            "mistral": lambda: transformers.MistralConfig(**common),
            "qwen2": lambda: transformers.Qwen2Config(**common),  # q/k/v with bias
            "qwen3": lambda: transformers.Qwen3Config(head_dim=32, **common),  # q_norm / k_norm
            }[arch]()


ARCHS = ["llama", "llama-bias", "mistral", "qwen2", "qwen3"]


def tiny_model(arch: str, dtype=F16):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(arch), dtype=dtype).eval()


@pytest.fixture
def reference_ops(monkeypatch):
    """The Sailfish ops' PyTorch reference on CPU tensors (the kernels are tested above and in
    test_w4a16 / test_w4a8; the interpreter would take seconds per decode step)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def per_segment(monkeypatch):
    """The fused layers compute each segment as its own layer (the unfused shapes), so a fused
    model must equal the unfused one bit for bit: everything but the fused GEMM's summation
    order, which test_fused_w4a16_layer / test_fused_w4a8_layer bound."""
    def forward(self, x):
        return torch.cat([part(x) for _, part in self.parts()], dim=-1)
    monkeypatch.setattr(FusedQuantLinear, "forward", forward)
    monkeypatch.setattr(FusedQuantLinearW4A8, "forward", forward)


def fused_and_unfused(arch, **quant):
    model = tiny_model(arch)
    return (sailfish.quantize_model(copy.deepcopy(model), **quant),
            sailfish.quantize_model(model, fuse=False, **quant))


def generate(model, ids):
    return model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static",
                          disable_compile=True, return_dict_in_generate=True, output_logits=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_model_equals_unfused(arch, reference_ops, per_segment):
    fused, unfused = fused_and_unfused(arch)
    report = fused.sailfish_report
    assert sorted(report["fused"]) == sorted(f"model.layers.{i}.{p}" for i in range(2)
                                             for p in ("self_attn.qkv_proj", "mlp.gate_up_proj"))
    assert report["not_fused"] == {} and report["quantized"] == unfused.sailfish_report["quantized"]
    attn = fused.model.layers[0].self_attn
    assert type(attn.qkv_proj) is FusedQuantLinear and type(attn.k_proj) is FusedOutput
    assert attn.qkv_proj.segments == (("q_proj", 128), ("k_proj", 64), ("v_proj", 64))
    assert (attn.qkv_proj.bias is not None) == (arch in ("llama-bias", "qwen2"))
    # the same state dict, key for key and byte for byte
    a, b = fused.state_dict(), unfused.state_dict()
    assert_same_state(dict(sorted(a.items())), dict(sorted(b.items())))
    ids = torch.randint(1, VOCAB, (2, 6))
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, unfused(ids).logits)
        g_f, g_u = generate(fused, ids), generate(unfused, ids)
    assert torch.equal(g_f.sequences, g_u.sequences)
    assert all(torch.equal(x, y) for x, y in zip(g_f.logits, g_u.logits))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_fused_moe_model_equals_unfused(arch, reference_ops, per_segment):
    """The MoE models' attention (and Qwen2-MoE's shared expert) fuse like the dense models'; the
    experts are QuantExperts either way."""
    from test_router import tiny_moe_model

    model = tiny_moe_model(arch, dtype=F16)
    fused = sailfish.quantize_model(copy.deepcopy(model))
    unfused = sailfish.quantize_model(model, fuse=False)
    want = [f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)]
    if arch == "qwen2_moe":
        want += [f"model.layers.{i}.mlp.shared_expert.gate_up_proj" for i in range(2)]
    assert sorted(fused.sailfish_report["fused"]) == sorted(want)
    assert fused.sailfish_report["not_fused"] == {}
    a, b = fused.state_dict(), unfused.state_dict()
    assert_same_state(dict(sorted(a.items())), dict(sorted(b.items())))
    ids = torch.randint(1, 128, (2, 6))
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, unfused(ids).logits)


def test_fused_deepseek_v2_model_equals_unfused(reference_ops, per_segment):
    """DeepSeek-V2's MLPs (its first dense layer and the MoE layers' shared experts) fuse gate / up;
    its MLA attention has no q / k / v to fuse and stays as it is."""
    cfg = transformers.DeepseekV2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
                                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                                        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                                        pad_token_id=0, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=F16).eval()
    fused = sailfish.quantize_model(copy.deepcopy(model))
    unfused = sailfish.quantize_model(model, fuse=False)
    assert sorted(fused.sailfish_report["fused"]) == ["model.layers.0.mlp.gate_up_proj",
                                                      "model.layers.1.mlp.shared_experts.gate_up_proj"]
    a, b = fused.state_dict(), unfused.state_dict()
    assert_same_state(dict(sorted(a.items())), dict(sorted(b.items())))
    ids = torch.randint(1, VOCAB, (2, 6))
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, unfused(ids).logits)


def test_fused_w4a8_model_equals_unfused(reference_ops, per_segment):
    fused, unfused = fused_and_unfused("qwen2", act_bits=8, group_size=128)
    assert type(fused.model.layers[1].mlp.gate_up_proj) is FusedQuantLinearW4A8
    ids = torch.randint(1, VOCAB, (2, 6))
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, unfused(ids).logits)


@pytest.mark.parametrize("quant", [{}, dict(act_bits=8, group_size=128)], ids=["w4a16", "w4a8"])
def test_fused_model_compiles_without_graph_breaks(quant, reference_ops):
    """fullgraph=True raises on a graph break; the eager backend runs the same ops, so the
    compiled model gives the eager model's logits (W4A8: its norms and silu * up stay the
    quantizing ops under compile, the W4A16 norms run the formula)."""
    model = sailfish.quantize_model(tiny_model("qwen3"), **quant)
    assert_compiles_to_eager_logits(model, torch.randint(1, VOCAB, (2, 6)))


def test_fuse_false_and_flag_errors():
    model = sailfish.quantize_model(tiny_model("llama"), fuse=False)
    assert "fused" not in model.sailfish_report
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    with pytest.raises(TypeError, match=r"fuse='yes' must be a bool"):
        sailfish.quantize_model(tiny_model("llama"), fuse="yes")
    from sailfish.hf import SailfishConfig
    assert SailfishConfig().fuse is True and SailfishConfig(fuse=False).to_dict()["fuse"] is False
    with pytest.raises(TypeError, match=r"fuse=1 must be a bool"):
        SailfishConfig(fuse=1)


def test_act_order_fuses_only_equal_g_idx(reference_ops, per_segment):
    """GPTQ act-order: q/k/v with one g_idx fuse; gate/up with different ones stay separate."""
    from sailfish.fuse import fuse_projections
    model = sailfish.quantize_model(tiny_model("llama"), fuse=False)
    shared = make_g_idx("descact", 128, 32)
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, NAMES), (layer.mlp, ("gate_proj", "up_proj"))):
            for n in names:
                g_idx = shared if parent is layer.self_attn else make_g_idx("descact", 128, 32)
                qw = random_quantized(128, getattr(parent, n).out_features, 32, False, F16, g_idx)
                setattr(parent, n, QuantLinear.from_quantized(qw))
    unfused = copy.deepcopy(model)
    fuse_projections(model)
    report = model.sailfish_report
    assert sorted(report["fused"]) == ["model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.qkv_proj"]
    assert model.model.layers[0].self_attn.qkv_proj.act_order
    assert set(report["not_fused"]) == {"model.layers.0.mlp.gate_up_proj", "model.layers.1.mlp.gate_up_proj"}
    assert all("up_proj has a different g_idx than gate_proj" in r for r in report["not_fused"].values())
    assert type(model.model.layers[0].mlp.up_proj) is QuantLinear
    ids = torch.randint(1, VOCAB, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, unfused(ids).logits)


def test_save_load_round_trip(tmp_path, reference_ops):
    """A fused model's checkpoint is the unfused model's, byte for byte; it loads fused or not."""
    from safetensors.torch import load_file
    fused, unfused = fused_and_unfused("qwen2", sym=False)
    sailfish.save_quantized(fused, str(tmp_path / "f"))
    sailfish.save_quantized(unfused, str(tmp_path / "u"))
    a, b = load_file(str(tmp_path / "f" / "model.safetensors")), load_file(str(tmp_path / "u" / "model.safetensors"))
    assert_same_state(dict(sorted(a.items())), dict(sorted(b.items())))
    assert (tmp_path / "f" / "config.json").read_text() == (tmp_path / "u" / "config.json").read_text()
    loaded = sailfish.load_quantized(str(tmp_path / "u"))
    assert sorted(loaded.sailfish_report["fused"]) == sorted(fused.sailfish_report["fused"])
    assert type(loaded.model.layers[0].self_attn.qkv_proj) is FusedQuantLinear
    plain = sailfish.load_quantized(str(tmp_path / "f"), fuse=False)
    assert type(plain.model.layers[0].self_attn.q_proj) is QuantLinear
    state = fused.state_dict()
    for m in (loaded, plain):
        assert_same_state(dict(sorted(m.state_dict().items())), dict(sorted(state.items())))
    ids = torch.randint(1, VOCAB, (2, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, fused(ids).logits)
    buf = io.BytesIO()  # whole-module pickles keep the fusion (hooks included)
    torch.save(fused, buf)
    buf.seek(0)
    with torch.no_grad():
        assert torch.equal(torch.load(buf, weights_only=False)(ids).logits, fused(ids).logits)
    # torch state dicts cross over too
    again = sailfish.quantize_model(tiny_model("qwen2"), sym=False)
    again.load_state_dict(unfused.state_dict())
    assert_same_state(again.state_dict(), state)
    with pytest.raises(TypeError, match=r"fuse=None must be a bool"):
        sailfish.load_quantized(str(tmp_path / "u"), fuse=None)


class _Uses:
    """forward bodies for the source check (never run)."""

    class Good(torch.nn.Module):
        def forward(self, x, scale=None):
            shape = (*x.shape[:-1], -1)
            return (self.gate_proj(x) * self.up_proj(x)).view(shape)

    class Reads(torch.nn.Module):
        def forward(self, x):
            return self.gate_proj(x) * self.up_proj(x) + x

    class Reassigns(torch.nn.Module):
        def forward(self, x):
            x = x * 2
            return self.gate_proj(x) * self.up_proj(x)

    class OtherInput(torch.nn.Module):
        def forward(self, x, y):
            return self.gate_proj(x) * self.up_proj(y)

    class Escapes(torch.nn.Module):
        def forward(self, x):
            up = self.up_proj
            return self.gate_proj(x) * up(x)

    class Misses(torch.nn.Module):
        def forward(self, x):
            return self.gate_proj(x)


def test_source_check():
    names = ("gate_proj", "up_proj")
    assert _input_only_through(_Uses.Good, names) is None
    for cls, match in ((_Uses.Reads, r"Reads.forward uses its input 'x' other than as the argument of gate_proj, up_proj"),
                       (_Uses.Reassigns, r"Reassigns.forward uses its input 'x' other than"),
                       (_Uses.OtherInput, r"uses self.up_proj other than as self.up_proj\(x\)"),
                       (_Uses.Escapes, r"uses self.up_proj other than as self.up_proj\(x\)"),
                       (_Uses.Misses, r"does not call up_proj")):
        reason = _input_only_through(cls, names)
        assert reason is not None and re.search(match, reason), reason


def test_unsupported_modules_stay_unfused_and_are_reported(reference_ops):
    from transformers.models.llama.modeling_llama import LlamaMLP
    from sailfish.fuse import fuse_projections

    class MyMLP(LlamaMLP):  # a subclass: its forward is not one Sailfish has checked
        pass

    model = tiny_model("llama")
    layer0 = model.model.layers[0]
    mlp = MyMLP(model.config).half()
    mlp.load_state_dict(layer0.mlp.state_dict())
    layer0.mlp = mlp
    model.model.layers[1].self_attn.register_forward_hook(lambda *a: None)
    unfused = sailfish.quantize_model(copy.deepcopy(model), skip=("lm_head", "model.layers.1.mlp.up_proj"), fuse=False)
    sailfish.quantize_model(model, skip=("lm_head", "model.layers.1.mlp.up_proj"))
    r = model.sailfish_report
    assert sorted(r["fused"]) == ["model.layers.0.self_attn.qkv_proj"]
    assert "MyMLP is not a module whose forward Sailfish has checked" in r["not_fused"]["model.layers.0.mlp.gate_up_proj"]
    assert "LlamaAttention has hooks" in r["not_fused"]["model.layers.1.self_attn.qkv_proj"]
    assert r["not_fused"]["model.layers.1.mlp.gate_up_proj"] == (
        "the projections are not Sailfish layers of one format: gate_proj is QuantLinear, up_proj is Linear")
    x = torch.randn(1, 3, 128).half()
    with torch.no_grad():  # the modules left unfused run as before
        for i, part in ((0, "mlp"), (1, "mlp")):
            got, want = model.model.layers[i].get_submodule(part), unfused.model.layers[i].get_submodule(part)
            assert torch.equal(got(x), want(x))
    # an unquantized model: nothing to fuse, each group reported
    plain = tiny_model("mistral")
    fuse_projections(plain)
    assert plain.sailfish_report["fused"] == {} and len(plain.sailfish_report["not_fused"]) == 4


def test_tensor_parallel_attention_matches_unfused_split(reference_ops, per_segment):
    """Two ranks simulated in one process: q/k/v column shards (the fused layer split per
    segment, its FusedOutput columns following), o_proj row shards, outputs summed; equal to
    the same split of the unfused attention."""
    fused, unfused = fused_and_unfused("qwen2", group_size=64)  # o_proj's row shards: K = 64 each
    x = torch.randn(2, 5, 128).half()
    pos = fused.model.rotary_emb(x, torch.arange(5)[None].expand(2, -1))
    world, outs = 2, {}
    for key, model, cols in (("fused", fused, ("qkv_proj",)), ("unfused", unfused, NAMES)):
        total = 0
        for r in range(world):
            attn = copy.deepcopy(model.model.layers[0].self_attn)
            for c in cols:
                attn.set_submodule(c, getattr(attn, c).shard(r, world, 0))
            attn.o_proj = attn.o_proj.shard(r, world, 1)
            with torch.no_grad():
                total = total + attn(x, position_embeddings=pos, attention_mask=None)[0].float()
        outs[key] = total
    assert torch.equal(outs["fused"], outs["unfused"])


# ----------------------------------------------------------------------------------
# 4. Row-wise ops in the model: RMSNorm and silu * up in one launch, W4A8's quantization
#    fused into them (sailfish.fuse.fuse_row_ops; the ops themselves: test_rowwise.py)
# ----------------------------------------------------------------------------------
def test_row_ops_report_and_modules(reference_ops):
    from sailfish.fuse import DeferredRMSNorm, GatedMLP, SailfishRMSNorm
    w4a16 = sailfish.quantize_model(tiny_model("qwen3"))
    rows = w4a16.sailfish_report["row_ops"]
    layers = range(2)
    assert sorted(rows["gated_mlp"]) == [f"model.layers.{i}.mlp" for i in layers]
    assert sorted(rows["norms"]) == sorted(["model.norm"] + [f"model.layers.{i}.{n}" for i in layers for n in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")])
    assert rows["deferred_norms"] == []  # W4A16 takes the norm's fp16 output as it is
    assert rows["attention"] == [f"model.layers.{i}.self_attn" for i in layers]  # (test_attention.py)
    layer = w4a16.model.layers[0]
    assert type(layer.mlp) is GatedMLP and type(layer.input_layernorm) is SailfishRMSNorm
    assert layer.mlp.intermediate_size == 256 and layer.mlp.replaces == "Qwen3MLP"
    w4a8 = sailfish.quantize_model(tiny_model("qwen3"), act_bits=8, group_size=128)
    rows = w4a8.sailfish_report["row_ops"]
    assert sorted(rows["deferred_norms"]) == [f"model.layers.{i}.{n}" for i in layers
                                              for n in ("input_layernorm", "post_attention_layernorm")]
    layer = w4a8.model.layers[1]
    assert type(layer.input_layernorm) is DeferredRMSNorm and layer.mlp._sailfish_norm is layer.post_attention_layernorm
    # the norm stays where it was: one parameter, under its own key
    keys = [k for k in w4a8.state_dict() if "layernorm" in k]
    assert sorted(keys) == sorted(f"model.layers.{i}.{n}.weight" for i in layers
                                  for n in ("input_layernorm", "post_attention_layernorm"))
    # idempotent: fusing again changes nothing
    from sailfish.fuse import fuse_row_ops
    assert fuse_row_ops(w4a8) == {"norms": [], "gated_mlp": [], "deferred_norms": [], "attention": [], "routers": [],
                                  "generate": []}


@pytest.mark.parametrize("act_bits", [16, 8])
def test_row_ops_with_a_gradient_or_fp32_run_the_formula(act_bits, reference_ops, per_segment):
    """Where the row ops cannot run (a gradient to compute, an fp32 input), the modules run
    transformers' formula: the model still equals the unfused one."""
    quant = {} if act_bits == 16 else dict(act_bits=8, group_size=128)
    fused, unfused = fused_and_unfused("llama", **quant)
    ids = torch.randint(1, VOCAB, (1, 5))
    assert torch.is_grad_enabled()
    assert torch.equal(fused(ids).logits, unfused(ids).logits)
    norm = fused.model.norm
    x = torch.randn(3, 128)
    assert torch.equal(norm(x), unfused.model.norm(x))  # fp32 input, fp16 weight: the formula's promotion


class _Layers:
    class Good(torch.nn.Module):
        def forward(self, h, mask=None):
            residual = h
            h = self.input_layernorm(h)
            h, _ = self.self_attn(hidden_states=h, attention_mask=mask)
            return residual + h

    class TwoUses(torch.nn.Module):
        def forward(self, h, mask=None):
            h = self.input_layernorm(h)
            h, _ = self.self_attn(hidden_states=h, extra=h)
            return h

    class Kept(torch.nn.Module):
        def forward(self, h, mask=None):
            n = self.input_layernorm(h)
            h, _ = self.self_attn(hidden_states=n)
            return h + n

    class NotNext(torch.nn.Module):
        def forward(self, h, mask=None):
            h = self.input_layernorm(h)
            print(h)
            h, _ = self.self_attn(hidden_states=h)
            return h


def test_norm_deferred_only_where_its_output_feeds_only_the_consumer():
    from sailfish.fuse import _feeds_only
    assert _feeds_only(_Layers.Good, "input_layernorm", "self_attn")
    for cls in (_Layers.TwoUses, _Layers.Kept, _Layers.NotNext):
        assert not _feeds_only(cls, "input_layernorm", "self_attn"), cls.__name__
    assert not _feeds_only(_Layers.Good, "input_layernorm", "mlp")


def test_norms_of_another_formula_are_left_alone(reference_ops):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class LlamaRMSNorm2(LlamaRMSNorm):  # Gemma's (1 + w): not Llama's formula
        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return (1 + self.weight) * hidden_states.to(input_dtype)
    LlamaRMSNorm2.__name__ = "LlamaRMSNorm"
    model = tiny_model("llama")
    other = LlamaRMSNorm2(128).half()
    model.model.norm = other
    sailfish.quantize_model(model)
    assert model.model.norm is other and "model.norm" not in model.sailfish_report["row_ops"]["norms"]


@pytest.mark.parametrize("act_bits", [16, 8])
def test_row_ops_run_the_kernels_in_the_model(act_bits):
    """With the interpreter (CPU) or on the GPU the modules call the row-wise kernels: a
    decoder layer's MLP and attention input give what the ops called one by one give."""
    from sailfish.ops.rowwise import rms_norm_quant, silu_mul, silu_mul_quant
    quant = {} if act_bits == 16 else dict(act_bits=8, group_size=128)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = sailfish.quantize_model(tiny_model("llama").to(dev), **quant)
    layer = model.model.layers[0]
    x = torch.randn(3, 128, dtype=F16, device=dev)
    with torch.no_grad():
        got = layer.mlp(x)
        if act_bits == 16:
            want = layer.mlp.down_proj(silu_mul(layer.mlp.gate_up_proj(x)))
        else:
            norm = layer.post_attention_layernorm
            gu = layer.mlp.gate_up_proj.forward_quantized(*rms_norm_quant(x, norm.weight, norm.variance_epsilon), F16)
            want = layer.mlp.down_proj.forward_quantized(*silu_mul_quant(gu), F16)
    assert torch.equal(got, want)
