"""QuantLinear and quantize_model: state_dict, errors, model conversion, torch.compile,
CUDA graphs, and the CPU PyTorch fallback."""
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from helpers import (DTYPE_NAMES, assert_close_per_element, make_g_idx, random_quantized,
                     rel_err)
import sailfish
from sailfish import QuantLinear, quantize_model

F16, BF16 = torch.float16, torch.bfloat16
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_layer(k, n, gs, sym, gidx, dtype, bias, device):
    qw = random_quantized(k, n, gs, sym, dtype, make_g_idx(gidx, k, gs, device), device)
    return QuantLinear.from_quantized(qw, torch.randn(n, device=device).to(dtype) if bias else None)


# ----------------------------------------------------------------------------------
# state_dict, repr
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("k,n,gs,sym,gidx,dtype,bias", [
    (400, 136, 128, True, "none", F16, True),
    (272, 64, 64, False, "descact", BF16, False),
    (400, 200, 32, False, "gidx", F16, True),
    (256, 64, -1, True, "none", BF16, False),
], ids=["g128-sym-fp16-bias", "g64-asym-descact-bf16", "g32-asym-gidx-fp16-bias", "g-1-sym-bf16"])
def test_state_dict_roundtrip(k, n, gs, sym, gidx, dtype, bias, device):
    src = random_layer(k, n, gs, sym, gidx, dtype, bias, device)
    dst = QuantLinear(k, n, bias=bias, group_size=gs, sym=sym, act_order=gidx != "none",
                      dtype=dtype, device=device)
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.dequantize(), src.dequantize())
    x = torch.randn(3, k, device=device).to(dtype)
    assert torch.equal(dst(x), src(x))
    assert dst.extra_repr() == src.extra_repr()


def test_state_dict_keys():
    plain = QuantLinear(256, 64, bias=False)
    assert set(plain.state_dict()) == {"qweight", "scales", "qweight_layout"}
    full = QuantLinear(256, 64, bias=True, sym=False, act_order=True)
    assert set(full.state_dict()) == {"qweight", "scales", "zeros", "perm", "sorted_g_idx", "bias",
                                      "qweight_layout"}


def _natural_words(codes: torch.Tensor) -> torch.Tensor:
    """Sailfish 0.1.0's packing (layout version 1): channel 8i + j in nibble j of word i."""
    n, k = codes.shape
    kp = -(-k // 256) * 256
    q = torch.zeros(n, kp, dtype=torch.int64)
    q[:, :k] = codes.cpu().long()
    words = (q.reshape(n, kp // 8, 8) << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("gidx", ["none", "descact"])
def test_loads_layout_version_1_state_dict(gidx, device):
    """A state_dict saved by Sailfish 0.1.0 (natural nibble order, no qweight_layout) loads
    and computes the same function; so does one whose qweight_layout says 1."""
    src = random_layer(400, 136, 64, False, gidx, F16, True, device)
    old = {key: v for key, v in src.state_dict().items() if key != "qweight_layout"}
    codes = src.quantized_weight().qweight
    if src.act_order:
        codes = codes[:, src.perm.long()]  # the kernel layout stores the permuted channels
    old["qweight"] = _natural_words(codes).to(device)
    x = torch.randn(3, 400, device=device).to(F16)
    for state in (old, dict(old, qweight_layout=torch.tensor(1, dtype=torch.int32))):
        dst = QuantLinear(400, 136, bias=True, group_size=64, sym=False, act_order=gidx != "none", device=device)
        dst.load_state_dict(dict(state))
        assert torch.equal(dst.qweight, src.qweight)
        assert torch.equal(dst(x), src(x))
    with pytest.raises(ValueError, match="qweight_layout=7 is not supported"):
        dst.load_state_dict(dict(old, qweight_layout=torch.tensor(7, dtype=torch.int32)))


def test_extra_repr():
    layer = QuantLinear(400, 136, bias=True, group_size=64, sym=False, act_order=True, dtype=BF16)
    assert layer.extra_repr() == ("in_features=400, out_features=136, bias=True, bits=4, "
                                  "group_size=64, sym=False, act_order=True, dtype=bfloat16")
    assert "QuantLinear(in_features=400" in repr(layer)


def test_from_linear_keeps_bias_and_dtype(device):
    lin = nn.Linear(256, 64, dtype=BF16, device=device)
    layer = QuantLinear.from_linear(lin, group_size=64, sym=False)
    assert layer.dtype == BF16 and not layer.sym and layer.group_size == 64
    assert torch.equal(layer.bias, lin.bias.detach())
    assert QuantLinear.from_linear(nn.Linear(256, 64, bias=False), dtype=BF16).dtype == BF16
    assert QuantLinear.from_linear(nn.Linear(256, 64)).dtype == F16  # fp32 linear -> fp16 layer


# ----------------------------------------------------------------------------------
# error messages
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(group_size=100), ValueError, "group_size=100"),
    (dict(group_size=16), ValueError, "group_size=16"),
    (dict(bits=8), ValueError, "bits=8"),
    (dict(in_features=264), ValueError, "in_features=264 must be a positive multiple of 16"),
    (dict(in_features=0), ValueError, "in_features=0"),
    (dict(out_features=60), ValueError, "out_features=60 must be a positive multiple of 8"),
    (dict(dtype=torch.float32), TypeError, "dtype=torch.float32"),
    (dict(group_size=-1, act_order=True), ValueError, "act_order=True needs a group size"),
], ids=["group_size-100", "group_size-16", "bits", "in_features", "in_features-0", "out_features",
        "dtype", "act_order-per-channel"])
def test_constructor_errors(kwargs, exc, match):
    args = dict(in_features=256, out_features=64)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        QuantLinear(**args)


@pytest.mark.parametrize("x,exc,match", [
    (lambda d: torch.randn(2, 256, device=d), TypeError, "input dtype torch.float32 does not match"),
    (lambda d: torch.randn(2, 256, device=d, dtype=BF16), TypeError, "input dtype torch.bfloat16"),
    (lambda d: torch.randn(2, 128, device=d, dtype=F16), ValueError, "input last dim 128 != in_features=256"),
], ids=["fp32", "bf16-into-fp16", "last-dim"])
def test_forward_errors(x, exc, match, device):
    layer = QuantLinear(256, 64, device=device)
    with pytest.raises(exc, match=match):
        layer(x(device))


def test_from_linear_errors():
    with pytest.raises(TypeError, match="linear must be an nn.Linear, got Conv1d"):
        QuantLinear.from_linear(nn.Conv1d(4, 4, 1))
    with pytest.raises(ValueError, match="in_features=100"):
        QuantLinear.from_linear(nn.Linear(100, 64))
    with pytest.raises(ValueError, match="group_size=7"):
        QuantLinear.from_linear(nn.Linear(128, 64), group_size=7)
    with pytest.raises(TypeError, match="dtype=torch.float32"):
        QuantLinear.from_linear(nn.Linear(128, 64), dtype=torch.float32)


def test_from_gptq_errors():
    qweight = torch.zeros(256 // 8, 60, dtype=torch.int32)
    with pytest.raises(ValueError, match="out_features=60"):
        QuantLinear.from_gptq(qweight, torch.zeros(2, 7, dtype=torch.int32), torch.ones(2, 60, dtype=F16))
    qweight = torch.zeros(256 // 8, 64, dtype=torch.int32)
    with pytest.raises(TypeError, match="dtype=torch.float32"):
        QuantLinear.from_gptq(qweight, torch.zeros(2, 8, dtype=torch.int32), torch.ones(2, 64, dtype=F16),
                              dtype=torch.float32)


def test_op_errors():
    layer = QuantLinear(256, 64, bias=False)
    args = (layer.qweight, layer.scales, None, None, None, None, 256, 128)
    with pytest.raises(TypeError, match="x dtype torch.float32 is not supported"):
        torch.ops.sailfish.w4a16_gemm(torch.randn(2, 256), *args)
    with pytest.raises(TypeError, match="does not match the layer dtype"):
        torch.ops.sailfish.w4a16_gemm(torch.randn(2, 256, dtype=BF16), *args)
    with pytest.raises(ValueError, match=r"x must have shape \(M, 256\)"):
        torch.ops.sailfish.w4a16_gemm(torch.randn(2, 3, 256, dtype=F16), *args)
    with pytest.raises(ValueError, match=r"bias must have shape \(64,\)"):
        torch.ops.sailfish.w4a16_gemm(torch.randn(2, 256, dtype=F16), layer.qweight, layer.scales,
                                      None, None, None, torch.zeros(32, dtype=F16), 256, 128)


# ----------------------------------------------------------------------------------
# quantize_model
# ----------------------------------------------------------------------------------
def test_quantize_model(device):
    model = nn.ModuleDict({
        "block": nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64, bias=False)),
        "odd_k": nn.Linear(100, 64),
        "odd_n": nn.Linear(128, 60),
        "lm_head": nn.Linear(64, 512),
    }).to(device=device, dtype=F16)
    model["fp32"] = nn.Linear(128, 64, device=device)
    inner = nn.Sequential(nn.Linear(64, 64))
    inner.lm_head = nn.Linear(64, 32)
    model["inner"] = inner.to(device=device, dtype=F16)
    original = model["block"][0].weight.detach().clone()

    assert quantize_model(model, group_size=64, sym=False) is model
    report = model.sailfish_report
    assert report["quantized"] == ["block.0", "block.2", "fp32", "inner.0"]
    assert report["skipped"] == {
        "odd_k": "in_features=100 must be a positive multiple of 16",
        "odd_n": "out_features=60 must be a positive multiple of 8",
        "lm_head": "in skip list",
        "inner.lm_head": "in skip list",
    }
    assert model["fp32"].dtype == F16  # float32 Linears give float16 layers, as from_linear
    q = model["block"][0]
    assert isinstance(q, QuantLinear) and q.group_size == 64 and not q.sym and q.bias is not None
    assert isinstance(model["lm_head"], nn.Linear) and not isinstance(model["lm_head"], QuantLinear)
    x = torch.randn(4, 256, device=device).to(F16)
    y = model["block"](x)
    assert y.shape == (4, 64)
    assert rel_err(q(x), x.float() @ original.float().T + q.bias.float()) < 0.2  # 4-bit RTN error
    # already-quantized layers are left alone on a second pass
    quantize_model(model, group_size=64, sym=False)
    assert model.sailfish_report["quantized"] == []


def test_quantize_model_skip_and_errors():
    model = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 64)).half()
    quantize_model(model, skip=("1",))
    assert model.sailfish_report == {"quantized": ["0"], "skipped": {"1": "in skip list"}, "shared": {}}
    with pytest.raises(ValueError, match="group_size=100"):
        quantize_model(nn.Sequential(nn.Linear(128, 64)).half(), group_size=100)


# ----------------------------------------------------------------------------------
# torch.compile, CUDA graphs
# ----------------------------------------------------------------------------------
class TinyMLP(nn.Module):
    def __init__(self, device, dtype):
        super().__init__()
        self.up = random_layer(256, 512, 128, False, "descact", dtype, True, device)
        self.down = random_layer(512, 256, 64, True, "gidx", dtype, False, device)

    def forward(self, x):
        """y and the hidden activations before and after silu, so that each layer can be
        checked on exactly the input it consumed (silu's own rounding may differ between
        eager and compiled code)."""
        u = self.up(x)
        h = torch.nn.functional.silu(u)
        return self.down(h), u, h

    def check(self, x, out):
        """out = (y, u, h) from some path (compiled, graph-replayed) against the independent
        float64 reference, per element, layer by layer."""
        y, u, h = out
        assert_close_per_element(u, x, self.up.dequantize(), self.up.bias)
        assert_close_per_element(y, h, self.down.dequantize(), self.down.bias)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
def test_torch_compile_fullgraph(dtype, device):
    model = TinyMLP(device, dtype)
    # CPU: aot_eager traces the op through its fake implementation without needing a C++
    # toolchain; CUDA: the default inductor backend.
    backend = "inductor" if device == "cuda" else "aot_eager"
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for m in (3, 17):
        x = torch.randn(2, m, 256, device=device).to(dtype)
        with torch.no_grad():
            out = compiled(x)
        assert out[0].shape == (2, m, 256) and out[0].dtype == dtype
        model.check(x, out)


@requires_cuda
@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
def test_cuda_graph_capture(dtype):
    model = TinyMLP("cuda", dtype)
    x = torch.randn(16, 256, device="cuda").to(dtype)
    with torch.no_grad():
        eager = model(x)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up: compile, pick configs
            for _ in range(2):
                model(x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
        graph.replay()
    torch.cuda.synchronize()
    model.check(x, out)
    assert all(torch.equal(a, b) for a, b in zip(out, eager))  # the graph runs the eager configs


# ----------------------------------------------------------------------------------
# CPU without TRITON_INTERPRET: the PyTorch fallback gives the same numbers
# ----------------------------------------------------------------------------------
_FALLBACK_CHILD = r"""
import sys, torch, sailfish
from sailfish.ops import use_triton
src = torch.load(sys.argv[1])
layer = sailfish.QuantLinear(**src["args"])
layer.load_state_dict(src["state"])
assert not use_triton(src["x"]), "TRITON_INTERPRET leaked into the child"
y = layer(src["x"])
assert "sailfish.kernels.w4a16" not in sys.modules, "the fallback must not run the kernels"
torch.save(y, sys.argv[2])
"""


@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
def test_cpu_fallback_matches_kernel(dtype, device, tmp_path):
    k, n = 400, 136
    layer = random_layer(k, n, 64, False, "descact", dtype, True, device)
    x = torch.randn(5, k).to(dtype)
    state = {key: v.cpu() for key, v in layer.state_dict().items()}
    args = dict(in_features=k, out_features=n, bias=True, group_size=64, sym=False,
                act_order=True, dtype=dtype)
    torch.save({"args": args, "state": state, "x": x}, tmp_path / "in.pt")
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    src_dir = os.path.dirname(os.path.dirname(sailfish.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src_dir, env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-c", _FALLBACK_CHILD, str(tmp_path / "in.pt"),
                    str(tmp_path / "out.pt")], env=env, check=True, timeout=300)
    y_fallback = torch.load(tmp_path / "out.pt")
    w, bias = layer.dequantize().cpu(), layer.bias.cpu()
    # both against the independent float64 reference, per element
    assert_close_per_element(y_fallback, x, w, bias)
    assert_close_per_element(layer(x.to(device)).cpu(), x, w, bias)
