"""How long GPTQ takes on a whole Llama-3-8B-shaped model (issue 42's bar: <= 10 minutes on an H100).

    python -m sailfish.bench.gptq --out gptq_8b.json                    # the bar: 32 layers, 128 x 2048 tokens
    python -m sailfish.bench.gptq --layers 2 --seqs 16 --out smoke.json  # a short GPU run first
    python -m sailfish.bench.gptq --tiny --out tiny.json                 # the tiny Llama: a CPU check, seconds

Model: bench.llama's Llama-3-8B shape (transformers' LlamaForCausalLM with its random init,
normal(0, 0.02)) with --layers decoder layers, built directly on the device in float16 (no
float32 or CPU copy). Calibration: --seqs sequences of --seqlen random token ids (seed --seed), in
batches of --batch sequences. Timed: sailfish.quantize_model(model, method="gptq",
calibration=..., group_size=128, act_order=True (--no-act-order)), wall clock, and split into
phases each timed between device synchronisations: capturing the first decoder layer's inputs,
accumulating the Hessians, the GPTQ solves (gptq_quantize), and the rest (the decoder layers'
forward passes, swapping in the QuantLinears). Prints a timestamped line per decoder layer and
rewrites --out after each (complete: false until quantize_model returns; an exception's message
under "error"), so a run cut short still leaves the layers done and the time so far.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from typing import Dict, Iterator
from unittest import mock

import torch

from .llama import MODELS, build_model, require_transformers

BAR_S = 600.0  # issue 42: the 8B-shaped model in <= 10 minutes on an H100
PHASES = ("capture", "hessian", "solve")


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive int")
    return value


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sailfish.bench.gptq", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON results file (rewritten after every decoder layer)")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny Llama (hidden 128) with 2 x 64 tokens unless given: a CPU check of every step")
    p.add_argument("--layers", type=_positive, help="decoder layers (default: the model's, 32 for the 8B)")
    p.add_argument("--seqs", type=_positive, help="calibration sequences (default 128; --tiny 2)")
    p.add_argument("--seqlen", type=_positive, help="tokens per sequence (default 2048; --tiny 64)")
    p.add_argument("--batch", type=_positive, default=8, help="sequences per calibration batch (default 8)")
    p.add_argument("--no-act-order", dest="act_order", action="store_false", help="GPTQ without act_order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = p.parse_args(argv)
    shape = MODELS["tiny" if args.tiny else "8b"]
    args.model = shape
    args.layers = args.layers or shape.layers
    args.seqs = args.seqs or (2 if args.tiny else 128)
    args.seqlen = args.seqlen or (64 if args.tiny else 2048)
    return args


def _stamp(start: float) -> str:
    return f"[{time.strftime('%H:%M:%S', time.gmtime())} +{time.perf_counter() - start:7.1f}s]"


def _write(path: str, doc: dict) -> None:
    """Replace `path` at once (a run killed mid-write keeps the previous version)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)


@contextlib.contextmanager
def _phase_timers(device: torch.device, phases: Dict[str, float], on_layer) -> Iterator[None]:
    """Inside: calibrate.model's capture_inputs, Hessian.add and gptq_quantize add their time
    (between device synchronisations, so the GPU work queued before them is not theirs) to
    phases["capture" / "hessian" / "solve"], and on_layer(index, total, seconds, error) is
    called as each decoder layer finishes (in place of its progress bar)."""
    from ..calibrate import model as driver
    from ..calibrate.gptq import Hessian

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn, phase):
        def run(*args, **kwargs):
            sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                phases[phase] += time.perf_counter() - start
        return run

    def progress(total, _shown):
        return lambda index, seconds, error: index is not None and on_layer(index, total, seconds, error)

    with mock.patch.object(driver, "capture_inputs", timed(driver.capture_inputs, "capture")), \
            mock.patch.object(Hessian, "add", timed(Hessian.add, "hessian")), \
            mock.patch.object(driver, "gptq_quantize", timed(driver.gptq_quantize, "solve")), \
            mock.patch.object(driver, "_progress", progress):
        yield


def main(argv=None) -> dict:
    import triton

    import sailfish
    start = time.perf_counter()
    args = parse(argv)
    transformers_version = require_transformers()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    shape = args.model
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    doc = {"benchmark": "sailfish.bench.gptq",
           "command": "python -m sailfish.bench.gptq " + shlex.join(sys.argv[1:] if argv is None else argv),
           "device": gpu, "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers_version, "sailfish": sailfish.__version__,
           "cuda": getattr(torch.version, "cuda", None), "timings_meaningful": cuda, "complete": False,
           "model": {"name": shape.name, "hidden": shape.hidden, "intermediate": shape.intermediate,
                     "heads": shape.heads, "kv_heads": shape.kv_heads, "vocab": shape.vocab, "layers": args.layers,
                     "model_layers": shape.layers, "dtype": "float16", "random_weights": True},
           "calibration": {"seqs": args.seqs, "seqlen": args.seqlen, "batch": args.batch, "seed": args.seed,
                           "tokens": args.seqs * args.seqlen},
           "options": {"method": "gptq", "group_size": 128, "sym": True, "act_order": args.act_order},
           "bar_s": BAR_S}
    print(f"sailfish.bench.gptq: {gpu} | torch {torch.__version__} | triton {triton.__version__} | "
          f"transformers {transformers_version}", flush=True)
    if not cuda:
        print("CPU check: every step runs, but the TIMES ARE MEANINGLESS.", flush=True)

    t = time.perf_counter()
    model = build_model(shape, args.layers, device, seed=args.seed)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    doc["build_s"] = time.perf_counter() - t
    doc["model"]["parameters"] = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, shape.vocab, (args.seqs, args.seqlen), generator=g).to(device)
    calibration = list(tokens.split(args.batch))
    print(f"{_stamp(start)} built {shape.name} with {args.layers} layers ({doc['model']['parameters'] / 1e6:.1f}M "
          f"parameters) in {doc['build_s']:.1f} s; calibration {args.seqs} x {args.seqlen} tokens in "
          f"{len(calibration)} batches; quantize_model(method='gptq', group_size=128, act_order={args.act_order})",
          flush=True)

    phases = {p: 0.0 for p in PHASES}
    layers = []
    t0 = time.perf_counter()

    def memory() -> dict:
        if not cuda:
            return {}
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2 ** 30}

    def snapshot(elapsed: float) -> None:
        doc.update(layers_done=len(layers), elapsed_s=elapsed, phases_s=dict(phases, other=elapsed - sum(
            phases.values())), per_layer=layers, **memory())
        _write(args.out, doc)

    def on_layer(index, total, seconds, error):
        elapsed = time.perf_counter() - t0
        layers.append({"layer": index, "seconds": seconds, "output_error": error, "elapsed_s": elapsed})
        snapshot(elapsed)
        eta = elapsed / (index + 1) * total  # capture aside, the layers take about the same time
        print(f"{_stamp(start)} layer {index + 1}/{total}: {seconds:.1f} s, output error {error:.4g} | "
              f"{elapsed:.1f} s so far (capture {phases['capture']:.1f}, hessian {phases['hessian']:.1f}, solve "
              f"{phases['solve']:.1f}), all {total} layers ~{eta:.0f} s | peak {doc.get('peak_allocated_gib', 0):.1f} "
              f"GiB",
              flush=True)

    snapshot(0.0)
    try:
        with _phase_timers(device, phases, on_layer):
            model = sailfish.quantize_model(model, method="gptq", calibration=calibration, group_size=128,
                                            act_order=args.act_order, progress=False)
    except BaseException as e:  # out of memory, interrupted...: the JSON says so, with the layers done
        doc["error"] = f"{type(e).__name__}: {e}"
        snapshot(time.perf_counter() - t0)
        raise
    if cuda:
        torch.cuda.synchronize(device)
    total = time.perf_counter() - t0
    report = model.sailfish_report
    doc.update(complete=True, quantize_model_s=total, within_bar=total <= BAR_S if cuda else None,
               after_layers_s=total - layers[-1]["elapsed_s"],
               quantized_linears=len(report["quantized"]), gptq_linears=len(report["gptq"]),
               gptq_error_sum=sum(v["error"] for v in report["gptq"].values()),
               fused=len(report.get("fused", ())))
    snapshot(total)
    verdict = ("within" if total <= BAR_S else "OVER") if cuda else "CPU: not comparable with"
    print(f"{_stamp(start)} quantize_model(method='gptq') took {total:.1f} s ({verdict} the {BAR_S:.0f} s bar): " +
          ", ".join(f"{k} {v:.1f} s" for k, v in doc["phases_s"].items()) +
          (f"; peak GPU memory {doc['peak_allocated_gib']:.1f} GiB allocated" if cuda else "") +
          f"; wrote {args.out}", flush=True)
    return doc


if __name__ == "__main__":
    main()
