"""load_quantized(path, device_mesh=...): each rank reads only its tensor-parallel shard of
every quantized layer from the safetensors files. Per rank, the layers must equal loading
the whole model and sharding it with sailfish.parallel (shard_layer, the styles), bit for bit,
for every format load_quantized reads; a 2-process gloo run checks the forward pass too.

Single-process tests pass a stand-in mesh (rank r of 2): the loader asks a mesh only for its
rank and size, and the row-parallel sum is first used in a forward pass."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from test_checkpoint import _edit_tensors, make_quantized
from test_seed_formats import make_tiled
from tp_load_worker import COLUMN, layer_differences, sailfish_layers
import safetensors
from sailfish import load_quantized, save_quantized
from sailfish.parallel import SailfishColwiseParallel, SailfishRowwiseParallel, default_plan, shard_layer

HERE = os.path.dirname(os.path.abspath(__file__))


class StandInMesh:
    """What load_quantized asks of a 1-D DeviceMesh."""
    ndim = 1

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.world


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    """Whole models on the CPU run the PyTorch reference, not the Triton interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def saved(fmt, **kw):
    """A checkpoint that save_quantized wrote in `fmt` from a loaded GPTQ one."""
    def make(path):
        make_quantized(path / "src", "gptq", 64, **kw)
        with warnings.catch_warnings():  # zero points of 0: gptq_v2, with a warning saying so
            warnings.simplefilter("ignore")
            save_quantized(load_quantized(str(path / "src")), str(path), format=fmt)
        with open(path / "config.json") as f:
            assert json.load(f)["quantization_config"].get("checkpoint_format") in (None, "gptq_v2")
    return make


CASES = {  # hidden 128 (or 256: Marlin / QQQ shards need 64 output features), 2 layers
    "gptq-asym-descact-g32": lambda p: make_quantized(p, "gptq", 32, False, True),
    "gptq-sym-g64": lambda p: make_quantized(p, "gptq", 64, True),  # qzeros all 8: symmetric
    "gptq_v2-asym-g64": lambda p: make_quantized(p, "gptq", 64, False, checkpoint_format="gptq_v2"),
    "gptq-asym-g64-bias": lambda p: make_quantized(p, "gptq", 64, False, attention_bias=True),  # q/k/v/o bias
    "awq-asym-g64": lambda p: make_quantized(p, "awq", 64, False),
    "awq-sym-g32": lambda p: make_quantized(p, "awq", 32, True),
    "ct-asym-actorder-g32": lambda p: make_quantized(p, "ct", 32, False, True),
    "ct-sym-channel": lambda p: make_quantized(p, "ct", -1, True),
    "saved-awq-asym-g64": saved("awq", sym=False),
    "saved-ct-asym-descact-g64": saved("compressed-tensors", sym=False, desc_act=True),
    "saved-gptq_v2-zero0-g64": saved("gptq", sym=False, zero_low=0),  # zero points of 0: gptq_v2
    "marlin-g128": lambda p: make_tiled(p, "marlin", 128, hidden=256),
    "marlin-channel": lambda p: make_tiled(p, "marlin", -1, hidden=256),
    "qqq-g128": lambda p: make_tiled(p, "qqq", 128, hidden=256),  # row shards of 128 = one group
    "qqq-channel": lambda p: make_tiled(p, "qqq", -1, hidden=256),
}


def assert_rank_equals_sharded_whole(path, fuse=True, world=2, row_only=None):
    """For every rank: load_quantized(device_mesh) == shard_layer of the whole model's layers
    (default plan; row_only: only that layer, row parallel, the others whole)."""
    full = sailfish_layers(load_quantized(str(path), fuse=fuse))
    plan = None if row_only is None else {row_only: SailfishRowwiseParallel()}
    for rank in range(world):
        mine = sailfish_layers(load_quantized(str(path), fuse=fuse, device_mesh=StandInMesh(rank, world),
                                              tp_plan=plan))
        assert mine.keys() == full.keys()
        for name, layer in full.items():
            dim = 0 if name.rpartition(".")[2] in COLUMN else 1
            ref = layer if row_only not in (None, name) else shard_layer(layer, rank, world, dim)
            assert layer_differences(mine[name], ref) == [], (name, rank)
            assert mine[name].bias is None or dim == 0 or rank == 0  # row parallel: rank 0 adds it
    return full


@pytest.mark.parametrize("case", list(CASES))
def test_rank_shards_equal_sharded_whole_model(tmp_path, case):
    CASES[case](tmp_path)
    full = assert_rank_equals_sharded_whole(tmp_path)
    act_order = "desc" in case or "actorder" in case  # the projections' g_idx differ: not fused
    assert any(n.endswith("qkv_proj") for n in full) == (not act_order)


def test_rank_shards_unfused(tmp_path):
    make_quantized(tmp_path, "awq", 64, False)
    assert not any(n.endswith("qkv_proj") for n in assert_rank_equals_sharded_whole(tmp_path, fuse=False))


# What a layer is (symmetric, act-order) is decided over the whole tensor, not the rank's part.
LAYER = "model.layers.1.mlp.down_proj"  # row parallel: K 256 split in two


def _plain_quarter_g_idx(t):  # K [0, 64) in order, the rest reversed: act-order, rank 0 of 4 sees plain
    g = torch.arange(256, dtype=torch.int32) // 128
    t[f"{LAYER}.g_idx"] = torch.cat([g[:64], g[64:].flip(0)])


def _eights_in_rank0_columns(t):  # zero points 8 in rank 0's output features of a column layer
    t["model.layers.0.mlp.up_proj.qzeros"][:, :16] = 0x77777777  # v1: 8 - 1 in every nibble


@pytest.mark.parametrize("edit", [_plain_quarter_g_idx, _eights_in_rank0_columns])
def test_layer_kind_is_decided_by_whole_tensor(tmp_path, edit):
    if edit is _plain_quarter_g_idx:  # act-order: a shard of 64 of K may cut a group of 128
        make_quantized(tmp_path, "gptq", 128, False)
        _edit_tensors(tmp_path, edit)
        full = assert_rank_equals_sharded_whole(tmp_path, fuse=False, world=4, row_only=LAYER)
        assert full[LAYER].act_order
        return
    make_quantized(tmp_path, "gptq", 64, False)
    _edit_tensors(tmp_path, edit)
    full = assert_rank_equals_sharded_whole(tmp_path, fuse=False)
    assert not full["model.layers.0.mlp.up_proj"].sym


def test_symmetric_awq_eights_outside_the_shard(tmp_path):
    make_quantized(tmp_path, "awq", 64, True)
    _edit_tensors(tmp_path, lambda t: t[f"{LAYER}.qzeros"].__setitem__((3, 0), 0x88888887 - (1 << 32)))  # group 3: rank 1
    with pytest.raises(ValueError, match=rf"{LAYER}: zero_point=False \(symmetric AWQ\) needs every qzeros "
                                         rf"nibble to be 8; some outside this rank's shard are not"):
        load_quantized(str(tmp_path), device_mesh=StandInMesh(0, 2))
    with pytest.raises(ValueError, match=rf"{LAYER}: zero_point=False .* 1 of"):
        load_quantized(str(tmp_path), device_mesh=StandInMesh(1, 2))


# ----------------------------------------------------------------------------------
# A rank reads only its shard
# ----------------------------------------------------------------------------------
def recording_safe_open(reads: list):
    """safetensors.safe_open that records (key, elements) of every tensor or slice read."""
    real = safetensors.safe_open

    class Slice:
        def __init__(self, key, inner):
            self.key, self.inner = key, inner

        def get_shape(self):
            return self.inner.get_shape()

        def get_dtype(self):
            return self.inner.get_dtype()

        def __getitem__(self, index):
            t = self.inner[index]
            reads.append((self.key, t.numel()))
            return t

    class File:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            return Slice(key, self.inner.get_slice(key))

        def get_tensor(self, key):
            t = self.inner.get_tensor(key)
            reads.append((key, t.numel()))
            return t

    return File


@pytest.mark.parametrize("case", ["gptq-sym-g64", "gptq-asym-descact-g32", "marlin-g128"])
def test_rank_reads_only_its_shard(tmp_path, monkeypatch, case):
    CASES[case](tmp_path)
    sizes = {k: t.numel() for k, t in safetensors.torch.load_file(str(tmp_path / "model.safetensors")).items()}
    reads = []
    monkeypatch.setattr(safetensors, "safe_open", recording_safe_open(reads))
    load_quantized(str(tmp_path), device_mesh=StandInMesh(1, 2))
    codes = [k for k in sizes if k.endswith((".qweight", ".B"))]
    assert len(codes) == 14
    for key in codes:  # the packed codes: exactly the shard's half, never more
        assert sum(n for k, n in reads if k == key) == sizes[key] // 2, key
    # no read of a quantized layer's tensor exceeds half of it, but for what every shard keeps
    # whole (g_idx, the bias of a row layer on rank 0) and the scale rows of an act-order row
    # shard (GPTQ desc_act spreads every group over all of K: a shard touches them all)
    whole = (".g_idx", ".bias", ".weight", ".s_channel")
    act_order_rows = "descact" in case
    for key, n in reads:
        if key.endswith(whole) or key not in sizes or "layers" not in key:
            continue
        if act_order_rows and key.endswith((".scales", ".qzeros")) and ("o_proj" in key or "down_proj" in key):
            continue
        assert n <= sizes[key] // 2, (key, n, sizes[key])


# ----------------------------------------------------------------------------------
# Refusals, before any weight is read
# ----------------------------------------------------------------------------------
def test_refusals(tmp_path):
    make_quantized(tmp_path / "g64", "gptq", 64, False, hidden=128, inter=384)
    path = str(tmp_path / "g64")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj: out_features=384 is not divisible by "
                                         r"world_size=5: .*\(mesh sizes up to 8 that split this layer: "
                                         r"\[1, 2, 3, 4, 6, 8\]\)"):
        load_quantized(path, device_mesh=StandInMesh(0, 5), tp_plan={"model.layers.*.mlp.up_proj":
                                                                     SailfishColwiseParallel()})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: input-feature slice \[0, 96\) of "
                                         r"in_features=384 cuts a group of group_size=64.*\[1, 2, 3, 6\]\)"):
        load_quantized(path, device_mesh=StandInMesh(0, 4), tp_plan={"model.layers.*.mlp.down_proj":
                                                                     SailfishRowwiseParallel()})
    with pytest.raises(ValueError, match=r"config.num_key_value_heads=2 is not divisible by the device mesh "
                                         r"size 4: .*allowed: mesh sizes that divide 2"):
        load_quantized(path, device_mesh=StandInMesh(0, 4))
    with pytest.raises(ValueError, match=r"tp_plan\['model.layers.\*.attn.q_proj'\] names no quantized layer"):
        load_quantized(path, device_mesh=StandInMesh(0, 2), tp_plan={"model.layers.*.attn.q_proj":
                                                                     SailfishColwiseParallel()})
    with pytest.raises(TypeError, match=r"tp_plan\['model.layers.\*.mlp.up_proj'\] is a str; allowed: "
                                        r"SailfishColwiseParallel, SailfishRowwiseParallel"):
        load_quantized(path, device_mesh=StandInMesh(0, 2), tp_plan={"model.layers.*.mlp.up_proj": "colwise"})
    with pytest.raises(ValueError, match=r"tp_plan needs device_mesh"):
        load_quantized(path, tp_plan=default_plan())
    mesh2 = StandInMesh(0, 2)
    mesh2.ndim = 2
    with pytest.raises(ValueError, match=r"need a 1-D device mesh, got 2-D"):
        load_quantized(path, device_mesh=mesh2)
    make_tiled(tmp_path / "marlin", "marlin", 128, hidden=256)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj: a column-parallel \(dim=0\) shard of "
                                         r"out_features=256 over world_size=8 holds 32, but quant_method 'marlin' "
                                         r"needs a multiple of 64 .*\[1, 2, 4\]\)"):
        load_quantized(str(tmp_path / "marlin"), device_mesh=StandInMesh(0, 8),
                       tp_plan={"model.layers.*.mlp.gate_proj": SailfishColwiseParallel()})


def test_fused_plan_names_projections(tmp_path):
    # the fused plan (qkv_proj, gate_up_proj; parallelize_module on a fused model) loads the same
    make_quantized(tmp_path, "gptq", 64, False)
    mesh = StandInMesh(1, 2)
    a = sailfish_layers(load_quantized(str(tmp_path), device_mesh=mesh))
    b = sailfish_layers(load_quantized(str(tmp_path), device_mesh=mesh, tp_plan=default_plan(fused=True)))
    assert a.keys() == b.keys() and all(layer_differences(a[n], b[n]) == [] for n in a)


# ----------------------------------------------------------------------------------
# Two processes
# ----------------------------------------------------------------------------------
def run_two_ranks(tmp_path, cases, cuda=False):
    out = str(tmp_path / "tp")
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(HERE), "src"))
    if not cuda:
        env["TRITON_INTERPRET"] = "0"  # the PyTorch reference path on the CPU
    cmd = [sys.executable, os.path.join(HERE, "tp_load_worker.py"), out, json.dumps(cases)] + (["--cuda"] if cuda else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            for res in json.load(f):
                assert res["layers"] >= 8 and res["diffs"] == {}, (rank, res)
                assert res["equal_to_sharded_full"], (rank, res)
                # TP and 1 process differ by rounding only (partial sums rounded before the sum,
                # W4A8 row shards quantizing their own slice of x): within 2x the 1-process
                # model's own error against the fp32 model, as python -m sailfish.bench.tp checks
                assert 0 < res["rel_err"] <= res["bound"], (rank, res)


TWO_RANK_CASES = [("gptq-asym-descact-g32", True), ("gptq-asym-g64-bias", True), ("awq-asym-g64", False),
                  ("ct-asym-actorder-g32", True), ("marlin-g128", True), ("qqq-g128", True)]


def _write_cases(tmp_path):
    cases = []
    for name, fuse in TWO_RANK_CASES:
        CASES[name](tmp_path / name)
        cases.append({"path": str(tmp_path / name), "fuse": fuse})
    return cases


def test_two_ranks_gloo(tmp_path):
    run_two_ranks(tmp_path, _write_cases(tmp_path))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_nccl(tmp_path):
    run_two_ranks(tmp_path, _write_cases(tmp_path), cuda=True)
