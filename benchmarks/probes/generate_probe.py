"""Where transformers' generate() spends a token beyond the compiled step (issue 39 item 6,
docs/perf_log.md v48-v49): the per-token time of generate() by path and the host time of the
pieces between the loop's stop check and the step (the inputs, the mask, the compiled call),
timed with perf_counter only: no profiler, whose CUPTI tracing inflates cudaGraphLaunch ~30x and
stays attached for the rest of the process (v49). Paths:
  transformers  transformers' compiled call, a user's StaticCache, the stop check every token
  user-cache    Sailfish's decode graphs, a user's StaticCache (returned to the user and not
                croppable: the stop check every token, as transformers does)
  static        Sailfish's graphs, cache_implementation="static" (a new cache every call), the
                class's generate(): the stop check every token
  deferred      the same through the model's generate (sailfish.generation.Generate): the stop
                check deferred a step

    PYTHONPATH=src python benchmarks/probes/generate_probe.py [--model 8b] [--variants w4a16,fp16-rowops]
        [--batches 1,16] [--paths transformers,user-cache,static,deferred] [--tokens 64] [--reps 7]

Needs CUDA and transformers (the e2e benchmark's models, bench/llama.py).
"""
import argparse
import functools
import statistics
import time

import torch

from sailfish import generation
from sailfish.bench.llama import MODELS, VARIANTS, build_model, make_variant

PATHS = ("transformers", "user-cache", "static", "deferred")


def timed(store: dict, key: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        store.setdefault(key, []).append((time.perf_counter() - t0) * 1e6)
        return out
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="8b", choices=sorted(MODELS))
    ap.add_argument("--variants", default="w4a16,fp16-rowops")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--paths", default=",".join(PATHS))
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
            for path in a.paths.split(","):
                (generation.remove if path == "transformers" else generation.install)(model)
                model.__dict__.pop("_compiled_call", None)
                torch._dynamo.reset()
                generate = type(model).generate.__get__(model) if path != "deferred" else model.generate
                kwargs = (dict(past_key_values=cache) if path in ("transformers", "user-cache")
                          else dict(cache_implementation="static", max_cache_len=a.context))

                def run(n: int) -> float:
                    cache.reset()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs)
                    torch.cuda.synchronize()
                    return (time.perf_counter() - t0) * 1e3

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
                print(f"{name} b{batch} {path:12s}: {(long - short) / a.tokens:.3f} ms a token ({long:.1f} ms for "
                      f"{a.tokens + 4}, {short:.1f} for 4); host us a call {pieces}",
                      flush=True)
                if call is None:
                    del model.get_compiled_call
                else:
                    model.get_compiled_call = call
                if "create_masks_for_generate" in model.__dict__:
                    model.create_masks_for_generate = generation.decode_masks
            graphs = getattr(model.__dict__.get("_compiled_call"), "graphs", {})
            for key, graph in graphs.items():
                graph = graph.graph
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
