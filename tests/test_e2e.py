"""`python -m sailfish.bench.e2e`: argument handling, the derived numbers, the model helpers
(shared copies, the dequantized reference, the decoder against an uncached forward, the
agreement measure) and whole runs: the CPU check (tiny Llama, every variant, JSON and PNG) and,
on a GPU, the tiny model through all three modes."""
import copy
import io
import json
import os

import pytest
import torch
from torch import nn

from sailfish import QuantLinear, QuantLinearW4A8
from sailfish.bench import e2e as E
from sailfish.bench import llama as L
from sailfish.bench import report as RP


@pytest.fixture(autouse=True)
def _keep_interpreter_setting(monkeypatch):
    """The CPU mode sets TRITON_INTERPRET=1 when it is unset (right for the CLI process); in
    a test process on a GPU machine that would switch every later kernel launch of the worker
    to the interpreter. Pin the variable to its current state for each test."""
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))


CPU = torch.device("cpu")


def _settings(argv, cuda=False):
    ap = E.build_parser()
    return E.resolve(ap.parse_args(argv), cuda, ap)


def test_parse_helpers():
    assert E.parse_ints("16, 1,16,64", "batch") == [16, 1, 64]  # (shared with sailfish.bench)
    for bad in ("0", "-1", "x", "", "1.5"):
        with pytest.raises(ValueError, match="batch"):
            E.parse_ints(bad, "batch")
    assert E.parse_names("all", list(L.VARIANTS), "variant") == list(L.VARIANTS)
    assert E.parse_names("w4a8,fp16", list(L.VARIANTS), "variant") == ["fp16", "w4a8"]  # run order
    with pytest.raises(ValueError, match="int3"):
        E.parse_names("fp16,int3", list(L.VARIANTS), "variant")


def test_resolve_defaults_and_errors():
    s = _settings([])
    assert (s.model, s.layers, s.batches, s.modes, s.context) == ("tiny", 2, [1, 2], ["eager"], 32)
    g = _settings([], cuda=True)
    assert (g.model, g.layers, g.batches, g.modes, g.context, g.prefill) == (
        "8b", 32, [1, 4, 16, 64], list(E.DEFAULT_MODES), 1024, 2048)
    assert g.budget_s == E.GPU_BUDGET_S and not g.extrapolated
    q = _settings(["--quick"], cuda=True)
    assert (q.layers, q.batches, q.variants, q.extrapolated) == (4, [1, 16], ["fp16", "w4a16", "w4a8"], True)
    assert _settings(["--model", "70b"], cuda=True).layers == E.DEFAULT_70B_LAYERS
    for argv in (["--context", "8"], ["--layers", "3"], ["--layers", "0"], ["--steps", "0"],
                 ["--replays", "2"], ["--batches", "0"], ["--modes", "fast"]):
        with pytest.raises(SystemExit):
            _settings(argv)
    with pytest.raises(SystemExit):
        _settings(["--model", "8b", "--layers", "33"], cuda=True)
    # file names: runs of different subsets do not overwrite each other
    assert E.default_name("h200", g) == "e2e_h200_8b" and g.variants == list(L.DEFAULT_VARIANTS)
    assert "w4a16-unfused" not in g.variants and "w4a16-unfused" in _settings(["--variants", "all"]).variants
    assert E.default_name("h100", q) == "e2e_h100_8b_L4_fp16-w4a16-w4a8"
    sub = _settings(["--variants", "w4a8,fp16", "--modes", "compile", "--model", "70b"], cuda=True)
    assert E.default_name("h200", sub) == "e2e_h200_70b_L8_fp16-w4a8_compile"


def test_derive_extrapolates_and_compares():
    s = _settings(["--model", "8b", "--layers", "4"])
    res = E.Results()
    res.decode = [dict(variant="fp16", mode="graph", batch=2, step_us=1000.0),
                  dict(variant="w4a16", mode="graph", batch=2, step_us=500.0),
                  dict(variant="w4a16", mode="eager", batch=2, step_us=800.0)]
    res.split = [dict(variant="fp16", batch=2, linears_us=700.0, head_us=100.0),
                 dict(variant="w4a16", batch=2, linears_us=300.0, head_us=100.0)]
    res.prefill = [dict(variant="fp16", tokens=64, time_us=2000.0), dict(variant="w4a16", tokens=64, time_us=4000.0)]
    E.derive(res, s)
    fp, w, we = res.decode
    assert fp["per_layer_us"] == pytest.approx(900 / 4) and fp["whole_model_us"] == pytest.approx(100 + 225 * 32)
    assert w["whole_model_us"] == pytest.approx(100 + 100 * 32) and w["extrapolated"]
    assert w["tokens_per_s"] == pytest.approx(2e6 / 3300)
    assert w["speedup_vs_fp16"] == pytest.approx(7300 / 3300) and w["speedup_vs_bf16"] is None
    assert we["speedup_vs_fp16"] is None                    # no fp16 eager row to compare with
    assert we["whole_model_us"] == pytest.approx(100 + 700 / 4 * 32)  # head from the split of its batch
    assert res.split[0]["rest_us"] == pytest.approx(200.0) and res.split[1]["step_graph_us"] == 500.0
    assert res.prefill[1]["speedup_vs_fp16"] == pytest.approx(0.5)
    assert res.prefill[0]["tokens_per_s"] == pytest.approx(64e6 / 2000)
    # the whole model is the step itself when no layer is cut
    full = _settings(["--model", "tiny"])
    r = dict(variant="fp16", mode="graph", batch=1, step_us=300.0)
    E.derive(E.Results(decode=[r], split=[dict(variant="fp16", batch=1, linears_us=1.0, head_us=50.0)]), full)
    assert r["whole_model_us"] == pytest.approx(300.0) and not r["extrapolated"]


@pytest.fixture(scope="module")
def tiny():
    return L.build_model(L.MODELS["tiny"], 2, CPU, seed=0)


def test_variants_share_the_base_and_reference_holds_dequantized_weights(tiny):
    base_linear = tiny.model.layers[0].mlp.down_proj
    before = base_linear.weight.clone()
    q = L.make_variant(tiny, L.VARIANTS["w4a16"])
    assert L.make_variant(tiny, L.VARIANTS["fp16"]) is tiny
    with pytest.raises(ValueError, match="bfloat16"):
        L.make_variant(tiny, L.VARIANTS["bf16"])
    # the base is untouched; the unquantized tensors are shared, not copied
    assert tiny.model.layers[0].mlp.down_proj is base_linear and torch.equal(base_linear.weight, before)
    assert q.get_input_embeddings().weight.data_ptr() == tiny.get_input_embeddings().weight.data_ptr()
    assert type(q.lm_head) is nn.Linear and q.lm_head.weight.data_ptr() == tiny.lm_head.weight.data_ptr()
    lins = L.decoder_linears(q)  # q/k/v and gate/up fused: 4 layers per decoder layer
    assert len(lins) == 2 * 4 and all(isinstance(m, QuantLinear) for _, m in lins)
    assert [n for n, _ in lins[:4]] == ["0.self_attn.o_proj", "0.self_attn.qkv_proj", "0.mlp.down_proj",
                                        "0.mlp.gate_up_proj"]
    unfused = L.decoder_linears(L.make_variant(tiny, L.VARIANTS["w4a16-unfused"]))
    assert len(unfused) == 2 * 7 and all(type(m) is QuantLinear for _, m in unfused)
    assert L.tensor_bytes(q) < L.tensor_bytes(tiny)
    ref = L.dequantized_reference(q)
    for (name, m), (rname, r) in zip(lins, L.decoder_linears(ref)):
        assert name == rname and type(r) is nn.Linear and r.weight.dtype == torch.float16
        assert torch.equal(r.weight, m.dequantize().half())
    assert isinstance(q.model.layers[0].mlp.down_proj, QuantLinear)  # the variant keeps its layers
    q8 = L.make_variant(tiny, L.VARIANTS["w4a8"])
    assert all(isinstance(m, QuantLinearW4A8) for _, m in L.decoder_linears(q8))
    assert len(L.decoder_linears(q8)) == 2 * 4 and len(L.decoder_linears(
        L.make_variant(tiny, L.VARIANTS["w4a8-unfused"]))) == 2 * 7


def test_decoder_matches_an_uncached_forward(tiny):
    model = copy.deepcopy(tiny).float()  # a float32 copy: a tight comparison
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(model.config.vocab_size, (2, 5), generator=gen)
    with torch.no_grad():
        dec = L.Decoder(model, batch=2, context=16)
        assert dec.position() == 0
        first = dec.forward(prompt)
        dec.ids.copy_(first.argmax(-1, keepdim=True))
        seq = torch.cat([prompt, dec.ids], 1)
        logits = dec.step()  # decodes at position 5 and writes its argmax into ids
        assert dec.position() == 6
        full = model(input_ids=seq, use_cache=False).logits[:, -1]
        torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
        assert torch.equal(dec.ids[:, 0], full.argmax(-1))
        dec.seek(3)
        assert dec.position() == 3
        with pytest.raises(ValueError, match="position"):
            dec.seek(16)


def test_decode_step_never_reads_the_device_on_the_host(tiny, monkeypatch):
    """What lets one CUDA graph hold the step: transformers' Llama with a StaticCache and the
    Decoder never turn a tensor into a Python value during a decode step (the prompt forward
    does: the control check below)."""
    reads = []

    def trap(name):
        orig = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            reads.append(name)
            return orig(self, *args, **kwargs)
        return read

    dec = L.Decoder(tiny, batch=2, context=16)
    dec.seek(8)
    with torch.no_grad():
        dec.step()  # first call: lazy set-up is allowed to read
        for name in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, trap(name))
        dec.step()
        dec.step()
        assert reads == []
        L.Decoder(tiny, batch=2, context=16).forward(torch.zeros(2, 4, dtype=torch.long))
        assert reads  # the trap works: the prompt's mask check reads a tensor


def test_greedy_agreement_detects_a_different_model(tiny):
    with torch.no_grad():
        same = L.greedy_agreement(tiny, L.shared_copy(tiny), batch=2, prompt=4, steps=2)
        assert same["agreement"] == 1.0 and same["logits_rel_err"] == 0.0 and same["tokens_compared"] == 6
        other = L.shared_copy(tiny)
        other.lm_head = nn.Linear(128, 512, bias=False, dtype=torch.float16)
        other.lm_head.weight.data.copy_(tiny.lm_head.weight.roll(1, dims=0))  # every logit moves by one token
        diff = L.greedy_agreement(tiny, other, batch=2, prompt=4, steps=2)
        assert diff["agreement"] < 0.5 and diff["logits_rel_err"] > 0.5
        alone = L.greedy_agreement(tiny, None, batch=1, prompt=4, steps=1)
        assert alone["logits_finite"] and alone["agreement"] is None


def test_progress_uses_tqdm_on_a_terminal():
    pytest.importorskip("tqdm")

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    prog = RP.Progress(3, stream=out)
    assert prog._tqdm is not None
    prog.set_status("w4a16 eager batch 1")
    prog.line("a finished row", counted=True)
    prog.step(2)
    prog.close()
    text = out.getvalue()
    assert "a finished row\n" in text and "2/3" in text and "w4a16 eager batch 1" in text
    log = io.StringIO()  # not a terminal: no bar, counted lines prefixed
    prog = RP.Progress(3, stream=log)
    prog.line("row", counted=True)
    prog.step()
    prog.close()
    assert log.getvalue() == "[1/3] row\n"


def _check_document(doc, variants, modes, batches):
    for key in ("command", "date", "gpu", "torch", "triton", "transformers", "model", "settings"):
        assert doc[key], key
    assert doc["benchmark"] == "sailfish.bench.e2e" and not doc["partial"] and not doc["errors"]
    assert set(doc["variants"]) == set(variants)
    for name, v in doc["variants"].items():
        assert v["weight_bytes"] > v["decoder_linear_bytes"] > 0
        if L.VARIANTS[name].quant is not None:
            assert v["quantized_layers"] == 7 * doc["model"]["layers"] and "lm_head" in v["skipped_layers"]
            fused = L.VARIANTS[name].quant.get("fuse", True)
            assert len(v["fused_layers"]) == (2 * doc["model"]["layers"] if fused else 0) and not v["not_fused"]
    # (at the tiny model's K = 128 the packing pads K to 256: less than the 4x of real shapes)
    assert doc["variants"]["w4a16"]["decoder_linear_bytes"] < doc["variants"]["fp16"]["decoder_linear_bytes"] * 0.6
    got = {(r["variant"], r["mode"], r["batch"]) for r in doc["decode"]}
    assert got == {(v, m, b) for v in variants for m in modes for b in batches}
    for r in doc["decode"]:
        assert r["step_us"] > 0 and r["tokens_per_s"] > 0 and r["whole_model_us"] > 0
        assert r["speedup_vs_fp16"] is not None
    assert {r["variant"] for r in doc["prefill"]} == set(variants)
    checks = {c["variant"]: c for c in doc["correctness"]}
    assert set(checks) == set(variants) and all(c["ok"] and c["logits_finite"] for c in checks.values())
    for name in variants:
        c = checks[name]
        if L.VARIANTS[name].quant is None:
            assert c["agreement"] is None
        else:
            assert 0.0 <= c["agreement"] <= 1.0 and c["tokens_compared"] == c["batch"] * (c["steps"] + 1)
            assert c["logits_rel_err"] < (0.05 if name == "w4a8" else 1e-2)
    return checks


def test_budget_skips_what_does_not_fit(tmp_path, capsys):
    rc = E.main(["--device", "cpu", "--budget-s", "0.001", "--variants", "fp16,w4a16", "--out-dir", str(tmp_path),
                 "--name", "b"])
    assert rc == 2, capsys.readouterr().out[-2000:]  # nothing ran
    doc = json.loads((tmp_path / "b.json").read_text())
    assert not doc["decode"] and not doc["errors"] and doc["settings"]["budget_s"] == 0.001
    skipped = [(k["variant"], k["unit"], k["batch"]) for k in doc["skipped"]]
    per_variant = [("build", None), ("eager", 1), ("eager", 2), ("prefill", None), ("check", None)]
    assert skipped == [(v, u, b) for v in ("fp16", "w4a16") for u, b in per_variant]
    assert doc["skipped"][0]["reason"].startswith("budget") and "build" in doc["skipped"][1]["reason"]


def test_cpu_check_end_to_end(tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        # GPU images may carry a Triton whose interpreter cannot run the kernels (see
        # test_bench): there the CPU check runs the PyTorch reference ops.
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    # One of the tiny model's two layers: half the interpreter time, and the extrapolation path.
    rc = E.main(["--device", "cpu", "--layers", "1", "--out-dir", str(tmp_path), "--name", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "MEANINGLESS" in out and "reproduce: python -m sailfish.bench.e2e --device cpu --layers 1" in out
    doc = json.loads((tmp_path / "cpu.json").read_text())
    assert doc["device"] == "cpu" and doc["timings_meaningful"] is False
    assert doc["command"] == f"python -m sailfish.bench.e2e --device cpu --layers 1 --out-dir {tmp_path} --name cpu"
    assert doc["model"]["hidden"] == 128 and doc["model"]["layers"] == 1 and doc["model"]["model_layers"] == 2
    assert doc["model"]["extrapolated"] and all(r["extrapolated"] for r in doc["decode"])
    for r in doc["decode"]:  # no head timing on the CPU: whole model = step / 1 layer x 2 layers
        assert r["whole_model_us"] == pytest.approx(2 * r["step_us"]) and r["per_layer_us"] == r["step_us"]
    checks = _check_document(doc, list(L.DEFAULT_VARIANTS), ["eager"], [1, 2])
    assert checks["w4a16"]["min_agreement"] == E.MIN_AGREEMENT_W4A16 and checks["w4a8"]["min_agreement"] is None
    assert not doc["split"] and all(r["transient_bytes"] is None for r in doc["decode"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "cpu_tokens.png").stat().st_size > 1000


def test_gpu_code_paths_with_fake_graphs(monkeypatch):
    """The graph, split and compile units, the extrapolation and the tables, on the CPU: a
    fake graph timer calls the step as often as capture and replays would (so the cache
    positions advance as on a GPU), torch.compile gets its eager backend (dynamo still traces
    the whole step with fullgraph=True), the Sailfish ops run their PyTorch reference."""
    from sailfish.bench import timing as T

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    graphs = []

    def fake_graph_time_us(calls, replays=20, warmup=2):
        for _ in range(1 + warmup + replays):  # side-stream warm-up, warm-up and timed replays
            for c in calls:
                c()
        graphs.append(len(calls))
        if len(calls) > 1:
            return 10.0  # per call: the linear layers
        return 400.0 if getattr(calls[0], "__name__", "") == "head_fn" else 1000.0  # the head, a step

    cpu_times = T.call_times_us
    monkeypatch.setattr(T, "graph_time_us", fake_graph_time_us)
    monkeypatch.setattr(T, "call_times_us", lambda fn, n, cuda, before=None: cpu_times(fn, n, False, before))
    monkeypatch.setattr(T, "transient_bytes", lambda fn, cuda: fn() is None or 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: compile_(fn, backend="eager", **kw))
    variants = ["fp16", "w4a16", "w4a16-unfused", "w4a8"]
    s = _settings(["--model", "tiny", "--layers", "1", "--batches", "2", "--variants", ",".join(variants),
                   "--context", "40", "--prefill", "16", "--warmup", "1", "--steps", "2", "--replays", "3",
                   "--check-batch", "2", "--check-steps", "2", "--check-prompt", "8"], cuda=True)
    runner = E.Runner(s, CPU, RP.Progress(E.progress_total(s), stream=io.StringIO()), save=lambda: None)
    with torch.no_grad():
        runner.run()
    res = runner.res
    assert not res.errors and not res.skipped
    vs = {c["variant"]: c.get("vs_unfused") for c in res.correctness}  # fused variants only
    assert vs["fp16"] is None and vs["w4a16-unfused"] is None
    assert all(0.0 <= vs[v]["agreement"] <= 1.0 and vs[v]["logits_rel_err"] < 1e-2 for v in ("w4a16", "w4a8"))
    assert "with the unfused model" in E.correctness_line(next(c for c in res.correctness if c["variant"] == "w4a16"))
    assert runner.prog.done == runner.prog.total == 4 * 2 + 4 * 4 + 4 * 2  # builds, measure and compile units
    assert {(r["variant"], r["mode"]) for r in res.decode} == {(v, m) for v in variants for m in E.DEFAULT_MODES}
    assert all(r["fullgraph"] for r in res.decode if r["mode"] == "compile")
    # per variant, one graph of the decoder's linear layers (1 layer): 7 in fp16 and unfused, 4 fused
    assert graphs.count(7) == 2 and graphs.count(4) == 2
    E.derive(res, s)
    graph_row = next(r for r in res.decode if r["mode"] == "graph" and r["variant"] == "w4a16")
    split = next(r for r in res.split if r["variant"] == "w4a16")
    assert split["linears_us"] == 40.0 and split["head_us"] == 400.0  # 4 linears x 10 us
    assert split["step_graph_us"] == 1000.0 and split["rest_us"] == 1000.0 - 40.0 - 400.0
    # 1 of the tiny model's 2 layers: per layer = step - head, whole = head + 2 layers
    assert graph_row["per_layer_us"] == 600.0 and graph_row["whole_model_us"] == 1600.0
    assert graph_row["extrapolated"] and graph_row["tokens_per_s"] == pytest.approx(2e6 / 1600)
    text = E.summary(res, s)
    assert "Split of the graph step" in text and "compile: ms" in text and "Prefill" in text
    assert "under half of the step (the rest dominates) for: fp16 b=2, w4a16 b=2, w4a16-unfused b=2, w4a8 b=2" in text


def test_generate_mode_times_transformers_generate(tiny, monkeypatch):
    """The generate mode runs model.generate() itself with cache_implementation="static" (a
    StaticCache of --context tokens) and times a token as the difference of a long and a short
    call; it needs room in the cache for both."""
    calls = []
    generate = type(tiny).generate

    def spy(self, *a, **kw):
        calls.append(kw["max_new_tokens"])
        assert kw["min_new_tokens"] == kw["max_new_tokens"] and not kw["do_sample"]
        assert kw["cache_implementation"] == "static" and kw["max_cache_len"] == 32
        return generate(self, *a, **kw)

    monkeypatch.setattr(type(tiny), "generate", spy)
    s = _settings(["--modes", "generate", "--gen-tokens", "3", "--context", "32"])
    runner = E.Runner(s, CPU, RP.Progress(1, stream=io.StringIO()), save=lambda: None)
    with torch.no_grad():
        out = runner.generate(tiny, 2)
    assert calls == [E.GEN_SHORT + 3] * 4 + [E.GEN_SHORT] * 3  # warm-up, long, short (CPU: 1, 3, 3)
    assert out["step_us"] > 0 and out["compiled_by_generate"] is False
    assert out["stop_check"] == ("deferred a step (sailfish Generate)" if "generate" in tiny.__dict__
                                 else "every token (transformers)")
    assert E.last_pass(s) == [("generate", 1), ("generate", 2)]
    for argv in (["--gen-tokens", "30", "--context", "32"], ["--layers", "1"]):
        with pytest.raises(SystemExit):
            _settings(["--modes", "generate"] + argv)  # no room in the cache; extrapolated


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture, torch.compile)")
def test_tiny_model_all_modes_on_gpu(tmp_path, capsys):
    variants = ["fp16", "w4a16", "w4a8"]
    rc = E.main(["--model", "tiny", "--batches", "2", "--variants", ",".join(variants), "--context", "64",
                 "--prefill", "32", "--budget-s", "0", "--modes", "all", "--gen-tokens", "8",
                 "--out-dir", str(tmp_path), "--name", "gpu"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    doc = json.loads((tmp_path / "gpu.json").read_text())
    assert doc["timings_meaningful"] is True and doc["device"] == "cuda"
    _check_document(doc, variants, list(E.MODES), [2])
    assert {(r["variant"], r["batch"]) for r in doc["split"]} == {(v, 2) for v in variants}
    assert all(r["transient_bytes"] is not None for r in doc["decode"] if r["mode"] == "eager")
    assert all(r["compile_s"] > 0 for r in doc["decode"] if r["mode"] == "compile")
    assert all(r["compiled_by_generate"] and r["step_us"] > 0 for r in doc["decode"] if r["mode"] == "generate")


def test_moe_model_cpu_check(tmp_path, capsys):
    """The Qwen3-MoE-shaped model: bf16 against W4A16 bf16 by default, every experts module a
    QuantExperts, and the correctness line against transformers' own experts code holding the
    dequantized experts."""
    rc = E.main(["--device", "cpu", "--model", "tiny-moe", "--batches", "1", "--prefill", "0",
                 "--check-steps", "1", "--out-dir", str(tmp_path), "--name", "moe", "--no-plots"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    doc = json.loads((tmp_path / "moe.json").read_text())
    assert doc["settings"]["variants"] == list(L.MOE_DEFAULT_VARIANTS)
    assert doc["variants"]["w4a16-bf16"]["experts_modules"] == L.MODELS["tiny-moe"].layers
    check = next(c for c in doc["correctness"] if c["variant"] == "w4a16-bf16")
    assert check["ok"] and check["agreement"] >= 0.9 and check["logits_rel_err"] < 1e-2
    assert "vs bf16" in out


def test_deepseek_model_cpu_check(tmp_path, capsys):
    """The DeepSeek-V2-shaped model (multi-head latent attention, whose cache the Decoder allocates
    with one forward; a dense first layer; shared experts): W4A16 folds every MoE block's shared
    MLP into its QuantExperts, and the correctness line holds against transformers' own block
    code holding the dequantized weights."""
    rc = E.main(["--device", "cpu", "--model", "tiny-deepseek", "--batches", "1", "--prefill", "0",
                 "--check-steps", "1", "--out-dir", str(tmp_path), "--name", "ds", "--no-plots"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    doc = json.loads((tmp_path / "ds.json").read_text())
    shape = L.MODELS["tiny-deepseek"]
    info = doc["variants"]["w4a16-bf16"]
    assert info["experts_modules"] == shape.layers - shape.dense_layers
    assert info["shared_experts_folded"] == [f"model.layers.{i}.mlp" for i in range(shape.dense_layers, shape.layers)]
    check = next(c for c in doc["correctness"] if c["variant"] == "w4a16-bf16")
    assert check["ok"] and check["agreement"] >= 0.9 and check["logits_rel_err"] < 1e-2


def test_moe_split_times_the_experts(monkeypatch):
    from sailfish.bench import timing as T
    from sailfish.moe import QuantExperts

    timed = []

    def fake_graph_time_us(calls, replays=20, warmup=2):
        for c in calls:
            c()
        timed.append(len(calls))
        return 10.0

    monkeypatch.setattr(T, "graph_time_us", fake_graph_time_us)
    s = _settings(["--model", "tiny-moe", "--batches", "2", "--variants", "bf16,w4a16-bf16", "--context", "40",
                   "--replays", "3"], cuda=True)
    runner = E.Runner(s, CPU, RP.Progress(1, stream=io.StringIO()), save=lambda: None)
    base = L.build_model(L.MODELS["tiny-moe"], 2, CPU, seed=0).to(torch.bfloat16)
    q = L.make_variant(base, L.VARIANTS["w4a16-bf16"])
    assert len(L.decoder_experts(q)) == 2 and all(isinstance(m, QuantExperts) for m in L.decoder_experts(q))
    with torch.no_grad():
        out = runner.split(q, 2)
    assert out["experts_calls"] == 2 and out["experts_us"] == 20.0 and timed[1] == 2
    E.derive(E.Results(split=[dict(variant="w4a16-bf16", batch=2, **out)]), s)  # (no graph row: no rest)
