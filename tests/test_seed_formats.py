"""The seeds' own checkpoint formats: Marlin (Layer.pack(), vLLM quant_method "marlin") into
QuantLinear and QQQ (quant_method "qqq") into QuantLinearW4A8, and GPTQ's quantized lm_head.

The packers here follow the formats' published descriptions (Marlin's and QQQ's pack()
permutations as facts: for each warp thread, the rows and columns of the 16 x 16 tiles it
takes, then the interleave of each 8), written as plain loops; the loader (formats/marlin.py)
inverts index maps. Literal tests pin a few stored positions to (k, n) by hand.
"""
import json

import numpy as np
import pytest
import torch

from test_checkpoint import (PROJ, _edit_config, _edit_tensors, gptq_pack, logits, reference_model, tiny_config,
                             write_checkpoint)
from sailfish import QuantLinear, load_quantized
from sailfish.formats.int4 import QuantizedWeight
from sailfish.formats.marlin import from_marlin
from sailfish.formats.qqq import QQQWeight, from_qqq
from sailfish.fuse import unfused_layers
from sailfish.nn import QuantLinearW4A8

F16 = torch.float16


@pytest.fixture
def reference_path(monkeypatch):
    """Whole models on the CPU run the PyTorch reference, not the Triton interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


# ----------------------------------------------------------------------------------
# Packers from the published descriptions
# ----------------------------------------------------------------------------------
def tile_perm(kind):
    """Position p of each 1024-element run (4 row-major 16 x 16 tiles) holds element perm[p].
    Thread t of 32 takes column t // 4 and that + 8 of its rows in each tile; Marlin: rows
    2u, 2u+1, 2u+8, 2u+9 (u = t % 4); QQQ: rows 4u .. 4u+3; each 8 is then interleaved."""
    rows = {"marlin": lambda u: [2 * u, 2 * u + 1, 2 * u + 8, 2 * u + 9]}.get(
        kind, lambda u: [4 * u, 4 * u + 1, 4 * u + 2, 4 * u + 3])
    order = [4, 0, 5, 1, 6, 2, 7, 3] if kind == "qqq-channel" else [0, 2, 4, 6, 1, 3, 5, 7]
    perm = []
    for t in range(32):
        for tile in range(4):
            eight = [256 * tile + 16 * r + t // 4 + 8 * h for h in (0, 1) for r in rows(t % 4)]
            perm += [eight[x] for x in order]
    return perm


def pack_tiles(nibbles_kn: np.ndarray, kind) -> torch.Tensor:
    """(K, N) nibbles -> int32 B (K / 16, 2 N)."""
    k, n = nibbles_kn.shape
    rows = []
    for kt in range(k // 16):
        seq = []  # the tiles of this row, one after the other, each row-major
        for nt in range(n // 16):
            seq += list(nibbles_kn[16 * kt:16 * kt + 16, 16 * nt:16 * nt + 16].reshape(-1))
        perm = tile_perm(kind)
        stored = [seq[1024 * run + perm[p]] for run in range(len(seq) // 1024) for p in range(1024)]
        rows.append([sum(int(stored[8 * w + i]) << (4 * i) for i in range(8)) for w in range(len(stored) // 8)])
    return torch.from_numpy(np.array(rows, dtype=np.uint32).view(np.int32))


def pack_scales(s: torch.Tensor) -> torch.Tensor:
    """(G, N) -> stored order: per group, position 8a + b of every 64 holds a + 8b; one row (per
    channel), position 8a + b of every 32 holds 2a + (0, 1, 8, 9, 16, 17, 24, 25)[b]."""
    g, n = s.shape
    flat = s.reshape(-1)
    if g > 1:
        perm = [a + 8 * b for a in range(8) for b in range(8)]
    else:
        perm = [2 * a + c for a in range(4) for c in (0, 1, 8, 9, 16, 17, 24, 25)]
    idx = [len(perm) * run + perm[p] for run in range(flat.numel() // len(perm)) for p in range(len(perm))]
    return flat[idx].reshape(g, n).contiguous()


def marlin_layer(k, n, gs, rng):
    """Marlin's pack() of a symmetric layer: codes q (K, N) in [0, 15] (value q - 8) and fp16 scales;
    returns (B, s, q, scales, effective weight fp16(s * (q - 8)) as float32 (N, K))."""
    g = 1 if gs == -1 else k // gs
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    scales = (torch.rand(g, n) * 0.004 + 0.002).to(F16)
    gi = torch.arange(k) // (k if gs == -1 else gs)
    w = (scales.double()[gi] * (torch.from_numpy(q.astype(np.float64)) - 8)).to(F16).float().T
    return pack_tiles(q, "marlin"), pack_scales(scales), q, scales, w


def qqq_layer(k, n, gs, rng):
    """QQQ's pack(): per group, codes q and s_group (scale / s_channel, fp16) with s_channel
    float32; per channel (QQQ: also when K = group size), two's-complement int4 w and
    s_channel = scale / 16. Returns (B, s_channel (1, N), s_group, the QQQWeight they hold,
    its effective weight (N, K))."""
    s_ch = torch.rand(n) * 0.01 + 0.001
    if gs in (-1, k):
        w = rng.integers(-8, 8, (k, n))
        B = pack_tiles((w & 0xF).astype(np.uint8), "qqq-channel")
        s_channel = pack_scales((s_ch / 16).reshape(1, n))
        ref = (s_ch.double()[:, None] * torch.from_numpy(w.T.astype(np.float64))).float()
        return B, s_channel, torch.tensor([], dtype=F16), QQQWeight(torch.from_numpy((w.T + 8).astype(np.uint8)),
                                                                   s_ch, None, -1), ref
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    s_g = (torch.rand(k // gs, n) * 14 + 1).to(F16)  # |s_g * (q - 8)| <= 120: no int8 clamp
    gi = torch.arange(k) // gs
    w8 = (s_g.double()[gi] * (torch.from_numpy(q.astype(np.float64)) - 8)).round()  # one rounding, half to even
    ref = (s_ch.double()[:, None] * w8.T).float()
    B = pack_tiles(q, "qqq")
    return (B, pack_scales(s_ch.reshape(1, n)), pack_scales(s_g),
            QQQWeight(torch.from_numpy(q.T.copy()), s_ch, s_g, gs), ref)


# ----------------------------------------------------------------------------------
# Single layers
# ----------------------------------------------------------------------------------
# the first word of B row 0: (k, n) of nibbles 0..7, from the published permutations
LITERAL = {"marlin": [(0, 0), (8, 0), (0, 8), (8, 8), (1, 0), (9, 0), (1, 8), (9, 8)],
           "qqq": [(0, 0), (2, 0), (0, 8), (2, 8), (1, 0), (3, 0), (1, 8), (3, 8)],
           "qqq-channel": [(0, 8), (0, 0), (1, 8), (1, 0), (2, 8), (2, 0), (3, 8), (3, 0)]}


@pytest.mark.parametrize("kind", list(LITERAL))
def test_tile_order_literal(kind):
    """Word 0 of B holds nibble i = i; every other nibble is 0 (per channel: int4 w = 0)."""
    k, n = 256, 64  # K > 128: QQQ stores K = 128 layers per channel
    B = torch.zeros(k // 16, 2 * n, dtype=torch.int32)
    B[0, 0] = 0x76543210
    if kind == "marlin":
        q = from_marlin(B, torch.ones(1, n, dtype=F16), group_size=-1).qweight.int()
    elif kind == "qqq":
        q = from_qqq(B, torch.ones(1, n), torch.ones(2, n, dtype=F16), group_size=128).qweight.int()
    else:
        q = from_qqq(B, torch.ones(1, n), None, group_size=-1).qweight.int() - 8  # code = w + 8
    for i, (kk, nn) in enumerate(LITERAL[kind]):
        assert q[nn, kk] == i, (i, kk, nn)
    assert int((q != 0).sum()) == 7


@pytest.mark.parametrize("gs", [128, -1])
def test_marlin_roundtrip(gs):
    rng = np.random.default_rng(0)
    B, s, q, scales, w = marlin_layer(256, 128, gs, rng)
    qw = from_marlin(B, s, group_size=gs)
    assert torch.equal(qw.qweight, torch.from_numpy(q.T.copy())) and torch.equal(qw.scales, scales)
    assert qw.zeros is None and qw.g_idx is None and qw.group_size == gs
    bias = torch.randn(128).to(F16)
    layer = QuantLinear.from_marlin(B, s, bias, group_size=gs)
    assert torch.equal(layer.dequantize(), w) and torch.equal(layer.bias, bias)
    assert torch.equal(layer.dequantize(), QuantLinear.from_quantized(QuantizedWeight(
        torch.from_numpy(q.T.copy()), scales, None, None, gs)).dequantize())


@pytest.mark.parametrize("gs", [128, -1])
def test_qqq_roundtrip(gs):
    rng = np.random.default_rng(1)
    B, s_channel, s_group, want, ref = qqq_layer(256, 128, gs, rng)
    qw = from_qqq(B, s_channel, s_group, group_size=gs)
    assert torch.equal(qw.qweight, want.qweight) and torch.equal(qw.s_ch, want.s_ch)
    assert (qw.s_g is None) == (gs == -1) and (gs == -1 or torch.equal(qw.s_g, want.s_g))
    layer = QuantLinearW4A8.from_qqq(B, s_channel, s_group, group_size=gs)
    assert layer.group_size == gs and torch.equal(layer.dequantize(), ref)


@pytest.mark.parametrize("call,exc,match", [
    (lambda B, s: from_marlin(B, s, group_size=64), ValueError, r"group_size=64 is not supported; allowed: \(-1, 128\)"),
    (lambda B, s: from_marlin(B[:, :-8], s, group_size=128), ValueError, r"B must have shape \(K / 16, 2 N\) with N a mult"),
    (lambda B, s: from_marlin(B, s[:1], group_size=128), ValueError, r"s must have shape \(G=2, N=64\)"),
    (lambda B, s: from_marlin(B.long(), s, group_size=128), TypeError, r"B must be a 2-D torch.int32"),
    (lambda B, s: from_marlin(B, s.float(), group_size=128), TypeError, r"s must be float16"),
    (lambda B, s: from_marlin(B, -s, group_size=128), ValueError, r"s must be finite and > 0"),
])
def test_marlin_errors(call, exc, match):
    B, s, *_ = marlin_layer(256, 64, 128, np.random.default_rng(2))
    with pytest.raises(exc, match=match):
        call(B, s)


def test_qqq_errors():
    B, s_channel, s_group, *_ = qqq_layer(256, 64, 128, np.random.default_rng(3))
    with pytest.raises(TypeError, match=r"s_channel must be float32"):
        from_qqq(B, s_channel.half(), s_group, group_size=128)
    with pytest.raises(ValueError, match=r"s_channel must have shape \(G=1, N=64\)"):
        from_qqq(B, s_channel[:, :32], s_group, group_size=128)
    with pytest.raises(TypeError, match=r"s_group must be a float16 tensor for group_size=128, got None"):
        from_qqq(B, s_channel, None, group_size=128)
    with pytest.raises(ValueError, match=r"s_group must be empty for a per-channel layer \(group_size=-1, K=256\), got shape \(2, 64\)"):
        from_qqq(B, s_channel, s_group, group_size=-1)
    with pytest.raises(ValueError, match=r"s_group must have shape \(G=2, N=64\)"):
        from_qqq(B, s_channel, s_group[:1], group_size=128)
    with pytest.raises(ValueError, match=r"group_size=32 is not supported"):
        from_qqq(B, s_channel, s_group, group_size=32)
    # s_group 16 with code 0: 16 * -8 = -128, which QQQ's kernel keeps and Sailfish's int8 range does not
    q = torch.zeros(256, 64, dtype=torch.uint8)
    B0 = pack_tiles(q.numpy(), "qqq")
    with pytest.raises(ValueError, match=r"s_group \* \(q - 8\) rounds to -128 at \(n=0, k=0\) \(16384 weights "
                                         r"outside \[-127, 127\]\)"):
        from_qqq(B0, s_channel, torch.full((2, 64), 16.0, dtype=F16), group_size=128)
    assert from_qqq(B0, s_channel, torch.full((2, 64), 15.875, dtype=F16), group_size=128).int8_weight().min() == -127


# ----------------------------------------------------------------------------------
# Whole checkpoints through load_quantized
# ----------------------------------------------------------------------------------
def make_tiled(path, method, gs, lm_head=False, tie=False, seed=0, **config_kw):
    """A tiny Llama checkpoint with every projection (and lm_head if asked) in `method`'s format;
    returns {layer name: expected dequantized weight (N, K)} and the reference model. tie: tied
    embeddings; a quantized lm_head then stands apart (GPTQModel stores it, the embedding stays)."""
    config = tiny_config(tie=tie, **config_kw)
    ref = reference_model(config)
    rng = np.random.default_rng(seed)
    tensors = {k: v.clone() for k, v in ref.state_dict().items()}
    if tie:
        del tensors["lm_head.weight"]
        if lm_head:  # untie the reference, so that writing the lm_head leaves the embedding
            ref.lm_head.weight = torch.nn.Parameter(ref.lm_head.weight.detach().clone())
    names = [f"model.layers.{i}.{p}" for i in range(2) for p in PROJ] + (["lm_head"] if lm_head else [])
    expected = {}
    for name in names:
        lin = ref.get_submodule(name)
        k, n = lin.in_features, lin.out_features
        tensors.pop(f"{name}.weight", None)
        if method == "marlin":
            B, s, _, _, w = marlin_layer(k, n, gs, rng)
            tensors.update({f"{name}.B": B, f"{name}.s": s})
        elif method == "qqq":
            B, s_channel, s_group, _, w = qqq_layer(k, n, gs, rng)
            tensors.update({f"{name}.B": B, f"{name}.s_channel": s_channel, f"{name}.s_group": s_group})
        else:  # gptq, symmetric, in order
            g = k // gs
            q = rng.integers(0, 16, (k, n)).astype(np.uint8)
            scales = (torch.rand(g, n) * 0.004 + 0.002).to(F16)
            qweight, qzeros = gptq_pack(q, np.full((g, n), 8, np.uint8))
            tensors.update({f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": scales,
                            f"{name}.g_idx": torch.arange(k, dtype=torch.int32) // gs})
            w = (scales.double()[torch.arange(k) // gs] * (torch.from_numpy(q.astype(np.float64)) - 8)).to(F16).float().T
        expected[name] = w
        with torch.no_grad():
            lin.weight.copy_(w.to(F16))
    qc = {"marlin": {"quant_method": "marlin", "group_size": gs, "lm_head": lm_head},
          "qqq": {"quant_method": "qqq", "group_size": gs, "wbits": 4},
          "gptq": {"quant_method": "gptq", "bits": 4, "group_size": gs, "desc_act": False, "sym": True,
                   "lm_head": lm_head, "checkpoint_format": "gptq"}}[method]
    write_checkpoint(path, config, tensors, qc)
    return expected, ref


@pytest.mark.parametrize("method,gs,lm_head,tie", [("marlin", 128, True, False), ("marlin", -1, False, True),
                                                   ("qqq", 128, False, False), ("qqq", -1, False, False),
                                                   ("gptq", 64, True, True)])
def test_load_quantized_seed_formats(tmp_path, reference_path, method, gs, lm_head, tie):
    expected, ref = make_tiled(tmp_path, method, gs, lm_head, tie)
    model = load_quantized(str(tmp_path), fuse=False)
    cls = QuantLinearW4A8 if method == "qqq" else QuantLinear
    layers = unfused_layers(model)
    for name, w in expected.items():
        layer = model.get_submodule(name)
        channel = method == "qqq" and layer.in_features == gs  # QQQ stores these per channel
        assert type(layer) is cls and layer.group_size == (-1 if channel else gs), name
        assert torch.equal(layer.dequantize(), w), name
    assert isinstance(model.lm_head, QuantLinear) == lm_head
    assert torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    if tie and not lm_head:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if tie and lm_head:  # untied on load: transformers' tie_weights leaves the quantized head alone
        model.tie_weights()
        assert not model.config.tie_word_embeddings and not list(model.lm_head.parameters())
    if method == "qqq":  # W4A8 runs per-token int8 activations: the same layers built by hand give the same bits
        for name in expected:
            qw = model.get_submodule(name).quantized_weight()
            ref.set_submodule(name, QuantLinearW4A8.from_quantized(qw))
        assert torch.equal(logits(model), logits(ref))
    else:
        fused = load_quantized(str(tmp_path))  # fused q/k/v and gate/up: the same weights
        assert set(unfused_layers(fused)) >= set(layers)
        y, r = logits(fused), logits(ref)
        assert float((y - r).norm() / r.norm()) <= 2e-3  # fp16 output rounding (helpers.TOL)


@pytest.mark.parametrize("method,lm_head,edit,match", [
    ("marlin", False, dict(group_size=64), r"quantization_config.group_size=64 is not supported; Sailfish loads "
                                           r"group sizes \(-1, 128\) for quant_method 'marlin'"),
    ("qqq", False, dict(wbits=8), r"quantization_config.wbits=8 is not supported; Sailfish loads 4-bit"),
    ("qqq", False, dict(lm_head=True), r"quantization_config.lm_head=True is not supported; .*QQQ keeps it in fp16"),
    ("marlin", False, dict(lm_head="yes"), r"quantization_config.lm_head='yes' is not supported; .*true or false"),
    ("marlin", False, dict(lm_head=True), r"quantization_config.lm_head=True but the checkpoint has no lm_head.B"),
    ("marlin", True, dict(lm_head=None), r"lm_head is quantized in the checkpoint \(it has lm_head.B\) but "
                                         r"quantization_config.lm_head is false"),
    ("gptq", True, dict(lm_head=False), r"lm_head is quantized in the checkpoint \(it has lm_head.qweight\)"),
    ("gptq", False, dict(lm_head=True), r"lm_head=True but the checkpoint has no lm_head.qweight"),
    ("gptq", False, dict(checkpoint_format="marlin", sym=False), r"quantization_config.sym=False is not supported"),
], ids=["marlin-g64", "qqq-wbits8", "qqq-lm_head", "lm_head-str", "marlin-lm_head-missing", "marlin-lm_head-absent",
        "gptq-lm_head-false", "gptq-lm_head-missing", "gptq-marlin-asym"])
def test_seed_format_refusals(tmp_path, method, lm_head, edit, match):
    make_tiled(tmp_path, method, 128 if method != "gptq" else 64, lm_head)
    _edit_config(tmp_path, **edit)
    with pytest.raises(ValueError, match=match):
        load_quantized(str(tmp_path))


def test_gptq_marlin_format_config(tmp_path, reference_path):
    """AutoGPTQ's Marlin checkpoints: quant_method "gptq" with checkpoint_format "marlin" (or
    is_marlin_format true), Marlin's B / s tensors."""
    expected, _ = make_tiled(tmp_path, "marlin", 128)
    _edit_config(tmp_path, quant_method="gptq", bits=4, sym=True, desc_act=False, checkpoint_format="marlin",
             lm_head=None)
    model = load_quantized(str(tmp_path), fuse=False)
    name = "model.layers.1.mlp.down_proj"
    assert torch.equal(model.get_submodule(name).dequantize(), expected[name])


L0 = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("method,gs,edit,match", [
    ("marlin", 128, lambda t: t.__setitem__(f"{L0}.s", t[f"{L0}.s"].float()),
     rf"{L0}.s must be F16 of shape \(1, 128\), got F32"),
    ("qqq", 128, lambda t: t.__setitem__(f"{L0}.s_channel", t[f"{L0}.s_channel"].half()),
     rf"{L0}.s_channel must be F32 of shape \(1, 128\), got F16"),
    ("qqq", -1, lambda t: t.__setitem__(f"{L0}.s_group", torch.ones(1, 128, dtype=F16)),
     rf"{L0}.s_group must be F16 of shape \(0,\), got F16 \(1, 128\)"),
    ("qqq", 128, lambda t: t.__setitem__(f"{L0}.workspace", torch.zeros(32, dtype=torch.int32)),
     rf"the model has no place for: \['{L0}.workspace'\]"),
    ("marlin", 128, lambda t: t[f"{L0}.s"].__setitem__((0, 3), float("inf")),
     rf"{L0}: s must be finite and > 0; 1 of 128 are not"),
], ids=["marlin-s-f32", "qqq-s_channel-f16", "qqq-channel-s_group", "unexpected", "marlin-s-inf"])
def test_seed_format_tensor_refusals(tmp_path, method, gs, edit, match):
    make_tiled(tmp_path, method, gs)
    _edit_tensors(tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        load_quantized(str(tmp_path))


def test_seed_format_shape_refusal_and_absent_s_group(tmp_path, reference_path):
    """QQQ may leave the empty per-channel s_group out; a layer narrower than Marlin's 64-column
    runs is refused before any tensor is read, naming it."""
    expected, _ = make_tiled(tmp_path, "qqq", -1)
    _edit_tensors(tmp_path, lambda t: [t.pop(k) for k in list(t) if k.endswith(".s_group")])
    model = load_quantized(str(tmp_path), fuse=False)
    assert torch.equal(model.get_submodule(L0).dequantize(), expected[L0])
    make_tiled(tmp_path / "narrow", "marlin", -1)
    cfg = json.loads((tmp_path / "narrow" / "config.json").read_text())
    (tmp_path / "narrow" / "config.json").write_text(json.dumps({**cfg, "head_dim": 8}))  # q_proj: 32 x 128
    with pytest.raises(ValueError, match=r"model.layers.\d.self_attn.\w_proj: quant_method 'marlin' stores whole "
                                         r"1024-element tile runs: out_features must be a multiple of 64 and "
                                         r"in_features of 128, got \d+ x \d+"):
        load_quantized(str(tmp_path / "narrow"))
