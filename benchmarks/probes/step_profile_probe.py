"""Where a compiled decode step's GPU time goes, kernel by kernel (issue 41's model bar: the
Qwen3-MoE-shaped model at batch 1 compiled is 1.62x bf16 where a CUDA graph gives 2.38x,
perf_log v44).

    PYTHONPATH=src python benchmarks/probes/step_profile_probe.py [--model qwen3-moe] [--layers 2]
        [--variants bf16,w4a16-bf16] [--batch 1] [--steps 20] [--top 25] [--graph]

Per variant: the e2e benchmark's decode step (bench/llama.py Decoder, static cache of --context
tokens, the steps at its last positions) compiled as the e2e's compile mode does
(torch.compile(fullgraph=True, dynamic=False)), warmed up, then --steps steps (no CUDA graph)
under torch.profiler; prints the --top CUDA kernels by total device time per step (us) and
their launches per step, and the sum of every kernel per step. --graph: the compiled step
captured in one CUDA graph as the e2e's compile mode times it, --steps replays profiled, and
every kernel of the step in launch order with its median duration and its median gap after the
previous kernel's end (what a graph loses between kernels: issue 39's W4A8 gap, perf_log v52).
Needs CUDA.
"""
import argparse
from collections import defaultdict

import torch

from sailfish.bench.llama import MODELS, VARIANTS, Decoder, build_model, make_variant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-moe", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--variants", default="bf16,w4a16-bf16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--graph", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from torch.profiler import ProfilerActivity, profile

    base = build_model(MODELS[a.model], a.layers, "cuda")
    for name in a.variants.split(","):
        v = VARIANTS[name]
        if base.get_input_embeddings().weight.dtype != v.dtype:
            base = base.to(v.dtype)
        model = make_variant(base, v)
        dec = Decoder(model, a.batch, a.context)
        dec.seek(a.context - a.steps - 8)
        torch._dynamo.reset()
        fn = torch.compile(dec.step, fullgraph=True, dynamic=False)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        if a.graph:
            _graph_timeline(fn, a, name)
            del model, dec, fn
            torch._dynamo.reset()
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                fn()
            torch.cuda.synchronize()
        total, count = defaultdict(float), defaultdict(int)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                total[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                count[e.name] += 1
        step = sum(total.values()) / a.steps
        print(f"\n{torch.cuda.get_device_name()} {a.model} L{a.layers} {name} batch {a.batch}: "
              f"{step:.1f} us of kernels a step, {sum(count.values()) / a.steps:.0f} launches")
        for k in sorted(total, key=total.get, reverse=True)[:a.top]:
            print(f"  {total[k] / a.steps:8.1f} us  x{count[k] / a.steps:5.1f}  {k[:110]}")
        del model, dec, fn
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def _graph_timeline(fn, a, name: str) -> None:
    """Profile --steps replays of one CUDA graph of fn; print each kernel of the step in order
    with its median duration and median gap after the previous kernel's end (us)."""
    import statistics

    from torch.profiler import ProfilerActivity, profile

    from sailfish.bench.timing import capture_graph

    graph = capture_graph([fn])
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            graph.replay()
        torch.cuda.synchronize()
    ev = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
                 and "memset" not in e.name.lower()), key=lambda t: t[0])
    per = len(ev) // a.steps
    if per == 0 or per * a.steps != len(ev):
        print(f"{name}: {len(ev)} kernel events for {a.steps} replays: not a whole number per replay")
        return
    reps = [ev[i * per:(i + 1) * per] for i in range(a.steps)]
    span = statistics.median(r[-1][1] - r[0][0] for r in reps)
    print(f"\n{torch.cuda.get_device_name()} {a.model} L{a.layers} {name} batch {a.batch}, one CUDA graph: "
          f"{per} kernels, first start to last end {span:.1f} us (median of {a.steps} replays)")
    dsum = gsum = 0.0
    for i in range(per):
        d = statistics.median(r[i][1] - r[i][0] for r in reps)
        g = statistics.median(r[i][0] - r[i - 1][1] for r in reps) if i else 0.0
        dsum, gsum = dsum + d, gsum + g
        print(f"  {i:3d} gap {g:5.2f} dur {d:6.2f}  {reps[0][i][2][:100]}")
    print(f"  kernels {dsum:.1f} us, gaps {gsum:.1f} us")


if __name__ == "__main__":
    main()
