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
import warnings

import numpy as np
import pytest
import torch
# The `test` extra installs both (they are the optional `hf` extra of the library).
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from helpers import TOL, desc_act_g_idx, random_checkpoint_weight, rel_err
from test_formats import gptq_dequant, gptq_pack
import sailfish
from sailfish import QuantLinear, from_awq, load_quantized, save_quantized
from sailfish.formats import from_compressed_tensors, to_awq, to_compressed_tensors
from sailfish.fuse import unfused_layers

F16, BF16 = torch.float16, torch.bfloat16
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
    back = to_awq(qw)  # saved back byte for byte
    assert torch.equal(back["qweight"], awq_pack(q)) and torch.equal(back["qzeros"], awq_pack(zeros))
    assert torch.equal(back["scales"], scales)
    if (k, n) == (128, 64):  # the kernels, on one small shape (interpreter on CPU)
        bias = torch.randn(n).to(F16)
        layer = QuantLinear.from_awq(awq_pack(q).to(device), awq_pack(zeros).to(device), scales.to(device),
                                     bias.to(device), group_size=gs)
        x = torch.randn(3, k).to(F16)
        ref = x.float() @ awq_dequant(q, zeros, scales, gs).T + bias.float()
        assert rel_err(layer(x.to(device)).cpu(), ref) <= TOL[F16]


def test_from_awq_all_zeros_8_is_symmetric():
    q = np.random.default_rng(0).integers(0, 16, (64, 16)).astype(np.uint8)
    eights = awq_pack(np.full((2, 16), 8, np.uint8))
    for zero_point in (True, False):  # GPTQModel's symmetric AWQ: zero_point false, qzeros all 8
        qw = from_awq(awq_pack(q), eights, torch.ones(2, 16, dtype=F16), group_size=32, zero_point=zero_point)
        assert qw.zeros is None
        assert torch.equal(qw.dequantize(), awq_dequant(q, np.full((2, 16), 8), torch.ones(2, 16, dtype=F16), 32))
        assert torch.equal(to_awq(qw)["qzeros"], eights)
    zeros = np.full((2, 16), 8, np.uint8)
    zeros[1, 5] = 7
    with pytest.raises(ValueError, match="zero_point=False .* every qzeros nibble to be 8; 1 of 32 are not"):
        from_awq(awq_pack(q), awq_pack(zeros), torch.ones(2, 16, dtype=F16), group_size=32, zero_point=False)


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
# compressed-tensors pack-quantized, from its packer's description: signed int4 values
# v in [-8, 7] are stored as v + 8, element i along the packed dimension in the nibble at
# bits 4 * (i % 8) of word i // 8; weights packed along K, zero points along N
# ----------------------------------------------------------------------------------
def ct_pack(values: np.ndarray, dim: int) -> torch.Tensor:
    """int8 (R, C) in [-8, 7] -> int32 words packed along `dim`."""
    u = values.astype(np.int64) + 8
    if dim == 0:
        u = u.T
    words = np.zeros((u.shape[0], u.shape[1] // 8), dtype=np.int64)
    for i in range(u.shape[1]):
        words[:, i // 8] |= u[:, i] << (4 * (i % 8))
    t = torch.from_numpy(words.astype(np.uint32).view(np.int32))
    return t.T.contiguous() if dim == 0 else t


def ct_dequant(q_signed, zp, scale, g_idx, group_size, dtype=F16):
    """W[n, k] = (q[n, k] - zp[n, g]) * scale[n, g], g = g_idx[k] (else k // group_size),
    the product rounded once to the scale dtype."""
    k = q_signed.shape[1]
    g = (g_idx.long() if g_idx is not None else
         torch.zeros(k, dtype=torch.long) if group_size == -1 else torch.arange(k) // group_size)
    diff = torch.from_numpy(q_signed.astype(np.float64))
    if zp is not None:
        diff = diff - torch.from_numpy(zp.astype(np.float64))[:, g]
    return (scale.double()[:, g] * diff).to(dtype).float()


def ct_config(gs, sym, actorder=None, **weights):
    """quantization_config as llm-compressor writes it for W4A16."""
    scheme = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "channel" if gs == -1 else "group",
              "group_size": None if gs == -1 else gs, "dynamic": False, "actorder": actorder,
              "block_structure": None, "observer": "minmax", "observer_kwargs": {}, **weights}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None,
            "version": "0.20.0"}


def test_ct_pack_literal():
    """Values -8..7 of one row pack to 0x76543210 and 0xFEDCBA98 (value + 8, low nibble first)."""
    words = ct_pack(np.arange(-8, 8, dtype=np.int8)[None], 1)
    assert [w & 0xFFFFFFFF for w in words[0].tolist()] == [0x76543210, 0xFEDCBA98]
    qw = from_compressed_tensors(words.repeat(8, 1), torch.ones(8, 1, dtype=F16), torch.tensor([8, 16]),
                                 ct_pack(np.full((8, 1), -8, np.int8), 0), group_size=-1)
    assert qw.qweight[0].tolist() == list(range(16)) and qw.zeros.flatten().tolist() == [0] * 8


@pytest.mark.parametrize("gs,sym,actorder", [(32, False, None), (64, True, "group"), (128, False, "group"),
                                             (-1, False, None), (-1, True, None)],
                         ids=["g32-asym", "g64-sym-actorder", "g128-asym-actorder", "channel-asym", "channel-sym"])
def test_from_compressed_tensors(gs, sym, actorder):
    """Exact against the format's dequantization; saved back byte for byte; zero points -8
    and 7 (Sailfish's 0 and 15) present."""
    rng = np.random.default_rng(abs(gs))
    n, k = 24, 256
    g = 1 if gs == -1 else k // gs
    q = rng.integers(-8, 8, (n, k)).astype(np.int8)
    zp = None if sym else rng.integers(-8, 8, (n, g)).astype(np.int8)
    if zp is not None:
        zp[0, 0], zp[1, -1] = -8, 7
    g_idx = desc_act_g_idx(k, gs) if actorder else None
    scale = (torch.rand(n, g) * 0.02 + 0.001).to(BF16)
    t = {"weight_packed": ct_pack(q, 1), "weight_scale": scale, "weight_shape": torch.tensor([n, k]),
         "weight_zero_point": None if sym else ct_pack(zp, 0), "weight_g_idx": g_idx}
    qw = from_compressed_tensors(**t, group_size=gs)
    assert qw.sym == sym and (qw.g_idx is not None) == bool(actorder) and qw.dtype == BF16
    assert torch.equal(qw.dequantize(), ct_dequant(q, zp, scale, g_idx, gs, BF16))
    back = to_compressed_tensors(qw, symmetric=sym, actorder=bool(actorder))
    assert back.keys() == {key for key, v in t.items() if v is not None}
    for key in back:
        assert back[key].dtype == t[key].dtype and torch.equal(back[key], t[key]), key


@pytest.mark.parametrize("over,match", [
    (dict(weight_shape=torch.tensor([24, 128])), r"weight_packed must be int32 of shape \(24, 16\) \(weight_shape \(24, 128\)\)"),
    (dict(weight_shape=torch.tensor([24.0, 256.0])), "weight_shape must be 2 integers"),
    (dict(weight_shape=torch.tensor([24, 260])), r"weight_shape=\(24, 260\) is not supported"),
    (dict(weight_scale=torch.ones(24, 4)), r"weight_scale must be float16 or bfloat16 of shape \(24, 8\)"),
    (dict(weight_scale=-torch.ones(24, 8, dtype=F16)), r"weight_scale must be finite and > 0; 192 of 192"),
    (dict(weight_zero_point=torch.zeros(24, 8, dtype=torch.int32)), r"weight_zero_point must be int32 of shape \(3, 8\)"),
    (dict(weight_g_idx=torch.zeros(100, dtype=torch.int32)), "weight_g_idx must be 256 integers"),
], ids=["shape-mismatch", "shape-float", "shape-odd", "scale-shape", "scale-negative", "zp-shape", "g_idx-shape"])
def test_from_compressed_tensors_errors(over, match):
    kw = dict(weight_packed=torch.zeros(24, 32, dtype=torch.int32), weight_scale=torch.ones(24, 8, dtype=F16),
              weight_shape=torch.tensor([24, 256]), group_size=32)
    kw.update(over)
    with pytest.raises(ValueError, match=match):
        from_compressed_tensors(**kw)


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


def quantize_layer(method, linear, gs, sym, desc_act, rng, checkpoint_format="gptq", zero_low=0):
    """Random codes, zeros and scales for one layer: its checkpoint tensors (packed from the
    spec; zero points 0 and 15 occur) and its effective weight, which goes into the reference
    model. AWQ sym: GPTQModel's symmetric AWQ (qzeros all 8). method "ct": compressed-tensors
    pack-quantized, desc_act = actorder "group"."""
    k, n = linear.in_features, linear.out_features
    g = 1 if gs == -1 else k // gs
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    scales = (torch.rand(g, n) * 0.004 + 0.002).to(F16)
    if method == "ct":
        q_signed = q.T.astype(np.int8) - 8  # (N, K) in [-8, 7]
        zp = None if sym else rng.integers(-8, 8, (n, g)).astype(np.int8)
        g_idx = desc_act_g_idx(k, gs) if desc_act else None
        tensors = {"weight_packed": ct_pack(q_signed, 1), "weight_scale": scales.T.contiguous(),
                   "weight_shape": torch.tensor([n, k])}
        if zp is not None:
            tensors["weight_zero_point"] = ct_pack(zp, 0)
        if g_idx is not None:
            tensors["weight_g_idx"] = g_idx
        return tensors, ct_dequant(q_signed, zp, scales.T, g_idx, gs)
    if method == "awq":
        zeros = np.full((g, n), 8, np.uint8) if sym else rng.integers(0, 16, (g, n)).astype(np.uint8)
        return ({"qweight": awq_pack(q), "qzeros": awq_pack(zeros), "scales": scales},
                awq_dequant(q, zeros, scales, gs))
    zeros = np.full((g, n), 8, np.uint8) if sym else rng.integers(zero_low, 16, (g, n)).astype(np.uint8)
    g_idx = desc_act_g_idx(k, gs) if desc_act else torch.arange(k, dtype=torch.int32) // gs
    qweight, qzeros = gptq_pack(q, zeros, checkpoint_format)
    return ({"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx},
            gptq_dequant(q, zeros, scales, g_idx))


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
                   hidden=128, inter=256, extra_qc=None, seed=0, checkpoint_format="gptq", zero_low=0,
                   **config_kw):
    """Write a checkpoint; return the fp16 reference model holding the dequantized weights."""
    config = tiny_config(hidden, inter, tie, **config_kw)
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
            packed, w = quantize_layer(method, linear, gs, sym, desc_act, rng, checkpoint_format, zero_low)
            with torch.no_grad():
                linear.weight.copy_(w.to(F16))
            del tensors[f"{name}.weight"]
            tensors.update({f"{name}.{k}": v for k, v in packed.items()})
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": gs, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": checkpoint_format, "damp_percent": 0.01, "true_sequential": True}
    elif method == "ct":
        qc = ct_config(gs, sym, "group" if desc_act else None)
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": not sym, "version": "gemm",
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


@pytest.mark.parametrize("method,gs,sym,desc_act,shards,tie,fmt", [
    ("gptq", 32, True, False, "single", False, "gptq"),
    ("gptq", 64, False, True, "index", False, "gptq"),
    ("gptq", 128, False, False, "noindex", True, "gptq"),
    ("gptq", 32, True, True, "single", True, "gptq"),
    ("gptq", 64, False, True, "index", False, "gptq_v2"),
    ("awq", 32, False, False, "single", False, None),
    ("awq", 64, False, False, "index", True, None),
    ("awq", 128, False, False, "noindex", False, None),
    ("awq", 64, True, False, "index", False, None),
    ("ct", 32, True, False, "single", False, None),
    ("ct", 64, False, True, "index", False, None),
    ("ct", 128, False, False, "noindex", True, None),
    ("ct", -1, False, False, "single", False, None),
], ids=["gptq-g32-sym", "gptq-g64-asym-descact-index", "gptq-g128-asym-noindex-tied", "gptq-g32-sym-descact-tied",
        "gptq_v2-g64-asym-descact-index", "awq-g32", "awq-g64-index-tied", "awq-g128-noindex", "awq-g64-sym-index",
        "ct-g32-sym", "ct-g64-asym-actorder-index", "ct-g128-asym-noindex-tied", "ct-channel-asym"])
def test_load_quantized(tmp_path, reference_path, method, gs, sym, desc_act, shards, tie, fmt):
    ref = make_quantized(tmp_path, method, gs, sym, desc_act, shards, tie, checkpoint_format=fmt)
    model = load_quantized(str(tmp_path))
    assert not model.training
    layer = projection(model, "model.layers.0.self_attn.q_proj")
    assert layer.group_size == gs and layer.sym == sym
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




@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_load_quantized_fp16_scales_into_bf16(tmp_path, reference_path, method):
    """fp16 scales (GPTQModel writes them even for bf16 models) in a bf16 model: refused by
    default, naming the tensor and the opt-in; allow_lossy_scales=True rounds them and warns
    once with the largest relative change of a dequantized weight against the format's own
    dequantization in bf16 (fp16 scale times (q - z), rounded to bf16), and of a bias value."""
    make_quantized(tmp_path, method, 32, desc_act=method == "gptq", hidden=64, inter=128, attention_bias=True)
    _edit_tensors(tmp_path, lambda t: t.update({k: torch.randn(v.shape).half() for k, v in t.items()
                                                if k.endswith("proj.bias")}))
    with pytest.raises(ValueError, match=r"model.layers.\d.\w+.\w+_proj: scales: \d+ of \d+ torch.float16 values are "
                                         r"not exactly representable in torch.bfloat16 \(first: .*\); allowed: an exact "
                                         r"cast, or load_quantized\(\.\.\., allow_lossy_scales=True\) \(dtype=torch.float16 "
                                         r"keeps them exact\), which rounds them"):
        load_quantized(str(tmp_path), dtype=BF16)
    exact = load_quantized(str(tmp_path), dtype=F16)  # the checkpoint's own dtype: exact
    with pytest.warns(UserWarning, match=r"load_quantized with allow_lossy_scales=True rounded torch.float16 scales "
                                         r"to torch.bfloat16 in 14 of 14 quantized layers \(largest in .*\): the "
                                         r"largest relative change of a dequantized weight is [\d.e-]+, of a bias "
                                         r"value [\d.e-]+") as rec:
        model = load_quantized(str(tmp_path), dtype=BF16, allow_lossy_scales=True)
    weight_change = bias_change = 0.0
    for name, layer in unfused_layers(model).items():
        if not isinstance(layer, QuantLinear):
            continue
        qw = projection(exact, name).quantized_weight()
        g = qw.group_index()
        z = 8.0 if qw.zeros is None else qw.zeros.double()[g].T
        codes = qw.qweight.double() - z
        own = (qw.scales.double()[g].T * codes).to(BF16).double()  # fp16 scales, bf16 weight
        got = (qw.scales.to(BF16).double()[g].T * codes).to(BF16).double()
        assert layer.dtype == BF16 and torch.equal(layer.dequantize().double(), got), name
        weight_change = max(weight_change, ((got - own).abs()[own != 0] / own.abs()[own != 0]).max().item())
        if layer.bias is not None:  # attention projections
            b16 = projection(exact, name).bias.double()
            bias_change = max(bias_change, ((layer.bias.double() - b16).abs() / b16.abs()).max().item())
    said = str(rec[0].message)
    assert f"weight is {weight_change:.3g}, of a bias value {bias_change:.3g}" in said
    assert 0 < weight_change <= 3.1 * 2 ** -8  # three roundings to bf16 (unit roundoff 2**-8)


def test_load_quantized_exact_scales_into_bf16(tmp_path, reference_path):
    """fp16 scales that bf16 holds exactly (powers of two) load into a bf16 model without a
    word, and the weights are the format's own dequantization in bf16."""
    make_quantized(tmp_path, "awq", 64, hidden=64, inter=128)
    _edit_tensors(tmp_path, lambda t: t.update({k: torch.exp2(torch.randint(-10, -4, v.shape).float()).half()
                                                for k, v in t.items() if k.endswith(".scales")}))
    exact = load_quantized(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_quantized(str(tmp_path), dtype=BF16)
    assert model.model.embed_tokens.weight.dtype == BF16
    layer = projection(model, "model.layers.1.mlp.up_proj")
    assert layer.dtype == BF16 and layer.scales.dtype == BF16
    qw = projection(exact, "model.layers.1.mlp.up_proj").quantized_weight()
    assert torch.equal(layer.dequantize(), qw.dequantize(rounded=False).to(BF16).float())


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
    ("gptq", dict(checkpoint_format="gptq_v3"), r"checkpoint_format='gptq_v3' is not supported; .*\"gptq_v2\""),
    ("gptq", dict(checkpoint_format=None, format="bitblas"), r"quantization_config.format='bitblas'"),
    ("gptq", dict(quant_method="bitsandbytes"), r"quant_method='bitsandbytes' is not supported; .*\"awq\""),
    ("gptq", dict(group_size=16), r"group_size=16 is not supported; Sailfish loads group sizes \(32, 64"),
    ("gptq", dict(dynamic={"-:.*down": {}}), r"quantization_config.dynamic="),
    ("awq", dict(version="gemv"), r"quantization_config.version='gemv' is not supported; .*\"gemm\""),
    ("awq", dict(version=None, format="gemv_fast"), r"quantization_config.format='gemv_fast'"),
    ("awq", dict(backend="llm-awq"), r"quantization_config.backend='llm-awq'"),
    ("awq", dict(zero_point="no"), r"quantization_config.zero_point='no' is not supported; .* or false"),
    ("awq", dict(modules_to_not_convert=["visual"]),
     r"modules_to_not_convert=\['visual'\] is not supported; .*'visual' names none"),
    ("awq", dict(modules_to_not_convert="lm_head"), r"modules_to_not_convert='lm_head'"),
], ids=["gptq-bits3", "gptq-bits8", "awq-bits8", "gptq-v3", "gptq-format-bitblas", "method", "group_size",
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
    (lambda t: t[f"{L0}.scales"].__setitem__((0, 5), float("nan")), ValueError,
     rf"{L0}: scales must be finite and > 0; 1 of 64 are not \(first: scales\[0, 5\] = nan\)"),
    (lambda t: t[f"{L0}.scales"].__setitem__((0, 7), -0.25), ValueError,
     rf"{L0}: scales must be finite and > 0; 1 of 64 are not \(first: scales\[0, 7\] = -0.25\)"),
], ids=["missing-scales", "missing-g_idx", "missing-param", "qzeros-dtype", "scales-shape", "param-shape",
        "unexpected", "qweight-not-linear", "nothing-quantized", "g_idx-range", "scales-nan", "scales-negative"])
def test_load_quantized_tensor_errors(tmp_path, edit, exc, match):
    make_quantized(tmp_path, "gptq", 64, desc_act=True, hidden=64, inter=128)
    _edit_tensors(tmp_path, edit)
    with pytest.raises(exc, match=match):
        load_quantized(str(tmp_path))


def _edit_ct_weights(path, **weights):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit,match", [
    (dict(format="float-quantized"), r"quantization_config.format='float-quantized' is not supported; "
                                     r"Sailfish loads compressed-tensors format \"pack-quantized\""),
    (dict(quantization_status="frozen"), r"quantization_status='frozen'"),
    (dict(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}), r"sparsity_config=\{"),
    (dict(kv_cache_scheme={"num_bits": 8, "type": "float"}), r"kv_cache_scheme="),
    (dict(config_groups={}), r"config_groups=\{\} is not supported; .*exactly one config group"),
    (dict(ignore="lm_head"), r"ignore='lm_head' is not supported"),
], ids=["format", "status", "sparsity", "kv-cache", "no-groups", "ignore-str"])
def test_load_compressed_tensors_config_errors(tmp_path, edit, match):
    make_quantized(tmp_path, "ct", 64, hidden=64, inter=128)
    _edit_config(tmp_path, **edit)
    with pytest.raises(ValueError, match=match):
        load_quantized(str(tmp_path))


@pytest.mark.parametrize("edit,match", [
    (dict(num_bits=8), r"config_groups.group_0.weights.num_bits=8 is not supported; Sailfish loads num_bits in \(4,\)"),
    (dict(type="float"), r"weights.type='float' is not supported"),
    (dict(strategy="tensor"), r"weights.strategy='tensor' is not supported; .*\('group', 'channel'\)"),
    (dict(strategy="block", block_structure=[128, 128]), r"weights.strategy='block'"),
    (dict(dynamic=True), r"weights.dynamic=True is not supported"),
    (dict(actorder="sideways"), r"weights.actorder='sideways' is not supported"),
    (dict(group_size=16), r"weights.group_size=16 is not supported; Sailfish loads group sizes \(32, 64, 128, 256\)"),
    (dict(strategy="channel", group_size=64), r"weights.group_size=64 is not supported; .*strategy \"channel\""),
], ids=["bits8", "float", "tensor", "block", "dynamic", "actorder", "group_size", "channel-group_size"])
def test_load_compressed_tensors_scheme_errors(tmp_path, edit, match):
    make_quantized(tmp_path, "ct", 64, hidden=64, inter=128)
    _edit_ct_weights(tmp_path, **edit)
    with pytest.raises(ValueError, match=match):
        load_quantized(str(tmp_path))


def test_load_compressed_tensors_group_errors(tmp_path):
    """Non-"Linear" targets, activation quantization (W4A8, FP8), two schemes, a quantized
    layer in ignore, and tensors that the scheme does not call for: refused, naming them."""
    make_quantized(tmp_path, "ct", 64, hidden=64, inter=128)
    cfg = json.loads((tmp_path / "config.json").read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    for edit, match in ((dict(targets=["re:.*mlp.*"]), r"config_groups.group_0.targets=\['re:.\*mlp.\*'\] is not "
                                                       r"supported; Sailfish loads targets \[\"Linear\"\]"),
                        (dict(input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
                         r"config_groups.group_0.input_activations=\{.*\} is not supported; Sailfish loads W4A16"),
                        (dict(format="float-quantized"), r"config_groups.group_0.format='float-quantized'")):
        _edit_config(tmp_path, config_groups={"group_0": dict(group, **edit)})
        with pytest.raises(ValueError, match=match):
            load_quantized(str(tmp_path))
    _edit_config(tmp_path, config_groups={"group_0": group, "group_1": group})
    with pytest.raises(ValueError, match="exactly one config group"):
        load_quantized(str(tmp_path))
    _edit_config(tmp_path, config_groups={"group_0": group}, ignore=["lm_head", "re:.*down_proj"])
    with pytest.raises(ValueError, match=r"model.layers.\d.mlp.down_proj is quantized in the checkpoint \(it has "
                                         r".*weight_packed\) but quantization_config.ignore lists 're:.\*down_proj'"):
        load_quantized(str(tmp_path))
    _edit_config(tmp_path, ignore=["lm_head"])
    _edit_ct_weights(tmp_path, symmetric=True)  # the checkpoint has zero points: unexpected tensors
    with pytest.raises(ValueError, match=r"tensor\(s\) the model has no place for: \['model.layers.0.*weight_zero_point'"):
        load_quantized(str(tmp_path))
    _edit_ct_weights(tmp_path, symmetric=False, actorder="group")  # and no weight_g_idx
    with pytest.raises(ValueError, match=r"the checkpoint has no tensor model.layers.\d.\w+.\w+_proj.weight_g_idx"):
        load_quantized(str(tmp_path))


def test_load_quantized_symmetric_awq_needs_eights(tmp_path):
    """zero_point false (GPTQModel's symmetric AWQ) with a layer whose qzeros are not all 8: refused."""
    make_quantized(tmp_path, "awq", 64, hidden=64, inter=128)  # asymmetric tensors
    _edit_config(tmp_path, zero_point=False)
    with pytest.raises(ValueError, match=r"model.layers.\d.\w+.\w+_proj: zero_point=False \(symmetric AWQ\) "
                                         "needs every qzeros nibble to be 8"):
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
        qw = random_checkpoint_weight(128, 64, 32, False, F16, desc_act_g_idx(128, 32))
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
        words = t[f"{name}.qzeros"].long() + 0x11111111  # v1: the stored word + 0x11111111
        zeros = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], 2).reshape(4, 64)
        ref = gptq_dequant(q.numpy().astype(np.uint8), zeros.numpy().astype(np.uint8), t[f"{name}.scales"],
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
    zeros[0, 0] = 16  # a QuantizedWeight allows it; no checkpoint format stores it
    model.model.layers[0].mlp.up_proj = QuantLinear.from_quantized(
        type(qw)(qw.qweight, qw.scales, zeros, None, qw.group_size))
    for fmt in ("gptq", "awq"):
        with pytest.raises(ValueError, match=f"model.layers.0.mlp.up_proj: a zero point of 16 cannot be stored in "
                                             f"{fmt.upper()} format .* allowed 0..15"):
            save_quantized(model, str(tmp_path), format=fmt)
    with pytest.raises(ValueError, match=r"format='exl2' is not supported; allowed: \('gptq', 'awq', 'compressed-tensors', 'qqq'\)"):
        save_quantized(model, str(tmp_path), format="exl2")
    model.model.layers[0].mlp.up_proj = sailfish_model().model.layers[1].mlp.down_proj  # act-order
    with pytest.raises(ValueError, match=r"up_proj: an act-order weight \(g_idx\) cannot be stored in AWQ"):
        save_quantized(model, str(tmp_path), format="awq")
    assert not os.listdir(tmp_path)  # nothing written by the failed calls
    model.model.layers[0].mlp.up_proj = layer
    save_quantized(model, str(tmp_path))
    with pytest.raises(FileExistsError, match="already holds"):
        save_quantized(model, str(tmp_path))


@pytest.mark.parametrize("method,sym,desc_act,fmt,zero_low", [
    ("gptq", True, True, "gptq", 0), ("gptq", False, False, "gptq", 1), ("gptq", False, True, "gptq_v2", 0),
    ("awq", False, False, None, 0), ("awq", True, False, None, 0), ("ct", False, True, None, 0),
    ("ct", True, False, None, 0)],
    ids=["gptq-sym-descact", "gptq-asym", "gptq_v2-asym-descact", "awq", "awq-sym", "ct-asym-actorder", "ct-sym"])
def test_save_back_byte_identical(tmp_path, reference_path, method, sym, desc_act, fmt, zero_low):
    """A checkpoint written by the independent packers, loaded and saved back in its own
    format, gives the same tensors byte for byte (GPTQ asymmetric with zero points >= 1 is
    v1 both ways; with zero points of 0 it is gptq_v2 both ways, with a warning on save)."""
    make_quantized(tmp_path / "in", method, 32, sym, desc_act, hidden=64, inter=128, checkpoint_format=fmt,
                   zero_low=zero_low)
    model = load_quantized(str(tmp_path / "in"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_quantized(model, str(tmp_path / "out"), format="compressed-tensors" if method == "ct" else method)
    said = [str(w.message) for w in caught if "gptq_v2" in str(w.message)]
    assert len(said) == (fmt == "gptq_v2")
    if said:
        assert 'wrote checkpoint_format "gptq_v2"' in said[0] and "zero point of 0" in said[0]
    want, got = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("in", "out"))
    assert want.keys() == got.keys()
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key
    qc = {d: json.loads((tmp_path / d / "config.json").read_text())["quantization_config"] for d in ("in", "out")}
    same = {"gptq": ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format"),
            "awq": ("quant_method", "bits", "group_size", "zero_point", "version"),
            "ct": ("quant_method", "format", "quantization_status", "ignore")}[method]
    assert {k: qc["out"][k] for k in same} == {k: qc["in"][k] for k in same}
    if method == "ct":
        scheme = {d: qc[d]["config_groups"]["group_0"] for d in ("in", "out")}
        assert scheme["out"]["targets"] == ["Linear"]
        fields = ("num_bits", "type", "symmetric", "strategy", "group_size", "actorder")
        assert {f: scheme["out"]["weights"][f] for f in fields} == {f: scheme["in"]["weights"][f] for f in fields}


def test_save_awq_roundtrip(tmp_path, reference_path):
    """A quantize_model model (symmetric, with an asymmetric layer that has zero points of 0
    and 15) saved as AWQ: read back by the AWQ spec and by load_quantized, bit-identical."""
    model = sailfish_model(act_order=False)
    qw = random_checkpoint_weight(128, 64, 32, False, F16, min_zero=0)
    qw.zeros[0, :2] = torch.tensor([0, 15], dtype=torch.uint8)
    model.model.layers[1].mlp.down_proj = QuantLinear.from_quantized(qw)
    save_quantized(model, str(tmp_path), format="awq")
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True,
                  "modules_to_not_convert": ["lm_head"]}
    t = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    assert torch.equal(t[f"{name}.qweight"], awq_pack(qw.qweight.T.numpy()))
    assert torch.equal(t[f"{name}.qzeros"], awq_pack(qw.zeros.numpy()))
    loaded = load_quantized(str(tmp_path))
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key


def test_save_compressed_tensors_roundtrip(tmp_path, reference_path):
    """A quantize_model model (symmetric layers, one asymmetric act-order layer) saved as
    compressed-tensors: one asymmetric actorder-"group" scheme, so every layer stores zero
    points (8 for the symmetric ones) and a g_idx; read back by the spec and by
    load_quantized, bit-identical."""
    model = sailfish_model()
    save_quantized(model, str(tmp_path), format="compressed-tensors")
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["ignore"] == ["lm_head"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"], w["actorder"]) == \
        (4, "int", False, "group", 32, "group")
    t = load_file(str(tmp_path / "model.safetensors"))
    for name in ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj"):
        layer = projection(model, name)
        n, k = layer.out_features, layer.in_features
        words = t[f"{name}.weight_packed"].long()
        q = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], 2).reshape(n, k) - 8
        zwords = t[f"{name}.weight_zero_point"].long()
        zp = torch.stack([(zwords >> (4 * j)) & 0xF for j in range(8)], 1).reshape(n, -1) - 8
        assert t[f"{name}.weight_shape"].tolist() == [n, k]
        got = ct_dequant(q.numpy(), zp.numpy(), t[f"{name}.weight_scale"], t[f"{name}.weight_g_idx"], 32)
        assert torch.equal(got, layer.dequantize()), name
    loaded = load_quantized(str(tmp_path))
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key


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
    # generate() may compile it, through Sailfish's decode graphs (sailfish.generation)
    assert model.hf_quantizer.is_compileable and model.sailfish_report["row_ops"]["generate"][0] == "get_compiled_call"


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
