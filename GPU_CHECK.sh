#!/usr/bin/env bash
# Issue 9 (s3-gemv): the M <= 8 tensor-core GEMV. Run from the repository root; <= 3 minutes.
# 1. its GPU tests; 2. decode-step timings (CUDA graph over >= 3x L2 of weight copies) on the
# 8 Llama-3 shapes: new GEMV (a few tiles) vs the CUDA-core GEMV vs the 'mma' kernel at M = 1,
# and M = 2, with the fraction of the HBM limit.
set -u
export PYTHONPATH=src
python -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_w4a16_gemv.py \
    "tests/test_w4a16.py::test_asm_dequant_matches_pure_triton" 2>&1 | tail -15
# the heuristic / table path (M <= 8 'gemv' through the layers) and K = 28672 per element
timeout 45 python -m pytest -q -p no:cacheprovider tests/test_w4a16_elementwise.py \
    tests/test_w4a16.py -k "matches_reference or gemv_and_dequant or per_element" 2>&1 | tail -8
timeout 80 python - <<'EOF'
import time
import torch
import triton
from sailfish import Config
from sailfish.bench.timing import copies_needed, graph_time_us
from sailfish.ops import w4a16 as ops
from sailfish.tuning import split_k_for

t_start = time.time()
dev = torch.device("cuda")
name = torch.cuda.get_device_name()
bw = 4.28e12 if "H200" in name else 3.35e12
sms = torch.cuda.get_device_properties(0).multi_processor_count
SHAPES = [(8192, 57344), (4096, 4096), (8192, 8192), (4096, 28672), (14336, 4096),
          (8192, 10240), (4096, 6144), (28672, 8192)]  # the largest first, then one small


def g(bm, bn, bk, w, st, n, k):
    return Config(bm, bn, bk, split_k_for(-(-n // bn), k // bk, sms), 8, w, st, kernel="gemv")


def run(cfg, ws, x, mma_gemv=True):
    ops.GEMV_MMA = mma_gemv
    qw, s = ws
    return ops.w4a16_launch(x, qw, s, None, None, None, None, x.shape[1], 128, config=cfg)


print(f"{'K x N':>12} {'M':>2} {'kernel':<34} {'us':>8} {'limit':>6}")
for k, n in SHAPES:
    if time.time() - t_start > 50:
        print("time budget reached, stopping"); break
    wbytes = n * k // 2 + n * (k // 128) * 2
    r = copies_needed(wbytes)
    copies = [(torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev),
               (torch.rand(n, k // 128, device=dev) * 0.01 + 0.001).half()) for _ in range(r)]
    for m in ((1, 2, 4, 8) if (k, n) in ((8192, 57344), (4096, 4096)) else (1, 2)):
        x = torch.randn(m, k, device=dev).half()
        lim = (wbytes + 2 * m * k + 2 * m * n) / bw * 1e6
        if m == 1:
            cands = [("gemv-mma " + c, g(1, *map(int, c.split("/")), n, k)) for c in
                     ("16/1024/8/1", "16/1024/8/2", "16/512/4/2", "32/512/4/1", "32/512/4/2", "64/512/4/1",
                      "64/512/4/2", "128/256/4/2", "16/1024/2/2", "32/1024/2/2", "64/1024/4/2")]
            cands += [("gemv-cuda-cores (table cfg)", None), ("mma BM16 BN128 BK256",
                      Config(16, 128, 256, split_k_for(-(-n // 128), k // 256, sms), 8, 4, 3))]
        else:
            cands = [("gemv-mma " + c, g(m, *map(int, c.split("/")), n, k)) for c in
                     ("32/512/4/2", "64/512/4/2", "16/1024/2/2", "32/1024/2/2")]
            cands += [("mma BM16 BN128 BK256", Config(16, 128, 256, split_k_for(-(-n // 128), k // 256, sms),
                                                        8, 4, 3))]
        # reference: the CUDA-core GEMV (the shipped path until now) on the first copy
        ref = run(Config(m, 16, 256, 1, 8, 4, 1, kernel="gemv"), copies[0], x, False).float()
        for label, cfg in cands:
            mma_gemv = not label.startswith("gemv-cuda-cores")
            if cfg is None:
                cfg = ops.W4A16_TUNER.get(ops.w4a16_key(k, n, 1, 128, False, False, torch.float16), dev, None,
                                          M=1, N=n, Kp=k, group_size=128, general_gidx=False)
                label = f"gemv-cuda-cores {cfg.BLOCK_N}/{cfg.BLOCK_K}/{cfg.num_warps} s{cfg.SPLIT_K}"
            try:
                y = run(cfg, copies[0], x, mma_gemv)
                err = float((y.float() - ref).norm() / ref.norm())
                t = graph_time_us([lambda w=w: run(cfg, w, x, mma_gemv) for w in copies])
                print(f"{k:>5}x{n:<6} {m:>2} {label + ' s' + str(cfg.SPLIT_K):<34} {t:8.1f} {lim / t:6.2f}"
                      f"{'' if err < 1e-2 else f'  MISMATCH rel err {err:.2e}'}", flush=True)
            except Exception as e:  # report and go on
                print(f"{k:>5}x{n:<6} {m:>2} {label:<34} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    del copies
    torch.cuda.empty_cache()
# formats (issue 9's bar: asym bf16 within 10% of sym fp16, per channel at least as fast as g128)
print("formats, M = 1, gemv-mma 32/512/4 prefetch")
for k, n in ((8192, 57344), (8192, 8192), (4096, 4096)):
    wbytes = n * k // 2 + n * (k // 128) * 2
    r = copies_needed(wbytes)
    for label, dt, gsz, asym in (("fp16 g128 sym", torch.float16, 128, False), ("bf16 g128 asym", torch.bfloat16, 128, True),
                                 ("fp16 per-channel sym", torch.float16, -1, False),
                                 ("bf16 per-channel asym", torch.bfloat16, -1, True)):
        gp = 1 if gsz == -1 else k // gsz
        ws = [(torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev),
               (torch.rand(n, gp, device=dev) * 0.01 + 0.001).to(dt),
               torch.randint(0, 16, (n, gp), device=dev).to(dt) if asym else None) for _ in range(r)]
        x = torch.randn(1, k, device=dev).to(dt)
        cfg = g(1, 32, 512, 4, 2, n, k)
        ops.GEMV_MMA = True

        def f(w, x=x, gsz=gsz, cfg=cfg):
            return ops.w4a16_launch(x, w[0], w[1], w[2], None, None, None, k, gsz, config=cfg)
        try:
            f(ws[0])
            t = graph_time_us([lambda w=w: f(w) for w in ws])
            lim = (n * k // 2 + n * gp * 2 * (2 if asym else 1) + 2 * k + 2 * n) / bw * 1e6
            print(f"{k:>5}x{n:<6} {label:<24} {t:8.1f} us {lim / t:6.2f}", flush=True)
        except Exception as e:
            print(f"{k:>5}x{n:<6} {label:<24} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        del ws
print(f"total {time.time() - t_start:.0f} s")
EOF
