"""Probe (not part of the package; Hopper GPU): the W4A8 one-warpgroup kernel for decode sizes
(config kernel "gluon_overlap", kernels/w4a8_gluon.w4a8_gluon_overlap_kernel) at the Llama-3-8B
projections, against the shipped W4A8 config and W4A16 on the same fp16 weights.

Why (issue 39's bar "W4A8 at least as fast as W4A16 compiled at batch 16"; docs/perf_log.md v47,
v50): at M = 16 W4A8's GEMMs took 4.2 us a layer more than W4A16's, and W4A16 runs o and down on
its one-warpgroup overlap kernel, of which W4A8 had no twin until v50.

    PYTHONPATH=src python benchmarks/probes/w4a8_overlap_probe.py [--m 16] [--rounds 5]

Every tile's output is first compared with the shipped config's bit for bit (int32 sums: exact;
a wrong kernel is never timed), then per projection the shipped W4A8 call (activation
quantization excluded: x_q given), every tile and W4A16 g128 are timed, interleaved, each in
CUDA graphs over enough weight copies to overflow L2.
"""
import argparse
import functools
import sys

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # K, N
STEPS = (3, 4)
SPLITS = (1, 2, 4, 7, 8)


def ab(m: int, rounds: int) -> None:
    import torch
    import triton

    from sailfish import Config
    from sailfish.bench.timing import copies_needed, graph_time_us
    from sailfish.nn import QuantLinear, QuantLinearW4A8
    from sailfish.ops import w4a8 as ops8
    from sailfish.ops.common import gluon_overlap_split_ok

    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "triton", triton.__version__, f"M = {m}", flush=True)
    bm = 16 if m <= 16 else 32
    for name, (K, N) in SHAPES.items():
        lin = torch.nn.Linear(K, N, bias=False, dtype=torch.float16, device=dev)
        l8 = QuantLinearW4A8.from_linear(lin, group_size=128)
        x = torch.randn(m, K, dtype=torch.float16, device=dev)
        x_q, x_s = l8.quantize_input(x)
        want = l8.forward_quantized(x_q, x_s, torch.float16)
        reps = copies_needed(N * K // 2, dev)
        w8 = [(l8.qweight.clone(), l8.s_ch.clone(), l8.s_g.clone()) for _ in range(reps)]
        l16s = [QuantLinear.from_linear(lin, group_size=128) for _ in range(min(reps, 8))]
        tiles = [Config(bm, 64, 256, split, 8, 4, stages, kernel="gluon_overlap")
                 for stages in STEPS for split in SPLITS if gluon_overlap_split_ok(split, K // 256)]
        calls = {"shipped w4a8": [functools.partial(ops8.w4a8_gemm_impl, x_q, x_s, qw, s_ch, s_g, None, K, 128,
                                                    torch.float16) for qw, s_ch, s_g in w8],
                 "w4a16": [functools.partial(layer, x) for layer in l16s]}
        for cfg in tiles:
            got = ops8.w4a8_launch(x_q, x_s, *w8[0], None, K, 128, torch.float16, config=cfg)
            same = torch.equal(got, want)
            print(f"  {name} split {cfg.SPLIT_K} stages {cfg.num_stages}: equal to the shipped W4A8 {same}", flush=True)
            if same:
                calls[f"split {cfg.SPLIT_K} stages {cfg.num_stages}"] = [
                    functools.partial(ops8.w4a8_launch, x_q, x_s, qw, s_ch, s_g, None, K, 128, torch.float16,
                                      config=cfg) for qw, s_ch, s_g in w8]
        for cs in calls.values():
            for c in cs:
                c()
        times = {k: [] for k in calls}
        for _ in range(rounds):
            for k, cs in calls.items():
                times[k].append(graph_time_us(cs))
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        best = min((k for k in med if k.startswith("split")), key=med.get, default=None)
        print(f"{name} K={K} N={N} M={m}: shipped W4A8 {med['shipped w4a8']:.1f} us, W4A16 {med['w4a16']:.1f} us, "
              f"overlap best ({best}) {med.get(best, float('nan')):.1f} us; all "
              f"{{{', '.join(f'{k}: {v:.1f}' for k, v in med.items())}}}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    ab(a.m, a.rounds)


if __name__ == "__main__":
    sys.exit(main())
