"""W4A16 split-K GEMV: the slices summed in the GEMV (one launch) against the reduce kernel (two),
same process, same configs (issue 39 item 5; ops/w4a16.gemv_fixup).

    PYTHONPATH=src python benchmarks/probes/split_fixup_probe.py [--shapes 4096x4096,...] [--m 1,2,4,8,16]

For each K x N shape and M, a QuantLinear (fp16 by default, g128) is called with
FLAGS.split_fixup off (the GEMV's partial sums added by _splitk_reduce_kernel, PDL-chained on
sm_90) and on, the launch plans rebuilt for each (the config, from the shipped table or the
heuristic, is the same for both). Per path, the median over --rounds interleaved rounds of:
  graph us   one call's share of a CUDA graph of --graph-calls calls (the GPU time a graph sees)
  eager us   CUDA events around --calls back-to-back calls (the larger of host and GPU per call)
  host us    perf_counter around each call, no sync (the host's share), median
The outputs of the two paths must be equal bit for bit. Rows whose config has no split-K (or is
not a 'gemv' config, e.g. M = 16's tensor-core tile) run the same kernel on both paths: controls.
Needs CUDA. Prints a table and, with --json, writes the rows.
"""
import argparse
import json
import statistics

import torch

from sailfish import QuantLinear
from sailfish.bench.overhead import gpu_us_per_call, host_us_interleaved
from sailfish.bench.timing import graph_time_us
from sailfish.ops.w4a16 import W4A16_TUNER, gemv_fixup
from sailfish.runtime.flags import FLAGS
from sailfish.tuning import m_bucket

LLAMA3_8B = "4096x4096,4096x6144,4096x28672,14336x4096"  # K x N: q/o, fused qkv, fused gate/up, down


def measure(layer, x, calls: int, graph_calls: int) -> dict:
    fn = lambda: layer(x)  # noqa: E731
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return {"graph_us": graph_time_us([fn] * graph_calls), "eager_us": gpu_us_per_call(fn, calls),
            "host_us": statistics.median(host_us_interleaved([("layer", fn)], calls)["layer"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=LLAMA3_8B, help=f"K x N list (default: Llama-3-8B, {LLAMA3_8B})")
    ap.add_argument("--m", default="1,2,4,8,16")
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--graph-calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    print(f"{torch.cuda.get_device_name()}  {args.dtype} g{args.group_size}")
    print(f"{'K x N':>12} {'M':>3} {'config':>28} | {'graph us':>17} {'eager us':>17} {'host us':>17} | graph x")
    rows = []
    with torch.no_grad():
        for shape in args.shapes.split(","):
            k, n = map(int, shape.split("x"))
            torch.manual_seed(0)
            lin = torch.nn.Linear(k, n, bias=False, dtype=dtype, device="cuda")
            layer = QuantLinear.from_linear(lin, group_size=args.group_size)
            del lin
            for m in map(int, args.m.split(",")):
                x = torch.randn(m, k, dtype=dtype, device="cuda")
                FLAGS.split_fixup = False
                W4A16_TUNER.plans.clear()
                layer(x)  # the problem's config (table, tuner or heuristic), then kept for both paths
                cfg = W4A16_TUNER.lookup(x.device, (layer.qweight.shape[1] * 8, n, m_bucket(m), layer.group_size,
                                                    layer.zeros is not None, False, dtype))
                res = {False: [], True: []}
                out = {}
                for _ in range(args.rounds):
                    for fixup in (False, True):
                        FLAGS.split_fixup = fixup
                        W4A16_TUNER.plans.clear()  # plans are built for the flag's value
                        out[fixup] = layer(x)
                        res[fixup].append(measure(layer, x, args.calls, args.graph_calls))
                FLAGS.split_fixup = True
                assert torch.equal(out[False], out[True]), f"{shape} M={m}: the two paths differ"
                med = {f: {key: statistics.median(r[key] for r in res[f]) for key in res[f][0]} for f in res}
                desc = (f"{cfg.kernel} {cfg.BLOCK_M}/{cfg.BLOCK_N}/{cfg.BLOCK_K} split {cfg.SPLIT_K}"
                        f"{' fixup' if gemv_fixup(cfg, m, n) else ''}")
                print(f"{shape:>12} {m:>3} {desc:>28} | "
                      + " ".join(f"{med[False][key]:7.2f} ->{med[True][key]:7.2f}" for key in ("graph_us", "eager_us",
                                                                                            "host_us"))
                      + f" | {med[False]['graph_us'] / med[True]['graph_us']:.3f}")
                rows.append(dict(shape=shape, m=m, config=desc, reduce=med[False], fixup=med[True]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), dtype=args.dtype, group_size=args.group_size,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
