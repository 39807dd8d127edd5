"""Eager per-call cost of a Sailfish layer against F.linear: `python -m sailfish.bench.overhead`.

At decode (M = 1) a 4096x4096 layer's kernels take ~7 us on an H100 / H200, so what the host
spends per call (op dispatch, checks, config lookup, allocation, Triton's launcher) decides
the eager speed. For each callable below, after a warm-up (compilation, config choice):

  gpu us/call   CUDA events around `--calls` back-to-back calls, divided by the count: the
                throughput of an eager loop (the larger of host and GPU time per call)
  host us/call  time.perf_counter around each call (the host's share: enqueueing only), median
                and 90th percentile; each row interleaved with F.linear, one call of each per
                round, so that the host's drifts (clock, other processes) reach both alike, and
                the GPU synchronized (untimed) every SYNC_EVERY rounds, so that no call waits for
                a slot in the launch queue (back to back, a call whose kernels outlast its host
                time fills the queue and then times the GPU). Only two calls alternate: with
                every row in one round, each call found the caches cold from the others (F.linear
                read 84-124 us a call on an H100 host, docs/perf_log.md v51)
  over F.linear the median over rounds of (the row's host time - F.linear's in the same round):
                issue 39's bar, a layer call at most F.linear + 5 us

Rows, down the stack: F.linear (cuBLAS, the bar); the W4A16 QuantLinear and the W4A8
QuantLinearW4A8 layers; the ops they call (no autograd formula: x needs no gradient here);
the public ops (with one); the bare launchers (no op dispatch, no argument checks), in their
steady state (the problem's launch plan, runtime/launch.py) and with the config passed
explicitly, which launches through Triton's JIT as every call did before plans. The
difference between rows shows where the time goes. Issue 11's target: <= 20 us per layer
call at M = 1. This is a benchmark, not a test: it prints numbers and exits 0.
Needs CUDA (on CPU the kernels run in Triton's interpreter, whose cost says nothing here).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

from ..formats.int4 import GROUP_SIZES

TARGET_US = 20.0
SYNC_EVERY = 32  # rounds between the untimed synchronizations (two calls of <= 3 launches a round)


def gpu_us_per_call(fn: Callable[[], object], calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def host_us_interleaved(fns: List[Tuple[str, Callable[[], object]]], rounds: int) -> Dict[str, List[float]]:
    """Each row's host time per call (us), one call of every row per round, in order; the GPU
    synchronized outside the timing every SYNC_EVERY rounds."""
    times: Dict[str, List[float]] = {name: [] for name, _ in fns}
    clock = time.perf_counter
    for r in range(rounds):
        for name, fn in fns:
            t0 = clock()
            fn()
            times[name].append((clock() - t0) * 1e6)
        if r % SYNC_EVERY == SYNC_EVERY - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return times


def summarize(times: Dict[str, List[float]], base: str = "F.linear") -> Dict[str, Dict[str, float]]:
    """host_us_median, host_us_p90 and host_us_over_base (the median of the per-round
    differences to row `base`) of each row of host_us_interleaved."""
    rows = {}
    for name, t in times.items():
        srt = sorted(t)
        rows[name] = {"host_us_median": statistics.median(srt), "host_us_p90": srt[int(0.9 * (len(srt) - 1))],
                      "host_us_over_base": statistics.median(a - b for a, b in zip(t, times[base]))}
    return rows


def callables(k: int, n: int, m: int, dtype: torch.dtype, group_size: int, device: str = "cuda"
              ) -> List[Tuple[str, Callable[[], object]]]:
    """(name, zero-argument call) per row, from the layer down the stack; each call returns
    the (M, N) output (the quantize rows: (x_q, scales))."""
    from ..nn import QuantLinear, QuantLinearW4A8
    from ..ops.w4a8 import W4A8_TUNER, quantize_per_token_launch, w4a8_launch
    from ..ops.w4a16 import W4A16_TUNER, w4a16_launch
    from ..tuning import m_bucket

    lin = torch.nn.Linear(k, n, bias=False, dtype=dtype, device=device)
    w16 = QuantLinear.from_linear(lin, group_size=group_size)
    w8 = QuantLinearW4A8.from_linear(lin, group_size=group_size if group_size in (-1, 128) else 128)
    x = torch.randn(m, k, dtype=dtype, device=device)
    x_q, x_s = w8.quantize_input(x)
    ops = torch.ops.sailfish
    a16 = (x, w16.qweight, w16.scales, w16.zeros, None, None, None, k, w16.group_size)
    a8 = (w8.qweight, w8.s_ch, w8.s_g, None, k, w8.group_size)
    w4a16_launch(*a16)  # the problems' configs, for the rows that pass them explicitly
    w4a8_launch(x_q, x_s, *a8, dtype)
    dev, mb = x.device, m_bucket(m)
    cfg16 = W4A16_TUNER.lookup(dev, (w16.qweight.shape[1] * 8, n, mb, w16.group_size, w16.zeros is not None,
                                     False, dtype))
    cfg8 = W4A8_TUNER.lookup(dev, (k, n, mb, w8.group_size, dtype, "int8"))
    return [
        ("F.linear", lambda: torch.nn.functional.linear(x, lin.weight)),
        ("W4A16 layer", lambda: w16(x)),
        ("W4A16 op, no autograd", lambda: ops.w4a16_gemm_nograd(*a16)),
        ("W4A16 op", lambda: ops.w4a16_gemm(*a16)),
        ("W4A16 launcher", lambda: w4a16_launch(*a16)),
        ("W4A16 launcher, Triton JIT", lambda: w4a16_launch(*a16, config=cfg16)),
        ("W4A8 layer", lambda: w8(x)),
        ("W4A8 op, no autograd", lambda: ops.w4a8_linear_nograd(x, *a8)),
        ("W4A8 ops (quantize + gemm)", lambda: ops.w4a8_gemm(*ops.quantize_per_token(x), *a8, dtype)),
        ("W4A8 quantize op", lambda: ops.quantize_per_token(x)),
        ("W4A8 gemm op", lambda: ops.w4a8_gemm(x_q, x_s, *a8, dtype)),
        ("W4A8 launchers", lambda: w4a8_launch(*quantize_per_token_launch(x), *a8, dtype)),
        ("W4A8 launchers, Triton JIT gemm", lambda: w4a8_launch(*quantize_per_token_launch(x), *a8, dtype,
                                                                config=cfg8)),
    ]


def measure(k: int, n: int, m: int, dtype: torch.dtype, group_size: int, calls: int, warmup: int
            ) -> Dict[str, Dict[str, float]]:
    with torch.no_grad():
        fns = callables(k, n, m, dtype, group_size)
        gpu = {}
        for name, fn in fns:
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            gpu[name] = gpu_us_per_call(fn, calls)
        base = fns[0]  # F.linear, interleaved with each row in turn
        rows: Dict[str, Dict[str, float]] = {}
        for row in fns[1:]:
            pair = summarize(host_us_interleaved([base, row], calls), base[0])
            rows.setdefault(base[0], pair[base[0]])  # (F.linear's own row: from its first pairing)
            rows[row[0]] = pair[row[0]]
    return {name: {"gpu_us_per_call": gpu[name], **r} for name, r in rows.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sailfish.bench.overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4096x4096", help="KxN (default 4096x4096)")
    ap.add_argument("--m", type=int, default=1, help="rows per call (default 1)")
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=128)
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per row")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    from .shapes import parse_shapes
    try:
        shapes = parse_shapes(args.shape)
    except ValueError as e:
        ap.error(str(e))
    if len(shapes) != 1:
        ap.error(f"--shape {args.shape!r}: one KxN shape")
    for name in ("m", "calls"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    if not torch.cuda.is_available():
        print("sailfish.bench.overhead measures the host cost of eager calls on a CUDA GPU; no GPU "
              "is available here (the CPU interpreter's cost says nothing about it).", file=sys.stderr)
        return 2
    (k, n), = shapes
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    rows = measure(k, n, args.m, dtype, args.group_size, args.calls, args.warmup)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; K x N = {k}x{n}, M = {args.m}, {args.dtype}, "
          f"{args.calls} calls; target <= {TARGET_US:.0f} us per layer call")
    print(f"{'':30s} {'gpu us/call':>12s} {'host median':>12s} {'host p90':>10s} {'over F.linear':>14s}")
    for name, r in rows.items():
        print(f"{name:30s} {r['gpu_us_per_call']:12.1f} {r['host_us_median']:12.1f} {r['host_us_p90']:10.1f} "
              f"{r['host_us_over_base']:+14.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "K": k, "N": n, "M": args.m, "dtype": args.dtype, "calls": args.calls,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
