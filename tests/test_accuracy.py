"""sailfish.bench.accuracy: the real-text perplexity script, in its --smoke size (CPU)."""
import json
import math

import pytest

pytest.importorskip("transformers")


def test_accuracy_smoke(tmp_path, monkeypatch):
    """Every variant trains, quantizes and evaluates; the JSON holds them all, fp16's ratio is 1."""
    from sailfish.bench import accuracy
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch reference ops on the CPU
    out = tmp_path / "smoke.json"
    accuracy.main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["results"]] == list(accuracy.VARIANTS)
    assert all(math.isfinite(r["ppl"]) and r["ppl"] > 1 for r in result["results"])
    assert result["results"][0]["ppl_vs_fp16"] == 1.0
    assert all("gptq_error_sum" in r for r in result["results"] if "gptq" in r["variant"] or "qqq" in r["variant"])
    c = result["corpus"]
    assert c["train_files"] and c["held_out_files"] and c["train_bytes"] > c["held_out_bytes"] > 0


def test_split_is_by_file_name():
    """The held-out files are those whose relative path hashes to 0 mod 10: the same on every run."""
    from sailfish.bench import accuracy
    a, b = accuracy.corpus(limit=40), accuracy.corpus(limit=40)
    assert a[2] == b[2] and bool((a[0] == b[0]).all()) and bool((a[1] == b[1]).all())
    with pytest.raises(SystemExit):
        accuracy.parse(["--variants", "fp16,awq"])
