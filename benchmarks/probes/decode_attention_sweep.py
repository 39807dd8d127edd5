"""Tile sweep of sailfish::decode_attention: block_n x num_warps x splits per (heads, batch,
context), against the launcher's defaults (ops/attention BLOCK_N, 4 warps, _splits).

Why (docs/perf_log.md v44): the tile and split rule were set on Llama-3-8B's 32 / 8 heads only.
There the kernel reaches 0.71 of its limit at batch 16 and takes 9 us at batch 1 (4 MB); in the
compiled Qwen3-MoE step (32 / 4 heads, 8 query heads a KV head) it took 15.6 us a layer at batch 1,
no faster than cuDNN's sdpa there.

Prediction (before any run): at batch 1 fewer, longer splits (each program streaming 128-256
tokens, not 64) and block_n 128 cut the per-program fixed cost, ~9 -> 6 us at 32 / 8 and
15.6 -> ~8 us at 32 / 4; at batch 16-64 block_n 128 with 8 warps lifts the 0.71-0.76 toward 0.85.

    PYTHONPATH=src python benchmarks/probes/decode_attention_sweep.py [--heads 32/8,32/4,64/8]
        [--batches 1,4,16,64] [--context 1024,4096] [--json out.json]

Per point: each candidate's one call in a CUDA graph of --graph-calls calls (median of --rounds),
checked against the reference first; prints the default's time, the best candidate and its time,
and the limit (K + V bytes at the measured copy rate). Needs CUDA.
"""
import argparse
import itertools
import json
import statistics

import torch

from sailfish.bench.timing import graph_time_us, hbm_ceiling_gbps
from sailfish.ops.attention import BLOCK_N, MAX_SPLITS, _splits, decode_attention_launch, decode_attention_reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="32/8,32/4,64/8", help="query/KV heads, comma separated")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--context", default="1024,4096")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--graph-calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    gbps = hbm_ceiling_gbps()
    D, dtype, rows = a.head_dim, torch.float16, []
    print(f"{torch.cuda.get_device_name()}  head_dim {D} fp16  copy {gbps:.0f} GB/s")
    for heads in a.heads.split(","):
        hq, hkv = (int(x) for x in heads.split("/"))
        for L in (int(x) for x in a.context.split(",")):
            for B in (int(x) for x in a.batches.split(",")):
                q = torch.randn(B, hq, 1, D, device="cuda", dtype=dtype)
                k = torch.randn(B, hkv, L, D, device="cuda", dtype=dtype)
                v = torch.randn(B, hkv, L, D, device="cuda", dtype=dtype)
                mask = torch.ones(B, 1, 1, L, device="cuda", dtype=torch.bool)
                ref = decode_attention_reference(q, k, v, mask, D ** -0.5).float()
                base = _splits(B * hkv, L, hq // hkv, q.device)
                split_set = sorted({s for s in (1, max(1, base // 4), max(1, base // 2), base, base * 2)
                                    if 1 <= s <= MAX_SPLITS})
                cands = [(bn, w, s) for bn, w, s in itertools.product((32, 64, 128), (4, 8), split_set)
                         if not (bn == 128 and w == 4 and D > 128)]
                times = {}
                for bn, w, s in cands:
                    def call(bn=bn, w=w, s=s):
                        return decode_attention_launch(q, k, v, mask, D ** -0.5, splits=s, block_n=bn, num_warps=w)
                    out = call().float()
                    if (out - ref).abs().max() > 2 ** -8 * v.abs().max().item():
                        raise SystemExit(f"({bn}, {w}, {s}) off the reference at {heads} batch {B} context {L}")
                    times[(bn, w, s)] = statistics.median(graph_time_us([call] * a.graph_calls)
                                                          for _ in range(a.rounds))
                dbn = BLOCK_N if D <= 128 else 64  # the launcher's default tile
                default = times[(dbn, 4, base)]
                best = min(times, key=times.get)
                limit = 2 * k.numel() * k.element_size() / (gbps * 1e3)
                rows.append({"heads": [hq, hkv], "batch": B, "context": L, "limit_us": limit, "default_us": default,
                             "default_splits": base, "best": list(best), "best_us": times[best],
                             "all": {f"{bn}/{w}/{s}": t for (bn, w, s), t in times.items()}})
                print(f"{heads:>5} b{B:<3} L{L:<5} limit {limit:6.1f}  default ({dbn}/4/{base}) {default:7.2f} us "
                      f"({limit / default:.2f})  best {best} {times[best]:7.2f} us ({limit / times[best]:.2f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_gbps": gbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
