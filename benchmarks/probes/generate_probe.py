"""Where transformers' generate() spends a token beyond the compiled step (issue 39 item 6,
docs/perf_log.md v48): the per-token time through transformers' compiled call and through
Sailfish's decode graphs (sailfish.generation), the step replayed back to back, the host time of
the pieces between the loop's per-token sync and the step (transformers' input preparation, the
mask, the compiled call), and the GPU's idle time per token from a CUDA-only profiler trace (no
host-side profiling, so the host is not slowed down).

    PYTHONPATH=src python benchmarks/probes/generate_probe.py [--model 8b] [--variants w4a16,fp16-rowops]
        [--batches 1,16] [--tokens 64] [--reps 7]

Needs CUDA and transformers (the e2e benchmark's models, bench/llama.py).
"""
import argparse
import functools
import statistics
import time

import torch

from sailfish import generation
from sailfish.bench.llama import MODELS, VARIANTS, build_model, make_variant


def timed(store: dict, key: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        store.setdefault(key, []).append((time.perf_counter() - t0) * 1e6)
        return out
    return wrapper


def gpu_idle_per_token(run, tokens: int) -> float:
    """us of GPU idle per token: the span of the kernels of a `tokens`-token generate() minus
    their busy time, over the tokens (CUDA activity only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(tokens)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, None
    for s, e in spans:  # union of the intervals
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return ((spans[-1][1] - spans[0][0]) - busy) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="8b", choices=sorted(MODELS))
    ap.add_argument("--variants", default="w4a16,fp16-rowops")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--context", type=int, default=1024)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from transformers import StaticCache

    print(torch.cuda.get_device_name())
    base = build_model(MODELS[a.model], MODELS[a.model].layers, "cuda")
    for name in a.variants.split(","):
        v = VARIANTS[name]
        if base.get_input_embeddings().weight.dtype != v.dtype:
            base = base.to(v.dtype)
        model = make_variant(base, v)
        host: dict = {}
        model.prepare_inputs_for_generation = timed(host, "inputs", type(model).prepare_inputs_for_generation.__get__(model))
        for batch in (int(b) for b in a.batches.split(",")):
            prompt = torch.randint(1000, (batch, 16), device="cuda")
            cache = StaticCache(config=model.config, max_cache_len=a.context)

            def run(n: int) -> float:
                cache.reset()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate(prompt, past_key_values=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
                torch.cuda.synchronize()
                return (time.perf_counter() - t0) * 1e3

            for path in ("transformers", "sailfish"):
                (generation.remove if path == "transformers" else generation.install)(model)
                model.__dict__.pop("_compiled_call", None)
                torch._dynamo.reset()
                for _ in range(2):
                    run(a.tokens)
                call = model.__dict__.get("get_compiled_call")  # (Sailfish's, or transformers' method)
                model.get_compiled_call = lambda cfg=None, c=model.get_compiled_call: timed(host, "call", c(cfg))
                if "create_masks_for_generate" in model.__dict__:
                    model.create_masks_for_generate = timed(host, "mask", model.create_masks_for_generate)
                host.clear()
                long = statistics.median(run(a.tokens + 4) for _ in range(a.reps))
                short = statistics.median(run(4) for _ in range(a.reps))
                pieces = {k: round(statistics.median(v), 1) for k, v in host.items()}
                idle = gpu_idle_per_token(run, a.tokens)
                print(f"{name} b{batch} {path:12s}: {(long - short) / a.tokens:.3f} ms a token, GPU idle "
                      f"{idle:.0f} us a token; host us a call {pieces}", flush=True)
                if call is None:
                    del model.get_compiled_call
                else:
                    model.get_compiled_call = call
                if "create_masks_for_generate" in model.__dict__:
                    model.create_masks_for_generate = generation.decode_masks
            graphs = getattr(model.__dict__.get("_compiled_call"), "graphs", {})
            if graphs:
                graph = next(iter(graphs.values())).graph
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(50):
                    graph.replay()
                torch.cuda.synchronize()
                print(f"{name} b{batch} step replayed back to back: {(time.perf_counter() - t0) / 50 * 1e3:.3f} ms")
            generation.remove(model)
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
