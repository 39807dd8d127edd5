"""Tensor parallelism: weight slices (formats/shard.py), layer shards (QuantLinear.shard,
QuantLinearW4A8.shard), their errors, and a 2-process gloo run of a small TP model.

The identities: concatenating the column shards' outputs (dim=0), or summing the row
shards' outputs over their slices of x (dim=1), gives the full layer's output. The shards'
weights are checked exactly against the full layer's dequantize(), their outputs (through
the kernels) against the fp32 reference of the full layer within the kernel tolerance."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from helpers import TOL, make_g_idx, random_checkpoint_weight, random_quantized, rel_err
from sailfish import QuantLinear, QuantLinearW4A8, from_gptq, to_gptq
from sailfish.formats.qqq import quantize_activations, quantize_qqq
from sailfish.formats.shard import slice_qqq, slice_quantized, slice_weight
from sailfish.parallel import (SailfishColwiseParallel, SailfishRowwiseParallel, shard_bias,
                               shard_layer, shard_quantized, shard_range)

F16, BF16 = torch.float16, torch.bfloat16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def w4a16_layer(k, n, gs, sym, gidx, dtype, bias, device):
    qw = random_quantized(k, n, gs, sym, dtype, make_g_idx(gidx, k, gs, device), device)
    return QuantLinear.from_quantized(qw, torch.randn(n, device=device).to(dtype) if bias else None)


def w4a8_layer(k, n, gs, bias, device):
    w = torch.randn(n, k, device=device)
    return QuantLinearW4A8.from_quantized(quantize_qqq(w, gs), torch.randn(n, device=device) if bias else None)


def shards(layer, world, dim):
    return [layer.shard(r, world, dim) for r in range(world)]


def x_slices(x, world):
    return x.chunk(world, dim=-1)


# ----------------------------------------------------------------------------------
# Exact weight identities (no kernels): every format, both dims, several world sizes
# ----------------------------------------------------------------------------------
W4A16_FORMATS = [(gs, sym, gidx) for gs in (32, 64, 128, -1) for sym in (True, False)
                 for gidx in (("none",) if gs == -1 else ("none", "descact", "gidx"))]


@pytest.mark.parametrize("gs,sym,gidx", W4A16_FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_w4a16_shard_weights_exact(gs, sym, gidx, dtype):
    k, n = 1024, 96
    qw = random_quantized(k, n, gs, sym, dtype, make_g_idx(gidx, k, gs))
    full = qw.dequantize()
    for dim, worlds in ((0, (1, 2, 3, 4)), (1, (1, 2, 4))):
        for world in worlds:
            parts = [shard_quantized(qw, r, world, dim) for r in range(world)]
            assert torch.equal(torch.cat([p.dequantize() for p in parts], dim=dim), full)
            for p in parts:
                assert p.sym == sym and p.dtype == dtype
                assert (p.g_idx is None) == (gidx == "none")


def test_w4a16_slice_ragged_and_arbitrary_ranges():
    # dim=0 at any range; dim=1 of a plain weight on group edges incl. the ragged last group
    qw = random_quantized(400, 72, 128, False, F16)
    full = qw.dequantize()
    assert torch.equal(slice_quantized(qw, 0, 8, 40).dequantize(), full[8:40])
    tail = slice_quantized(qw, 1, 256, 400)
    assert tail.scales.shape == (2, 72) and torch.equal(tail.dequantize(), full[:, 256:400])
    # act-order: any range, incl. one that touches fewer groups than its rows (padded rows)
    g_idx = torch.arange(400, dtype=torch.int32) % 4  # groups 0..3 interleaved
    qa = random_quantized(400, 72, 128, True, F16, g_idx)
    for a, b in ((0, 400), (16, 144), (3, 397)):
        assert torch.equal(slice_quantized(qa, 1, a, b).dequantize(), qa.dequantize()[:, a:b])
    g_idx = torch.cat([torch.full((300,), 3), torch.arange(100) % 3]).to(torch.int32)
    qb = random_quantized(400, 72, 128, True, F16, g_idx)
    part = slice_quantized(qb, 1, 0, 300)  # touches one group but has ceil(300 / 128) = 3 rows
    assert torch.equal(part.g_idx, torch.zeros(300, dtype=torch.int32)) and part.group_size == 128
    assert torch.equal(part.scales[0], qb.scales[3]) and not part.scales[1:].any()
    assert torch.equal(part.dequantize(), qb.dequantize()[:, :300])


@pytest.mark.parametrize("gs,world", [(128, 2), (32, 2), (32, 4)])
def test_act_order_shard_keeps_permutation(gs, world, device):
    # desc_act, K 512 over `world` ranks: each shard touches (nearly) every group; it keeps
    # them (renumbered, in the original channel order) with the group size unchanged, in more
    # scale rows than ceil(K' / group_size) where it needs them (g32 at world 4: 16 groups
    # in a 128-channel shard), and the kernel computes the same function
    k, n = 512, 64
    part_k = k // world
    g_idx = make_g_idx("descact", k, gs, device)
    qw = random_quantized(k, n, gs, False, F16, g_idx, device)
    layer = QuantLinear.from_quantized(qw)
    x = torch.randn(3, k, device=device).half()
    total = torch.zeros(3, n, dtype=torch.float64, device=device)
    for r in range(world):
        part = layer.shard(r, world, 1)
        pq = part.quantized_weight()
        assert part.act_order and part.group_size == gs
        xs = x[:, r * part_k:(r + 1) * part_k]
        y = part(xs)
        ref = xs.double() @ part.dequantize().double().T
        assert rel_err(y, ref) <= TOL[F16]
        total += ref
        sl = g_idx[r * part_k:(r + 1) * part_k].long()
        touched = torch.unique(sl)
        assert torch.equal(touched[pq.g_idx.long()], sl)  # same group for every channel
        assert torch.equal(pq.scales[:touched.numel()], qw.scales[touched])
        assert torch.equal(pq.qweight, qw.qweight[:, r * part_k:(r + 1) * part_k])
    assert rel_err(total, x.double() @ layer.dequantize().double().T) < 1e-12  # shards sum to the layer


@pytest.mark.parametrize("gs", [-1, 128])
def test_w4a8_shard_weights_exact(gs):
    k, n = 1024, 96
    qw = quantize_qqq(torch.randn(n, k), gs)
    for dim, worlds in ((0, (1, 2, 3, 4)), (1, (1, 2, 4, 8))):
        for world in worlds:
            parts = [shard_quantized(qw, r, world, dim) for r in range(world)]
            assert torch.equal(torch.cat([p.int8_weight() for p in parts], dim=dim), qw.int8_weight())
            assert torch.equal(torch.cat([p.dequantize() for p in parts], dim=dim), qw.dequantize())
    tail = slice_qqq(quantize_qqq(torch.randn(16, 400), 128), 1, 256, 400)
    assert tail.s_g.shape == (2, 16)


# ----------------------------------------------------------------------------------
# Layer shards through the kernels
# ----------------------------------------------------------------------------------
LAYER_CASES = [
    (512, 128, 128, True, "none", F16, True),
    (512, 128, 128, False, "none", BF16, False),
    (512, 96, 64, False, "none", F16, True),
    (512, 64, 32, True, "none", F16, False),
    (512, 64, -1, False, "none", BF16, True),
    (512, 128, 128, False, "descact", F16, True),
    (512, 64, 64, True, "descact", BF16, False),
    (512, 128, 128, True, "gidx", F16, False),
    (512, 64, 64, False, "gidx", F16, True),
]


@pytest.mark.parametrize("k,n,gs,sym,gidx,dtype,bias", LAYER_CASES,
                         ids=[f"g{c[2]}-{'sym' if c[3] else 'asym'}-{c[4]}-{'fp16' if c[5] == F16 else 'bf16'}"
                              f"{'-bias' if c[6] else ''}" for c in LAYER_CASES])
def test_w4a16_layer_shards(k, n, gs, sym, gidx, dtype, bias, device):
    layer = w4a16_layer(k, n, gs, sym, gidx, dtype, bias, device)
    x = torch.randn(3, k, device=device).to(dtype)
    w = layer.dequantize()
    ref = x.float() @ w.T + (layer.bias.float() if bias else 0)
    world = 2
    col = shards(layer, world, 0)
    assert all(type(s) is QuantLinear and s.out_features == n // world for s in col)
    assert rel_err(torch.cat([s(x) for s in col], dim=-1), ref) <= TOL[dtype]
    row = shards(layer, world, 1)
    assert all(s.in_features == k // world and s.act_order == (gidx != "none") for s in row)
    assert [s.bias is not None for s in row] == [bias, False]
    assert torch.equal(torch.cat([s.dequantize() for s in row], dim=1), w)
    y = sum(s(xs).float() for s, xs in zip(row, x_slices(x, world)))
    assert rel_err(y, ref) <= TOL[dtype]


@pytest.mark.parametrize("gs", [-1, 128])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_w4a8_layer_shards(gs, dtype, device):
    k, n, world = 512, 128, 2
    layer = w4a8_layer(k, n, gs, True, device)
    x = torch.randn(3, k, device=device).to(dtype)
    w = layer.dequantize()

    def q_ref(xs, ws):  # per-token int8 x (its own scale per slice) times the weight
        x_q, s = quantize_activations(xs)
        return (s[:, None] * x_q.float()) @ ws.T

    col = shards(layer, world, 0)
    assert all(type(s) is QuantLinearW4A8 for s in col)
    ref = q_ref(x, w) + layer.bias
    assert rel_err(torch.cat([s(x) for s in col], dim=-1), ref) <= TOL[dtype]
    row = shards(layer, world, 1)
    assert [s.bias is not None for s in row] == [True, False]
    xs = x_slices(x, world)
    ref = sum(q_ref(xr, w[:, r * k // world:(r + 1) * k // world]) for r, xr in enumerate(xs)) + layer.bias
    y = sum(s(xr).float() for s, xr in zip(row, xs))
    assert rel_err(y, ref) <= TOL[dtype]


def test_shard_leaves_layer_and_device(device):
    layer = w4a16_layer(256, 64, 64, False, "descact", F16, True, device)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    part = layer.shard(1, 2, 0)
    assert part.qweight.device.type == torch.device(device).type
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())


@pytest.mark.parametrize("gidx", ["none", "descact"])
def test_shard_from_gptq_checkpoint(gidx):
    # what a loader does: GPTQ tensors -> canonical weight -> this rank's shard -> one packed
    # shard layer; the same layer as sharding the fully built one
    k, n = 512, 64
    qw = random_checkpoint_weight(k, n, 128, False, F16, make_g_idx(gidx, k, 128))
    bias = torch.randn(n).to(F16)
    full = QuantLinear.from_quantized(qw, bias)
    ckpt = to_gptq(qw)
    for dim in (0, 1):
        for r in range(2):
            loaded = from_gptq(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt.get("g_idx"), group_size=128)
            layer = QuantLinear.from_quantized(shard_quantized(loaded, r, 2, dim), shard_bias(bias, r, 2, dim))
            ref = full.shard(r, 2, dim)
            assert layer.state_dict().keys() == ref.state_dict().keys()
            assert all(torch.equal(v, ref.state_dict()[key]) for key, v in layer.state_dict().items())


# ----------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("k,n,gs,gidx,rank,world,dim,exc,match", [
    (256, 64, 128, "none", 0, 3, 0, ValueError, r"out_features=64 is not divisible by world_size=3"),
    (256, 64, 128, "none", 0, 3, 1, ValueError, r"in_features=256 is not divisible by world_size=3"),
    (256, 64, 128, "none", 0, 16, 0, ValueError, r"\(N=4, K=256\).*out_features=4 must be a positive multiple of 8"),
    (256, 64, 32, "none", 0, 32, 1, ValueError, r"\(N=64, K=8\).*in_features=8 must be a positive multiple of 16"),
    (256, 64, 128, "none", 0, 4, 1, ValueError, r"\[0, 64\) of in_features=256 cuts a group of group_size=128"),
    (384, 64, 128, "none", 0, 2, 1, ValueError, r"\[0, 192\) of in_features=384 cuts a group of group_size=128"),
    (256, 64, 128, "none", 2, 2, 0, ValueError, r"rank=2 must lie in \[0, world_size=2\)"),
    (256, 64, 128, "none", -1, 2, 0, ValueError, r"rank=-1 must lie in"),
    (256, 64, 128, "none", 0, 0, 0, ValueError, r"world_size=0 must be >= 1"),
    (256, 64, 128, "none", 0, 2, 2, ValueError, r"dim=2 is not supported; allowed: 0 .*, 1 "),
    (256, 64, 128, "none", 0, 2.0, 0, TypeError, r"world_size must be an int, got float"),
    (256, 64, 128, "none", True, 2, 0, TypeError, r"rank must be an int, got bool"),
])
def test_shard_errors(k, n, gs, gidx, rank, world, dim, exc, match):
    layer = w4a16_layer(k, n, gs, True, gidx, F16, True, "cpu")
    with pytest.raises(exc, match=match):
        layer.shard(rank, world, dim)
    with pytest.raises(exc, match=match):
        shard_quantized(layer.quantized_weight(), rank, world, dim)


def test_shard_errors_w4a8_and_types():
    layer = w4a8_layer(256, 64, 128, False, "cpu")
    with pytest.raises(ValueError, match=r"\[0, 64\) of in_features=256 cuts a group of group_size=128"):
        layer.shard(0, 4, 1)
    with pytest.raises(ValueError, match=r"out_features=4 must be a positive multiple of 8"):
        layer.shard(0, 16, 0)
    assert w4a8_layer(256, 64, -1, False, "cpu").shard(3, 16, 1).in_features == 16  # per channel: any K/16
    with pytest.raises(TypeError, match=r"layer must be a QuantLinear or a QuantLinearW4A8, got Linear"):
        shard_layer(nn.Linear(256, 64), 0, 2, 0)
    with pytest.raises(TypeError, match=r"qw must be a QuantizedWeight or a QQQWeight, got Tensor"):
        shard_quantized(torch.zeros(4, 4), 0, 2, 0)
    with pytest.raises(TypeError, match=r"qw must be a QuantizedWeight or a QQQWeight, got Tensor"):
        slice_weight(torch.zeros(4, 4), 0, 0, 2)
    with pytest.raises(TypeError, match=r"qw must be a QuantizedWeight, got QQQWeight"):
        slice_quantized(layer.quantized_weight(), 0, 0, 8)
    with pytest.raises(TypeError, match=r"qw must be a QQQWeight, got QuantizedWeight"):
        slice_qqq(random_quantized(256, 64, 128, True, F16), 0, 0, 8)


@pytest.mark.parametrize("dim,start,stop,exc,match", [
    (0, 0, 0, ValueError, r"slice \[0, 0\) is not a non-empty range inside out_features=64"),
    (0, 8, 72, ValueError, r"slice \[8, 72\) is not a non-empty range inside out_features=64"),
    (1, -16, 16, ValueError, r"inside in_features=256"),
    (1, 0, 1.5, TypeError, r"stop must be an int, got float"),
    (3, 0, 8, ValueError, r"dim=3 is not supported"),
])
def test_slice_errors(dim, start, stop, exc, match):
    qw = random_quantized(256, 64, 128, True, F16)
    with pytest.raises(exc, match=match):
        slice_quantized(qw, dim, start, stop)
    with pytest.raises(exc, match=match):
        slice_qqq(quantize_qqq(torch.randn(64, 256), -1), dim, start, stop)


def test_shard_bias_and_range():
    b = torch.arange(8.0)
    assert torch.equal(shard_bias(b, 1, 2, 0), b[4:])
    assert torch.equal(shard_bias(b, 0, 2, 1), b) and shard_bias(b, 1, 2, 1) is None
    assert shard_bias(None, 0, 2, 0) is None
    assert shard_range(12, 2, 3, 1) == (8, 12)
    with pytest.raises(ValueError, match=r"rank=3 must lie in \[0, world_size=2\)"):
        shard_bias(b, 3, 2, 1)


def test_styles_reject_plain_linear_and_bad_reduce():
    with pytest.raises(TypeError, match=r"SailfishColwiseParallel applies to QuantLinear and "
                                        r"QuantLinearW4A8, got Linear"):
        SailfishColwiseParallel()._apply(nn.Linear(256, 64), None)
    with pytest.raises(ValueError, match=r"reduce='nccl' is not supported; allowed: \('dtensor', 'c10d'\)"):
        SailfishRowwiseParallel(reduce="nccl")


@pytest.fixture
def mesh1():
    """A one-rank gloo process group in this process (styles, hooks, in-place sharding)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reduce", ["dtensor", "c10d"])
def test_styles_shard_in_place(mesh1, reduce):
    from torch.distributed.tensor.parallel import parallelize_module
    model = nn.Sequential(w4a16_layer(256, 128, 128, True, "none", F16, True, "cpu"),
                          w4a16_layer(128, 64, 64, False, "descact", F16, True, "cpu"))
    first, calls = model[0], []
    first.register_forward_pre_hook(lambda mod, args: calls.append(mod))
    x = torch.randn(2, 256).to(F16)
    y_ref = model(x)
    plan = {"0": SailfishColwiseParallel(), "1": SailfishRowwiseParallel(reduce=reduce)}
    assert parallelize_module(model, mesh1, plan) is model
    assert model[0] is first and len(model[1]._forward_hooks) == 1  # in place, hooks kept
    y = model(x)
    assert torch.equal(y, y_ref) and calls == [first, first]
    # shard=False: the layer is taken as this rank's shard; only the sum is attached
    layer = w4a16_layer(128, 64, 64, False, "descact", F16, True, "cpu")
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    assert parallelize_module(layer, mesh1, SailfishRowwiseParallel(reduce=reduce, shard=False)) is layer
    assert len(layer._forward_hooks) == 1
    assert all(torch.equal(v, state[k]) for k, v in layer.state_dict().items())


def test_styles_need_1d_mesh(mesh1):
    from torch.distributed.device_mesh import init_device_mesh
    mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"need a 1-D device mesh, got 2-D"):
        SailfishColwiseParallel()._apply(w4a16_layer(256, 64, 128, True, "none", F16, False, "cpu"), mesh2)


# ----------------------------------------------------------------------------------
# A 2-process gloo run of the tensor-parallel example (python -m sailfish.bench.tp)
# ----------------------------------------------------------------------------------
def run_tp_bench(tmp_path, *args) -> dict:
    out = tmp_path / "tp.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    # CPU workers run the PyTorch reference path (the kernels are covered above): the
    # interpreter would make each of the 3 processes compile every kernel again.
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "sailfish.bench.tp", "--nproc", "2", "--preset", "tiny",
           "--json", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["check"]["passed"], res["check"]
    assert res["check"]["rel_err"] <= res["check"]["bound"]
    assert set(res["step_ms"]) == {"1", "2"}
    return res


@pytest.mark.parametrize("fmt,reduce", [("w4a16", "dtensor"), ("w4a8", "c10d")])
def test_tp_model_gloo(fmt, reduce, tmp_path):
    res = run_tp_bench(tmp_path, "--cpu", "--replays", "1", "--format", fmt, "--reduce", reduce)
    assert res["backend"] == "gloo" and res["format"] == fmt and res["reduce"] == reduce


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("reduce", ["dtensor", "c10d"])
def test_tp_model_nccl_cuda_graph(reduce, tmp_path):
    res = run_tp_bench(tmp_path, "--reduce", reduce)
    assert res["backend"] == "nccl" and res["cuda_graph"]
    assert res["check"]["rel_err_graph_vs_eager"] <= res["check"]["bound"]
