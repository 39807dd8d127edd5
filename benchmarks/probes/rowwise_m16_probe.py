"""Probe (Hopper GPU; not part of the package): the row-wise W4A8 kernels at decode sizes, by
num_warps, against what inductor makes of the 16-bit model's norm (issue 39's W4A8 lever 3,
docs/perf_log.md v47 / v49).

Why: v47's batch-16 profile put Sailfish's fused norm / silu-and-multiply + quantize launches at
3.6 us each (rowwise_kernel x 3 a layer) against 2.3-3.1 us for W4A16's inductor-fused add +
RMSNorm and silu * up; 2.7 us a layer of W4A8's 13.7 us gap. At M = 16 the kernel runs 16
programs, one row each, with ops/rowwise._tile's warps by row width (8 for 4096 channels, 16 for
14336): two row reductions (the sum of squares, then the absolute maximum) across 8-16 warps a
row, each a shared-memory round and a barrier, on 16 of 132 SMs. Fewer warps a row means fewer
barrier participants and more values a thread; the probe times every num_warps.

    PYTHONPATH=src python benchmarks/probes/rowwise_m16_probe.py [--m 16] [--rounds 5]

For each form (RMSNorm + int8 quantize over 4096 channels; SiLU-and-multiply + quantize over
14336), and each num_warps, the outputs are compared with the package's launch (the codes may
differ by one where the sum's order moves a value across a rounding boundary: reported), then
timed in CUDA graphs, interleaved; beside them inductor's add + RMSNorm (fp16, 4096) and silu * up
(14336) compiled, and the package's unfused quantize_per_token launch. Since v50 the package's
silu_mul_quant at decode sizes is the split form (silu_mul_quant_split_kernel, each row over
programs), timed here by part width beside the one-program kernel's num_warps.
"""
import argparse
import functools

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from sailfish.bench.timing import graph_time_us
    from sailfish.ops import rowwise as R
    from sailfish.ops import w4a8 as ops8
    from sailfish.runtime.launch import Launch

    dev = torch.device("cuda")
    torch.manual_seed(0)
    m, calls = a.m, 20
    print(torch.cuda.get_device_name(), f"M = {m}", flush=True)
    x = torch.randn(m, 4096, dtype=torch.float16, device=dev)
    r = torch.randn_like(x)
    w = torch.rand(4096, dtype=torch.float16, device=dev) + 0.5
    gu = torch.randn(m, 2 * 14336, dtype=torch.float16, device=dev)
    paths = {}
    for rms, n, src, ops_ in ((True, 4096, x, (w,)), (False, 14336, gu, (gu,))):
        name = "rms_norm_quant 4096" if rms else "silu_mul_quant 14336"
        want_q, want_s = (R.rms_norm_launch(x, w, 1e-5, "int8") if rms else R.silu_mul_launch(gu, "int8"))
        base = R._tile(n, None)
        for warps in (2, 4, 8, 16, 32):
            meta = dict(base, num_warps=warps)
            launch = Launch(R._kernel(), dict(meta, RMS=rms, QUANT=True, FP8=False, EMU_BF16=False), dev.index or 0)
            q, s = torch.empty_like(want_q), torch.empty_like(want_s)

            def run(launch=launch, q=q, s=s, n=n, src=src, ops_=ops_):
                launch((m, 1), src, *ops_, q, s, m, n, src.shape[-1], 1, 1, 1e-5)
            run()
            diff = (q.int() - want_q.int()).abs().max().item()
            print(f"  {name} num_warps {warps}{' (the package: ' + str(base['num_warps']) + ')' if warps == base['num_warps'] else ''}: "
                  f"codes within {diff} of the package's, scales rel {((s - want_s).abs() / want_s.abs()).max().item():.2e}",
                  flush=True)
            paths[f"{name} warps {warps}"] = run
    for bk in (1024, 2048, 4096):  # the split form (each row over programs), by part width; the package: 2048
        paths[f"silu_mul_quant 14336 split {bk}"] = functools.partial(R.silu_mul_launch, gu, "int8", bk, True)
        q, sc = paths[f"silu_mul_quant 14336 split {bk}"]()
        print(f"  silu_mul_quant split {bk}: codes equal to the one-program kernel's "
              f"{torch.equal(q, R.silu_mul_launch(gu, 'int8', split=False)[0])}", flush=True)
    paths["quantize_per_token 4096 (unfused)"] = functools.partial(ops8.quantize_per_token_launch, x)
    norm = torch.compile(lambda x, r, w: torch.nn.functional.rms_norm(x + r, (4096,), w, 1e-5), fullgraph=True)
    silu = torch.compile(lambda gu: torch.nn.functional.silu(gu[:, :14336]) * gu[:, 14336:], fullgraph=True)
    paths["inductor add + rms_norm 4096"] = functools.partial(norm, x, r, w)
    paths["inductor silu * up 14336"] = functools.partial(silu, gu)
    for fn in paths.values():
        fn()
    times = {k: [] for k in paths}
    for _ in range(a.rounds):
        for k, fn in paths.items():
            times[k].append(graph_time_us([fn] * calls))
    for k, v in times.items():
        print(f"{k:45s} {sorted(v)[len(v) // 2]:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
