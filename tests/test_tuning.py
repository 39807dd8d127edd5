"""Config choice: the shipped tables and the lookup order (exact key, then the shape's
"any" fallback, then autotune / heuristic). Runs on CPU: the CUDA-only parts of the
lookup (GPU name, stream capture) are replaced by stand-ins."""
import dataclasses
import json
import threading
import time
import types
import warnings

import pytest
import torch

import sailfish.runtime.device as device_mod
import sailfish.tune_model as tune_model
import sailfish.tuning as tuning
from sailfish.ops.w4a8 import W4A8_KERNELS, W4A8_TUNER, w4a8_key
from sailfish.ops.w4a16 import W4A16_KERNELS, w4a16_key
from sailfish.tuning import CONFIG_DIR, Config, Tuner, problem_key

TABLES = sorted(CONFIG_DIR.glob("*.json"))
# the kernels each family's launcher accepts (ops/w4a16.check_w4a16_config, tuning.check_config)
KERNELS = {"w4a16": set(W4A16_KERNELS), "w4a8": set(W4A8_KERNELS)}


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
    """A CUDA device for Tuner.get (torch.device("cuda", 0) needs no GPU until used), named
    like an H200, never capturing, with a user table in tmp_path."""
    monkeypatch.setattr(tuning, "gpu_key", lambda device: "h200")
    monkeypatch.setattr(tuning, "_capturing", lambda: False)
    for var in ("SAILFISH_HEURISTICS_ONLY", "SAILFISH_AUTOTUNE", "SAILFISH_CONFIG_FILE", "SAILFISH_CONFIG_REPLACE"):
        monkeypatch.delenv(var, raising=False)
    tuning.clear_caches()
    table = tmp_path / "table.json"

    def use(configs):
        table.write_text(json.dumps({"configs": configs}))
        tuning._load_table.cache_clear()
        monkeypatch.setenv("SAILFISH_CONFIG_FILE", str(table))

    yield torch.device("cuda", 0), use
    tuning.clear_caches()


HEURISTIC = Config(16, 64, 128, kernel="heuristic")
CANDIDATES = [Config(16, 64, 64, kernel="a"), Config(32, 64, 64, kernel="b"), Config(64, 64, 64, kernel="c")]


def _tuner(candidates=(), heuristic=None):
    return Tuner("test", heuristic=heuristic or (lambda **p: HEURISTIC), candidates=lambda **p: list(candidates))


class FakeBench:
    """Stands in for triton's do_bench: runs fn once and returns the time given per kernel."""

    def __init__(self, times, fail=(), delay=0.0):
        self.times, self.fail, self.delay = times, set(fail), delay
        self.ran = []

    def run(self, cfg):  # the launcher's run(cfg)
        self.ran.append(cfg)
        if cfg.kernel in self.fail:
            raise RuntimeError(f"out of resources ({cfg.kernel})")

    def __call__(self, fn):
        n = len(self.ran)
        fn()
        time.sleep(self.delay)
        return self.times[self.ran[n].kernel]


def test_lookup_order(fake_gpu):
    dev, use = fake_gpu
    exact, fallback = Config(16, 128, 128, 2), Config(32, 64, 256, 4)
    use({"test|exact": vars(exact), "test|any": vars(fallback)})
    assert _tuner().get("test|exact", dev, None, fallback_key="test|any") == exact
    assert _tuner().get("test|other", dev, None, fallback_key="test|any") == fallback
    # no entry and no way to autotune (run=None): the heuristic
    assert _tuner().get("test|other", dev, None, fallback_key="test|none").kernel == "heuristic"
    assert _tuner().get("test|other", dev, None).kernel == "heuristic"


def test_config_replace_uses_the_user_table_alone(fake_gpu, monkeypatch, tmp_path):
    """SAILFISH_CONFIG_REPLACE=1: the user file instead of the shipped table (merged over it
    otherwise), so a key only the shipped table holds falls to the heuristic; a missing file is
    an error, not a silent switch to the heuristics."""
    dev, use = fake_gpu
    shipped, mine = Config(16, 128, 128, 2), Config(32, 64, 256, 4)
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    (tmp_path / "h200.json").write_text(json.dumps({"configs": {"test|shipped": vars(shipped)}}))
    use({"test|mine": vars(mine)})
    assert _tuner().get("test|shipped", dev, None) == shipped
    assert _tuner().get("test|mine", dev, None) == mine
    monkeypatch.setenv("SAILFISH_CONFIG_REPLACE", "1")
    tuning.clear_caches()
    assert _tuner().get("test|shipped", dev, None).kernel == "heuristic"
    assert _tuner().get("test|mine", dev, None) == mine
    monkeypatch.setenv("SAILFISH_CONFIG_FILE", str(tmp_path / "nope.json"))
    tuning.clear_caches()
    with pytest.raises(ValueError, match="SAILFISH_CONFIG_REPLACE=1 needs SAILFISH_CONFIG_FILE"):
        _tuner().get("test|mine", dev, None)
    monkeypatch.delenv("SAILFISH_CONFIG_FILE")
    tuning.clear_caches()
    with pytest.raises(ValueError, match="SAILFISH_CONFIG_REPLACE=1 needs SAILFISH_CONFIG_FILE"):
        _tuner().get("test|mine", dev, None)


def test_heuristics_only_switch(fake_gpu, monkeypatch):
    dev, use = fake_gpu
    use({"test|exact": vars(Config(16, 128, 128, 2))})
    monkeypatch.setenv("SAILFISH_HEURISTICS_ONLY", "1")
    assert _tuner().get("test|exact", dev, None).kernel == "heuristic"


@pytest.mark.parametrize("gs,dtype", [(-1, torch.float16), (128, torch.bfloat16), (-1, torch.bfloat16)],
                         ids=["chan-fp16", "g128-bf16", "chan-bf16"])
def test_w4a8_untuned_format_uses_the_shapes_g128_config(gs, dtype, fake_gpu, monkeypatch, tmp_path):
    """A W4A8 format without its own table entry takes its shape's "any" entry (written by the
    tuner beside the g128 one) before the heuristics. The table here is a user file, for a
    shape the shipped tables do not hold (their exact entries would win: the shipped H200 table
    has per-channel and g128 fp16 W4A8 entries for the 8 Llama-3 shapes)."""
    dev, use = fake_gpu
    k, n, m = 5120, 13824, 1024
    want = Config(1, 64, 256, 1, 8, 4, 1, kernel="dequant")
    table = tmp_path / "user.json"
    table.write_text(json.dumps({"configs": {problem_key("w4a8", k, n, m, "any"): dataclasses.asdict(want)}}))
    monkeypatch.setenv("SAILFISH_CONFIG_FILE", str(table))
    tuning._load_table.cache_clear()
    got = W4A8_TUNER.get(w4a8_key(k, n, m, gs, dtype), dev, None,
                         fallback_key=problem_key("w4a8", k, n, m, "any"),
                         M=m, N=n, K=k, Kp=k, group_size=gs)
    tuning._load_table.cache_clear()
    assert got == want  # (the W4A8 heuristic picks fused tensor-core tiles at M = 1024)


@pytest.mark.parametrize("family", ["w4a16", "w4a8"])
def test_launchers_pass_the_shape_fallback(family, monkeypatch):
    """The launchers must ask for the "any" key of the same shape and M bucket."""
    seen = {}

    def spy(self, key, device, run, fallback_key=None, **problem):
        seen.update(key=key, fallback_key=fallback_key)
        raise RuntimeError("stop")

    monkeypatch.setattr(Tuner, "get", spy)
    tuning.clear_caches()  # a cached config would skip get()
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
    from sailfish.ops.w4a8 import w4a8_heuristic
    from sailfish.ops.w4a16 import w4a16_heuristic
    dev = types.SimpleNamespace(type="cpu", index=None)  # CPU: 132 SMs assumed (H100/H200)
    cfg = w4a16_heuristic(device=dev, M=m, N=n, Kp=4096, group_size=128, general_gidx=False)
    assert cfg.kernel == "mma" and cfg.SPLIT_K == split
    assert w4a8_heuristic(device=dev, M=m, N=n, K=4096, Kp=4096, group_size=128).SPLIT_K == split


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


# ----------------------------------------------------------------------------------
# GPU names
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,key", [
    ("NVIDIA H100 80GB HBM3", "h100"),        # SXM5: the board h100.json was tuned on
    ("NVIDIA H100 PCIe", "h100_pcie"),
    ("NVIDIA H100 NVL", "h100_nvl"),
    ("NVIDIA H100", "nvidia_h100"),           # an H100 that does not say it is the SXM part
    ("NVIDIA H200", "h200"),
    ("NVIDIA H200 NVL", "h200_nvl"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100 80GB PCIe", "a100_pcie"),
    ("NVIDIA L40S", "nvidia_l40s"),
    ("NVIDIA GeForce RTX 4090", "nvidia_geforce_rtx_4090"),
])
def test_gpu_key_names(name, key):
    assert device_mod.gpu_key_for_name(name) == key


def test_pcie_and_nvl_h100_do_not_use_the_sxm_table():
    for name in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL"):
        assert not (CONFIG_DIR / f"{device_mod.gpu_key_for_name(name)}.json").exists(), name
    assert (CONFIG_DIR / f"{device_mod.gpu_key_for_name('NVIDIA H100 80GB HBM3')}.json").exists()
    assert (CONFIG_DIR / f"{device_mod.gpu_key_for_name('NVIDIA H200')}.json").exists()


def test_gpu_key_is_cached_per_device_index(monkeypatch):
    names = {0: "NVIDIA H200", 1: "NVIDIA H100 PCIe"}
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: asked.append(i) or names[i])
    parsed = []
    real = device_mod.gpu_key_for_name
    monkeypatch.setattr(device_mod, "gpu_key_for_name", lambda n: parsed.append(n) or real(n))
    tuning.clear_caches()
    try:
        for _ in range(3):
            assert tuning.gpu_key(torch.device("cuda", 0)) == "h200"
            assert tuning.gpu_key(torch.device("cuda", 1)) == "h100_pcie"
        assert asked == [0, 1] and len(parsed) == 2  # no name query and no regex after the first
    finally:
        tuning.clear_caches()


# ----------------------------------------------------------------------------------
# The lookup: cached, no tuning in forward unless opted in
# ----------------------------------------------------------------------------------
def test_steady_state_is_one_cached_lookup(fake_gpu, monkeypatch):
    dev, use = fake_gpu
    use({"test|exact": vars(Config(16, 128, 128, 2))})
    calls = []
    tuner = _tuner(heuristic=lambda **p: calls.append("heuristic") or HEURISTIC)
    real_table = Tuner.table
    monkeypatch.setattr(Tuner, "table", lambda self, d: calls.append("table") or real_table(self, d))
    for _ in range(3):
        assert tuner.get("test|exact", dev, None, memo_key=("exact",)) == Config(16, 128, 128, 2)
        assert tuner.get("test|other", dev, None, memo_key=("other",)) == HEURISTIC
    assert calls == ["table", "table", "heuristic"]  # each problem resolved once, then cached
    assert tuner.lookup(dev, ("exact",)) == Config(16, 128, 128, 2)
    assert tuner.lookup(dev, ("other",)) == HEURISTIC
    assert tuner.lookup(torch.device("cuda", 1), ("exact",)) is None  # per device
    assert tuner.lookup(dev, ("new",)) is None


def test_forward_never_autotunes_by_default(fake_gpu, monkeypatch):
    dev, _ = fake_gpu
    bench = FakeBench({"a": 3.0, "b": 1.0, "c": 2.0})
    monkeypatch.setattr(tuning, "_bench", bench)
    assert _tuner(CANDIDATES).get("test|k", dev, bench.run) == HEURISTIC
    assert bench.ran == []
    monkeypatch.setenv("SAILFISH_AUTOTUNE", "0")
    assert _tuner(CANDIDATES).get("test|k", dev, bench.run) == HEURISTIC
    assert bench.ran == []


def test_autotune_opt_in_picks_the_fastest_once(fake_gpu, monkeypatch):
    dev, _ = fake_gpu
    monkeypatch.setenv("SAILFISH_AUTOTUNE", "1")
    bench = FakeBench({"a": 3.0, "b": 1.0, "c": 2.0})
    monkeypatch.setattr(tuning, "_bench", bench)
    tuner = _tuner(CANDIDATES)
    assert tuner.get("test|k", dev, bench.run) == CANDIDATES[1]
    assert tuner.get("test|k", dev, bench.run) == CANDIDATES[1]
    assert bench.ran == CANDIDATES  # every candidate timed once, on the first call only


def test_graph_capture_and_eager_share_one_config(fake_gpu, monkeypatch):
    """A capture on a cold cache takes the heuristic; later eager calls must use the same
    config (the graph keeps the one it captured), even with autotuning on."""
    dev, _ = fake_gpu
    monkeypatch.setenv("SAILFISH_AUTOTUNE", "1")
    bench = FakeBench({"a": 3.0, "b": 1.0, "c": 2.0})
    monkeypatch.setattr(tuning, "_bench", bench)
    tuner = _tuner(CANDIDATES)
    monkeypatch.setattr(tuning, "_capturing", lambda: True)
    captured = tuner.get("test|k", dev, bench.run)
    monkeypatch.setattr(tuning, "_capturing", lambda: False)
    assert captured == HEURISTIC and tuner.get("test|k", dev, bench.run) == captured
    assert bench.ran == []


def test_environment_is_read_per_problem_until_cleared(fake_gpu, monkeypatch):
    dev, use = fake_gpu
    use({"test|exact": vars(Config(16, 128, 128, 2))})
    tuner = _tuner()
    assert tuner.get("test|exact", dev, None) == Config(16, 128, 128, 2)
    monkeypatch.setenv("SAILFISH_HEURISTICS_ONLY", "1")
    assert tuner.get("test|exact", dev, None) == Config(16, 128, 128, 2)  # cached
    tuning.clear_caches()
    assert tuner.get("test|exact", dev, None) == HEURISTIC


def test_autotune_failures_are_reported(fake_gpu, monkeypatch):
    dev, _ = fake_gpu
    monkeypatch.setenv("SAILFISH_AUTOTUNE", "1")
    bench = FakeBench({"a": 3.0, "b": 1.0, "c": 2.0}, fail={"b"})
    monkeypatch.setattr(tuning, "_bench", bench)
    with pytest.warns(RuntimeWarning, match=r"config Config\(BLOCK_M=32.*kernel='b'.*\) failed while "
                                            r"tuning test\|k: RuntimeError: out of resources \(b\)"):
        assert _tuner(CANDIDATES).get("test|k", dev, bench.run) == CANDIDATES[2]
    bench = FakeBench({"a": 3.0, "b": 1.0, "c": 2.0}, fail={"a", "b", "c"})
    monkeypatch.setattr(tuning, "_bench", bench)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert _tuner(CANDIDATES).get("test|k2", dev, bench.run) == HEURISTIC
    messages = [str(w.message) for w in got]
    assert len(messages) == 4 and "no test candidate ran for test|k2" in messages[-1], messages


def test_two_threads_do_not_tune_one_key_twice(fake_gpu, monkeypatch):
    dev, _ = fake_gpu
    monkeypatch.setenv("SAILFISH_AUTOTUNE", "1")
    bench = FakeBench({"a": 3.0, "b": 1.0, "c": 2.0}, delay=0.02)
    monkeypatch.setattr(tuning, "_bench", bench)
    tuner = _tuner(CANDIDATES)
    start = threading.Barrier(4)
    got = []

    def worker():
        start.wait()
        got.append(tuner.get("test|k", dev, bench.run))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [CANDIDATES[1]] * 4
    assert bench.ran == CANDIDATES  # one thread benchmarked; the others waited and reused it


def test_a_bad_table_entry_fails_at_first_use(fake_gpu):
    dev, use = fake_gpu
    use({"w4a8|K=256|N=64|M=4|gs=-1|float16": vars(Config(16, 64, 512))})
    with pytest.raises(ValueError, match="BLOCK_K=512 must divide the padded K=256"):
        W4A8_TUNER.get("w4a8|K=256|N=64|M=4|gs=-1|float16", dev, None, M=4, N=64, K=256, Kp=256,
                       group_size=-1)
    assert not W4A8_TUNER.cache


# ----------------------------------------------------------------------------------
# Explicit tuning: tuning_session() and sailfish.tune()
# ----------------------------------------------------------------------------------
def test_session_tunes_every_problem_once_over_the_table(fake_gpu, monkeypatch):
    dev, use = fake_gpu
    use({"test|k": vars(Config(16, 128, 128, 2))})
    bench = FakeBench({"a": 3.0, "b": 1.0, "c": 2.0})
    monkeypatch.setattr(tuning, "_bench", bench)
    tuner = _tuner(CANDIDATES)
    assert tuner.get("test|k", dev, bench.run, memo_key="k") == Config(16, 128, 128, 2)  # the table
    with tuning.tuning_session() as tuned:
        assert tuner.lookup(dev, "k") is None  # lookups go through get() while tuning
        assert tuner.get("test|k", dev, bench.run, memo_key="k") == CANDIDATES[1]
        assert tuner.get("test|k", dev, bench.run, memo_key="k") == CANDIDATES[1]
        assert tuned == {("test", dev, "test|k"): CANDIDATES[1]}
    assert bench.ran == CANDIDATES
    assert tuner.lookup(dev, "k") == CANDIDATES[1]  # the measurement replaces the table entry


def _layers(device="cpu"):
    from sailfish import QuantLinear
    lin = torch.nn.Linear(64, 16, bias=False).half()
    a, b = QuantLinear.from_linear(lin), QuantLinear.from_linear(lin)  # the same problems
    c = QuantLinear.from_linear(lin, act_bits=8, group_size=-1)
    return torch.nn.Sequential(a, b, c).to(device)


def test_tune_arguments():
    import sailfish
    model = _layers()
    with pytest.raises(ValueError, match=r"on CUDA; layer 0 is on cpu"):
        sailfish.tune(model, m=[1])
    with pytest.raises(ValueError, match="no QuantLinear"):
        sailfish.tune(torch.nn.Linear(4, 4), m=[1])
    with pytest.raises(TypeError, match=r"model_or_layers\[1\] is a Linear"):
        sailfish.tune([model[0], torch.nn.Linear(4, 4)])
    with pytest.raises(ValueError, match="positive ints"):
        sailfish.tune(model, m=[0])
    with pytest.raises(ValueError, match="positive ints"):
        sailfish.tune(model, m=16)
    with pytest.raises(TypeError, match="w4a8_dtype"):
        sailfish.tune(model, m=[1], w4a8_dtype=torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the CPU walk: without TRITON_INTERPRET (set only on CPU machines) CPU layers "
                           "run the PyTorch reference and never ask the tuner; test_tune_on_gpu covers CUDA")
def test_tune_runs_each_distinct_problem_once(monkeypatch):
    """On CPU the layers take their heuristic configs; this checks the walk: one forward per
    distinct layer and M bucket, inside a tuning session."""
    import sailfish
    monkeypatch.setattr(tune_model, "_check_on_cuda", lambda name, layer: None)
    seen = []
    real_get = Tuner.get

    def spy(self, key, device, run, fallback_key=None, memo_key=None, **problem):
        seen.append((key, tuning._SESSION.active, run is not None))
        return real_get(self, key, device, run, fallback_key, memo_key, **problem)

    monkeypatch.setattr(Tuner, "get", spy)
    tuning.clear_caches()
    assert sailfish.tune(_layers(), m=[1, 3, 4, 2]) == {}  # CPU: nothing is benchmarked
    keys = [k for k, _, _ in seen]
    assert len(keys) == len(set(keys)) == 3 * 2  # (W4A16, W4A8) x M buckets {1, 2, 4}
    assert {k.split("|")[3] for k in keys} == {"M=1", "M=2", "M=4"}
    assert all(active and has_run for _, active, has_run in seen)
    assert not tuning._SESSION.active
    tuning.clear_caches()


def test_save_tuned_merges_into_a_table(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "gpu_key", lambda device: "h200")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    path = tmp_path / "t.json"
    tuning.save_tuned(str(path), {"w4a8|a": Config(16, 64, 128)}, torch.device("cuda", 0))
    tuning.save_tuned(str(path), {"w4a8|b": Config(32, 64, 128, 2)}, torch.device("cuda", 0))
    data = json.loads(path.read_text())
    assert data["gpu"] == "h200" and data["device"] == "NVIDIA H200"
    assert {k: Config(**v) for k, v in data["configs"].items()} == {
        "w4a8|a": Config(16, 64, 128), "w4a8|b": Config(32, 64, 128, 2)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tune() benchmarks on a GPU")
def test_tune_on_gpu(tmp_path, monkeypatch):
    import sailfish
    for var in ("SAILFISH_HEURISTICS_ONLY", "SAILFISH_AUTOTUNE", "SAILFISH_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    tuning.clear_caches()
    model = _layers("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # candidates a small shape cannot run
        got = sailfish.tune(model, m=[1, 16], save=str(tmp_path / "t.json"))
    assert len(got) == 4 and all(isinstance(c, Config) for c in got.values())
    table = json.loads((tmp_path / "t.json").read_text())["configs"]
    assert {k: Config(**v) for k, v in table.items()} == got
    x = torch.randn(16, 64, device="cuda").half()
    for layer in model:
        layer(x)
    assert got[w4a8_key(64, 16, 16, -1, torch.float16)] == W4A8_TUNER.lookup(
        torch.device("cuda", torch.cuda.current_device()), (64, 16, 16, -1, torch.float16, "int8"))
    tuning.clear_caches()


@pytest.mark.parametrize("cfg,match", [
    (Config(16, 64, 0), "BLOCK_K=0 must be a power of two"),
    (Config(16, 48, 64), "BLOCK_N=48 must be a power of two"),
    (Config(16, 64, 64, kernel="tiles"), "kernel='tiles' is not one of"),
    (Config(8, 64, 64), "'mma' needs BLOCK_M >= 16"),
    (Config(16, 64, 512), "BLOCK_K=512 must divide the padded K=256"),
    (Config(16, 64, 64, 5), r"SPLIT_K=5 must lie in \[1, 4\]"),
    (Config(16, 64, 64, 0), r"SPLIT_K=0 must lie in \[1, 4\]"),
])
def test_check_config(cfg, match):
    tuning.check_config(Config(16, 64, 64, 4), 256, 256)
    tuning.check_config(Config(1, 16, 128, 2, kernel="gemv"), 256, 200)  # ceil(200 / 128) = 2 tiles
    with pytest.raises(ValueError, match=match):
        tuning.check_config(cfg, 256, 256)


def test_shared_heuristics_match_the_recorded_choices():
    """gemv_heuristic / mma_heuristic as the families used them before they were shared
    (split-K: the smallest power of two giving >= 2 programs per SM, 132 SMs)."""
    sms = 132
    # 256 tiles of BN 16 -> split 2; 64 tiles -> 8 (= the 8 K tiles of BK 512)
    assert tuning.gemv_heuristic(4096, 4096, 4096, sms) == Config(1, 16, 512, 2, 8, 4, 4, kernel="gemv")
    assert tuning.gemv_heuristic(1024, 4096, 4096, sms) == Config(1, 16, 512, 8, 8, 4, 4, kernel="gemv")
    assert tuning.gemv_heuristic(64, 200, 256, sms).BLOCK_K == 256
    tiles = ((16, 64, 128, 4, 6), (32, 64, 128, 4, 4), (128, 128, 128, 8, 3))
    # 64 tiles of 64 columns -> split 8
    assert tuning.mma_heuristic(8, 4096, 4096, sms, *tiles) == Config(16, 64, 128, 8, 8, 4, 6)
    assert tuning.mma_heuristic(48, 4096, 4096, sms, *tiles) == Config(64, 64, 128, 8, 8, 4, 4)
    assert tuning.mma_heuristic(128, 1024, 4096, sms, *tiles) == Config(128, 128, 128, 16, 8, 8, 3)
    assert tuning.mma_heuristic(8, 40, 4096, sms, *tiles).BLOCK_N == 64


def test_w4a16_heuristic_m32_on_gpus(monkeypatch):
    """17 <= M <= 32 on a GPU with >= 2**25 weights: BM 32 / BN 64 / BK 128 with scale_acc,
    split until the tiles fill the SMs ~3 times (H200 measurements in ops/w4a16.py); not for
    smaller weights, a general g_idx, groups the tile cannot scale (group 64), nor in the
    interpreter (rounded weights there); every choice passes the launcher's checks."""
    from sailfish.ops import w4a16 as ops16
    monkeypatch.setattr(ops16, "sm_count", lambda index: 132)
    gpu = types.SimpleNamespace(type="cuda", index=0)

    def pick(m, n, kp, gs=128, gidx=False, dev=gpu):
        cfg = ops16.w4a16_heuristic(device=dev, M=m, N=n, Kp=kp, group_size=gs, general_gidx=gidx)
        ops16.check_w4a16_config(cfg, kp, m, gs, gidx)
        return cfg

    for (kp, n), split in {(8192, 57344): 1, (8192, 8192): 3, (14336, 4096): 6, (18944, 3584): 8,
                           (65536, 512): 8}.items():
        cfg = pick(32, n, kp, gs=-1)
        assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.SPLIT_K, cfg.scale_acc) == (32, 64, 128, split, True), cfg
    assert pick(17, 8192, 8192).scale_acc
    assert not pick(32, 4096, 4096).scale_acc  # 2**24 weights: the rounded tile
    assert not pick(32, 8192, 8192, gs=64).scale_acc
    assert not pick(32, 8192, 8192, gidx=True).scale_acc
    assert not pick(32, 8192, 8192, dev=types.SimpleNamespace(type="cpu", index=None)).scale_acc
    # 33 <= M <= 64: the BM 64 tile and its split, with scale_acc under the same conditions
    assert (pick(64, 8192, 8192).BLOCK_M, pick(64, 8192, 8192).SPLIT_K, pick(64, 8192, 8192).scale_acc) == (64, 8, True)
    assert not pick(64, 4096, 4096).scale_acc and not pick(64, 8192, 8192, gidx=True).scale_acc
    assert not pick(64, 8192, 8192, dev=types.SimpleNamespace(type="cpu", index=None)).scale_acc
    assert not pick(128, 8192, 8192).scale_acc
