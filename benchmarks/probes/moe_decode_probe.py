"""Where the MoE block's decode time goes (GPU): one weight copy replayed (L2-warm) against
enough copies to defeat L2, and the device time of each kernel (torch.profiler) on the cold run.

    PYTHONPATH=src python benchmarks/probes/moe_decode_probe.py [model] [M]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from sailfish.bench.moe import MODELS, grouped_block, make_experts, routing, sailfish_block
from sailfish.bench.timing import graph_time_us


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "Qwen3-30B-A3B"
    M = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    H, I, E, topk, _ = MODELS[name]
    dev = torch.device("cuda")
    copies = [make_experts(H, I, E, 0, torch.bfloat16, 128, dev, False, r) for r in range(8)]
    ids, w = routing(M, E, topk, False, dev)
    x = torch.randn(M, H, dtype=torch.bfloat16, device=dev)
    routed = topk * min(M, E) * 3 * H * I // 2  # 4-bit bytes of the routed experts (upper bound)
    print(f"{name} M={M}: routed 4-bit expert bytes <= {routed / 2**20:.1f} MiB")
    with torch.no_grad():
        for label, block in (("sailfish", sailfish_block), ("bf16-grouped", grouped_block)):
            warm = [lambda: block(x, ids, w, copies[0])] * 8
            cold = [lambda ex=ex: block(x, ids, w, ex) for ex in copies]
            warm[0](), [c() for c in cold]
            print(f"{label:14s} warm (1 copy) {graph_time_us(warm):8.1f} us   cold (8 copies) "
                  f"{graph_time_us(cold):8.1f} us")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    for c in cold:
                        c()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    main()
