"""Where an eager decode step's host time goes (issue 39, eager bar).

    PYTHONPATH=src python benchmarks/probes/eager_step_probe.py [--layers 4] [--batches 1,16]
        [--variants fp16,w4a16,w4a16-unfused] [--rounds 2] [--profile]

For the variants (sailfish.bench.llama.VARIANTS) on Llama-3-8B shapes: the eager step's wall
time per call (CUDA events around --steps steps) and its host time (perf_counter without
synchronizing), the variants interleaved round by round so that host drift hits them alike (the
eager step is host-bound: separate runs of the e2e benchmark disagree by more than the
differences); with --profile, a cProfile of each quantized variant's steps (top functions by own
time).
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
    ap.add_argument("--batches", default="1")
    ap.add_argument("--variants", default="fp16,w4a16,w4a16-unfused")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    base = build_model(MODELS["8b"], a.layers, torch.device("cuda"))
    models = {name: make_variant(base, VARIANTS[name]) for name in a.variants.split(",")}
    for batch in (int(b) for b in a.batches.split(",")):
        print(torch.cuda.get_device_name(), f"layers {a.layers}, batch {batch}")
        steps = {name: [] for name in models}
        for rnd in range(a.rounds):
            for name, model in models.items():
                with torch.no_grad():
                    ms, host_ms = timed(Decoder(model, batch, 1024), a.steps)
                steps[name].append(ms)
                print(f"round {rnd} {name:14s} step {ms:7.3f} ms   host {host_ms:7.3f} ms")
        base_ms = sorted(steps[next(iter(models))])[a.rounds // 2]
        for name, t in steps.items():
            med = sorted(t)[a.rounds // 2]
            print(f"batch {batch} {name:14s} median step {med:7.3f} ms   {base_ms / med:5.2f}x {next(iter(models))}")
    for name in [n for n in models if VARIANTS[n].quant is not None] if a.profile else []:
        dec = Decoder(models[name], 1, 1024)
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
