"""Where the MoE block's decode time goes (GPU), and the decode launch chain before / after
(docs/perf_log.md v42), and the one-GEMV-per-slot path (kernel "moe_gemv", v45), in one process.

v45: rows "moe" (separate reduce launches), "moe_fused" (the v42 decode path) and "moe_gemv" at
its heuristic's tiles (at every M, also where the launcher's rule, ops/moe.moe_gemv_applies, would
not take it); --sweep
also times every "moe_gemv" candidate of gate_up (down at the heuristic's) and then of down (gate_up
at the best), cold, and prints the best pair. Prediction (before any GPU run): Qwen3-30B-A3B M = 1
25.4 -> ~14 us (two GEMVs on 12.6 + 6.3 MB at the dense GEMV's ~1.3-1.5 TB/s, plus ~2 us of tails),
limit fraction 0.25 -> ~0.45; DeepSeek-V2-Lite M = 1 (shared experts as before) 51 -> ~40 us.

Per model and M: the launcher's configs (the heuristic's with SAILFISH_AUTOTUNE=0: at M <= 16
kernel "moe_fused", the split-K and top-k sums inside the GEMM launches) against the same tiles
as kernel "moe" (the separate reduce launches: the chain before v42), each timed with one weight
copy replayed (L2-warm) and with enough copies to defeat L2 (cold), one CUDA graph per row
(bench.timing.graph_time_us); the two outputs must be the same bits (same tiles, same sums in
the same order). --profile: the device time of each kernel (torch.profiler) on the cold run.
"after" includes PDL between the two GEMMs on sm_90+; SAILFISH_PDL=0 leaves it out ("before"
never has it: its down GEMM is not the decode path's).

    SAILFISH_AUTOTUNE=0 PYTHONPATH=src python benchmarks/probes/moe_decode_probe.py \
        --models Qwen3-30B-A3B,DeepSeek-V2-Lite,Mixtral-8x7B --m 1,4,16 [--profile]
"""
import argparse
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from sailfish.bench.moe import MODELS, _shared, limit_us, make_experts, routing
from sailfish.bench.timing import copies_needed, graph_time_us, hbm_ceiling_gbps, tensor_core_peaks
from sailfish.ops.moe import moe_candidates, moe_config, moe_gemv_applies, moe_heuristic, moe_w4a16_launch


def block(x, ids, w, ex, configs):
    """bench.moe's sailfish block (shared experts included) with explicit configs."""
    q13, q2 = ex.q13, ex.q2
    y = moe_w4a16_launch(x, ids, w, q13.qweight, q13.scales, q13.zeros, q2.qweight, q2.scales, q2.zeros,
                         q13.group_size, configs=configs)
    return y if ex.shared is None else y + _shared(x, ex, True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="Qwen3-30B-A3B,DeepSeek-V2-Lite,Mixtral-8x7B")
    ap.add_argument("--m", default="1,4,16")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time every moe_gemv candidate (see the doc)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"{props.name}, torch {torch.__version__}")
    hbm, peak = hbm_ceiling_gbps(), tensor_core_peaks().get("half")  # (as bench.moe: its limit_fraction)
    ms = [int(m) for m in args.m.split(",")]
    for name in args.models.split(","):
        H, I, E, topk, shared = MODELS[name]
        # copies from the routed bytes at the smallest M, as bench.moe counts them (L2-cold)
        one = make_experts(H, I, E, shared, torch.bfloat16, 128, dev, False, 0)
        per_expert = (one.q13.qweight[0].numel() + one.q2.qweight[0].numel()) * 4
        n_copies = copies_needed(min(E, min(ms) * topk) * per_expert)
        copies = [one] + [make_experts(H, I, E, shared, torch.bfloat16, 128, dev, False, r) for r in range(1, n_copies)]
        for M in ms:
            ids, w = routing(M, E, topk, False, dev)
            x = torch.randn(M, H, dtype=torch.bfloat16, device=dev)
            kp13, kp2 = one.q13.qweight.shape[2] * 8, one.q2.qweight.shape[2] * 8
            after = moe_config(dev, M, topk, E, I, H, kp13, kp2)
            before = tuple(replace(c, kernel="moe") for c in after)
            rows = [("before", before), ("after", after)]
            # "moe_gemv" at its heuristic's tiles, also past the launcher's rule (to place the rule)
            rows.append(("gemv", tuple(moe_heuristic(device=dev, M=M, topk=topk, E=E, N=N, Kp=Kp, gated=g, block_m=1)
                                       for g, N, Kp in ((True, I, kp13), (False, H, kp2)))))
            print(f"  the launcher's rule takes moe_gemv: {moe_gemv_applies(M, topk, E, H, I, True)}")
            lim = limit_us(M, H, I, E, topk, shared, ids, "sailfish-moe-w4a16", 2, 128, hbm, peak)
            print(f"\n{name} M={M}: {int(torch.unique(ids).numel())} experts routed, {n_copies} weight copies; "
                  f"limit {lim:.1f} us\n  after's configs: {after}")
            outs = {}
            with torch.no_grad():
                for label, cfgs in rows:
                    warm = [lambda c=cfgs: block(x, ids, w, copies[0], c)] * 8
                    cold = [lambda ex=ex, c=cfgs: block(x, ids, w, ex, c) for ex in copies]
                    outs[label] = warm[0]()
                    for c in cold:
                        c()
                    t_cold = graph_time_us(cold)
                    kinds = "+".join(sorted({c.kernel for c in cfgs}))
                    print(f"  {label:6s} ({kinds}): warm {graph_time_us(warm):7.1f} us   cold {t_cold:7.1f} us   "
                          f"limit fraction {lim / t_cold:.2f}")
                    if args.profile:
                        with profile(activities=[ProfilerActivity.CUDA]) as prof:
                            for _ in range(3):
                                for c in cold:
                                    c()
                            torch.cuda.synchronize()
                        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10,
                                                        max_name_column_width=60))
            print(f"  same bits before / after: {torch.equal(outs['before'], outs['after'])}")
            if "gemv" in outs:
                d = (outs["gemv"].float() - outs["after"].float()).abs().max().item()
                print(f"  gemv vs after: max |diff| {d:.3g} (max |y| {outs['after'].float().abs().max().item():.3g})")
            if args.sweep and "gemv" in outs:
                sweep(x, ids, w, copies, M, topk, E, I, H, kp13, kp2, dict(rows)["gemv"], outs["after"], lim)


def sweep(x, ids, w, copies, M, topk, E, I, H, kp13, kp2, heur, want, lim):
    """Every "moe_gemv" candidate of gate_up (down at the heuristic's), then of down (gate_up at
    the best), timed cold; each checked against the decode path's output first."""
    dev = x.device
    best = list(heur)
    scale = want.float().abs().max().item()
    for i, (gated, N, Kp) in enumerate(((True, I, kp13), (False, H, kp2))):
        times = {}
        for cfg in moe_candidates(device=dev, M=M, topk=topk, E=E, N=N, Kp=Kp, gated=gated, block_m=1):
            pair = tuple(best[:i] + [cfg] + best[i + 1:])
            with torch.no_grad():
                got = block(x, ids, w, copies[0], pair)
                if (got.float() - want.float()).abs().max().item() > 2 ** -6 * scale:
                    raise SystemExit(f"{cfg} off the decode path's output")
                cold = [lambda ex=ex, c=pair: block(x, ids, w, ex, c) for ex in copies]
                times[cfg] = graph_time_us(cold)
        top = sorted(times, key=times.get)[:4]
        best[i] = top[0]
        print(f"  sweep {'gate_up' if gated else 'down'}: heuristic {times[heur[i]]:.1f} us; best " + "; ".join(
            f"{c.BLOCK_N}/{c.BLOCK_K}/s{c.SPLIT_K}/w{c.num_warps}/st{c.num_stages} {times[c]:.1f}" for c in top))
    print(f"  sweep best pair limit fraction {lim / times[best[1]]:.2f}")


if __name__ == "__main__":
    main()
