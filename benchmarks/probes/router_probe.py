"""MoE router: transformers' TopKRouter formula compiled by inductor (what a compiled model runs)
against F.linear + sailfish::router_topk (sailfish.fuse.SailfishTopKRouter), on the Qwen3-30B-A3B
and Mixtral router shapes (issue 41: in the compiled decode step of the Qwen3-MoE-shaped model
each layer's router spends ~9 us after its F.linear in three-four launches: inductor's softmax,
torch.topk's bitonicSortKVInPlace 4.2 us + gatherTopK 4.9 us, the renormalisation;
docs/perf_log.md v44).

Prediction (written before any GPU run), H100, bf16, per router call in a CUDA graph:
  Qwen3-30B-A3B (E 128, top 8, hidden 2048, norm_topk_prob): the F.linear (a 0.5 MB weight
  read, launch-bound) ~3 us at every T; compiled formula ~12-13 us (linear + softmax ~2.5 +
  sort 4.2 + gather 4.9 + renormalise / cast, which inductor may fold into one ~2 us kernel);
  sailfish ~5-6 us (linear + one ~2.5-3 us launch). The part after the linear: ~9 -> ~3 us
  (~3x), the whole router ~2.2x at T = 1; at T = 64 still launch-bound, the same within ~10%.
  Mixtral (E 8, top 2, hidden 4096, always renormalised, float32 weights): linear ~3 us, the
  tail ~8 us compiled (torch.topk's two kernels even for 8 columns) -> ~2.5 us.
  Under torch.compile the op stays one launch (its fake implementation traces), so
  `sailfish_compiled` should equal `sailfish` within ~0.5 us (inductor's linear vs eager's).
Measured since (H100, compiled Qwen3-MoE-shaped decode step profile, per layer): the router's
F.linear 5.1 us (its own cuBLAS kernel) + router_topk 4.35 us.

Prediction for sailfish::router_linear_topk (the F.linear in the same launch: `sailfish` below,
the previous two launches `split`), written before any GPU run, H100, bf16, per router call:
  Qwen3-30B-A3B at T = 1: ~9.5 us (split) -> ~3-4 us (one launch: 128 programs each one 4 KB
  weight row, then the last one's top-k); T = 4-16 ~4-5 us; T = 64 (16-token blocks, a pipelined
  K loop of 64 channels) unsure, ~5-7 us: if it loses to `split` there, lower
  ops/router.LINEAR_MAX_T. Mixtral (8 programs of one 8 KB row) at T = 1: ~3 us.
Measured (H100, docs/perf_log.md v45, router_h100.json): Qwen3 T = 1 5.1 us (split 9.2), T = 4 8.1
(8.0), T = 16 25 (8.1), T = 64 47 (8.2); Mixtral T = 1 3.4 (7.8), T = 4 4.7 (7.5), T = 16 12.3 (7.6):
LINEAR_MAX_T is 4.

    PYTHONPATH=src python benchmarks/probes/router_probe.py [--tokens 1,4,16,64]
        [--models qwen3-30b-a3b,mixtral] [--dtype bf16] [--graph-calls 20] [--rounds 5] [--json out.json]

Per (model, T): one call's share of a CUDA graph of --graph-calls calls, median of --rounds
interleaved rounds (us), for
  linear            F.linear(h, weight) alone (cuBLAS: what the split path launches first)
  compiled          torch.compile(transformers' router module) (inductor; dynamic=False)
  split             F.linear + sailfish::router_topk (the fused module before the linear joined it)
  sailfish          the fused router module eagerly (sailfish::router_linear_topk's direct launch)
  sailfish_compiled torch.compile(the fused router module) (the op inside inductor's graph)
and the speedups compiled / sailfish and split / sailfish. The outputs are checked first: the
fused module's logits within a bf16 rounding of F.linear's (2 ** -7 relative, the sums run in
another order), its ids transformers' formula's on its own logits wherever those probabilities
have no tie, the weights within 2 ** -7 relative (a bf16 rounding or two; the tests bound the
fp32 values). Needs CUDA; --help and the argument parsing work without it.
"""
import argparse
import copy
import json

import torch
from torch import nn
from torch.nn import functional as F

MODELS = {  # name: (router class path, config class, config kwargs)
    "qwen3-30b-a3b": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter", "Qwen3MoeConfig",
                      dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)),
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter", "MixtralConfig",
                dict(hidden_size=4096, num_local_experts=8, num_experts_per_tok=2)),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,4,16,64", help="T values (tokens per router call)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--dtype", default="bf16", choices=["fp16", "bf16"])
    ap.add_argument("--graph-calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.tokens = [int(t) for t in a.tokens.split(",")]
    a.models = a.models.split(",")
    bad = [m for m in a.models if m not in MODELS]
    if bad or not a.tokens or min(a.tokens) < 1:
        ap.error(f"--models must be of {', '.join(MODELS)} (got {bad}) and --tokens positive ints")
    return a


def build(name: str, dtype: torch.dtype, device: str = "cuda"):
    """(transformers' router, the fused router) on `device`, the same weight (std 0.02, as
    transformers initializes it)."""
    import importlib

    from sailfish.fuse import SailfishTopKRouter, fuse_row_ops

    module, cls_name, cfg_name, kw = MODELS[name]
    mod = importlib.import_module(module)
    router = getattr(mod, cls_name)(getattr(mod, cfg_name)(**kw))
    with torch.no_grad():
        router.weight.normal_(0, 0.02)
    router = router.to(device, dtype).eval()
    holder = nn.Module()
    holder.gate = copy.deepcopy(router)
    if fuse_row_ops(holder)["routers"] != ["gate"] or not isinstance(holder.gate, SailfishTopKRouter):
        raise SystemExit(f"{cls_name} was not replaced: its forward is not a formula sailfish.fuse knows")
    return router, holder.gate


def check(router, fused, h) -> None:
    """logits within 2 ** -7 of F.linear's; ids equal to transformers' formula's on the fused
    module's logits where its probabilities have no tie; weights within 2 ** -7."""
    from sailfish.ops.router import router_topk_reference

    logits, w, ids = fused(h)
    ref = F.linear(h, router.weight).float()
    off = (logits.float() - ref).abs() > 2 ** -7 * (ref.abs() + 2 ** -10 * ref.abs().amax(-1, keepdim=True))
    if bool(off.any()):
        raise SystemExit(f"router_linear_topk logits off F.linear's at {int(off.sum())} positions")
    w_ref, ids_ref = router_topk_reference(logits, fused.top_k, fused.renormalize, fused.fp32_weights)
    probs = torch.softmax(logits.float(), -1)
    differ = (ids != ids_ref) & (probs.gather(-1, ids) != probs.gather(-1, ids_ref))
    if bool(differ.any()):
        raise SystemExit(f"router_topk ids differ from transformers' at {int(differ.sum())} positions")
    same = ids == ids_ref
    err = ((w.float() - w_ref.float()).abs() / w_ref.float().abs())[same]
    if w.dtype != w_ref.dtype or (err.numel() and not float(err.max()) <= 2 ** -7):
        raise SystemExit(f"router_topk weights off transformers' by {float(err.max())} (dtype {w.dtype})")


def split(h, fused):
    """The router in two launches: cuBLAS's F.linear, then sailfish::router_topk's direct launch."""
    from sailfish.ops.router import router_topk_launch

    logits = F.linear(h, fused.weight)
    return (logits, *router_topk_launch(logits, fused.top_k, fused.renormalize, fused.fp32_weights))


def main(argv=None) -> None:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from sailfish.bench.timing import interleaved_graph_times_us

    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    rows = []
    print(f"{torch.cuda.get_device_name()}  {a.dtype}  (us per call, one CUDA graph of {a.graph_calls} calls)")
    print(f"{'model':>14} {'T':>4} {'linear':>7} {'compiled':>9} {'split':>7} {'sailfish':>9} {'sf_comp':>8}  "
          f"speedup (over compiled, over split)")
    for name in a.models:
        router, fused = build(name, dtype)
        for T in a.tokens:
            g = torch.Generator(device="cuda").manual_seed(T)
            h = torch.randn(T, router.hidden_dim, device="cuda", dtype=dtype, generator=g)
            torch._dynamo.reset()
            compiled = torch.compile(router, dynamic=False)
            fused_compiled = torch.compile(fused, dynamic=False)
            with torch.no_grad():
                check(router, fused, h)
                paths = {"linear": lambda: F.linear(h, router.weight), "compiled": lambda: compiled(h),
                         "split": lambda: split(h, fused), "sailfish": lambda: fused(h),
                         "sailfish_compiled": lambda: fused_compiled(h)}
                t = interleaved_graph_times_us(paths, a.graph_calls, a.rounds)
            whole = t["compiled"] / t["sailfish"]
            over_split = t["split"] / t["sailfish"]
            rows.append({"model": name, "T": T, "dtype": a.dtype, **{f"{n}_us": x for n, x in t.items()},
                         "speedup": whole, "speedup_over_split": over_split})
            print(f"{name:>14} {T:4d} {t['linear']:7.2f} {t['compiled']:9.2f} {t['split']:7.2f} {t['sailfish']:9.2f} "
                  f"{t['sailfish_compiled']:8.2f}  {whole:.2f}x, {over_split:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
