"""Time GPTQ on Llama-3-8B layer shapes (issue 42's bar: the 8B model in <= 10 minutes).

    PYTHONPATH=src python benchmarks/probes/gptq_speed_probe.py

Per shape: the Hessian of --tokens calibration rows (accumulated in --chunk-row chunks) and
gptq_quantize (group 128, act-order), on the GPU; then the 8B total estimated from the
per-layer counts (q/k/v share one Hessian, gate/up one: 4 Hessians and 7 solves per layer,
32 layers), without the decoder layers' forward passes.
"""
import argparse
import time

import torch

from sailfish.calibrate import Hessian, gptq_quantize

# (K, N, solves per layer) of the 8B: qkv as q + k + v on one Hessian, o, gate/up, down
SHAPES = [(4096, 4096, 1), (4096, 1024, 2), (4096, 4096, 1), (4096, 14336, 2), (14336, 4096, 1)]
HESSIANS = {4096: 3, 14336: 1}  # per layer: qkv, o, gate_up inputs are K = 4096; down's 14336


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128 * 2048)
    ap.add_argument("--chunk-rows", type=int, default=8192)
    a = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name())
    hess_s = {}
    for k in HESSIANS:
        h = Hessian(k, device=dev)
        x = torch.randn(a.chunk_rows, k, device=dev, dtype=torch.float16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.tokens // a.chunk_rows):
            h.add(x)
        hv = h.value()
        torch.cuda.synchronize()
        hess_s[k] = time.perf_counter() - t0
        print(f"Hessian K={k}: {hess_s[k]:.2f} s for {a.tokens} rows")
    total = sum(hess_s[k] * n for k, n in HESSIANS.items())
    for k, n, count in SHAPES:
        h = Hessian(k, device=dev)
        h.add(torch.randn(4096, k, device=dev, dtype=torch.float16))
        w = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
        gptq_quantize(w, h.value(), group_size=128, act_order=True)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gptq_quantize(w, h.value(), group_size=128, act_order=True)
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        total += s * count
        print(f"gptq_quantize {k}x{n}: {s:.2f} s (x{count} per layer)")
    print(f"per decoder layer ~{total:.1f} s; 32 layers ~{32 * total / 60:.1f} min (no forward passes)")


if __name__ == "__main__":
    main()
