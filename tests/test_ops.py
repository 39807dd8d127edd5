"""ops: the device guard every launcher runs under (ops.device_of), and the W4A8 launchers
at sizes where 32-bit offsets would overflow (CUDA only, skipped without the memory)."""
import contextlib

import pytest
import torch

import sailfish.ops as ops
import sailfish.ops.w4a8 as w4a8_ops
from sailfish import QuantLinear, QuantLinearW4A8, quantize_qqq
from sailfish.formats.qqq import pack_qqq, quantize_activations
from sailfish.tuning import Config, clear_caches

F16 = torch.float16


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch):
    monkeypatch.setenv("SAILFISH_AUTOTUNE", "0")


def test_device_of_is_a_no_op_off_cuda():
    for dev in ("cpu", "meta"):
        ctx = ops.device_of(torch.empty(2, device=dev))
        assert isinstance(ctx, contextlib.nullcontext)
        with ctx:
            pass


def test_device_of_selects_the_tensors_gpu(monkeypatch):
    """For a CUDA tensor: torch.cuda.device(x.device) (checked with a stand-in tensor and a
    stand-in torch.cuda.device, so that it runs without a GPU)."""
    made = []

    class FakeGuard:
        def __init__(self, device):
            made.append(device)

    class FakeCudaTensor:
        is_cuda = True
        device = torch.device("cuda", 1)

    monkeypatch.setattr(torch.cuda, "device", FakeGuard)
    assert isinstance(ops.device_of(FakeCudaTensor()), FakeGuard)
    assert made == [torch.device("cuda", 1)]


def test_w4a8_launchers_run_under_the_guard(monkeypatch, device):
    entered = []

    def guard(x):
        entered.append(x.device)
        return contextlib.nullcontext()

    monkeypatch.setattr(w4a8_ops, "device_of", guard)
    clear_caches()  # a problem's first call (no launch plan yet) runs under the guard
    layer = QuantLinearW4A8.from_linear(torch.nn.Linear(64, 16, device=device).half())
    x = torch.randn(3, 64, device=device).half()
    if ops.use_triton(x):
        y = layer(x)
        assert len(entered) == 2 and y.shape == (3, 16)  # quantize_per_token, then the GEMM
    x_q, x_s = quantize_activations(x)
    w4a8_ops.w4a8_launch(x_q, x_s, layer.qweight, layer.s_ch, None, layer.bias, 64, -1, F16,
                         config=Config(16, 64, 64))
    w4a8_ops.quantize_per_token_launch(x)
    assert len(entered) >= 2 and set(entered) == {x.device}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("family", ["w4a8", "w4a16"])
def test_layers_on_the_second_gpu_while_the_first_is_current(family):
    """Every tensor on cuda:1 while cuda:0 is current: without the guard Triton launched on
    cuda:0 and failed ("Pointer argument cannot be accessed from Triton"). (W4A16 passes once
    ops/w4a16.py launches under ops.device_of as well.)"""
    torch.cuda.set_device(0)
    lin = torch.nn.Linear(256, 128).half()
    for gs in (-1, 128):
        if family == "w4a8":
            layer = QuantLinearW4A8.from_linear(lin, group_size=gs).to("cuda:1")
        else:
            layer = QuantLinear.from_linear(lin, group_size=gs).to("cuda:1")
        for m in (1, 5, 300):
            x = torch.randn(m, 256).half()
            y = layer(x.to("cuda:1"))
            assert y.device == torch.device("cuda", 1) and torch.cuda.current_device() == 0
            if family == "w4a8":
                x_q, s = quantize_activations(x)
                x = s[:, None] * x_q.float()
            ref = x.double() @ layer.dequantize().cpu().double().T + layer.bias.cpu().double()
            assert ((y.cpu().double() - ref).abs() <= 2e-3 * ref.abs() + 1e-3).all()


# ----------------------------------------------------------------------------------
# 64-bit offsets: shapes past 2**31 elements (CUDA only)
# ----------------------------------------------------------------------------------
def _need_gib(gib: float) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")


def _packed(k, n, gs):
    w = torch.randn(n, k, device="cuda")
    return pack_qqq(quantize_qqq(w, gs)), quantize_qqq(w, gs).int8_weight()


@pytest.mark.parametrize("m,n,cfg", [
    # dequant + torch._int_mm, then the reduce / epilogue kernel over (M, N): past 2**31
    # elements from M = 37450 on N = 57344
    (37456, 57344, Config(1, 64, 256, kernel="dequant")),
    # fused tiles, split-K 4: the workspace slices 2 and 3 start past 2**31
    (18736, 57344, Config(128, 128, 64, 4, 8, 8, 3)),
], ids=["dequant-M37456", "mma-split4-M18736"])
def test_w4a8_past_2g_elements(m, n, cfg):
    k = 256
    _need_gib((cfg.SPLIT_K + 1) * m * n * 4 * 1.1 / 2**30 + 2)  # int32 product / workspace + output
    p, w8 = _packed(k, n, 128)
    x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
    x_s = torch.rand(m, device="cuda") * 0.01
    acc = w4a8_ops.w4a8_launch(x_q, x_s, p.qweight, p.s_ch, p.s_g, None, k, 128, F16, config=cfg, raw_acc=True)
    torch.cuda.synchronize()
    boundary = 2**31 // n
    rows = torch.tensor([0, m // 2, boundary - 1, boundary, boundary + 1, m - 1], device="cuda").clamp_max(m - 1)
    exact = (x_q[rows].double() @ w8.double().T).long()
    assert torch.equal(acc[rows].long(), exact)
    del acc
    y = w4a8_ops.w4a8_launch(x_q, x_s, p.qweight, p.s_ch, p.s_g, None, k, 128, F16, config=cfg)
    ref = x_s[rows, None].double() * exact.double() * p.s_ch.double()[None, :]
    assert ((y[rows].double() - ref).abs() <= 2**-10 * ref.abs() + 2**-24).all()  # within an fp16 ulp


def test_quantize_past_2g_elements():
    m, k = 37456, 57344  # x has M * K > 2**31 elements
    _need_gib(m * k * 3 / 2**30 + 2)
    x = torch.empty(m, k, dtype=F16, device="cuda").normal_()
    x_q, s = w4a8_ops.quantize_per_token_launch(x)
    rows = torch.tensor([0, 2**31 // k - 1, 2**31 // k, 2**31 // k + 1, m - 1], device="cuda")
    r_q, r_s = quantize_activations(x[rows])
    assert torch.equal(x_q[rows], r_q) and torch.equal(s[rows], r_s)


# ----------------------------------------------------------------------------------
# Registration (torch.library.Library ops, ops.define_op)
# ----------------------------------------------------------------------------------
def _op_cases(device):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 64, device=device)
    l16 = QuantLinear.from_linear(lin.half(), group_size=128, sym=False)
    l8 = QuantLinearW4A8.from_linear(lin.float(), group_size=128)
    x = torch.randn(3, 256, device=device).half()
    a16 = (x, l16.qweight, l16.scales, l16.zeros, None, None, l16.bias, 256, 128)
    a8 = (x, l8.qweight, l8.s_ch, l8.s_g, l8.bias, 256, 128)
    x_q, x_s = quantize_activations(x)
    ops_ = torch.ops.sailfish
    return {"w4a16_gemm": (ops_.w4a16_gemm, a16), "w4a16_gemm_nograd": (ops_.w4a16_gemm_nograd, a16),
            "quantize_per_token": (ops_.quantize_per_token, (x,)),
            "w4a8_gemm": (ops_.w4a8_gemm, (x_q, x_s, *a8[1:], F16)),
            "w4a8_linear": (ops_.w4a8_linear, a8), "w4a8_linear_nograd": (ops_.w4a8_linear_nograd, a8)}


@pytest.mark.parametrize("name", ["w4a16_gemm", "w4a16_gemm_nograd", "quantize_per_token", "w4a8_gemm",
                                  "w4a8_linear", "w4a8_linear_nograd"])
def test_ops_pass_opcheck(name, device):
    """Schema, fake implementation (torch.compile's view of the op) and autograd
    registration agree with what the op computes (torch.library.opcheck)."""
    op, args = _op_cases(device)[name]
    result = torch.library.opcheck(op.default, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_nograd_twins_compute_the_public_ops(device):
    cases = _op_cases(device)
    with torch.no_grad():
        for twin, public in (("w4a16_gemm_nograd", "w4a16_gemm"), ("w4a8_linear_nograd", "w4a8_linear")):
            (op_a, args), (op_b, _) = cases[twin], cases[public]
            assert torch.equal(op_a(*args), op_b(*args)), twin
        # w4a8_linear = quantize_per_token, then w4a8_gemm
        op, args = cases["w4a8_gemm"]
        assert torch.equal(cases["w4a8_linear_nograd"][0](*cases["w4a8_linear_nograd"][1]), op(*args))


@pytest.mark.parametrize("name", ["quantize_per_token", "w4a8_gemm"])
def test_w4a8_parts_refuse_backward(name, device):
    """The int8 quantization has no derivative: backward through it names the op and the
    layer path that gives a (straight-through) gradient."""
    op, args = _op_cases(device)[name]
    args = list(args)
    i = 0 if name == "quantize_per_token" else 1  # x, or x_scales
    args[i] = args[i].clone().requires_grad_()
    out = op(*args)
    out = out[1] if name == "quantize_per_token" else out
    with pytest.raises(RuntimeError, match=f"sailfish::{name} has no derivative.*QuantLinearW4A8"):
        out.float().sum().backward()
