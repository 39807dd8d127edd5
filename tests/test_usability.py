"""Module behaviour users rely on: pickling, the dtype policy, float32 Linears, error
messages that name the right tensor, and the input gradient (frozen 4-bit weights under
trainable adapters)."""
import copy
import io

import pytest
import torch
from torch import nn

from helpers import (DTYPE_NAMES, UNIT_ROUNDOFF, assert_close_per_element, elementwise_bound,
                     make_g_idx, random_checkpoint_weight, random_quantized)
from sailfish import QuantLinear, QuantLinearW4A8, QuantizedWeight, quantize_model, to_gptq
from sailfish.formats.qqq import quantize_qqq

F16, BF16 = torch.float16, torch.bfloat16


def random_layer(k, n, gs, sym, gidx, dtype, bias, device):
    qw = random_quantized(k, n, gs, sym, dtype, make_g_idx(gidx, k, gs, device), device)
    return QuantLinear.from_quantized(qw, torch.randn(n, device=device).to(dtype) if bias else None)


def w4a8_layer(k, n, gs, bias, device):
    qw = quantize_qqq(torch.randn(n, k, device=device), gs)
    return QuantLinearW4A8.from_quantized(qw, torch.randn(n, device=device) if bias else None)


def save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def buffers(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_same_buffers(module, before):
    after = module.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k


# ----------------------------------------------------------------------------------
# pickling
# ----------------------------------------------------------------------------------
def test_torch_save_whole_layers(device):
    # a general g_idx: the loaded layer must keep the flag derived from its buffers
    layer = random_layer(272, 64, 64, False, "gidx", F16, True, device)
    layer8 = w4a8_layer(272, 64, 128, True, device)
    x = torch.randn(3, 272, device=device).half()
    for src in (layer, layer8, copy.deepcopy(layer)):
        dst = save_load(src)
        assert type(dst) is type(src)
        assert_same_buffers(dst, buffers(src))
        assert torch.equal(dst(x), src(x))
    # the load_state_dict hook survives pickling: loading a descact state updates the flag
    other = random_layer(272, 64, 64, False, "descact", F16, True, device)
    dst = save_load(layer)
    dst.load_state_dict(other.state_dict())
    assert torch.equal(dst.dequantize(), other.dequantize())
    assert torch.equal(dst(x), other(x))


@pytest.mark.parametrize("act_bits", [16, 8])
def test_torch_save_quantized_model(act_bits, device):
    model = nn.Sequential(nn.Linear(256, 128), nn.SiLU(), nn.Linear(128, 64)).to(device, F16)
    quantize_model(model, act_bits=act_bits, group_size=128)
    loaded = save_load(model)
    x = torch.randn(2, 256, device=device).half()
    assert torch.equal(loaded(x), model(x))
    assert loaded.sailfish_report == model.sailfish_report


# ----------------------------------------------------------------------------------
# dtype policy
# ----------------------------------------------------------------------------------
def test_half_is_a_noop_and_device_moves_work(device):
    model = nn.Sequential(random_layer(256, 64, 128, False, "descact", F16, True, device))
    before = buffers(model)
    assert model.half() is model
    model.to(torch.float16)
    model.to(device)
    model.to(device, torch.float16)
    assert_same_buffers(model, before)
    model.cpu()
    assert model[0].scales.device.type == "cpu" and model[0].perm.device.type == "cpu"
    model.to(device)
    x = torch.randn(2, 256, device=device).half()
    assert torch.equal(model(x), random_layer_like(model[0])(x))


def random_layer_like(layer):
    """An independent layer with the same weight (built from its QuantizedWeight)."""
    return QuantLinear.from_quantized(layer.quantized_weight(), layer.bias)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("convert,target", [
    (lambda m: m.float(), torch.float32),
    (lambda m: m.double(), torch.float64),
    (lambda m: m.to(torch.float32), torch.float32),
    (lambda m: m.half(), F16),
    (lambda m: m.bfloat16(), BF16),
], ids=["float", "double", "to-fp32", "half", "bfloat16"])
def test_dtype_change_raises_and_keeps_layer(dtype, convert, target, device):
    layer = random_layer(256, 64, 64, False, "none", dtype, True, device)
    before = buffers(layer)
    if target == dtype:  # same dtype: a no-op
        convert(layer)
    else:
        hint = "to_dtype" if target in (F16, BF16) else "runs float16 or bfloat16 only"
        with pytest.raises(TypeError, match=rf"QuantLinear has dtype {dtype}.*{target} was requested.*{hint}"):
            convert(layer)
    assert layer.dtype == dtype
    assert_same_buffers(layer, before)


def test_model_conversion_refused_for_other_dtype(device):
    model = nn.Sequential(random_layer(256, 64, 128, True, "none", BF16, False, device))
    with pytest.raises(TypeError, match="layer.to_dtype"):
        model.half()
    assert model[0].dtype == BF16
    # a device move with a dtype change: refused as a whole, every buffer stays put
    with pytest.raises(TypeError, match="runs float16 or bfloat16 only"):
        model.to("meta", torch.float32)
    assert {b.device.type for b in model.buffers()} == {torch.device(device).type}


def test_to_dtype_exact(device):
    # bf16 -> fp16: bf16 scales in fp16's normal range convert exactly
    layer = random_layer(256, 64, 64, False, "none", BF16, True, device)
    qw = layer.quantized_weight()
    assert layer.to_dtype(F16) is layer and layer.dtype == F16
    assert layer.zeros.dtype == F16 and layer.bias.dtype == F16
    assert torch.equal(layer.scales.float(), QuantLinear.from_quantized(qw).scales.float())
    assert torch.equal(layer.quantized_weight().qweight, qw.qweight)
    x = torch.randn(3, 256, device=device).half()
    assert_close_per_element(layer(x), x, layer.dequantize(), layer.bias)
    # ... and back (they came from bf16)
    layer.to_dtype(BF16)
    assert torch.equal(layer.scales, QuantLinear.from_quantized(qw).scales)
    # fp16 -> bf16: random fp16 scales need 11 significant bits: refused, layer unchanged
    layer = random_layer(256, 64, 64, False, "none", F16, True, device)
    before = buffers(layer)
    with pytest.raises(ValueError, match=r"scales: \d+ of \d+ torch.float16 values are not exactly representable "
                                         r"in torch.bfloat16 \(first: .*\); allowed: an exact cast, or "
                                         r"to_dtype\(torch.bfloat16, allow_lossy_scales=True\)"):
        layer.to_dtype(BF16)
    assert_same_buffers(layer, before)
    with pytest.raises(TypeError, match="dtype=torch.float32 is not supported"):
        layer.to_dtype(torch.float32)


def test_to_dtype_lossy_opt_in(device):
    """allow_lossy_scales=True rounds the scales (and bias) and warns with the largest
    relative change of a dequantized weight: against s * (q - z) with the original fp16
    scales rounded to bf16, i.e. what the weight would be in a bf16 layer with exact scales."""
    layer = random_layer(256, 64, 64, False, "descact", F16, True, device)
    qw, bias = layer.quantized_weight(), layer.bias.clone()
    exact_in_bf16 = qw.dequantize(rounded=False).to(BF16).float()
    with pytest.warns(UserWarning, match=r"QuantLinear.to_dtype with allow_lossy_scales=True rounded torch.float16 "
                                         r"scales to torch.bfloat16: the largest relative change of a dequantized "
                                         r"weight is ([\d.e-]+), of a bias value ([\d.e-]+)") as rec:
        assert layer.to_dtype(BF16, allow_lossy_scales=True) is layer
    w = layer.dequantize()
    assert layer.dtype == BF16 and torch.equal(layer.scales[:, :4], qw.scales.T.to(BF16))
    nz = exact_in_bf16 != 0
    want = ((w - exact_in_bf16).abs()[nz] / exact_in_bf16.abs()[nz]).max().item()
    # the scale and the two products are each rounded once to bf16 (unit roundoff 2**-8)
    assert 0 < want <= 3.1 * 2 ** -8
    said = str(rec[0].message)
    assert f"weight is {want:.3g}" in said
    bias_change = ((layer.bias.float() - bias.float()).abs() / bias.float().abs()).max().item()
    assert f"bias value {bias_change:.3g}" in said
    assert torch.equal(layer.bias, bias.to(BF16))


def test_to_dtype_powers_of_two_both_ways(device):
    qw = random_quantized(256, 64, 128, True, F16, device=device)
    qw.scales = torch.exp2(torch.randint(-12, 0, qw.scales.shape, device=device).float()).half()
    layer = QuantLinear.from_quantized(qw)
    w = layer.dequantize()
    layer.to_dtype(BF16)
    assert layer.dtype == BF16 and torch.equal(layer.dequantize(), w)  # |q - 8| <= 8: exact
    layer.to_dtype(F16)
    assert torch.equal(layer.dequantize(), w)


def test_load_state_dict_other_dtype_exact_or_refused(device):
    """The rule of to_dtype: an exact cast loads, a lossy one is a load error naming the
    tensor, its values and the opt-in (a layer of the checkpoint's dtype, then to_dtype)."""
    src = random_layer(256, 64, 128, True, "none", F16, True, device)
    dst = QuantLinear(256, 64, bias=True, dtype=BF16, device=device)
    with pytest.raises(RuntimeError, match=r"scales: \d+ of \d+ torch.float16 values are not exactly representable in "
                                           r"torch.bfloat16 .* loading into a torch.float16 layer, then "
                                           r"layer.to_dtype\(torch.bfloat16, allow_lossy_scales=True\)"):
        dst.load_state_dict(src.state_dict())
    exact = QuantLinear.from_quantized(QuantizedWeight(
        src.quantized_weight().qweight, torch.exp2(torch.randint(-12, 0, (2, 64), device=device).float()).half(),
        None, None, 128), torch.ones(64, device=device).half())
    dst.load_state_dict(exact.state_dict())  # powers of two: exact in bf16
    assert dst.dtype == BF16 and torch.equal(dst.scales.float(), exact.scales.float())
    assert torch.equal(dst.dequantize(), exact.quantized_weight().dequantize(rounded=False).to(BF16).float())


# ----------------------------------------------------------------------------------
# float32 Linears: one policy for from_linear and quantize_model
# ----------------------------------------------------------------------------------
def test_float32_linear_policy(device):
    lin = nn.Linear(256, 64, device=device)  # float32
    a = QuantLinear.from_linear(lin)
    assert a.dtype == F16
    model = nn.Sequential(copy.deepcopy(lin))
    quantize_model(model)
    assert model.sailfish_report == {"quantized": ["0"], "skipped": {}, "shared": {}}
    assert model[0].dtype == F16 and torch.equal(model[0].dequantize(), a.dequantize())
    assert torch.equal(model[0].bias, a.bias)
    model.half()  # the rest of a float32 model follows; the layer is already float16
    x = torch.randn(2, 256, device=device).half()
    assert torch.equal(model(x), a(x))
    # dtype= chooses the layer dtype in both
    b = QuantLinear.from_linear(lin, dtype=BF16)
    model = quantize_model(nn.Sequential(copy.deepcopy(lin)), dtype=BF16)
    assert b.dtype == BF16 and torch.equal(model[0].dequantize(), b.dequantize())
    # W4A8 layers take fp16 and bf16 inputs: float32 Linears quantize the same way
    model8 = quantize_model(nn.Sequential(copy.deepcopy(lin)), act_bits=8)
    assert torch.equal(model8[0].dequantize(), QuantLinear.from_linear(lin, act_bits=8).dequantize())


def test_quantize_model_dtype_errors():
    with pytest.raises(TypeError, match="dtype=torch.float32 is not supported"):
        quantize_model(nn.Sequential(nn.Linear(256, 64)), dtype=torch.float32)
    with pytest.raises(ValueError, match="dtype does not apply to W4A8"):
        quantize_model(nn.Sequential(nn.Linear(256, 64)), act_bits=8, dtype=F16)


# ----------------------------------------------------------------------------------
# error messages
# ----------------------------------------------------------------------------------
def test_from_gptq_blames_the_right_tensor():
    t = to_gptq(random_checkpoint_weight(256, 64, 128, True, F16))
    with pytest.raises(ValueError, match=r"scales has 3 groups but K=256 with group_size=128 needs .* = 2"):
        QuantLinear.from_gptq(t["qweight"], t["qzeros"], torch.ones(3, 64, dtype=F16))
    with pytest.raises(ValueError, match=r"qzeros must have shape \(G=2, N/8=8\), got \(2, 4\)"):
        QuantLinear.from_gptq(t["qweight"], t["qzeros"][:, :4], t["scales"])
    with pytest.raises(ValueError, match=r"scales has 32 columns but qweight has N=64"):
        QuantLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"][:, :32])


def test_bias_validation():
    qw = random_checkpoint_weight(256, 64, 128, True, F16)
    wrong = r"bias must have shape \(out_features,\) = \(64,\), got \(32,\)"
    with pytest.raises(ValueError, match=wrong):
        QuantLinear.from_quantized(qw, torch.zeros(32, dtype=F16))
    with pytest.raises(ValueError, match=r"got \(1, 64\)"):
        QuantLinear.from_quantized(qw, torch.zeros(1, 64, dtype=F16))
    with pytest.raises(TypeError, match="bias must be a floating-point tensor, got torch.int64"):
        QuantLinear.from_quantized(qw, torch.zeros(64, dtype=torch.long))
    t = to_gptq(qw)
    with pytest.raises(ValueError, match=wrong):
        QuantLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"], bias=torch.zeros(32, dtype=F16))
    with pytest.raises(ValueError, match=wrong):
        QuantLinearW4A8.from_quantized(quantize_qqq(torch.randn(64, 256), 128), torch.zeros(32))
    for cls in (QuantLinear, QuantLinearW4A8):
        with pytest.raises(TypeError, match=f"bias must be a bool in the constructor, got Tensor; .*{cls.__name__}.from_quantized"):
            cls(256, 64, bias=torch.zeros(64))


# ----------------------------------------------------------------------------------
# input gradient
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("m,gs,sym,gidx,dtype,bias", [
    (1, 128, True, "none", F16, True),
    (3, 64, False, "descact", BF16, False),
    (17, 32, False, "gidx", F16, True),
    (2, -1, True, "none", BF16, True),
], ids=["M1-g128-sym-fp16", "M3-g64-asym-descact-bf16", "M17-g32-gidx-fp16", "M2-chan-bf16"])
def test_w4a16_input_gradient(m, gs, sym, gidx, dtype, bias, device):
    k, n = 272, 64
    layer = random_layer(k, n, gs, sym, gidx, dtype, bias, device)
    before = buffers(layer)
    x = torch.randn(2, m, k, device=device).to(dtype).requires_grad_()
    dy = torch.randn(2, m, n, device=device).to(dtype)
    layer(x).backward(dy)
    # dx = dy @ W_eff: the same per-element bound as a forward product over N
    assert x.grad.dtype == dtype and x.grad.shape == x.shape
    assert_close_per_element(x.grad, dy, layer.dequantize().T)
    assert_same_buffers(layer, before)
    assert all(b.grad is None for b in layer.buffers())


@pytest.mark.parametrize("gs,dtype", [(-1, F16), (128, BF16)], ids=["chan-fp16", "g128-bf16"])
def test_w4a8_input_gradient_straight_through(gs, dtype, device):
    layer = w4a8_layer(256, 64, gs, True, device)
    x = torch.randn(3, 256, device=device).to(dtype).requires_grad_()
    y = layer(x)
    with torch.no_grad():  # the grad path runs the same two ops: identical outputs
        assert torch.equal(y, layer(x))
    dy = torch.randn(3, 64, device=device).to(dtype)
    y.backward(dy)
    assert_close_per_element(x.grad, dy, layer.dequantize().T)


class LoRA(nn.Module):
    """y = base(x) + (x @ A^T) @ B^T * scale, adapters in float32."""

    def __init__(self, base, rank=4, scale=0.5):
        super().__init__()
        self.base, self.scale = base, scale
        self.a = nn.Parameter(torch.randn(rank, base.in_features, device=base.qweight.device) * 0.05)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank, device=base.qweight.device))

    def forward(self, x):
        return self.base(x).float() + (x.float() @ self.a.T) @ self.b.T * self.scale


@pytest.mark.parametrize("base", ["w4a16", "w4a8"])
def test_lora_on_frozen_base_trains(base, device):
    k, n = 256, 64
    layer = (random_layer(k, n, 128, False, "none", F16, True, device) if base == "w4a16"
             else w4a8_layer(k, n, 128, True, device))
    before = buffers(layer)
    model = LoRA(layer)
    target_delta = torch.randn(n, 4, device=device) @ torch.randn(4, k, device=device) * 0.05
    x = torch.randn(32, k, device=device).half()
    target = (layer(x).float() + x.float() @ target_delta.T).detach()
    opt = torch.optim.Adam([model.a, model.b], lr=5e-2)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.5 * losses[0], losses
    assert_same_buffers(layer, before)
    check_lora_input_grad(model, x, layer.dequantize())


def check_lora_input_grad(model, x, w, c=3.0):
    """x.grad of sum(c * model(x)) per element: the base's share dy @ W_eff (fp16 dy = c)
    within elementwise_bound, plus the adapters' share and the fp16 sum of the two, each
    rounded once to fp16."""
    xg = x.clone().requires_grad_()
    (model(xg) * c).sum().backward()
    m, n = x.shape[0], w.shape[0]
    dy = torch.full((m, n), c, device=x.device, dtype=torch.float64)
    lora_part = dy @ (model.b.double() @ model.a.double()).detach() * model.scale
    total = dy @ w.double() + lora_part
    _, bound_base = elementwise_bound(dy.half(), w.T, None, F16)
    u = UNIT_ROUNDOFF[F16]
    bound = bound_base + u * (lora_part.abs() + total.abs()) + 1e-6 * lora_part.abs()
    err = (xg.grad.double() - total).abs()
    assert (err <= bound).all(), f"{int((err > bound).sum())} elements, worst {float((err / bound).max()):.3g}x"
    return xg.grad


def test_compiled_backward(device):
    layer = random_layer(256, 64, 64, False, "descact", F16, True, device)
    lora = LoRA(layer)
    nn.init.normal_(lora.b, std=0.05)
    torch._dynamo.reset()
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(lora, fullgraph=True, backend=backend)
    x = torch.randn(5, 256, device=device).half()
    check_lora_input_grad(compiled, x, layer.dequantize())
    assert lora.a.grad is not None and lora.b.grad is not None
