"""Sweep the MoE kernels' tiles per (model, M) on the GPU: each GEMM's config varied with the
other at the heuristic's choice (they are separate launches; BLOCK_M shared; each tile of the
family's kernel kind, ops/moe.moe_kind: at decode the split-K and top-k sums inside the
launches), whole-block time in one CUDA graph (bench/timing.py). Prints the heuristic's time, the best of each GEMM, and
the combined best; writes JSON rows to argv[1].

    PYTHONPATH=src python benchmarks/probes/moe_config_sweep.py /tmp/sweep.json [models] [Ms] [wide|scale]

wide: also gate_up BLOCK_N 256, down BLOCK_K 512, 4 and 8 warps, 3 and 4 stages (v46's look at
Mixtral's M = 256-1024, where the heuristic's tiles run at 0.3-0.5 of the limit). scale: the
same warps / stages / BLOCK_N with scale_acc (BLOCK_K 128: one group of the benchmark's g128 a K
tile; v46).
"""
import itertools
import json
import sys

import torch

from sailfish.bench.moe import MODELS, make_experts, routing
from sailfish.bench.timing import graph_time_us
from sailfish.ops.moe import moe_block_m, moe_heuristic, moe_kind, moe_w4a16_launch
from sailfish.runtime.device import sms_for
from sailfish.tuning import Config


def main():
    out = sys.argv[1]
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(MODELS)
    ms = [int(v) for v in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 16, 64, 256, 1024, 4096]
    mode = sys.argv[4] if len(sys.argv) > 4 else ""
    wide = mode in ("wide", "scale")
    dev = torch.device("cuda")
    sms = sms_for(dev)
    rows = []
    for name in names:
        H, I, E, topk, _ = MODELS[name]
        ex = make_experts(H, I, E, 0, torch.bfloat16, 128, dev, False, 0)
        kp13, kp2 = ex.q13.qweight.shape[2] * 8, ex.q2.qweight.shape[2] * 8
        for M in ms:
            ids, w = routing(M, E, topk, False, dev)
            x = torch.randn(M, H, dtype=torch.bfloat16, device=dev)
            args = (x, ids, w, ex.q13.qweight, ex.q13.scales, ex.q13.zeros, ex.q2.qweight, ex.q2.scales,
                    ex.q2.zeros, 128)
            p = dict(device=dev, M=M, topk=topk, E=E, block_m=moe_block_m(M, topk, E))
            h13 = moe_heuristic(N=I, Kp=kp13, gated=True, **p)
            h2 = moe_heuristic(N=H, Kp=kp2, gated=False, **p)

            def t(c13, c2):
                try:
                    moe_w4a16_launch(*args, configs=(c13, c2))
                    return graph_time_us([lambda: moe_w4a16_launch(*args, configs=(c13, c2))], replays=10)
                except Exception as e:  # noqa: BLE001 - a config the kernel refuses
                    return float("inf")

            base = t(h13, h2)
            best = {"base": base}
            T = M * topk
            bms = sorted({h13.BLOCK_M, min(128, 2 * h13.BLOCK_M)} if h13.BLOCK_M > 16 else {16})
            for bm in bms:
                blocks = max(min(E, T), -(-T // bm))
                warps_list = ((4, 8) if wide else (4 if bm <= 32 else 8,))
                stages_list = (3, 4) if wide else (3,)
                for which in ("gate_up", "down"):
                    kp, N = (kp13, I) if which == "gate_up" else (kp2, H)
                    bns = ((32, 64, 128) + ((256,) if wide else ())) if which == "gate_up" else (64, 128, 256)
                    bks = (128, 256, 512) if wide and which == "down" else (128, 256)
                    if mode == "scale":
                        bns, bks = (64, 128, 256), (128,)
                    for bn, bk, warps, stages in itertools.product(bns, bks, warps_list, stages_list):
                        if kp % bk:
                            continue
                        tiles = blocks * -(-N // bn)
                        splits = {1}
                        if bm == 16:
                            sp = 1
                            while tiles * sp < 2 * sms and sp * 2 <= kp // bk and sp < 16:
                                sp *= 2
                            splits |= {sp, max(1, sp // 2)}
                        for split in sorted(splits):
                            c = Config(bm, bn, bk, split, 8, warps, stages,
                                       kernel=moe_kind(M, which == "gate_up", bm, split, kp),
                                       scale_acc=mode == "scale")
                            other = h2 if which == "gate_up" else h13
                            other = Config(bm, other.BLOCK_N, other.BLOCK_K, other.SPLIT_K, 8, other.num_warps,
                                           other.num_stages, kernel=moe_kind(M, which != "gate_up", bm,
                                                                             other.SPLIT_K,
                                                                             kp13 if which != "gate_up" else kp2))
                            pair = (c, other) if which == "gate_up" else (other, c)
                            us = t(*pair)
                            rows.append(dict(model=name, M=M, which=which, cfg=c.__dict__, us=us))
                            print(f"  {which} {c}: {us:.1f} us", flush=True)
                            key = (which, bm)
                            if us < best.get(key, (float("inf"),))[0]:
                                best[key] = (us, c)
            for bm in (16, 32, 64, 128):
                a, b = best.get(("gate_up", bm)), best.get(("down", bm))
                if a and b:
                    both = t(a[1], b[1])
                    rows.append(dict(model=name, M=M, which="both", bm=bm, us=both,
                                     cfg13=a[1].__dict__, cfg2=b[1].__dict__))
                    print(f"{name:16} M={M:5} base {base:8.1f} us  BM={bm:3} best both {both:8.1f} us "
                          f"({both / base:.2f}x of base)  gate_up {a[1]}  down {b[1]}", flush=True)
            print(f"{name:16} M={M:5} heuristic {h13} / {h2}: {base:.1f} us", flush=True)
            json.dump(rows, open(out, "w"))


if __name__ == "__main__":
    main()
