"""The public API used the way a newcomer uses it: wrong devices, shapes, argument types and
values, weights that cannot be quantized, bad state dicts and bad command lines. Each case
must raise an error that names the argument, the value and what is allowed (never return a
wrong answer, never fail deep inside torch), and the CLIs must answer --help and bad
arguments with usage and one line."""
import importlib
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from sailfish import QuantLinear, QuantLinearW4A8, quantize, quantize_model, quantize_qqq, to_gptq
from sailfish.ops.w4a8 import w4a8_gemm_impl, w4a8_linear_impl
from sailfish.ops.w4a16 import w4a16_gemm_impl, w4a16_layer_impl

F16, BF16 = torch.float16, torch.bfloat16
K, N = 256, 64


def linear(dtype=F16, weight=None):
    lin = nn.Linear(K, N).to(dtype)
    if weight is not None:
        with torch.no_grad():
            lin.weight.copy_(weight)
    return lin


def layers():
    """A W4A16 and a W4A8 layer of the same small Linear (CPU: cheap to build and to run)."""
    lin = linear()
    return [QuantLinear.from_linear(lin), QuantLinearW4A8.from_linear(lin, group_size=128)]


# ----------------------------------------------------------------------------------
# devices
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("which", [0, 1], ids=["w4a16", "w4a8"])
def test_layer_and_input_on_different_devices_raise(which):
    # get_device() is -1 for the CPU and for meta alike: a meta layer once "ran" on a CPU
    # input and returned uninitialised memory
    layer = layers()[which]
    x = torch.randn(4, K, dtype=F16)
    with pytest.raises(ValueError, match=r"x on cpu.*qweight on meta.*move the layer"):
        layer.to("meta")(x)
    with pytest.raises(ValueError, match=r"x on meta.*qweight on cpu"):
        layers()[which](x.to("meta"))
    # all on meta: shapes only, as nn.Linear gives (what tracing relies on)
    y = layer.to("meta")(x.to("meta"))
    assert y.device.type == "meta" and y.shape == (4, N) and y.dtype == F16


def test_ops_run_on_cuda_or_cpu_only():
    # the ops' implementations (what runs outside the fake / meta path) refuse any other
    # device, even when every tensor is on it: there is no kernel for it
    q, q8 = (layer.to("meta") for layer in layers())
    x = torch.randn(4, K, dtype=F16, device="meta")
    with pytest.raises(ValueError, match=r"one CUDA device or all on the CPU, got x on meta"):
        w4a16_gemm_impl(x, q.qweight, q.scales, None, None, None, q.bias, K, 128)
    with pytest.raises(ValueError, match=r"one CUDA device or all on the CPU, got x on meta"):
        w4a8_linear_impl(x, q8.qweight, q8.s_ch, q8.s_g, q8.bias, K, 128)
    x_q = torch.zeros(4, K, dtype=torch.int8, device="meta")
    with pytest.raises(ValueError, match=r"one CUDA device or all on the CPU, got x on meta"):
        w4a8_gemm_impl(x_q, torch.ones(4, device="meta"), q8.qweight, q8.s_ch, q8.s_g, q8.bias, K, 128, F16)


def test_layer_impl_checks_what_the_layer_does_not():
    """QuantLinear.forward's direct call (w4a16_layer_impl) skips the checks the layer has made
    (x's dtype and shape) but not the devices nor qweight's dtype; its output is the op's."""
    q = layers()[0]
    x = torch.randn(3, K, dtype=F16)
    args = (q.qweight, q.scales, None, None, None, q.bias, K, 128)
    assert torch.equal(w4a16_layer_impl(x, *args), w4a16_gemm_impl(x, *args))
    with pytest.raises(ValueError, match=r"x on cpu.*qweight on meta"):
        w4a16_layer_impl(x, q.qweight.to("meta"), *args[1:])
    with pytest.raises(ValueError, match=r"one CUDA device or all on the CPU, got x on meta"):
        w4a16_layer_impl(x.to("meta"), *(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
    with pytest.raises(TypeError, match=r"qweight dtype torch.int64 is not supported; allowed: torch.int32"):
        w4a16_layer_impl(x, q.qweight.long(), *args[1:])


@pytest.mark.parametrize("which", [0, 1], ids=["w4a16", "w4a8"])
def test_zero_dim_input_raises(which):
    with pytest.raises(ValueError, match=r"the input is 0-D; allowed: an input of shape \(\.\.\., 256\)"):
        layers()[which](torch.tensor(1.0, dtype=F16))


@pytest.mark.parametrize("act_bits", [16, 8])
def test_quantize_model_on_meta_names_the_module(act_bits):
    model = nn.Sequential(nn.Linear(K, N), nn.ReLU(), nn.Linear(N, N)).to("meta")
    with pytest.raises(ValueError, match=r"module '0': linear.weight is on the meta device.*allowed: a CUDA or CPU"):
        quantize_model(model, act_bits=act_bits)


# ----------------------------------------------------------------------------------
# names: a str is one name; tied Linears
# ----------------------------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(K, N)
        self.lm_head = nn.Linear(N, N)
        self.b = self.a  # the same Linear under a second name


def test_skip_as_one_string():
    model = quantize_model(Tied(), skip="lm_head")  # not the letters l, m, _, h, e, a, d
    assert type(model.lm_head) is nn.Linear and isinstance(model.a, QuantLinear)
    with pytest.raises(TypeError, match=r"skip must be a module name \(str\) or an iterable of them, got 3$"):
        quantize_model(Tied(), skip=3)
    with pytest.raises(TypeError, match=r"skip must be .* got None in it"):
        quantize_model(Tied(), skip=["lm_head", None])


def test_sailfish_config_modules_as_one_string():
    pytest.importorskip("transformers")
    from sailfish.hf import SailfishConfig
    assert SailfishConfig(modules_to_not_convert="lm_head").modules_to_not_convert == ["lm_head"]
    assert SailfishConfig(modules_to_not_convert=None).modules_to_not_convert == []


@pytest.mark.parametrize("act_bits", [16, 8])
def test_tied_linear_converted_once_and_shared(act_bits):
    model = quantize_model(Tied(), skip=(), act_bits=act_bits)
    assert model.a is model.b and isinstance(model.a, QuantLinear if act_bits == 16 else QuantLinearW4A8)
    assert model.sailfish_report == {"quantized": ["a", "lm_head"], "skipped": {}, "shared": {"b": "a"}}
    # skipped under one of its names: skipped under every name, the tie kept
    model = Tied()
    lin = model.a
    quantize_model(model, skip="b", act_bits=act_bits)
    assert model.a is lin and model.b is lin
    assert model.sailfish_report == {"quantized": ["lm_head"], "skipped": {"a": "in skip list"},
                                     "shared": {"b": "a"}}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(K, 4, batch_first=True)
        self.fc = nn.Linear(K, N)

    def forward(self, x):
        return self.fc(self.attn(x, x, x, need_weights=False)[0])


def test_multihead_attention_out_proj_left_alone():
    # nn.MultiheadAttention reads out_proj.weight itself: converting it broke the forward
    # ("'QuantLinear' object has no attribute 'weight'")
    model = Attention().half().eval()
    x = torch.randn(2, 3, K, dtype=F16)
    with torch.no_grad():
        ref = model(x).float()
        quantize_model(model)
        y = model(x).float()
    assert model.sailfish_report["quantized"] == ["fc"] and isinstance(model.fc, QuantLinear)
    assert "nn.MultiheadAttention" in model.sailfish_report["skipped"]["attn.out_proj"]
    assert (y - ref).norm() / ref.norm() < 0.1  # 4-bit weights: a few % off, not garbage


# ----------------------------------------------------------------------------------
# weights that cannot be quantized: one rule for W4A16 and W4A8
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_raises_naming_the_module(act_bits, bad):
    w = torch.randn(N, K)
    w[3, 5] = bad
    model = nn.Sequential(linear(F16), linear(F16, w))
    with pytest.raises(ValueError, match=rf"module '1': the weight holds 1 non-finite value\(s\), first "
                                         rf"weight\[3, 5\] = {bad}; allowed: finite weights only"):
        quantize_model(model, act_bits=act_bits)


def test_w4a16_scale_overflow_raises():
    # s = 65000 / 7.5 is a fine float16, but the code -8 times it is -69333: -inf in float16
    w = torch.randn(N, K, dtype=F16)
    w[0, 0] = -65000
    with pytest.raises(ValueError, match=r"module '0': the quantized weight overflows torch.float16: "
                                         r"weight\[0, 0\] dequantizes to -inf"):
        quantize_model(nn.Sequential(linear(F16, w)))
    # bfloat16 holds it; and just below the limit float16 does too
    assert torch.isfinite(quantize(w.float(), dtype=BF16).dequantize()).all()
    w[0, 0] = -61000
    assert torch.isfinite(quantize(w).dequantize()).all()


def test_w4a8_scale_overflow_raises():
    w = torch.randn(N, K)
    w[2, 0] = 3.3e38  # s_ch = w / 7.5; the code -8 times s_ch overflows float32
    w[2, 1] = -3.3e38
    with pytest.raises(ValueError, match=r"module '0': the quantized weight overflows torch.float32: weight\[2, 1\] "
                                         r"dequantizes to -inf.*scale the weight down\)$"):
        quantize_model(nn.Sequential(linear(torch.float32, w)), act_bits=8, group_size=-1)
    # per group, the int8 step keeps the codes within range: it quantizes
    assert torch.isfinite(quantize_qqq(w, 128).dequantize()).all()


def test_w4a16_scale_underflow_raises():
    # float32 weights of ~1e-7 need float16 scales of ~1e-8: they round to 0 or to a
    # subnormal far from the value, and the weights came out as 0
    w = torch.randn(N, K) * 1e-7
    with pytest.raises(ValueError, match=r"module '0': the weight's scales underflow torch.float16: a group needs "
                                         r"a scale of .*allowed: scales that torch.float16 represents to "
                                         r"within 1/16 \(scale the weight up, or use dtype=torch.bfloat16\)"):
        quantize_model(nn.Sequential(linear(torch.float32, w)))
    # bfloat16 scales hold them; W4A8's float32 channel scales too
    qw = quantize(w, dtype=BF16)
    assert (qw.dequantize() - w).abs().max() <= qw.scales.float().max() * 0.51
    assert (quantize_qqq(w).dequantize() - w).abs().max() <= w.abs().max() / 7.5 * 0.51
    # subnormal float16 scales that keep 1/16 of their value are accepted: the rounding adds
    # at most the 4-bit step's own error
    w = torch.randn(N, K) * 1e-5
    qw = quantize(w)
    assert bool((qw.scales.float() < torch.finfo(F16).tiny).any())
    step = w.reshape(N, 2, 128).abs().amax(2) / 7.5
    err = (qw.dequantize() - w).abs().reshape(N, 2, 128).amax(2)
    assert bool((err <= step).all())


def test_all_zero_groups_still_quantize():
    w = torch.zeros(N, K)
    for fn in (quantize, lambda w: quantize(w, sym=False), quantize_qqq, lambda w: quantize_qqq(w, 128)):
        assert torch.equal(fn(w).dequantize(), w)


# ----------------------------------------------------------------------------------
# argument types and values
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda: QuantLinear(K, N, group_size=128.0),
    lambda: QuantLinear.from_linear(linear(), group_size=128.0),
    lambda: QuantLinearW4A8(K, N, group_size=128.0),
    lambda: QuantLinearW4A8.from_linear(linear(), group_size=128.0),
    lambda: quantize_model(nn.Sequential(linear()), group_size=128.0),
    lambda: quantize(torch.randn(N, K), group_size=128.0),
], ids=["ctor", "from_linear", "w4a8_ctor", "w4a8_from_linear", "quantize_model", "quantize"])
def test_float_group_size_named(call):
    with pytest.raises(ValueError, match=r"group_size=128.0 \(a float; an int is needed\) is not supported.*allowed"):
        call()


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(in_features=256.0), ValueError, r"in_features=256.0 \(a float; an int is needed\) must be a positive"),
    (dict(out_features="64"), ValueError, r"out_features='64' \(a str; an int is needed\)"),
    (dict(bits=4.0), ValueError, r"bits=4.0 \(a float; an int is needed\) is not supported"),
    (dict(dtype="float16"), TypeError, r"dtype='float16' is not supported; allowed: torch.float16, torch.bfloat16"),
    (dict(sym="no"), TypeError, r"sym='no' must be a bool"),
    (dict(act_order=1), TypeError, r"act_order=1 must be a bool"),
])
def test_constructor_argument_types(kwargs, exc, msg):
    args = dict(in_features=K, out_features=N)
    args.update(kwargs)
    with pytest.raises(exc, match=msg):
        QuantLinear(args.pop("in_features"), args.pop("out_features"), **args)


def test_quantize_model_argument_types():
    with pytest.raises(ValueError, match=r"act_bits=8.0 \(a float; an int is needed\) is not supported"):
        quantize_model(nn.Sequential(linear()), act_bits=8.0)
    with pytest.raises(TypeError, match=r"sym=1 must be a bool"):
        quantize_model(nn.Sequential(linear()), sym=1)
    with pytest.raises(TypeError, match=r"linear must be an nn.Linear, got Tensor"):
        QuantLinear.from_linear(torch.randn(N, K))
    with pytest.raises(ValueError, match=r"weight must be a 2-D \(out_features, in_features\) tensor, got \(64,\)"):
        quantize(torch.randn(N))


def test_from_quantized_of_the_other_format():
    q, q8 = layers()
    with pytest.raises(TypeError, match=r"QuantLinear.from_quantized takes a QuantizedWeight, got QQQWeight "
                                        r"\(QuantLinearW4A8.from_quantized takes a QQQWeight\)"):
        QuantLinear.from_quantized(q8.quantized_weight())
    with pytest.raises(TypeError, match=r"QuantLinearW4A8.from_quantized takes a QQQWeight, got QuantizedWeight"):
        QuantLinearW4A8.from_quantized(q.quantized_weight())
    with pytest.raises(TypeError, match=r"takes a QuantizedWeight, got Tensor$"):
        QuantLinear.from_quantized(torch.zeros(N, K))


def test_more_argument_types():
    q = layers()[0]
    with pytest.raises(TypeError, match=r"dtype='bfloat16' is not supported; allowed: torch.float16, torch.bfloat16"):
        q.to_dtype("bfloat16")
    with pytest.raises(ValueError, match=r"groups=5.0 is only for act_order layers and must be an int"):
        QuantLinear(K, N, act_order=True, groups=5.0)
    with pytest.raises(TypeError, match=r"sym='no' must be a bool"):
        quantize(torch.randn(N, K), sym="no")  # was read as True


@pytest.mark.parametrize("model, got", [(nn.Linear(K, N), "an nn.Linear itself"), ("model", "a str")])
def test_quantize_model_of_a_linear_or_a_non_module(model, got):
    # a root Linear came back unchanged (it cannot replace itself in place)
    with pytest.raises(TypeError, match=rf"model must be an nn.Module holding nn.Linear layers, got {got}; for one "
                                        r"Linear use QuantLinear.from_linear\(linear\)"):
        quantize_model(model)


def test_to_gptq_of_a_layer_or_a_w4a8_weight():
    q, q8 = layers()
    with pytest.raises(TypeError, match=r"to_gptq takes a W4A16 QuantizedWeight .*got QuantLinear"):
        to_gptq(q)
    with pytest.raises(TypeError, match=r"got QQQWeight"):
        to_gptq(q8.quantized_weight())
    assert set(to_gptq(q.quantized_weight())) == {"qweight", "qzeros", "scales", "g_idx"}


# ----------------------------------------------------------------------------------
# state dicts
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("which, name, dtype, msg", [
    (0, "scales", torch.float32, r"scales: the checkpoint has dtype torch.float32 but the layer has dtype "
                                 r"torch.float16; allowed: torch.float16"),
    (0, "qweight", torch.float32, r"qweight: .* dtype torch.float32 .* allowed: torch.int32"),
    (1, "s_g", torch.float32, r"s_g: .* dtype torch.float32 .* allowed: torch.float16"),
    (1, "s_ch", F16, r"s_ch: .* dtype torch.float16 .* allowed: torch.float32"),
])
def test_load_state_dict_wrong_dtype(which, name, dtype, msg):
    # load_state_dict would copy_ and convert the values without a word (fp16 <-> bf16 scales:
    # test_usability.test_load_state_dict_other_dtype_exact_or_refused)
    src, dst = layers()[which], layers()[which]
    sd = src.state_dict()
    sd[name] = sd[name].to(dtype)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(RuntimeError, match=msg):
        dst.load_state_dict(sd)
    assert all(torch.equal(v, dst.state_dict()[k]) for k, v in before.items())


def test_load_state_dict_bad_act_order_indices():
    # the kernels index x by perm and the scales by sorted_g_idx without bounds checks
    g_idx = torch.arange(K, dtype=torch.int32).flip(0) // 64  # a general g_idx: sorted_g_idx is kept
    g_idx[:8] = 3 - g_idx[:8]
    qw = quantize(torch.randn(N, K), group_size=64)
    layer = QuantLinear.from_quantized(type(qw)(qw.qweight, qw.scales, None, g_idx, 64))
    assert layer._general_g_idx
    fresh = lambda: QuantLinear(K, N, False, group_size=64, act_order=True, groups=layer.scales.shape[1])  # noqa: E731
    sd = layer.state_dict()
    sd["perm"] = sd["perm"].clone()
    sd["perm"][0] = sd["perm"][1]
    with pytest.raises(RuntimeError, match=r"perm: the checkpoint's perm is not a permutation of 0 .. "
                                           r"in_features - 1 = 255; allowed: each input channel once"):
        fresh().load_state_dict(sd)
    sd = layer.state_dict()
    sd["sorted_g_idx"] = sd["sorted_g_idx"].clone()
    sd["sorted_g_idx"][5] = layer.scales.shape[1]
    with pytest.raises(RuntimeError, match=r"sorted_g_idx: the checkpoint's group indices span \[0, 4\]; "
                                           r"allowed: \[0, 4\), the columns of its scales"):
        fresh().load_state_dict(sd)
    fresh().load_state_dict(layer.state_dict())  # the valid one loads


def test_load_state_dict_layout_version_dtype():
    sd = layers()[0].state_dict()
    sd["qweight_layout"] = torch.tensor(2.5)  # int(2.5) == 2 was accepted
    with pytest.raises(RuntimeError, match=r"qweight_layout: .* dtype torch.float32 .* allowed: torch.int32"):
        layers()[0].load_state_dict(sd)


@pytest.mark.parametrize("which, name", [(0, "scales"), (1, "s_ch"), (1, "s_g")])
def test_load_state_dict_non_finite_scales(which, name):
    sd = layers()[which].state_dict()
    sd[name][0, ...].view(-1)[0] = float("nan")
    with pytest.raises(RuntimeError, match=rf"{name}: the checkpoint's values include NaN or Inf; allowed: finite"):
        layers()[which].load_state_dict(sd)


# ----------------------------------------------------------------------------------
# command lines
# ----------------------------------------------------------------------------------
CLIS = ["demo", "bench", "bench.e2e", "bench.tune", "bench.ptx", "bench.overhead", "bench.merge", "bench.tp"]


@pytest.mark.parametrize("name", CLIS)
def test_cli_help(name, capsys):
    # in-process: --help must exit before anything runs (the demo ignored it and ran)
    mod = importlib.import_module("sailfish." + (name if name != "bench" else "bench.__main__"))
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m sailfish.{name} ")


def test_demo_help_as_a_newcomer_runs_it():
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"))
    r = subprocess.run([sys.executable, "-m", "sailfish.demo", "--help"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m sailfish.demo"), r.stderr
    assert "err vs fp16" not in r.stdout  # the demo did not run


@pytest.mark.parametrize("name, argv, msg", [
    ("bench.tune", ["--m", "0"], "bad M '0': use positive integers"),
    ("bench.tune", ["--shapes", "4096by4096"], "bad shape '4096by4096'"),
    ("bench.tune", ["--group-size", "100"], "argument --group-size: invalid choice: 100"),
    ("bench.tune", ["--family", "w4a8", "--group-size", "64"], "--group-size 64: --family w4a8 takes (-1, 128)"),
    ("bench.ptx", ["--config", "16,128,256,1,4,x"], "--config '16,128,256,1,4,x': want BLOCK_M,"),
    ("bench.overhead", ["--shape", "4096"], "bad shape '4096'"),
    ("bench.overhead", ["--m", "0"], "--m must be >= 1, got 0"),
    ("bench.merge", ["out.json", "no/such/file.json"], "cannot read no/such/file.json"),
    ("bench.tp", ["--nproc", "0"], "--nproc=0 must be >= 1"),
    ("bench.tp", ["--nproc", "3"], "--nproc 3: kv_heads=8 is not divisible by world_size=3 of --preset 8b"),
    ("demo", ["--m", "4"], "unrecognized arguments: --m 4"),
])
def test_cli_bad_arguments_one_line(name, argv, msg, capsys):
    mod = importlib.import_module("sailfish." + name)
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert err.startswith("usage: ") and last.startswith(f"python -m sailfish.{name}: error: ") and msg in last


def test_tp_worker_error_is_one_line(monkeypatch, capsys):
    # what `--nproc 3` gave: every worker's traceback; now the error's own line
    import torch.multiprocessing as mp
    from sailfish.bench import tp

    def spawn(*args, **kwargs):
        raise mp.ProcessRaisedException("\n\n-- Process 0 terminated with the following error:\nTraceback (most "
                                        "recent call last):\n  File \"x.py\", line 1\nValueError: kv_heads=2 is not "
                                        "divisible by world_size=3\n", 0, 1234)
    monkeypatch.setattr(mp, "spawn", spawn)
    assert tp.main(["--nproc", "2", "--preset", "tiny", "--cpu"]) == 1
    assert capsys.readouterr().err == ("python -m sailfish.bench.tp: error: ValueError: kv_heads=2 is not "
                                       "divisible by world_size=3\n")


def test_lm_head_option():
    """lm_head=True quantizes the lm_head that quantize_model and SailfishConfig leave in 16 bits
    by default; naming it in skip as well is a contradiction, said."""
    from torch import nn as tnn

    from sailfish import QuantLinear, quantize_model

    def model():
        m = tnn.Module()
        m.body, m.lm_head = tnn.Linear(64, 64), tnn.Linear(64, 128)
        return m

    default = quantize_model(model())
    assert isinstance(default.body, QuantLinear) and isinstance(default.lm_head, tnn.Linear)
    assert default.sailfish_report["skipped"] == {"lm_head": "in skip list"}
    both = quantize_model(model(), lm_head=True)
    assert isinstance(both.lm_head, QuantLinear) and both.sailfish_report["skipped"] == {}
    kept = quantize_model(model(), lm_head=True, skip=("body",))
    assert isinstance(kept.lm_head, QuantLinear) and isinstance(kept.body, tnn.Linear)
    with pytest.raises(ValueError, match=r"lm_head=True quantizes the lm_head, but skip=\['lm_head'\]"):
        quantize_model(model(), lm_head=True, skip="lm_head")
    with pytest.raises(TypeError, match="lm_head=1"):
        quantize_model(model(), lm_head=1)
    pytest.importorskip("transformers")
    from sailfish.hf import SailfishConfig

    assert SailfishConfig().modules_to_not_convert == ["lm_head"]
    assert SailfishConfig(lm_head=True).modules_to_not_convert == [] and SailfishConfig(lm_head=True).lm_head
    with pytest.raises(ValueError, match="modules_to_not_convert=\\['lm_head'\\]"):
        SailfishConfig(lm_head=True, modules_to_not_convert=["lm_head"])
