"""Whole-model checkpoints: load_quantized (GPTQ, AWQ), save_quantized, SailfishConfig.

The checkpoints are written here by packers that follow the format specs (test_formats'
gptq_pack, and awq_pack below), never by Sailfish's own to_gptq. The reference is the same
tiny Llama in fp16 holding the dequantized weights as plain nn.Linear weights. The whole-model
forwards run Sailfish's PyTorch reference path (TRITON_INTERPRET=0) because the Triton
interpreter is too slow for a whole model; one test runs the kernels in the interpreter.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
# The `test` extra installs both (they are the optional `hf` extra of the library).
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from helpers import TOL, desc_act_g_idx, random_quantized, rel_err
from test_formats import gptq_dequant, gptq_pack
import sailfish
from sailfish import QuantLinear, from_awq, load_quantized, save_quantized
from sailfish.fuse import unfused_layers

F16 = torch.float16
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture
def reference_path(monkeypatch):
    """Run QuantLinear on the CPU with the PyTorch reference, not the Triton interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


# ----------------------------------------------------------------------------------
# AWQ GEMM format, from AutoAWQ's packer: nibble i (bits 4i) of word c holds channel 8c + ORDER[i]
# ----------------------------------------------------------------------------------
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_pack(cols: np.ndarray) -> torch.Tensor:
    """(R, N) codes in [0, 15] -> int32 (R, N / 8)."""
    r, n = cols.shape
    words = np.zeros((r, n // 8), dtype=np.uint32)
    for c in range(n // 8):
        for i, j in enumerate(AWQ_PACK_ORDER):
            words[:, c] |= cols[:, 8 * c + j].astype(np.uint32) << np.uint32(4 * i)
    return torch.from_numpy(words.view(np.int32))


def awq_dequant(q_kn, zeros, scales, group_size, dtype=F16):
    """W[n, k] = scales[g, n] * (q[k, n] - zeros[g, n]), g = k // group_size, rounded once."""
    k = q_kn.shape[0]
    g = torch.arange(k) // group_size if group_size != -1 else torch.zeros(k, dtype=torch.long)
    w = scales.double()[g] * (torch.from_numpy(q_kn.astype(np.float64))
                              - torch.from_numpy(zeros.astype(np.float64))[g])
    return w.T.to(dtype).float()


def test_awq_pack_order_literal():
    """Channels 0..7 holding codes 0..7 pack to 0x75316420 (AutoAWQ's interleave)."""
    word = awq_pack(np.arange(8, dtype=np.uint8)[None])
    assert word.item() == 0x75316420
    qw = from_awq(torch.zeros(32, 1, dtype=torch.int32) + word, word.repeat(1, 1),
                  torch.ones(1, 8, dtype=F16), group_size=32)
    assert qw.qweight[:, 0].tolist() == list(range(8)) and qw.zeros[0].tolist() == list(range(8))


@pytest.mark.parametrize("k,n,gs", [(256, 64, 128), (128, 136, 32), (192, 72, 64), (128, 64, -1)])
def test_from_awq(k, n, gs, device):
    rng = np.random.default_rng(k + n)
    g = 1 if gs == -1 else k // gs
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    zeros = rng.integers(0, 16, (g, n)).astype(np.uint8)
    zeros[0, :2] = (0, 15)  # both ends of AWQ's zero range
    scales = (torch.rand(g, n) * 0.02 + 0.001).to(F16)
    qw = from_awq(awq_pack(q), awq_pack(zeros), scales, group_size=gs)
    assert qw.g_idx is None and qw.zeros is not None
    assert torch.equal(qw.dequantize(), awq_dequant(q, zeros, scales, gs))
    if (k, n) == (128, 64):  # the kernels, on one small shape (interpreter on CPU)
        bias = torch.randn(n).to(F16)
        layer = QuantLinear.from_awq(awq_pack(q).to(device), awq_pack(zeros).to(device), scales.to(device),
                                     bias.to(device), group_size=gs)
        x = torch.randn(3, k).to(F16)
        ref = x.float() @ awq_dequant(q, zeros, scales, gs).T + bias.float()
        assert rel_err(layer(x.to(device)).cpu(), ref) <= TOL[F16]


def test_from_awq_all_zeros_8_is_symmetric():
    q = np.random.default_rng(0).integers(0, 16, (64, 16)).astype(np.uint8)
    qw = from_awq(awq_pack(q), awq_pack(np.full((2, 16), 8, np.uint8)), torch.ones(2, 16, dtype=F16),
                  group_size=32)
    assert qw.zeros is None
    assert torch.equal(qw.dequantize(), awq_dequant(q, np.full((2, 16), 8), torch.ones(2, 16, dtype=F16), 32))


def _awq_args(k=64, n=16, g=2):
    return dict(qweight=torch.zeros(k, n // 8, dtype=torch.int32), qzeros=torch.zeros(g, n // 8, dtype=torch.int32),
                scales=torch.ones(g, n, dtype=F16), group_size=32)


# dtype / bits / group-size checks are shared with from_gptq (test_formats); these test the AWQ shapes.
@pytest.mark.parametrize("over,exc,match", [
    (dict(qweight=torch.zeros(64, 2, dtype=torch.int64)), TypeError, "qweight must be a 2-D torch.int32"),
    (dict(scales=torch.ones(2, 8, dtype=F16)), ValueError, "scales has 8 columns but qweight has N=16"),
    (dict(qzeros=torch.zeros(2, 3, dtype=torch.int32)), ValueError, r"qzeros must have shape \(G=2, N/8=2\)"),
    (dict(qweight=torch.zeros(96, 2, dtype=torch.int32)), ValueError, "scales has 2 groups but K=96"),
], ids=["qweight-dtype", "scales-cols", "qzeros-shape", "groups"])
def test_from_awq_errors(over, exc, match):
    kw = _awq_args()
    kw.update(over)
    with pytest.raises(exc, match=match):
        from_awq(**kw)


def test_quantlinear_from_awq_errors():
    with pytest.raises(ValueError, match="in_features=40 must be a positive multiple of 16"):
        QuantLinear.from_awq(**_awq_args(k=40, g=1))
    with pytest.raises(TypeError, match="dtype=torch.float32"):
        QuantLinear.from_awq(**_awq_args(), dtype=torch.float32)


# ----------------------------------------------------------------------------------
# Tiny Llama checkpoints written from the specs
# ----------------------------------------------------------------------------------
def tiny_config(hidden=128, inter=256, tie=False, **kw) -> LlamaConfig:
    return LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                       max_position_embeddings=64, tie_word_embeddings=tie, dtype="float16", **kw)


def reference_model(config):
    torch.manual_seed(1)  # fp16 parameters, fp32 rotary buffers: as from_pretrained builds it
    return AutoModelForCausalLM.from_config(config, dtype=F16).eval()


def quantize_layer(method, linear, gs, sym, desc_act, rng):
    """Random codes, zeros and scales for one layer: its checkpoint tensors (packed from the
    spec) and its effective weight, which goes into the reference model."""
    k, n = linear.in_features, linear.out_features
    g = 1 if gs == -1 else k // gs
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    scales = (torch.rand(g, n) * 0.004 + 0.002).to(F16)
    if method == "awq":
        zeros = rng.integers(0, 16, (g, n)).astype(np.uint8)
        return ({"qweight": awq_pack(q), "qzeros": awq_pack(zeros), "scales": scales},
                awq_dequant(q, zeros, scales, gs))
    stored = np.full((g, n), 7, np.uint8) if sym else rng.integers(0, 16, (g, n)).astype(np.uint8)
    g_idx = desc_act_g_idx(k, gs) if desc_act else torch.arange(k, dtype=torch.int32) // gs
    qweight, qzeros = gptq_pack(q, stored)
    return ({"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx},
            gptq_dequant(q, stored, scales, g_idx))


def write_checkpoint(path, config, tensors, quant_config, shards="single"):
    """shards: 'single' (model.safetensors), 'index' (3 shards + index), 'noindex' (3 shards)."""
    os.makedirs(path, exist_ok=True)
    cfg = config.to_dict()
    cfg["quantization_config"] = quant_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    keys = list(tensors)
    parts = [keys] if shards == "single" else [keys[i::3] for i in range(3)]
    names = ["model.safetensors"] if shards == "single" else [f"part-{i}.safetensors" for i in range(3)]
    for name, part in zip(names, parts):
        save_file({k: tensors[k].contiguous() for k in part}, os.path.join(path, name), metadata={"format": "pt"})
    if shards == "index":
        weight_map = {k: name for name, part in zip(names, parts) for k in part}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)


def make_quantized(path, method="gptq", gs=64, sym=False, desc_act=False, shards="single", tie=False,
                   hidden=128, inter=256, extra_qc=None, seed=0):
    """Write a checkpoint; return the fp16 reference model holding the dequantized weights."""
    config = tiny_config(hidden, inter, tie)
    ref = reference_model(config)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    tensors = {}
    for key, value in ref.state_dict().items():
        if not (tie and key == "lm_head.weight"):
            tensors[key] = value
    for i in range(config.num_hidden_layers):
        for proj in PROJ:
            name = f"model.layers.{i}.{proj}"
            linear = ref.get_submodule(name)
            packed, w = quantize_layer(method, linear, gs, sym, desc_act, rng)
            with torch.no_grad():
                linear.weight.copy_(w.to(F16))
            del tensors[f"{name}.weight"]
            tensors.update({f"{name}.{k}": v for k, v in packed.items()})
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": gs, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    qc.update(extra_qc or {})
    write_checkpoint(path, config, tensors, qc, shards)
    return ref


def logits(model, seq=5):
    ids = torch.arange(3, 3 + 2 * seq).reshape(2, seq) % 128
    with torch.no_grad():
        return model(input_ids=ids.to(model.device)).logits.float().cpu()


def projection(model, name):
    """The layer `name` as a checkpoint stores it (fused q/k/v and gate/up given per projection)."""
    return unfused_layers(model)[name]


def assert_matches_reference(model, ref):
    for i in range(2):
        for proj in PROJ:
            name = f"model.layers.{i}.{proj}"
            layer = projection(model, name)
            assert isinstance(layer, QuantLinear), name
            assert torch.equal(layer.dequantize().cpu(), ref.get_submodule(name).weight.float()), name
    assert rel_err(logits(model), logits(ref)) <= TOL[F16]


@pytest.mark.parametrize("method,gs,sym,desc_act,shards,tie", [
    ("gptq", 32, True, False, "single", False),
    ("gptq", 64, False, True, "index", False),
    ("gptq", 128, False, False, "noindex", True),
    ("gptq", 32, True, True, "single", True),
    ("awq", 32, False, False, "single", False),
    ("awq", 64, False, False, "index", True),
    ("awq", 128, False, False, "noindex", False),
], ids=["gptq-g32-sym", "gptq-g64-asym-descact-index", "gptq-g128-asym-noindex-tied", "gptq-g32-sym-descact-tied",
        "awq-g32", "awq-g64-index-tied", "awq-g128-noindex"])
def test_load_quantized(tmp_path, reference_path, method, gs, sym, desc_act, shards, tie):
    ref = make_quantized(tmp_path, method, gs, sym, desc_act, shards, tie)
    model = load_quantized(str(tmp_path))
    assert not model.training
    layer = projection(model, "model.layers.0.self_attn.q_proj")
    assert layer.group_size == gs and layer.sym == (method == "gptq" and sym)
    assert layer.act_order == desc_act
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(not p.is_meta for p in model.parameters())
    assert_matches_reference(model, ref)


def test_load_quantized_kernels(tmp_path, device):
    """The whole model through the Triton kernels (the interpreter on CPU): tiny shapes."""
    ref = make_quantized(tmp_path, "gptq", 32, False, True, hidden=64, inter=128)
    model = load_quantized(str(tmp_path), device=device)
    assert model.model.layers[0].mlp.down_proj.qweight.device.type == torch.device(device).type
    assert rel_err(logits(model.to(device), seq=2), logits(ref.to(device), seq=2)) <= TOL[F16]


def test_load_quantized_bf16(tmp_path, reference_path):
    make_quantized(tmp_path, "awq", 64)
    model = load_quantized(str(tmp_path), dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    layer = projection(model, "model.layers.1.mlp.up_proj")
    assert layer.dtype == torch.bfloat16 and layer.scales.dtype == torch.bfloat16
    assert logits(model).isfinite().all()


def test_load_quantized_old_checkpoint(tmp_path, reference_path):
    """Old AutoGPTQ wrote an all-zero bias for bias-free layers: accepted and dropped; a
    non-zero one raises. A stored buffer is loaded."""
    ref = make_quantized(tmp_path, "gptq", 64)
    file = str(tmp_path / "model.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.mlp.up_proj.bias"] = torch.zeros(256, dtype=F16)
    save_file(tensors, file, metadata={"format": "pt"})
    model = load_quantized(str(tmp_path))
    assert projection(model, "model.layers.0.mlp.up_proj").bias is None
    assert_matches_reference(model, ref)
    # old checkpoints also stored the rotary frequencies: loaded into the buffer
    inv_freq = model.model.rotary_emb.inv_freq * 2
    save_file(dict(tensors, **{"model.rotary_emb.inv_freq": inv_freq}), file, metadata={"format": "pt"})
    assert torch.equal(load_quantized(str(tmp_path)).model.rotary_emb.inv_freq, inv_freq)
    tensors["model.layers.0.mlp.up_proj.bias"][3] = 1
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="up_proj.bias is not zero, but the model's layer has no bias"):
        load_quantized(str(tmp_path))


def test_load_quantized_modules_to_not_convert(tmp_path, reference_path):
    """A layer left in fp16 (listed in modules_to_not_convert, stored as .weight) loads as nn.Linear."""
    make_quantized(tmp_path, "awq", 64, extra_qc={"modules_to_not_convert": ["lm_head", "layers.1.mlp"]})
    file = str(tmp_path / "model.safetensors")
    tensors = load_file(file)
    w = torch.randn(256, 128).to(F16)
    for suffix in ("qweight", "qzeros", "scales"):
        del tensors[f"model.layers.1.mlp.up_proj.{suffix}"]
    tensors["model.layers.1.mlp.up_proj.weight"] = w
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers.1.mlp.\w+_proj is quantized in the checkpoint \(it has .*\) "
                                         "but quantization_config.modules_to_not_convert lists 'layers.1.mlp'"):
        load_quantized(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["lm_head", "layers.1.mlp.up_proj"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_quantized(str(tmp_path))
    up = model.model.layers[1].mlp.up_proj
    assert type(up) is torch.nn.Linear and torch.equal(up.weight, w)
    assert isinstance(model.model.layers[1].mlp.gate_proj, QuantLinear)


def _edit_config(path, **qc):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in qc.items():
        if value is None:
            cfg["quantization_config"].pop(key, None)
        else:
            cfg["quantization_config"][key] = value
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("method,edit,match", [
    ("gptq", dict(bits=3), r"quantization_config.bits=3 is not supported; Sailfish loads 4-bit"),
    ("gptq", dict(bits=8), r"quantization_config.bits=8 is not supported"),
    ("awq", dict(bits=8), r"quantization_config.bits=8 is not supported"),
    ("gptq", dict(checkpoint_format="gptq_v2"), r"checkpoint_format='gptq_v2' is not supported; .*\"gptq\""),
    ("gptq", dict(checkpoint_format=None, format="marlin"), r"quantization_config.format='marlin'"),
    ("gptq", dict(quant_method="bitsandbytes"), r"quant_method='bitsandbytes' is not supported; .*\"awq\""),
    ("gptq", dict(group_size=16), r"group_size=16 is not supported; Sailfish loads group sizes \(32, 64"),
    ("gptq", dict(dynamic={"-:.*down": {}}), r"quantization_config.dynamic="),
    ("awq", dict(version="gemv"), r"quantization_config.version='gemv' is not supported; .*\"gemm\""),
    ("awq", dict(version=None, format="gemv_fast"), r"quantization_config.format='gemv_fast'"),
    ("awq", dict(backend="llm-awq"), r"quantization_config.backend='llm-awq'"),
    ("awq", dict(zero_point=False), r"quantization_config.zero_point=False is not supported"),
    ("awq", dict(modules_to_not_convert=["visual"]),
     r"modules_to_not_convert=\['visual'\] is not supported; .*'visual' names none"),
    ("awq", dict(modules_to_not_convert="lm_head"), r"modules_to_not_convert='lm_head'"),
], ids=["gptq-bits3", "gptq-bits8", "awq-bits8", "gptq-v2", "gptq-format-marlin", "method", "group_size",
        "dynamic", "awq-gemv", "awq-format", "llm-awq", "zero_point", "not-convert-missing", "not-convert-str"])
def test_load_quantized_config_errors(tmp_path, method, edit, match):
    make_quantized(tmp_path, method, 64, hidden=64, inter=128)
    _edit_config(tmp_path, **edit)
    with pytest.raises(ValueError, match=match):
        load_quantized(str(tmp_path))


def _edit_tensors(path, fn):
    file = str(path / "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


L0 = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("edit,exc,match", [
    (lambda t: t.pop(f"{L0}.scales"), ValueError, f"the checkpoint has no tensor {L0}.scales"),
    (lambda t: t.pop(f"{L0}.g_idx"), ValueError, f"the checkpoint has no tensor {L0}.g_idx"),  # desc_act
    (lambda t: t.pop("model.norm.weight"), ValueError, "the checkpoint has no tensor model.norm.weight"),
    (lambda t: t.__setitem__(f"{L0}.qzeros", torch.zeros(2, 64 // 8, dtype=torch.int64)), ValueError,
     rf"{L0}.qzeros must be I32 of shape \(1, 8\), got I64"),
    (lambda t: t.__setitem__(f"{L0}.scales", torch.zeros(2, 64, dtype=F16)), ValueError,
     rf"{L0}.scales must be F16 or BF16 of shape \(1, 64\), got F16 \(2, 64\)"),
    (lambda t: t.__setitem__("model.norm.weight", torch.ones(32, dtype=F16)), ValueError,
     r"model.norm.weight has shape \(32,\), the model expects \(64,\)"),
    (lambda t: t.__setitem__("model.extra.weight", torch.ones(3)), ValueError,
     r"1 tensor\(s\) the model has no place for: \['model.extra.weight'\]"),
    (lambda t: t.__setitem__("model.norm.qweight", torch.ones(3, dtype=torch.int32)), ValueError,
     "model.norm.qweight: the model has no nn.Linear named 'model.norm'"),
    (lambda t: [t.pop(k) for k in list(t) if k.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))],
     ValueError, "the checkpoint has no quantized layer"),
    (lambda t: t.__setitem__(f"{L0}.g_idx", torch.full((64,), 5, dtype=torch.int32)), ValueError,
     rf"{L0}: g_idx values must lie in \[0, 1\)"),  # a data error: raised while loading
], ids=["missing-scales", "missing-g_idx", "missing-param", "qzeros-dtype", "scales-shape", "param-shape",
        "unexpected", "qweight-not-linear", "nothing-quantized", "g_idx-range"])
def test_load_quantized_tensor_errors(tmp_path, edit, exc, match):
    make_quantized(tmp_path, "gptq", 64, desc_act=True, hidden=64, inter=128)
    _edit_tensors(tmp_path, edit)
    with pytest.raises(exc, match=match):
        load_quantized(str(tmp_path))


def test_load_quantized_other_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_quantized(str(tmp_path))
    tiny_config(64, 128).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="config.json has no quantization_config"):
        load_quantized(str(tmp_path))
    make_quantized(tmp_path / "q", "gptq", 64, hidden=64, inter=128)
    with pytest.raises(TypeError, match="dtype=torch.float32 is not supported"):
        load_quantized(str(tmp_path / "q"), dtype=torch.float32)
    os.remove(tmp_path / "q" / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors file"):
        load_quantized(str(tmp_path / "q"))


def test_load_quantized_index_errors(tmp_path):
    make_quantized(tmp_path, "gptq", 64, shards="index", hidden=64, inter=128)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.ghost.weight"] = "part-0.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lists tensors that its shards do not hold: \['model.ghost.weight'\]"):
        load_quantized(str(tmp_path))
    index["weight_map"]["model.ghost.weight"] = "part-9.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="lists part-9.safetensors, which does not exist"):
        load_quantized(str(tmp_path))


# ----------------------------------------------------------------------------------
# save_quantized
# ----------------------------------------------------------------------------------
def sailfish_model(tie=False, act_order=True, fuse=True):
    """A tiny Llama quantized by quantize_model, with an asymmetric act-order layer mixed in."""
    model = reference_model(tiny_config(64, 128, tie))
    sailfish.quantize_model(model, group_size=32, sym=True, fuse=fuse)
    if act_order:
        down = model.model.layers[1].mlp.down_proj
        qw = random_quantized(128, 64, 32, False, F16, desc_act_g_idx(128, 32))
        qw.zeros.clamp_(min=1)  # GPTQ stores zero - 1
        model.model.layers[1].mlp.down_proj = QuantLinear.from_quantized(qw, down.bias)
    return model


@pytest.mark.parametrize("tie,shard", [(False, None), (True, 40_000)], ids=["single", "sharded-tied"])
def test_save_load_roundtrip(tmp_path, reference_path, tie, shard):
    model = sailfish_model(tie)
    kw = {} if shard is None else {"max_shard_size": shard}
    save_quantized(model, str(tmp_path), **kw)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
                  "checkpoint_format": "gptq", "lm_head": False, "modules_to_not_convert": ["lm_head"]}
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard is not None)
    loaded = load_quantized(str(tmp_path))
    # bit-identical: every buffer and parameter, hence identical logits
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key
    assert torch.equal(logits(loaded), logits(model))
    if tie:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # the stored tensors read by the GPTQ spec (independent of Sailfish) give the layer's weight
    if shard is None:
        t = load_file(str(tmp_path / "model.safetensors"))
        name = "model.layers.1.mlp.down_proj"
        q = torch.stack([(t[f"{name}.qweight"] >> (4 * j)) & 0xF for j in range(8)], 1).reshape(128, 64)
        stored = torch.stack([(t[f"{name}.qzeros"] >> (4 * j)) & 0xF for j in range(8)], 2).reshape(4, 64)
        ref = gptq_dequant(q.numpy().astype(np.uint8), stored.numpy().astype(np.uint8), t[f"{name}.scales"],
                           t[f"{name}.g_idx"])
        assert torch.equal(ref, model.get_submodule(name).dequantize())


def test_save_symmetric_in_order(tmp_path, reference_path):
    model = sailfish_model(act_order=False)
    save_quantized(model, str(tmp_path))
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["sym"] is True and qc["desc_act"] is False
    loaded = load_quantized(str(tmp_path))
    assert projection(loaded, "model.layers.0.self_attn.q_proj").sym
    assert torch.equal(logits(loaded), logits(model))


def test_save_quantized_errors(tmp_path):
    model = sailfish_model(act_order=False, fuse=False)  # (it swaps single projections)
    with pytest.raises(TypeError, match="model must be a transformers model"):
        save_quantized(torch.nn.Sequential(model.model.layers[0].mlp.up_proj), str(tmp_path))
    with pytest.raises(ValueError, match="max_shard_size=0"):
        save_quantized(model, str(tmp_path), max_shard_size=0)
    with pytest.raises(ValueError, match="model has no QuantLinear layer"):
        save_quantized(reference_model(tiny_config(64, 128)), str(tmp_path))
    layer = model.model.layers[0].mlp.gate_proj
    w4a8 = QuantLinear.from_linear(torch.nn.Linear(64, 128, bias=False).half(), act_bits=8, group_size=128)
    model.model.layers[0].mlp.gate_proj = w4a8
    with pytest.raises(TypeError, match="model.layers.0.mlp.gate_proj is a QuantLinearW4A8"):
        save_quantized(model, str(tmp_path))
    model.model.layers[0].mlp.gate_proj = QuantLinear.from_linear(torch.nn.Linear(64, 128, bias=False).half(),
                                                                  group_size=64)
    with pytest.raises(ValueError, match=r"different group sizes \[32, 64\]"):
        save_quantized(model, str(tmp_path))
    model.model.layers[0].mlp.gate_proj = layer
    qw = layer.quantized_weight()
    zeros = torch.full_like(qw.scales, 8, dtype=torch.uint8)
    zeros[0, 0] = 0
    model.model.layers[0].mlp.up_proj = QuantLinear.from_quantized(
        type(qw)(qw.qweight, qw.scales, zeros, None, qw.group_size))
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj: a zero point of 0 cannot be stored"):
        save_quantized(model, str(tmp_path))
    assert not os.listdir(tmp_path)  # nothing written by the failed calls
    model.model.layers[0].mlp.up_proj = layer
    save_quantized(model, str(tmp_path))
    with pytest.raises(FileExistsError, match="already holds"):
        save_quantized(model, str(tmp_path))


# ----------------------------------------------------------------------------------
# transformers integration: quantize on load
# ----------------------------------------------------------------------------------
def test_sailfish_config_from_pretrained(tmp_path, reference_path):
    from sailfish.hf import SailfishConfig

    ref = reference_model(tiny_config(64, 128))
    ref.save_pretrained(str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                 quantization_config=SailfishConfig(group_size=32, sym=False))
    expected = sailfish.quantize_model(ref, group_size=32, sym=False)
    assert model.model.embed_tokens.weight.dtype == F16
    assert type(model.lm_head) is torch.nn.Linear  # skipped by default
    for i in range(2):
        for proj in PROJ:
            name = f"model.layers.{i}.{proj}"
            got = projection(model, name)
            assert isinstance(got, QuantLinear) and got.group_size == 32 and not got.sym
            assert torch.equal(got.dequantize(), projection(expected, name).dequantize()), name
    assert torch.equal(logits(model), logits(expected))
    assert len(model.sailfish_report["fused"]) == 4 and not model.sailfish_report["not_fused"]  # q/k/v, gate/up


def test_sailfish_config_errors():
    from sailfish.hf import SailfishConfig

    assert sailfish.SailfishConfig is SailfishConfig
    with pytest.raises(ValueError, match="group_size=48"):
        SailfishConfig(group_size=48)
    with pytest.raises(ValueError, match="bits=3"):
        SailfishConfig(bits=3)
    with pytest.raises(ValueError, match="sym=False is not supported"):
        SailfishConfig(act_bits=8, sym=False, group_size=128)
    with pytest.raises(TypeError, match="sym='yes'"):
        SailfishConfig(sym="yes")


def test_import_sailfish_does_not_import_transformers():
    """The hf extra is optional: only load_quantized / save_quantized / sailfish.hf import it."""
    code = ("import sys, sailfish; bad = [m for m in ('transformers', 'safetensors', 'sailfish.hf') "
            "if m in sys.modules]; assert not bad, bad")
    src_dir = os.path.dirname(os.path.dirname(sailfish.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src_dir, os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
