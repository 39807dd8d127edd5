"""W4A8 with float8 (e4m3) activations: QuantLinearW4A8(act_dtype="fp8").

References (formats/qqq.py): quantize_activations(x, "fp8") bit for bit; the GEMM against
the float64 product of the e4m3 activations and formats.qqq.fp8_weight, within the bound
of fp32 accumulation (Hopper's fp8 tensor cores keep fewer accumulator bits: see
ACC_UNIT). On CPU the kernels run in Triton's interpreter (tests/conftest.py).
"""
import pytest
import torch

from helpers import DTYPE_NAMES
from sailfish import Config, QuantLinearW4A8
from sailfish.formats.qqq import QQQWeight, fp8_weight, pack_qqq, quantize_activations
from sailfish.ops.w4a8 import quantize_per_token_launch, w4a8_launch
from test_w4a8 import nonfinite_rows, random_qqq, special_rows

F16, BF16 = torch.float16, torch.bfloat16
E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch):
    monkeypatch.setenv("SAILFISH_AUTOTUNE", "0")


def acc_unit(device) -> float:
    """Relative rounding unit of one accumulation step: fp32 (2**-24) in the interpreter; on
    Hopper's fp8 wgmma the accumulator keeps about 14 significant bits (DeepSeek-V3 report,
    sec. 3.3.2), hence 2**-13 there; the kernel adds every K tile's partial sum in fp32."""
    return 2.0 ** -13 if torch.device(device).type == "cuda" else 2.0 ** -24


def acc_bound(x_q, w, block_k, device):
    """Per-element bound on |acc - exact|: each of the <= block_k additions inside a K tile
    rounds at acc_unit of the tile's absolute sum, each of the K / block_k tile additions at
    fp32's unit of the running absolute sum."""
    k = x_q.shape[1]
    abs_sum = x_q.double().abs() @ w.double().abs().T
    return abs_sum * (block_k * acc_unit(device) + (k // block_k + 1) * 2.0 ** -24)


# ----------------------------------------------------------------------------------
# activation quantization
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("k,block_k", [(16, None), (400, None), (400, 64)], ids=["k16", "onepass", "twopass"])
def test_quantize_fp8_exact(k, block_k, dtype, device):
    x = torch.cat([special_rows(k, dtype, device), torch.randn(3, k, device=device).to(dtype) * 50])
    x_q, s = quantize_per_token_launch(x, block_k, "fp8")
    r_q, r_s = quantize_activations(x, "fp8")
    assert x_q.dtype == E4M3 and s.dtype == torch.float32
    assert torch.equal(x_q.view(torch.uint8), r_q.view(torch.uint8))
    assert torch.equal(s, r_s)
    # the scaled row never leaves e4m3's range and its largest value maps to 448
    nz = s > 0
    assert torch.equal(x_q.float().abs().amax(dim=1)[nz], torch.full_like(s[nz], 448.0))


def test_e4m3_rounding_is_nearest_even(device):
    """Values placed on e4m3 ties and subnormals (row max 448: scale 1, so x_q = rne(x)),
    against hand-computed e4m3 values."""
    vals = [448.0, 1.0625, 1.1875, 17.0, 19.0, 432.0, 440.0, 2.0 ** -10, 1.5 * 2.0 ** -9,
            -2.0 ** -7 * 1.0625, 7.5, 7.75, -0.0, 0.001, 2.0 ** -6 * 0.97]
    want = [448.0, 1.0, 1.25, 16.0, 20.0, 448.0, 448.0, 0.0, 2.0 ** -8,
            -2.0 ** -7, 7.5, 8.0, 0.0, 2.0 ** -9, 2.0 ** -6]
    x = torch.tensor([vals], dtype=torch.float32, device=device)
    x_q, s = quantize_per_token_launch(x, None, "fp8")
    assert s.item() == 1.0
    assert x_q.float().cpu().tolist() == [want]
    assert torch.equal(x_q.view(torch.uint8), quantize_activations(x, "fp8")[0].view(torch.uint8))


@pytest.mark.parametrize("block_k", [None, 64], ids=["onepass", "twopass"])
def test_quantize_fp8_nonfinite_rows(block_k, device):
    x, bad = nonfinite_rows(200, F16, device)
    x_q, s = quantize_per_token_launch(x, block_k, "fp8")
    assert torch.equal(s.isnan(), bad)
    assert (x_q[bad].float() == 0).all()


def test_quantize_fp8_op(device):
    x = torch.randn(4, 96, device=device).half()
    q, s = torch.ops.sailfish.quantize_per_token_fp8(x)
    r_q, r_s = quantize_activations(x, "fp8")
    assert torch.equal(q.view(torch.uint8), r_q.view(torch.uint8)) and torch.equal(s, r_s)
    with pytest.raises(TypeError, match="int32"):
        torch.ops.sailfish.quantize_per_token_fp8(torch.zeros(2, 8, dtype=torch.int32, device=device))


# ----------------------------------------------------------------------------------
# GEMM
# ----------------------------------------------------------------------------------
GEMM_CASES = [  # M, K, N, gs, config (None: the heuristic)
    (1, 400, 200, 128, None),
    (3, 272, 136, -1, None),
    (17, 512, 64, 128, Config(16, 64, 128, 2)),          # split-K (float32 workspace)
    (33, 272, 200, -1, Config(32, 128, 64, 3)),          # BLOCK_K < chunk, split-K 3 of 5 tiles
    (40, 400, 136, 128, Config(64, 64, 64, 1)),
    (100, 400, 136, -1, Config(128, 128, 256, 1, num_warps=8)),  # large-M tile, 2 chunks per K tile
]


@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-g{c[3]}-{c[4]}")
def test_fp8_accumulator(case, device):
    m, k, n, gs, cfg = case
    qw = random_qqq(k, n, gs, device)
    p = pack_qqq(qw)
    x_q, x_s = quantize_activations(torch.randn(m, k, device=device) * 3, "fp8")
    acc = w4a8_launch(x_q, x_s, p.qweight, p.s_ch, p.s_g, None, k, gs, F16, config=cfg, raw_acc=True)
    w = fp8_weight(qw)
    ref = x_q.double() @ w.double().T
    bk = 128 if cfg is None else cfg.BLOCK_K
    assert acc.dtype == torch.float32
    err = (acc.double() - ref).abs()
    assert (err <= acc_bound(x_q, w, bk, device)).all(), float(err.max())


@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("gs", [-1, 128], ids=["chan", "g128"])
def test_fp8_layer_matches_reference(gs, dtype, device):
    k, n = 400, 136
    qw = random_qqq(k, n, gs, device)
    bias = torch.randn(n, device=device)
    layer = QuantLinearW4A8.from_quantized(qw, bias, act_dtype="fp8")
    x = torch.randn(2, 3, k, device=device).to(dtype)
    y = layer(x)
    x_q, s_tok = quantize_activations(x.reshape(-1, k), "fp8")
    w = fp8_weight(qw)
    acc = x_q.double() @ w.double().T
    ref = s_tok.double()[:, None] * acc * qw.s_ch.double()[None, :] + bias.double()
    assert y.shape == (2, 3, n) and y.dtype == dtype
    # the accumulation error, carried through the scales, then the output rounding
    slack = acc_bound(x_q, w, 128, device) * (s_tok.double()[:, None] * qw.s_ch.double().abs()[None, :])
    yd = y.reshape(-1, n).double()
    # output rounding: half an ulp (2**-11 fp16, 2**-8 bf16) of |y| <= |ref| + slack
    u = {F16: 2.0 ** -11, BF16: 2.0 ** -8}[dtype]
    assert ((yd - ref).abs() <= slack + u * (ref.abs() + slack) + 1e-6 * bias.double().abs()).all()
    assert torch.equal(layer.dequantize(), qw.s_ch[:, None] * w)


@pytest.mark.parametrize("gs", [-1, 128], ids=["chan", "g128"])
def test_fp8_nonfinite_rows_give_nan(gs, device):
    layer = QuantLinearW4A8.from_quantized(random_qqq(256, 64, gs, device), act_dtype="fp8")
    x, bad = nonfinite_rows(256, F16, device)
    y = layer(x)
    assert y[bad].isnan().all() and y[~bad].isfinite().all()


# ----------------------------------------------------------------------------------
# module API
# ----------------------------------------------------------------------------------
def test_fp8_module_api(device):
    lin = torch.nn.Linear(256, 64, device=device)
    l8 = QuantLinearW4A8.from_linear(lin, group_size=128)
    lf = QuantLinearW4A8.from_linear(lin, group_size=128, act_dtype="fp8")
    assert lf.act_dtype == "fp8" and "act_dtype=fp8" in repr(lf) and "fp8" not in repr(l8)
    sd = lf.state_dict()  # the same weights and buffers as the int8 layer
    assert sd.keys() == l8.state_dict().keys()
    assert all(torch.equal(sd[k], v) for k, v in l8.state_dict().items())
    fresh = QuantLinearW4A8(256, 64, True, group_size=128, act_dtype="fp8", device=device)
    fresh.load_state_dict(l8.state_dict())
    x = torch.randn(5, 256, device=device).half()
    assert torch.equal(fresh(x), lf(x))
    x_q, s = lf.quantize_input(x)
    assert x_q.dtype == E4M3 and torch.equal(lf.forward_quantized(x_q, s, F16), lf(x))
    with pytest.raises(TypeError, match="does not match"):
        l8.forward_quantized(x_q, s, F16)
    with pytest.raises(ValueError, match="act_dtype='int4'"):
        QuantLinearW4A8(256, 64, act_dtype="int4")
    with pytest.raises(NotImplementedError, match="no backward"):
        lf(x.requires_grad_())
    assert lf.shard(0, 2, 0).act_dtype == "fp8"


@pytest.mark.parametrize("cfg,match", [
    (Config(1, 16, 256, kernel="gemv"), "mma' only"),
    (Config(16, 64, 128, kernel="dequant"), "mma' only"),
    (Config(16, 64, 256), "group_size=128"),
])
def test_fp8_bad_config(cfg, match, device):
    qw = random_qqq(512, 64, 128, device)
    p = pack_qqq(qw)
    x_q, x_s = quantize_activations(torch.randn(1, 512, device=device), "fp8")
    with pytest.raises(ValueError, match=match):
        w4a8_launch(x_q, x_s, p.qweight, p.s_ch, p.s_g, None, 512, 128, F16, config=cfg)


def test_fp8_weight_is_exact_in_e4m3(device):
    """Per channel the fp8 weight tile is q - 8, which e4m3 holds exactly; per group it is
    not w8 = rne(s_g * (q - 8)) (not e4m3-representable in general) but s_g * (q - 8)."""
    q = torch.arange(16, dtype=torch.uint8, device=device)[None, :].repeat(2, 1)
    w = fp8_weight(QQQWeight(q, torch.ones(2, device=device), None, -1))
    assert torch.equal(w.to(E4M3).float(), w) and w[0].tolist() == list(range(-8, 8))
    s_g = torch.tensor([[2.5, 19.0]], device=device).half()
    wg = fp8_weight(QQQWeight(q, torch.ones(2, device=device), s_g, 128))
    assert wg[0].tolist() == [2.5 * v for v in range(-8, 8)] and wg[1, 0].item() == -152.0
