"""MoE checkpoints (issue 41 item 3): per-expert GPTQ / AWQ / compressed-tensors tensors load
into QuantExperts' stacked layout and save_quantized writes them back per expert.

Tiny random transformers 5 models (Mixtral, Qwen3-MoE, Qwen2-MoE with a shared expert),
nothing downloaded. Checkpoints are written two ways: by save_quantized (round trip: every
tensor and the logits bit for bit, the same shapes computed twice), and by the independent
per-expert packer below, built from the formats' own definitions (tests/test_formats'
gptq_pack, test_checkpoint's awq_pack / ct_pack), whose dequantization the loaded experts
must equal per element."""
import json
import os

import numpy as np
import pytest
import torch

from test_checkpoint import awq_dequant, awq_pack, ct_config, ct_dequant, ct_pack, reference_path  # noqa: F401
from test_formats import gptq_dequant, gptq_pack
from helpers import desc_act_g_idx, general_g_idx
import sailfish
from sailfish import QuantExperts, QuantLinear, load_quantized, save_quantized
from sailfish.formats.int4 import QuantizedWeight
from sailfish.fuse import unfused_layers

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

F16 = torch.float16
H, I, E, LAYERS = 64, 96, 4, 2  # K = 96 (down) pads to one 128-chunk in the stacked layout


def tiny_config(arch: str):
    common = dict(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=64, max_position_embeddings=64, dtype="float16", num_experts_per_tok=2)
    if arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=I, num_local_experts=E, **common)
    if arch == "deepseek_v2":  # layer 0 dense (first_k_dense_replace), layer 1 MoE with shared experts
        return transformers.DeepseekV2Config(moe_intermediate_size=I, intermediate_size=2 * I, n_routed_experts=E,
                                             n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=32,
                                             q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                             **common)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(moe_intermediate_size=I, intermediate_size=2 * I, num_experts=E,
                                           head_dim=16, **common)
    return transformers.Qwen2MoeConfig(moe_intermediate_size=I, intermediate_size=2 * I, num_experts=E,
                                       shared_expert_intermediate_size=2 * I, **common)


# the checkpoint names real MoE checkpoints use (vLLM's, GPTQModel's): Mixtral keeps its
# pre-transformers-5 block name and w1 (gate) / w3 (up) / w2 (down)
CKPT = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
QWEN = ("mlp", ("gate_proj", "up_proj", "down_proj"))


def experts_prefix(arch, layer):
    block, _ = CKPT.get(arch, QWEN)
    return f"model.layers.{layer}.{block}.experts"


def tiny_model(arch, seed=0, dtype=F16):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch), dtype=dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def logits(model):
    ids = torch.arange(3, 13).reshape(2, 5) % 64
    with torch.no_grad():
        return model(input_ids=ids).logits


# ----------------------------------------------------------------------------------
# Round trip: quantize_model -> save_quantized -> load_quantized
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,fmt,gs,sym,dtype", [
    ("mixtral", "gptq", 32, False, F16), ("mixtral", "awq", 32, True, F16), ("qwen3_moe", "gptq", -1, True, F16),
    ("qwen3_moe", "awq", 32, False, torch.bfloat16), ("qwen2_moe", "gptq", 32, False, F16),
    ("qwen2_moe", "compressed-tensors", 32, True, F16), ("deepseek_v2", "awq", 32, False, F16),
], ids=lambda v: str(v).removeprefix("torch."))
def test_roundtrip(tmp_path, reference_path, arch, fmt, gs, sym, dtype):  # noqa: F811
    model = tiny_model(arch, dtype=dtype)
    sailfish.quantize_model(model, group_size=gs, sym=sym)
    converted = model.sailfish_report["experts"]
    moe_layers = [1] if arch == "deepseek_v2" else range(LAYERS)
    assert converted == [f"model.layers.{i}.mlp.experts" for i in moe_layers]
    save_quantized(model, str(tmp_path), format=fmt)
    keys = load_file(str(tmp_path / "model.safetensors")).keys()
    block, (gate, up, down) = CKPT.get(arch, QWEN)
    marker = "weight_packed" if fmt == "compressed-tensors" else "qweight"
    for layer in moe_layers:  # per expert, under the names other loaders read
        prefix = experts_prefix(arch, layer)
        assert {f"{prefix}.{e}.{p}.{marker}" for e in range(E) for p in (gate, up, down)} <= set(keys)
        assert f"model.layers.{layer}.{block}.gate.weight" in keys  # the router, 16-bit
    assert not any(k.endswith(("gate_up_proj", "w13_qweight")) for k in keys)
    loaded = load_quantized(str(tmp_path), fuse=False)
    assert loaded.sailfish_report["experts"] == converted
    assert all(isinstance(loaded.get_submodule(n), QuantExperts) for n in converted)
    if arch == "qwen2_moe":  # the shared expert: ordinary QuantLinears; its gate and the router 16-bit
        assert isinstance(loaded.model.layers[0].mlp.shared_expert.down_proj, QuantLinear)
        assert type(loaded.model.layers[0].mlp.shared_expert_gate) is torch.nn.Linear
    if arch == "deepseek_v2":
        assert isinstance(loaded.model.layers[1].mlp.shared_experts.up_proj, QuantLinear)
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert value.dtype == theirs[key].dtype and torch.equal(value, theirs[key]), key
    if arch == "deepseek_v2":  # the saved model runs its shared experts in the block (fuse.fold_shared_experts):
        loaded = load_quantized(str(tmp_path))  # so does the model loaded with fuse=True, bit for bit
        assert loaded.sailfish_report["shared_experts_folded"] == ["model.layers.1.mlp"]
    assert torch.equal(logits(model), logits(loaded))


def test_roundtrip_sharded(tmp_path, reference_path):  # noqa: F811
    """Shards with an index; a model loaded from it saves again to the same checkpoint."""
    model = tiny_model("qwen2_moe")
    sailfish.quantize_model(model, group_size=32, sym=False)
    save_quantized(model, str(tmp_path / "a"), max_shard_size=60_000)
    assert os.path.isfile(tmp_path / "a" / "model.safetensors.index.json")
    save_quantized(load_quantized(str(tmp_path / "a")), str(tmp_path / "b"))
    loaded = load_quantized(str(tmp_path / "b"), fuse=False)
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in ours.items())
    assert torch.equal(logits(loaded), logits(model))


# ----------------------------------------------------------------------------------
# Checkpoints from an independent per-expert packer (the formats' definitions)
# ----------------------------------------------------------------------------------
def pack_projection(method, n, k, gs, sym, rng, fmt="gptq", g_idx=None):
    """One projection's checkpoint tensors, and its effective weight (N, K) float32 by the
    format's own dequantization: GPTQ (qweight (K/8, N), v1 zero words - 0x11111111), AWQ
    GEMM (interleaved nibbles), compressed-tensors pack-quantized (signed codes + 8)."""
    g = 1 if gs == -1 else -(-k // gs)
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    zeros = np.full((g, n), 8, np.uint8) if sym else rng.integers(0, 16, (g, n)).astype(np.uint8)
    scales = (torch.rand(g, n) * 0.004 + 0.002).to(F16)
    if method == "gptq":
        if g_idx is None:
            g_idx = torch.zeros(k, dtype=torch.int32) if gs == -1 else torch.arange(k, dtype=torch.int32) // gs
        qweight, qzeros = gptq_pack(q, zeros, fmt)
        return ({"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx},
                gptq_dequant(q, zeros, scales, g_idx))
    if method == "awq":
        return ({"qweight": awq_pack(q), "qzeros": awq_pack(zeros), "scales": scales},
                awq_dequant(q, zeros, scales, gs))
    q_signed, zp = q.T.astype(np.int8) - 8, zeros.T.astype(np.int8) - 8  # (N, K), (N, G)
    tensors = {"weight_packed": ct_pack(q_signed, 1), "weight_scale": scales.T.contiguous(),
               "weight_shape": torch.tensor([n, k])}
    if not sym:
        tensors["weight_zero_point"] = ct_pack(zp, 0)
    return tensors, ct_dequant(q_signed, None if sym else zp, scales.T, None, gs)


def quant_config(method, gs, sym, fmt="gptq", desc_act=False):
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": gs, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": fmt, "lm_head": False}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": not sym, "version": "gemm",
                "modules_to_not_convert": None}
    return ct_config(gs, sym)


def write_moe_checkpoint(path, arch, method, gs, sym, fmt="gptq", g_idx=None, seed=0):
    """A checkpoint of `arch` whose experts (and Qwen2-MoE's shared expert) are packed here,
    everything else from a tiny random model under the checkpoint's names. Returns
    {experts module: (gate_up (E, 2I, H), down (E, H, I))} and {shared layer: weight}, the
    effective weights."""
    model = tiny_model(arch, seed)
    rng = np.random.default_rng(seed)
    block, (gate, up, down) = CKPT.get(arch, QWEN)
    tensors = {k.replace(".mlp.", f".{block}."): v for k, v in model.state_dict().items()
               if not k.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    experts, shared = {}, {}
    for layer in range(LAYERS):
        prefix = experts_prefix(arch, layer)
        w = {p: [] for p in (gate, up, down)}
        for e in range(E):
            # (gate and up read one input: GPTQ quantizes both from its one Hessian, so one g_idx)
            g_of = g_idx and {k: g_idx(k) for k in (H, I)}
            for proj, (n, k) in ((gate, (I, H)), (up, (I, H)), (down, (H, I))):
                packed, weight = pack_projection(method, n, k, gs, sym, rng, fmt, g_idx and g_of[k].clone())
                tensors.update({f"{prefix}.{e}.{proj}.{s}": t for s, t in packed.items()})
                w[proj].append(weight)
        experts[f"model.layers.{layer}.mlp.experts"] = (torch.cat([torch.stack(w[gate]), torch.stack(w[up])], 1),
                                                      torch.stack(w[down]))
        if arch == "qwen2_moe":
            for proj, (n, k) in (("gate_proj", (2 * I, H)), ("up_proj", (2 * I, H)), ("down_proj", (H, 2 * I))):
                name = f"model.layers.{layer}.mlp.shared_expert.{proj}"
                packed, shared[name] = pack_projection(method, n, k, gs, sym, rng, fmt)
                del tensors[f"{name}.weight"]
                tensors.update({f"{name}.{s}": t for s, t in packed.items()})
    os.makedirs(path, exist_ok=True)
    cfg = tiny_config(arch).to_dict()
    cfg["quantization_config"] = quant_config(method, gs, sym, fmt, desc_act=g_idx is not None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return experts, shared


def assert_loads_as_packed(path, experts, shared):
    model = load_quantized(str(path), fuse=False)
    for name, (gate_up, down) in experts.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, QuantExperts)
        ours_gate_up, ours_down = layer.dequantize()
        assert torch.equal(ours_gate_up, gate_up) and torch.equal(ours_down, down), name
    layers = unfused_layers(model)
    for name, weight in shared.items():
        assert torch.equal(layers[name].quantized_weight().dequantize(), weight), name
    return model


@pytest.mark.parametrize("arch,method,gs,sym,fmt", [
    ("mixtral", "gptq", 32, False, "gptq"),  # v1, GPTQModel's whole-word zero points (0 borrows)
    ("qwen3_moe", "gptq", 64, False, "gptq_v2"),  # ragged last group of K = 96
    ("qwen3_moe", "gptq", -1, True, "gptq"),
    ("mixtral", "awq", 32, False, None), ("qwen3_moe", "awq", 32, True, None),
    ("qwen2_moe", "gptq", 32, True, "gptq"), ("qwen2_moe", "ct", 32, False, None), ("mixtral", "ct", -1, True, None),
])
def test_independent_checkpoint(tmp_path, reference_path, arch, method, gs, sym, fmt):  # noqa: F811
    experts, shared = write_moe_checkpoint(tmp_path, arch, method, gs, sym, fmt or "gptq")
    model = assert_loads_as_packed(tmp_path, experts, shared)
    layer = model.model.layers[0].mlp.experts
    assert (layer.w13_zeros is None) == sym and layer.dtype == F16
    assert torch.isfinite(logits(model)).all()


def test_act_order_experts(tmp_path):
    """GPTQ desc_act experts (each expert its own g_idx, gate and up one) load: every expert's
    effective weight equals the packer's per element, in the checkpoint's channel order; the
    experts module matches transformers' holding those weights within the per-element bound,
    and the model's logits a 16-bit model holding them; saved (GPTQ, compressed-tensors) and
    loaded again, every tensor (the g_idx too) and the logits are equal bit for bit; AWQ, which
    has no g_idx, refuses them. desc_act with g_idx equal to k // group_size loads without
    act-order."""
    from test_moe_module import check_against_transformers

    trivial = lambda k: torch.arange(k, dtype=torch.int32) // 32  # noqa: E731
    experts, shared = write_moe_checkpoint(tmp_path / "plain", "mixtral", "gptq", 32, False, g_idx=trivial)
    assert assert_loads_as_packed(tmp_path / "plain", experts, shared).model.layers[0].mlp.experts.w13_perm is None
    torch.manual_seed(1)
    experts, shared = write_moe_checkpoint(tmp_path / "act", "mixtral", "gptq", 32, False,
                                           g_idx=lambda k: desc_act_g_idx(k, 32))
    model = assert_loads_as_packed(tmp_path / "act", experts, shared)
    layer = model.model.layers[0].mlp.experts
    assert layer.act_order and layer.w13_perm.shape == (E, H) and layer.w2_perm.shape == (E, I)
    x = torch.randn(5, H).to(F16)
    ids, weights = torch.stack([torch.randperm(E)[:2] for _ in range(5)]), torch.softmax(torch.randn(5, 2), -1)
    check_against_transformers(tiny_model("mixtral").model.layers[0].mlp.experts.float(), layer, x, ids, weights)
    ref = tiny_model("mixtral")  # (the checkpoint's 16-bit tensors are this model's)
    with torch.no_grad():
        for name, (gate_up, down) in experts.items():
            ref.get_submodule(name).gate_up_proj.copy_(gate_up)
            ref.get_submodule(name).down_proj.copy_(down)
    got, want = logits(model).float(), logits(ref).float()
    # fp16 model, the two rounding at different places: measured 1e-6 relative; the kernel ignoring
    # the perms gave 6e-4 (the packer's small scales keep the experts' share of the residual stream
    # small: the per-element check above is the sharp one)
    assert float((got - want).norm() / want.norm()) < 1e-4
    save_quantized(model, str(tmp_path / "again"))
    written, original = load_file(str(tmp_path / "again" / "model.safetensors")), load_file(
        str(tmp_path / "act" / "model.safetensors"))
    g_keys = [k for k in original if k.endswith(".g_idx") and ".experts." in k]
    assert len(g_keys) == LAYERS * E * 3 and all(torch.equal(written[k], original[k]) for k in g_keys)
    again = load_quantized(str(tmp_path / "again"), fuse=False)
    ours, theirs = model.state_dict(), again.state_dict()
    assert ours.keys() == theirs.keys() and "model.layers.0.mlp.experts.w13_perm" in ours
    assert all(torch.equal(v, theirs[k]) for k, v in ours.items())
    assert torch.equal(logits(again), logits(model))
    save_quantized(model, str(tmp_path / "ct"), format="compressed-tensors")  # (actorder "group": weight_g_idx)
    theirs = load_quantized(str(tmp_path / "ct"), fuse=False).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in ours.items())
    with pytest.raises(ValueError, match=r"experts.0.w1: an act-order weight \(g_idx\) cannot be stored in AWQ"):
        save_quantized(model, str(tmp_path / "awq"), format="awq")


@pytest.mark.parametrize("g_idx,match", [
    (lambda k: general_g_idx(k, 32), r"g_idx whose sorted values are not k // group_size \(a general g_idx\)"),
    (lambda k: desc_act_g_idx(k, 32), r"the projections of one expert that share an input \(gate and up\) have "
                                      r"different g_idx"),
])
def test_act_order_experts_refused(tmp_path, g_idx, match):
    """Act-order the grouped kernel cannot take: a general g_idx (not a permutation of
    k // group_size) or a gate and up of different g_idx, refused naming the expert's tensor."""
    write_moe_checkpoint(tmp_path, "mixtral", "gptq", 32, False, g_idx=lambda k: desc_act_g_idx(k, 32))
    _edit(tmp_path, lambda t: t.__setitem__(f"{P}.2.w3.g_idx", g_idx(H)))
    with pytest.raises(ValueError, match=rf"{P}.2.w1 \(experts model.layers.1.mlp.experts\): .*{match}"):
        load_quantized(str(tmp_path))


# ----------------------------------------------------------------------------------
# Bad input: checked from the headers before any weight is read, naming key and value
# ----------------------------------------------------------------------------------
P = "model.layers.1.block_sparse_moe.experts"  # Mixtral names


def _edit(path, fn):
    file = str(path / "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file)


def _drop_expert(t, e):
    for k in [k for k in t if k.startswith(f"{P}.{e}.")]:
        del t[k]


@pytest.mark.parametrize("edit,match", [
    (lambda t: _drop_expert(t, 2), rf"the checkpoint has no tensor {P}.2.w1.qweight"),
    (lambda t: t.pop(f"{P}.3.w2.scales"), rf"the checkpoint has no tensor {P}.3.w2.scales"),
    (lambda t: t.__setitem__(f"{P}.1.w3.qweight", torch.zeros(H // 8, 2 * I, dtype=torch.int32)),
     rf"{P}.1.w3.qweight must be I32 of shape \(8, 96\), got I32 \(8, 192\)"),
    (lambda t: t.__setitem__(f"{P}.0.w2.qzeros", t[f"{P}.0.w2.qzeros"].to(torch.int64)),
     rf"{P}.0.w2.qzeros must be I32 of shape \(3, 8\), got I64"),
    (lambda t: t.__setitem__(f"{P}.2.w1.scales", t[f"{P}.2.w1.scales"].to(torch.bfloat16)),
     rf"{P}.2.w1.scales is BF16 but {P}.0.w1.scales is F16; allowed: one scale dtype for all experts"),
    (lambda t: t.__setitem__(f"{P}.{E}.w1.qweight", t[f"{P}.0.w1.qweight"].clone()),
     rf"{P}.{E}.w1.qweight: model.layers.1.mlp.experts has experts 0..{E - 1} with projections "
     r"\('w1', 'w3', 'w2'\); the checkpoint holds expert 4, projection 'w1'"),
    (lambda t: t.__setitem__(f"{P}.0.gate_proj.qweight", t[f"{P}.0.w1.qweight"].clone()),
     rf"{P}.0.gate_proj.qweight: .* the checkpoint holds expert 0, projection 'gate_proj'"),
    (lambda t: t.__setitem__(f"{P}.1.w2.bias", torch.ones(H, dtype=F16)),
     rf"{P}.1.w2.bias is not zero, but the model's layer has no bias"),
    (lambda t: t[f"{P}.1.w1.scales"].__setitem__((0, 3), -1.0),
     rf"{P}.1.w1 \(experts model.layers.1.mlp.experts\): scales must be finite and > 0"),
    (lambda t: t.__setitem__("model.layers.1.mlp.gate.weight", t[f"{P[:-8]}.gate.weight"].clone()),
     r"tensors model.layers.1.(block_sparse_moe|mlp).gate.weight and model.layers.1.(block_sparse_moe|mlp).gate.weight "
     r"both load into model.layers.1.mlp.gate.weight"),
], ids=["missing-expert", "missing-tensor", "shape", "dtype", "scale-dtypes", "extra-expert", "projection-name",
        "bias", "scale-value", "renamed-twice"])
def test_bad_checkpoints(tmp_path, edit, match):
    write_moe_checkpoint(tmp_path, "mixtral", "gptq", 32, False)
    _edit(tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        load_quantized(str(tmp_path))


def test_bad_configs(tmp_path):
    write_moe_checkpoint(tmp_path, "qwen3_moe", "gptq", 32, False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["experts"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.0.gate_proj is quantized in the checkpoint "
                                         r"but quantization_config.modules_to_not_convert lists 'experts'"):
        load_quantized(str(tmp_path))
    # a format whose experts Sailfish does not read: refused naming the field and what is allowed
    cfg["quantization_config"] = {"quant_method": "marlin", "group_size": 128, "lm_head": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _edit(tmp_path, lambda t: t.__setitem__("model.layers.0.mlp.experts.0.gate_proj.B",
                                            t.pop("model.layers.0.mlp.experts.0.gate_proj.qweight")))
    with pytest.raises(ValueError, match=r"quantization_config.quant_method='marlin' is not supported; Sailfish "
                                         r"loads MoE experts \(such as model.layers.0.mlp.experts.0.gate_proj.B\) "
                                         r"from quant_method \('gptq', 'awq', 'compressed-tensors'\)"):
        load_quantized(str(tmp_path))


def test_save_refusals(tmp_path):
    """AWQ cannot hold an expert whose K is not a whole number of groups: the expert is named."""
    model = tiny_model("qwen3_moe")
    sailfish.quantize_model(model, group_size=64)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.0.down_proj: AWQ needs in_features to be a "
                                         r"multiple of group_size; got K=96, group_size=64"):
        save_quantized(model, str(tmp_path), format="awq")
    assert not os.listdir(tmp_path)
    with pytest.raises(TypeError, match=r"model.layers.0.mlp.experts is a QuantExperts \(W4A16 experts\): "
                                        r"format='qqq' holds QuantLinearW4A8 layers only"):
        save_quantized(model, str(tmp_path), format="qqq")


def test_lossy_expert_scales(tmp_path):
    """fp16 expert scales into a bf16 model: refused naming the expert, or rounded and warned."""
    write_moe_checkpoint(tmp_path, "qwen3_moe", "awq", 32, False)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.0.gate_proj \(experts model.layers.0.mlp."
                                         r"experts\): scales: \d+ of \d+ torch.float16 values are not exactly "
                                         r"representable in torch.bfloat16 .* \(dtype=torch.float16 keeps them "
                                         r"exact\)"):
        load_quantized(str(tmp_path), dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match=rf"in {LAYERS} of {LAYERS} quantized layers and experts modules"):
        model = load_quantized(str(tmp_path), dtype=torch.bfloat16, allow_lossy_scales=True)
    assert model.model.layers[0].mlp.experts.dtype == torch.bfloat16


def test_load_reads_no_float_weights(tmp_path, monkeypatch):
    """Experts go from the file's packed words to the stacked layout without a float weight:
    loading never dequantizes (the scales are exact in the model dtype, so nothing asks to)."""
    experts, _ = write_moe_checkpoint(tmp_path, "mixtral", "gptq", 32, False, "gptq_v2")

    def refuse(self, rounded=True):
        raise AssertionError("load_quantized dequantized a weight")

    monkeypatch.setattr(QuantizedWeight, "dequantize", refuse)
    model = load_quantized(str(tmp_path), fuse=False)
    monkeypatch.undo()
    gate_up, down = model.model.layers[1].mlp.experts.dequantize()
    assert torch.equal(gate_up, experts["model.layers.1.mlp.experts"][0])


def test_tensor_parallel_load_keeps_experts_whole(tmp_path):
    """With a device mesh, the plan's layers (here the shared expert's) are split and the experts
    load whole."""
    from test_tp_load import StandInMesh
    from sailfish.parallel import SailfishColwiseParallel, SailfishRowwiseParallel

    write_moe_checkpoint(tmp_path, "qwen2_moe", "gptq", 32, False)
    plan = {**{f"model.layers.*.mlp.shared_expert.{p}_proj": SailfishColwiseParallel() for p in ("gate", "up")},
            "model.layers.*.mlp.shared_expert.down_proj": SailfishRowwiseParallel()}
    whole = load_quantized(str(tmp_path), fuse=False)
    part = load_quantized(str(tmp_path), fuse=False, device_mesh=StandInMesh(1, 2), tp_plan=plan)
    assert part.model.layers[0].mlp.shared_expert.gate_proj.out_features == 2 * I // 2
    for name in whole.sailfish_report["experts"]:
        ours, theirs = dict(whole.get_submodule(name).named_buffers()), dict(part.get_submodule(name).named_buffers())
        assert ours.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in ours.items())


def test_pack_into():
    """pack_into (one expert at a time into a preallocated stack) gives formats.experts.stack's
    bits; a symmetric weight in a stack with zero points gets zero point 8; refusals."""
    from dataclasses import replace
    from sailfish.formats.experts import PackedExperts, pack_into, stack
    from sailfish.formats.int4 import quantize
    from sailfish.formats.shard import slice_weight

    weights = [quantize(torch.randn(2 * I, H), group_size=32, sym=False) for _ in range(3)]
    ref = stack(weights)
    out = PackedExperts(torch.zeros_like(ref.qweight), torch.zeros_like(ref.scales), torch.zeros_like(ref.zeros),
                        H, 32)
    for e, w in enumerate(weights):  # gate rows, then up rows, as the loader fills them
        pack_into(out, e, [(0, slice_weight(w, 0, 0, I)), (I, slice_weight(w, 0, I, 2 * I))])
    for part in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(out, part), getattr(ref, part)), part
    sym = quantize(torch.randn(2 * I, H), group_size=32, sym=True)
    pack_into(out, 1, [(0, sym)])
    eights = stack([replace(sym, zeros=torch.full_like(sym.scales, 8, dtype=torch.uint8))])
    assert torch.equal(out.zeros[1], eights.zeros[0]) and torch.equal(out.qweight[1], eights.qweight[0])
    with pytest.raises(ValueError, match=r"act-order weight .* cannot go into a stack without permutations"):
        pack_into(out, 0, [(0, replace(sym, g_idx=desc_act_g_idx(H, 32)))])
    with pytest.raises(ValueError, match=r"weight \(K=32, group_size=32, torch.float16\) does not fit the stack "
                                         r"\(K=64, group_size=32, torch.float16\)"):
        pack_into(out, 0, [(0, quantize(torch.randn(8, 32), group_size=32))])
    sym_stack = PackedExperts(out.qweight, out.scales, None, H, 32)
    with pytest.raises(ValueError, match="an asymmetric weight .* cannot go into a symmetric stack"):
        pack_into(sym_stack, 0, [(0, weights[0])])


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_16bit_experts(tmp_path, reference_path, fmt):  # noqa: F811
    """Experts left in 16 bits are saved per expert ({e}.gate_proj.weight, as transformers writes
    them) and listed in modules_to_not_convert; they load back into transformers' own experts
    module, also under an AWQ config that lists them vLLM-style with trailing dots."""
    model = tiny_model("qwen3_moe")
    kept = "model.layers.1.mlp.experts"
    sailfish.quantize_model(model, group_size=32, skip=["lm_head", kept])
    save_quantized(model, str(tmp_path), format=fmt)
    keys = load_file(str(tmp_path / "model.safetensors")).keys()
    assert {f"{kept}.{e}.{p}.weight" for e in range(E) for p in QWEN[1]} <= set(keys)
    assert not any(k.startswith(f"{kept}.") and not k.endswith(".weight") for k in keys)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert kept in cfg["quantization_config"]["modules_to_not_convert"]
    if fmt == "awq":  # DeepSeek-V3.2-Exp-AWQ style entries (vLLM matches them as substrings)
        cfg["quantization_config"]["modules_to_not_convert"] = ["mlp.gate.", "model.layers.1.mlp.experts.", "lm_head"]
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_quantized(str(tmp_path), fuse=False)
    assert loaded.sailfish_report["experts"] == ["model.layers.0.mlp.experts"]
    assert type(loaded.get_submodule(kept)) is type(model.get_submodule(kept))
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in ours.items())
    assert torch.equal(logits(model), logits(loaded))
    _edit(tmp_path, lambda t: t.pop(f"{kept}.2.up_proj.weight"))
    with pytest.raises(ValueError, match=rf"the checkpoint has no tensor {kept}.2.up_proj.weight"):
        load_quantized(str(tmp_path))
