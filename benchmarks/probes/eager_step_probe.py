"""Where an eager decode step's host time goes, fused against unfused (issue 39, eager bar).

    PYTHONPATH=src python benchmarks/probes/eager_step_probe.py [--layers 4] [--batch 1]

For fp16, w4a16 (fused q/k/v, gate/up) and w4a16-unfused on Llama-3-8B shapes: the eager step's
wall time per call (CUDA events around --steps steps) and its host time (perf_counter without
synchronizing), then a cProfile of the fused and unfused steps (top functions by own time).
"""
import argparse
import cProfile
import io
import pstats
import time

import torch

from sailfish.bench.llama import MODELS, VARIANTS, Decoder, build_model, make_variant


def timed(dec: Decoder, steps: int):
    for _ in range(3):
        dec.seek(8)
        dec.step()
    torch.cuda.synchronize()
    dec.seek(8)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = []
    start.record()
    for _ in range(steps):
        t0 = time.perf_counter()
        dec.step()
        host.append(time.perf_counter() - t0)
    end.record()
    end.synchronize()
    host.sort()
    return start.elapsed_time(end) / steps, 1e3 * host[len(host) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    base = build_model(MODELS["8b"], a.layers, torch.device("cuda"))
    models = {name: make_variant(base, VARIANTS[name]) for name in ("fp16", "w4a16", "w4a16-unfused")}
    print(torch.cuda.get_device_name(), f"layers {a.layers}, batch {a.batch}")
    for rnd in range(2):
        for name, model in models.items():
            with torch.no_grad():
                ms, host_ms = timed(Decoder(model, a.batch, 1024), a.steps)
            print(f"round {rnd} {name:14s} step {ms:7.3f} ms   host {host_ms:7.3f} ms")
    for name in ("w4a16", "w4a16-unfused"):
        dec = Decoder(models[name], a.batch, 1024)
        with torch.no_grad():
            timed(dec, 3)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.steps):
                dec.step()
            prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
        print(f"==== {name}: cProfile of {a.steps} eager steps (tottime)\n" + s.getvalue()[-6000:])


if __name__ == "__main__":
    main()
