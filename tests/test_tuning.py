"""Config choice: the shipped tables and the lookup order (exact key, then the shape's
"any" fallback, then autotune / heuristic). Runs on CPU: the CUDA-only parts of the
lookup (GPU name, stream capture) are replaced by stand-ins."""
import json
import types

import pytest
import torch

import sailfish.tuning as tuning
from sailfish.ops.w4a8 import W4A8_TUNER, w4a8_key
from sailfish.ops.w4a16 import w4a16_key
from sailfish.tuning import CONFIG_DIR, Config, Tuner, problem_key

TABLES = sorted(CONFIG_DIR.glob("*.json"))
KERNELS = {"w4a16": {"mma", "gemv", "dequant"}, "w4a8": {"mma", "gemv", "dequant"}}


def test_tables_shipped():
    assert {p.stem for p in TABLES} >= {"h100", "h200"}


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.stem)
def test_table_entries_are_valid_configs(path):
    configs = json.loads(path.read_text())["configs"]
    assert configs
    for key, entry in configs.items():
        family = key.split("|")[0]
        cfg = Config(**entry)  # unknown fields would raise TypeError
        assert cfg.kernel in KERNELS[family], key
        assert cfg.SPLIT_K >= 1 and cfg.num_warps in (1, 2, 4, 8) and cfg.num_stages >= 1, key


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.stem)
def test_every_tuned_shape_has_a_fallback(path):
    """Formats without their own entry (asymmetric, act-order, bf16, per-channel W4A8)
    use the shape's "any" entry, the config tuned for the default format."""
    configs = json.loads(path.read_text())["configs"]
    defaults = {"w4a16": "|gs=128|zeros=0|gidx=0|float16", "w4a8": "|gs=128|float16"}
    n_default = 0
    for key, entry in configs.items():
        family = key.split("|")[0]
        if key.endswith(defaults[family]):
            n_default += 1
            twin = key[: -len(defaults[family])] + "|any"
            assert configs.get(twin) == entry, twin
    assert n_default > 0


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A device that looks like CUDA to Tuner.get, with a user table in tmp_path."""
    monkeypatch.setattr(tuning, "gpu_key", lambda device: "h200")
    monkeypatch.delenv("SAILFISH_HEURISTICS_ONLY", raising=False)
    table = tmp_path / "table.json"

    def use(configs):
        table.write_text(json.dumps({"configs": configs}))
        tuning._load_table.cache_clear()
        monkeypatch.setenv("SAILFISH_CONFIG_FILE", str(table))

    yield types.SimpleNamespace(type="cuda", index=0), use
    tuning._load_table.cache_clear()


def _tuner():
    return Tuner("test", heuristic=lambda **p: Config(16, 64, 128, kernel="heuristic"),
                 candidates=lambda **p: [])


def test_lookup_order(fake_gpu):
    dev, use = fake_gpu
    exact, fallback = Config(16, 128, 128, 2), Config(32, 64, 256, 4)
    use({"test|exact": vars(exact), "test|any": vars(fallback)})
    assert _tuner().get("test|exact", dev, None, fallback_key="test|any") == exact
    assert _tuner().get("test|other", dev, None, fallback_key="test|any") == fallback
    # no entry and no way to autotune (run=None): the heuristic
    assert _tuner().get("test|other", dev, None, fallback_key="test|none").kernel == "heuristic"
    assert _tuner().get("test|other", dev, None).kernel == "heuristic"


def test_heuristics_only_switch(fake_gpu, monkeypatch):
    dev, use = fake_gpu
    use({"test|exact": vars(Config(16, 128, 128, 2))})
    monkeypatch.setenv("SAILFISH_HEURISTICS_ONLY", "1")
    assert _tuner().get("test|exact", dev, None).kernel == "heuristic"


@pytest.mark.parametrize("gs,dtype", [(-1, torch.float16), (128, torch.bfloat16), (-1, torch.bfloat16)],
                         ids=["chan-fp16", "g128-bf16", "chan-bf16"])
def test_w4a8_untuned_format_uses_the_shapes_g128_config(gs, dtype, fake_gpu, monkeypatch):
    """Per-channel W4A8 had no table entry and ran on heuristics, which chose the fused
    tiles at M >= 1024 (0.63-0.71x cuBLAS fp16, H200 8192x57344); the g128 entry there is
    dequantize + int8 cuBLAS."""
    dev, use = fake_gpu
    monkeypatch.delenv("SAILFISH_CONFIG_FILE", raising=False)
    tuning._load_table.cache_clear()
    W4A8_TUNER.cache.clear()
    shipped = json.loads((CONFIG_DIR / "h200.json").read_text())["configs"]
    k, n, m = 8192, 57344, 1024
    want = Config(**shipped[w4a8_key(k, n, m, 128, torch.float16)])
    assert want.kernel == "dequant"
    got = W4A8_TUNER.get(w4a8_key(k, n, m, gs, dtype), dev, None,
                         fallback_key=problem_key("w4a8", k, n, m, "any"),
                         M=m, N=n, K=k, Kp=k, group_size=gs)
    W4A8_TUNER.cache.clear()
    assert got == want


@pytest.mark.parametrize("family", ["w4a16", "w4a8"])
def test_launchers_pass_the_shape_fallback(family, monkeypatch):
    """The launchers must ask for the "any" key of the same shape and M bucket."""
    seen = {}

    def spy(self, key, device, run, fallback_key=None, **problem):
        seen.update(key=key, fallback_key=fallback_key)
        raise RuntimeError("stop")

    monkeypatch.setattr(Tuner, "get", spy)
    from sailfish import QuantLinear
    lin = torch.nn.Linear(256, 64, bias=False).to(torch.float16)
    if family == "w4a16":
        from sailfish.ops.w4a16 import w4a16_launch
        layer = QuantLinear.from_linear(lin, group_size=-1, sym=False)
        x = torch.randn(5, 256, dtype=torch.float16)
        with pytest.raises(RuntimeError, match="stop"):
            w4a16_launch(x, layer.qweight, layer.scales, layer.zeros, None, None, None, 256, -1)
        assert seen["key"] == w4a16_key(256, 64, 5, -1, True, False, torch.float16)
        assert seen["fallback_key"] == problem_key("w4a16", 256, 64, 5, "any")
    else:
        from sailfish.ops.w4a8 import w4a8_launch
        layer = QuantLinear.from_linear(lin, act_bits=8, group_size=-1)
        x_q, x_s = layer.quantize_input(torch.randn(5, 256, dtype=torch.float16))
        with pytest.raises(RuntimeError, match="stop"):
            w4a8_launch(x_q, x_s, layer.qweight, layer.s_ch, layer.s_g, layer.bias, 256, -1, torch.float16)
        assert seen["key"] == w4a8_key(256, 64, 5, -1, torch.float16)
        assert seen["fallback_key"] == problem_key("w4a8", 256, 64, 5, "any")


@pytest.mark.parametrize("m,n,split", [(16, 1024, 16), (128, 1024, 16), (256, 1024, 8), (128, 14336, 1),
                                       (512, 4096, 1), (128, 4096, 4)])
def test_heuristic_split_k(m, n, split):
    """Split-K in the heuristic (H200 measurements in ops/w4a16.py): at small M up to 2
    programs per SM; at M > 64 only while the tiles fill under half the SMs (4096x1024 at
    M = 128: 0.17x -> 0.63x cuBLAS; 4096x14336 at M = 128 stays unsplit, 0.71x)."""
    from sailfish.ops.w4a8 import _w4a8_heuristic
    from sailfish.ops.w4a16 import _w4a16_heuristic
    dev = types.SimpleNamespace(type="cpu", index=None)  # CPU: 132 SMs assumed (H100/H200)
    cfg = _w4a16_heuristic(device=dev, M=m, N=n, Kp=4096, group_size=128, general_gidx=False)
    assert cfg.kernel == "mma" and cfg.SPLIT_K == split
    assert _w4a8_heuristic(device=dev, M=m, N=n, K=4096, Kp=4096, group_size=128).SPLIT_K == split


def test_scratch_runner_allocates_once_and_lazily():
    from sailfish.tuning import scratch_runner
    like = torch.zeros(3, 5, dtype=torch.float16)
    outs = []
    run = scratch_runner(lambda cfg, out: outs.append((cfg, out)), like)
    assert outs == []  # nothing allocated or run before the first candidate
    run("a")
    run("b")
    assert [c for c, _ in outs] == ["a", "b"]
    assert outs[0][1] is outs[1][1] and outs[0][1] is not like
    assert outs[0][1].shape == like.shape and outs[0][1].dtype == like.dtype
