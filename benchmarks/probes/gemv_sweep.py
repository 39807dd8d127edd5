"""Sweep (not part of the package; GPU; run from the repo root as
`PYTHONPATH=src python benchmarks/probes/gemv_sweep.py`): the shipped GEMV kernel at M = 1 over tile shapes outside
the candidate list, small accumulators (registers) included. Graph-timed like the tuner."""
import functools

import torch

import sailfish
from sailfish.bench.timing import copies_needed, graph_time_us, w4a16_min_bytes
from sailfish.ops.w4a16 import w4a16_launch
from sailfish.runtime.device import sm_count
from sailfish.tuning import Config, split_k_for

torch.manual_seed(0)
space = []
for bn in (8, 16, 32, 64):
    for bk in (128, 256, 512, 1024):
        for w in (1, 2, 4, 8):
            regs = bn * bk // (32 * w)
            if 8 <= regs <= 128:
                space.append((bn, bk, w))
print(len(space), "tiles")
summary = []
for (K, N) in [(8192, 57344), (8192, 8192), (4096, 4096), (14336, 4096), (4096, 14336)]:
    lin = torch.nn.Linear(K, N, bias=False, dtype=torch.float16, device="cuda")
    L = sailfish.QuantLinear.from_linear(lin)
    R = copies_needed(N * K // 2)
    Ls = [L] + [sailfish.QuantLinear.from_linear(lin) for _ in range(R - 1)]
    Wc = [lin.weight.detach()] + [lin.weight.detach().clone() for _ in range(copies_needed(N * K * 2) - 1)]
    x = torch.randn(1, K, dtype=torch.float16, device="cuda")
    ref = x.float() @ L.dequantize().T
    ideal = w4a16_min_bytes(1, K, N, 128) / 4.25e12 * 1e6
    t_cb = graph_time_us([functools.partial(torch.nn.functional.linear, x, w) for w in Wc])
    L(x)
    t_sf = graph_time_us([functools.partial(l, x) for l in Ls])
    print(f"K={K} N={N}: cuBLAS {t_cb:.1f}, shipped {t_sf:.1f} us ({t_cb / t_sf:.2f}x)", flush=True)
    res = []
    for bn, bk, w in space:
        if K % bk:
            continue
        for split in sorted({1, split_k_for(-(-N // bn), K // bk, sm_count(0))}):
            for st in (4,):
                cfg = Config(1, bn, bk, split, 8, w, st, kernel="gemv")

                def call(l, cfg=cfg):
                    return w4a16_launch(x, l.qweight, l.scales, None, None, None, None, K, 128, config=cfg)
                try:
                    y = call(L)
                    err = float((y.float() - ref).norm() / ref.norm())
                    assert err < 2e-3, err
                    t = graph_time_us([functools.partial(call, l) for l in Ls])
                except Exception as e:
                    print(f"  {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                res.append((t, bn, bk, w, split, st))
    res.sort()
    for r in res[:6]:
        print(f"  {r[0]:7.1f} us {t_cb / r[0]:.2f}x roof {ideal / r[0]:.2f}  BN={r[1]} BK={r[2]} warps={r[3]} split={r[4]} stages={r[5]}", flush=True)
    summary.append((K, N, t_cb, t_sf, res[0]))
print("\nK x N | cuBLAS | shipped | best sweep")
for K, N, t_cb, t_sf, b in summary:
    print(f"{K}x{N} | {t_cb:.1f} | {t_sf:.1f} ({t_cb / t_sf:.2f}x) | {b[0]:.1f} ({t_cb / b[0]:.2f}x) BN={b[1]} BK={b[2]} w={b[3]} split={b[4]} st={b[5]}")
