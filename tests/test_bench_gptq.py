"""sailfish.bench.gptq: the whole-model GPTQ timing script, on the tiny Llama (CPU)."""
import json

import pytest

pytest.importorskip("transformers")


def test_tiny_run_and_partial_result(tmp_path, monkeypatch):
    """A run writes the complete JSON with the phase split; a run that fails in its second
    decoder layer leaves the first layer's result and the error (complete: false)."""
    from sailfish.bench import gptq as bench
    from sailfish.calibrate import model as driver
    out = tmp_path / "tiny.json"
    bench.main(["--tiny", "--layers", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["layers_done"] == 1 and doc["gptq_linears"] == 7
    assert set(doc["phases_s"]) == {"capture", "hessian", "solve", "other"}
    assert doc["phases_s"]["solve"] > 0 and doc["phases_s"]["hessian"] > 0
    assert abs(sum(doc["phases_s"].values()) - doc["quantize_model_s"]) < 1e-6
    assert doc["calibration"]["tokens"] == 2 * 64 and doc["options"]["act_order"]

    solve, calls = driver.gptq_quantize, []

    def fails_in_layer_2(*args, **kwargs):  # 7 Linears a layer
        calls.append(1)
        if len(calls) > 7:
            raise RuntimeError("stop")
        return solve(*args, **kwargs)

    monkeypatch.setattr(driver, "gptq_quantize", fails_in_layer_2)
    with pytest.raises(RuntimeError, match="stop"):
        bench.main(["--tiny", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert not doc["complete"] and doc["layers_done"] == 1 and len(doc["per_layer"]) == 1
    assert doc["error"] == "RuntimeError: stop"
