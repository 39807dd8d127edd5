"""CPU-only checks of `python -m sailfish.bench`: byte models, parsing, registry, JSON schema,
the runner (with a fake timer) and an end-to-end `--quick` run in CPU correctness mode."""
import json
import os
import subprocess
import sys

import pytest
import torch

from sailfish.bench import kernels as KR
from sailfish.bench import report as RP
from sailfish.bench.__main__ import QUICK_SHAPES, parse_m, parse_shapes, run_benchmark
from sailfish.bench.timing import w4a16_min_bytes
from sailfish.bench.tune import LLAMA_SHAPES, M_LIST, RETIME, best_of_three


def test_min_bytes_models():
    k = n = 4096
    w, s = n * k // 2, 2 * n * (k // 128)
    assert w4a16_min_bytes(1, k, n, 128) == w + s + 2 * k + 2 * n
    assert w4a16_min_bytes(1, k, n, 128, zeros=True) == w + 2 * s + 2 * k + 2 * n
    assert w4a16_min_bytes(16, k, n, -1) == w + 2 * n + 2 * 16 * k + 2 * 16 * n
    assert w4a16_min_bytes(1, 4000, 8, 128) == 8 * 4000 // 2 + 2 * 8 * 32 + 2 * 4000 + 2 * 8  # ceil(K/g)
    assert KR.half_min_bytes(3, k, n) == 2 * n * k + 2 * 3 * k + 2 * 3 * n
    assert KR.int8_min_bytes(3, k, n) == n * k + 3 * k + 2 * 3 * n
    assert KR.fp8_min_bytes(3, k, n) == n * k + 3 * k + 2 * 3 * n + 8


def test_parse_shapes_and_m():
    assert parse_shapes("8b") == LLAMA_SHAPES[:4]
    assert parse_shapes("70b") == LLAMA_SHAPES[4:]
    assert parse_shapes("all") == LLAMA_SHAPES
    assert parse_shapes("4096x4096, 8192X8192") == QUICK_SHAPES
    assert parse_shapes("4096x4096,8b") == [(4096, 4096), (4096, 6144), (4096, 28672), (14336, 4096)]
    for bad in ("4096", "4096x", "ax4", "0x8", "", "13b"):
        with pytest.raises(ValueError):
            parse_shapes(bad)
    assert parse_m("all") == M_LIST
    assert parse_m("1,16,1,64") == [1, 16, 64]
    for bad in ("0", "-1", "x", ""):
        with pytest.raises(ValueError):
            parse_m(bad)


def test_registry():
    sf = [s for s in KR.REGISTRY.values() if s.kernel == "sailfish-w4a16"]
    assert {(s.dtype, s.group_size, s.sym) for s in sf} == {("fp16", 128, True), ("bf16", 128, False),
                                                            ("fp16", -1, True)}
    assert all(s.ours and s.cpu for s in sf)
    assert KR.REGISTRY[KR.BASELINE_ID].baseline
    for name in ("cublas-fp16", "cublas-bf16", "tinygemm", "gemlite", "marlin", "cublas-int8", "cublas-fp8"):
        assert KR.select([name]), name
    assert len(KR.select(["sailfish-w4a16"])) == 3
    assert KR.select(["sailfish-w4a16/bf16/g128/asym"]) == [s for s in sf if s.dtype == "bf16"]
    with pytest.raises(ValueError):
        KR.select(["qqq"])
    assert KR.REGISTRY["marlin/fp16/g128"].optional


def test_marlin_row_unavailable_without_a_build(monkeypatch):
    """Marlin's row is optional: without an importable marlin_cuda it says why and its
    builder skips, never failing the run."""
    import sys

    monkeypatch.setitem(sys.modules, "marlin_cuda", None)  # import raises ImportError
    why = KR.marlin_available()
    assert why and "marlin_cuda" in why
    ctx = KR.BuildContext(device=torch.device("cpu"), copies=lambda nb: 2)
    with pytest.raises(KR.Skip):
        KR.build_marlin(256, 256, ctx)
    with pytest.raises(ValueError):
        KR.register(KR.REGISTRY[KR.BASELINE_ID])
    unquantized = [s for s in KR.REGISTRY.values() if s.kernel.startswith("cublas")]
    assert all(s.group_size == 0 for s in unquantized)


def test_sailfish_builder_bytes_on_cpu():
    ctx = KR.BuildContext(device=torch.device("cpu"), copies=lambda nb: 2)
    for spec in KR.select(["sailfish-w4a16"]):
        built = spec.builder(256, 128, ctx)
        assert built.copies == 2
        case = built.case(4)
        assert len(case.calls) == 2
        zeros = not spec.sym
        assert case.min_bytes == w4a16_min_bytes(4, 256, 128, spec.group_size, zeros=zeros)


def _fake_timer(calls):
    for c in calls:
        c()
    return 10.0 * len(calls)  # deterministic "us per call" * R so rows differ by R


def test_runner_with_fake_timer():
    specs = KR.select(["cublas-fp16", "cublas-int8"])
    ctx = KR.BuildContext(device=torch.device("cpu"), copies=lambda nb: 3)
    shapes, ms = [(256, 128)], [1, 32]
    prog = RP.Progress(len(shapes) * len(ms) * len(specs), stream=open(os.devnull, "w"))
    res = run_benchmark(specs, shapes, ms, ctx=ctx, timer=_fake_timer, hbm_gbps=100.0,
                        base_spec=specs[0], report_base=True, prog=prog)
    assert not res.failures
    rows = {(r["kernel"], r["M"]): r for r in res.rows}
    for m in ms:
        b = rows[("cublas-fp16", m)]
        assert b["time_us"] == 30.0 and b["speedup_vs_fp16"] == 1.0
        assert b["gbps"] == pytest.approx(KR.half_min_bytes(m, 256, 128) / 30.0e3)
        assert b["roofline"] == pytest.approx(b["gbps"] / 100.0)
        if ("cublas-int8", m) in rows:  # _int_mm may refuse small M on some builds
            assert rows[("cublas-int8", m)]["gbps"] == pytest.approx(KR.int8_min_bytes(m, 256, 128) / 30.0e3)
    assert all(c["ok"] for c in res.checks)
    RP.add_limit_fractions(res.rows, 100.0)
    best_half = max(2 * m * 256 * 128 / 30.0 for m in ms)  # flop per us of the fp16 rows
    for m in ms:
        b = rows[("cublas-fp16", m)]
        hbm_us = KR.half_min_bytes(m, 256, 128) / (100.0 * 1e3)
        assert b["limit_fraction"] == pytest.approx(max(hbm_us, 2 * m * 256 * 128 / best_half) / 30.0)
    # a probe rate (timing.tensor_core_peaks) above the rows' own rates is the P; below, the rows'
    for probe in (10 * best_half, best_half / 10):
        RP.add_limit_fractions(res.rows, 100.0, {"half": probe})
        p = max(probe, best_half)
        for m in ms:
            b = rows[("cublas-fp16", m)]
            hbm_us = KR.half_min_bytes(m, 256, 128) / (100.0 * 1e3)
            assert b["limit_fraction"] == pytest.approx(max(hbm_us, 2 * m * 256 * 128 / p) / 30.0)
    doc = RP.build_document({"gpu": "fake", "torch": torch.__version__, "triton": "x", "hbm_gbps": 100.0},
                            res.rows, {"command": "python -m sailfish.bench"})
    assert RP.validate_document(doc) == []
    assert list(doc)[:5] == list(RP.TOP_KEYS)
    assert all(list(r) == list(RP.ROW_KEYS) for r in doc["rows"])
    table = RP.summary_table(res.rows, res.base_us, ["int8 cublas"])
    assert "| 256x128 | 1 | 30.0 |" in table


def test_wrong_kernel_is_not_timed():
    def bad_builder(k, n, ctx):
        w = torch.randn(n, k)
        case = KR.Case(calls=[lambda: None], check=lambda: 0.5, tol=1e-3, min_bytes=1)
        return KR.Built(case=lambda m: case, copies=1, weight_bytes=w.numel() * 4)

    spec = KR.KernelSpec("bad", "fp16", 0, bad_builder, ours=True)
    timed = []
    prog = RP.Progress(1, stream=open(os.devnull, "w"))
    res = run_benchmark([spec], [(16, 8)], [1], ctx=KR.BuildContext(torch.device("cpu"), lambda nb: 1),
                        timer=lambda calls: timed.append(1) or 1.0, hbm_gbps=1.0, base_spec=spec,
                        report_base=True, prog=prog)
    assert not timed and not res.rows and res.failures and res.checks[0]["ok"] is False


def test_tuner_retimes_the_fastest_and_the_shipped_config():
    """bench.tune.best_of_three: the RETIME fastest and the shipped config (wherever it ranks)
    are timed twice more and keep their best of three; the rest keep their one timing."""
    first = [(float(i + 1), f"c{i}") for i in range(RETIME + 3)]  # c0 fastest
    later = {"c1": [0.5, 0.7]}  # c1 turns out fastest
    shipped = f"c{RETIME + 2}"  # the slowest at first
    later[shipped] = [RETIME + 9.0, 1.5]
    calls = []

    def time(cfg):
        calls.append(cfg)
        return later.get(cfg, [99.0, 99.0])[calls.count(cfg) - 1]

    got = best_of_three(first, shipped, time)
    assert sorted(calls) == sorted([f"c{i}" for i in range(RETIME)] * 2 + [shipped] * 2)
    assert [c for _, c in got][:3] == ["c1", "c0", shipped] and got[0][0] == 0.5 and got[2][0] == 1.5
    assert dict((c, t) for t, c in got)[f"c{RETIME}"] == RETIME + 1.0  # not timed again
    calls.clear()  # the shipped config among the fastest: timed twice more, once
    best_of_three(first, "c0", time)
    assert sorted(calls) == sorted([f"c{i}" for i in range(RETIME)] * 2)


def test_merge_later_runs_replace_rows():
    from sailfish.bench.merge import merge

    def row(kernel, m, t):
        return {"kernel": kernel, "K": 64, "N": 32, "M": m, "dtype": "fp16", "group_size": 128,
                "time_us": t, "gbps": 1.0, "roofline": 0.5, "speedup_vs_fp16": 1.0}

    a = {"gpu": "h200", "hbm_gbps": 4000.0, "command": "run a", "rows": [row("x", 1, 10.0), row("x", 16, 20.0),
                                                                      row("y", 1, 30.0)]}
    b = {"gpu": "h200", "hbm_gbps": 4200.0, "command": "run b", "rows": [row("x", 16, 15.0), row("x", 64, 40.0)]}
    doc = merge([a, b])
    assert [(r["kernel"], r["M"], r["time_us"]) for r in doc["rows"]] == [
        ("x", 1, 10.0), ("x", 16, 15.0), ("y", 1, 30.0), ("x", 64, 40.0)]
    assert doc["hbm_gbps"] == 4100.0 and doc["command"] == "run a && run b"
    # a merged file merged again keeps its runs (and their environment) separate
    c = {"gpu": "h200", "hbm_gbps": 4300.0, "command": "run c", "env": {"SAILFISH_AUTOTUNE": "0"},
         "rows": [row("y", 1, 25.0)]}
    again = merge([doc, c])
    assert [r["command"] for r in again["runs"]] == ["run a", "run b", "run c"]
    assert again["runs"][2]["env"] == {"SAILFISH_AUTOTUNE": "0"}
    assert again["hbm_gbps"] == pytest.approx((4000 + 4200 + 4300) / 3) and [r["time_us"] for r in again["rows"]] == [10.0, 15.0, 25.0, 40.0]
    with pytest.raises(ValueError, match="different GPUs"):
        merge([a, dict(b, gpu="h100")])


def test_schema_validation_catches_extra_keys():
    row = dict.fromkeys(RP.ROW_KEYS, 1)
    row.update(kernel="k", dtype="fp16", extra=3)
    doc = {"gpu": "g", "torch": "t", "triton": "t", "hbm_gbps": 1.0, "rows": [row]}
    assert RP.validate_document(doc)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="tests the CPU (interpreter) mode; GPU images may carry an older Triton "
                           "whose interpreter cannot run the kernels (seen: triton 3.6)")
def test_quick_cpu_end_to_end(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "sailfish.bench", "--quick", "--out-dir", str(tmp_path),
                           "--name", "cpu"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "correctness" in proc.stdout.lower()
    doc = json.loads((tmp_path / "cpu.json").read_text())
    assert RP.validate_document(doc) == []
    assert doc["mode"] == "correctness only" and doc["hbm_gbps"] is None
    assert doc["command"].startswith("python -m sailfish.bench --quick")
    # 2 shapes x 2 M x (3 W4A16 + 4 W4A8 configurations)
    assert len(doc["rows"]) == 2 * 2 * 7 and all(r["time_us"] is None for r in doc["rows"])
    assert {r["kernel"] for r in doc["rows"]} == {"sailfish-w4a16", "sailfish-w4a8", "sailfish-w4a8-gemm"}
    assert doc["checks"] and all(c["ok"] for c in doc["checks"])
    assert not list(tmp_path.glob("*.png"))


def test_overhead_refuses_without_cuda(monkeypatch, capsys):
    from sailfish.bench import overhead
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert overhead.main([]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_overhead_summary_pairs_rows_by_round():
    """`over F.linear` is the median of the per-round differences (paired, so a slow round
    reaches both rows), not the difference of the medians."""
    from sailfish.bench.overhead import summarize
    times = {"F.linear": [10.0, 30.0, 11.0, 50.0, 12.0], "layer": [14.0, 35.0, 15.0, 53.0, 40.0]}
    rows = summarize(times)
    assert rows["layer"]["host_us_over_base"] == 4.0  # differences 4, 5, 4, 3, 28
    assert rows["layer"]["host_us_median"] == 35.0 and rows["F.linear"]["host_us_over_base"] == 0.0
    assert rows["layer"]["host_us_p90"] == 40.0  # sorted [14, 15, 35, 40, 53], index int(0.9 * 4) = 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check of the callables")
def test_overhead_rows_compute_the_layer():
    """Every row of `python -m sailfish.bench.overhead` runs and computes its layer's output
    (checked here on CPU through the interpreter, at a small shape)."""
    from sailfish.bench.overhead import callables
    rows = dict(callables(256, 64, 1, torch.float16, 128, device="cpu"))
    ref = rows["F.linear"]()
    x_q, x_s = rows.pop("W4A8 quantize op")()
    assert x_q.shape == (1, 256) and x_s.shape == (1,)
    for name, fn in rows.items():
        y = fn()
        assert y.shape == (1, 64), name
        assert (y.float() - ref.float()).norm() / ref.float().norm() < 0.2, name  # 4-bit weights
