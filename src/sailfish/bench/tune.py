"""Tune W4A16 kernel configs with the decode-step timing method and write a config table.

    python -m sailfish.bench.tune --out src/sailfish/kernels/configs/h200.json

For every shape and M, every candidate config of the kernel family (--family w4a16 or
w4a8: the ops module's candidate list plus the heuristic's choice and the config the
launcher uses today, "shipped": the package table's entry or the heuristic) is checked
against the reference, then timed (CUDA graph over R weight copies); the fastest is
written under the same key the launcher looks up (the 4 fastest and the shipped config are
timed twice more, best of three). Each line of the log gives the best, the shipped and the
heuristic times (--show N: the N fastest candidates too).
Existing entries in --out are kept unless re-tuned.

    python -m sailfish.bench.tune --kernels gluon_overlap --m 16,32,64 --show 3

times only one kernel's tiles (here 'gluon_overlap') against the shipped config, which is how
a new path is measured and a table updated for it without re-timing every candidate.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

from ..formats.int4 import GROUP_SIZES
from ..formats.qqq import GROUP_SIZES_W4A8
from .shapes import LLAMA_SHAPES, M_LIST, parse_ints, parse_shapes
from .timing import copies_needed, graph_time_us

def _w4a16_family(k, n, group_size, sym, dtype, experimental=False):
    """(layer factory, launcher(layer, x, cfg), reference(layer, x), candidates, keys).
    experimental: the candidates also include ops/w4a16.experimental_candidates."""
    from ..formats.int4 import padded_k
    from ..nn import QuantLinear
    from ..ops.w4a16 import (w4a16_candidates, w4a16_heuristic, experimental_candidates, w4a16_config,
                             w4a16_key, w4a16_launch)
    from ..tuning import problem_key
    kp = padded_k(k)
    problem = dict(N=n, Kp=kp, group_size=group_size, general_gidx=False, has_zeros=not sym)

    def make(lin):
        return QuantLinear.from_linear(lin, group_size=group_size, sym=sym)

    def launch(l, x, cfg):
        return w4a16_launch(x, l.qweight, l.scales, l.zeros, None, None, None, k, group_size, config=cfg)

    def prepare(l, x):
        return x, x.float() @ l.dequantize().T

    def candidates(m):
        dev = torch.device("cuda")
        extra = experimental_candidates(device=dev, M=m, **problem) if experimental else ()
        return [w4a16_heuristic(device=dev, M=m, **problem), *w4a16_candidates(device=dev, M=m, **problem),
                *extra]

    def keys(m):
        out = [w4a16_key(kp, n, m, group_size, not sym, False, dtype)]
        if group_size == 128 and sym and dtype == torch.float16:  # the default for other formats
            out.append(problem_key("w4a16", kp, n, m, "any"))
        return out

    def shipped(m):  # what the launcher picks without autotuning: its lookup
        return w4a16_config(torch.device("cuda"), m, n, kp, group_size, not sym, False, dtype)

    return make, launch, prepare, candidates, keys, shipped


def _w4a8_family(k, n, group_size, sym, dtype, experimental=False):
    """As _w4a16_family (experimental: W4A8 has no such tiles; main refuses the flag)."""
    from ..formats.int4 import padded_k
    from ..nn import QuantLinear
    from ..ops.w4a8 import w4a8_candidates, w4a8_heuristic, w4a8_config, w4a8_key, w4a8_launch
    from ..tuning import problem_key
    kp = padded_k(k)

    def make(lin):
        return QuantLinear.from_linear(lin, act_bits=8, group_size=group_size)

    def launch(l, xq, cfg):
        x_q, x_s = xq
        return w4a8_launch(x_q, x_s, l.qweight, l.s_ch, l.s_g, l.bias, k, group_size, dtype, config=cfg)

    def prepare(l, x):
        x_q, x_s = l.quantize_input(x)
        return (x_q, x_s), (x_s[:, None] * x_q.float()) @ l.dequantize().T

    def candidates(m):
        problem = dict(M=m, N=n, K=k, Kp=kp, group_size=group_size)
        dev = torch.device("cuda")
        return [w4a8_heuristic(device=dev, **problem), *w4a8_candidates(device=dev, **problem)]

    def keys(m):
        out = [w4a8_key(k, n, m, group_size, dtype)]
        if group_size == 128 and dtype == torch.float16:  # the default for other formats
            out.append(problem_key("w4a8", k, n, m, "any"))
        return out

    def shipped(m):  # the launcher's lookup
        return w4a8_config(torch.device("cuda"), m, n, k, kp, group_size, dtype)

    return make, launch, prepare, candidates, keys, shipped


FAMILIES = {"w4a16": _w4a16_family, "w4a8": _w4a8_family}


RETIME = 4  # candidates timed twice more before the choice


def best_of_three(results, shipped, time):
    """results: (time, config) pairs sorted by time. The RETIME fastest, and the shipped config
    wherever it ranks, are timed twice more (time(config)) and keep their best of three; the
    pairs come back sorted. One timing each let a 5-10% outlier decide between near-equal tiles
    (H200: the same config's time spread 3-7% between runs), and a single timing of the shipped
    config once read 36.1 us against 19-22 us in other runs (H100), which the log compares with."""
    again = results[:RETIME] + [tc for tc in results[RETIME:] if tc[1] == shipped]
    rest = [tc for tc in results[RETIME:] if tc[1] != shipped]
    top = []
    for t, cfg in again:
        for _ in range(2):
            t = min(t, time(cfg))
        top.append((t, cfg))
    return sorted(top + rest, key=lambda tc: tc[0])


def tune_shape(family, k, n, ms, group_size, sym, dtype, log=print, experimental=False, kernels=None, show=0):
    """kernels: only the candidates of these kernels (Config.kernel) are timed, with the shipped
    config (None: all). show: log the `show` fastest candidates with their times."""
    make, launch, prepare, candidates, keys, shipped = FAMILIES[family](k, n, group_size, sym, dtype,
                                                                        experimental)
    lin = torch.nn.Linear(k, n, bias=False, dtype=dtype, device="cuda")
    base = make(lin)
    del lin
    layers = [base] + [copy.deepcopy(base) for _ in range(copies_needed(
        sum(b.numel() * b.element_size() for b in base.buffers())) - 1)]
    fp16_w = [torch.randn(n, k, dtype=dtype, device="cuda") for _ in range(copies_needed(2 * n * k))]
    best = {}
    for m in ms:
        x = torch.randn(m, k, dtype=dtype, device="cuda")
        xin, ref = prepare(base, x)
        now = shipped(m)
        cands = [c for c in candidates(m) if kernels is None or c.kernel in kernels]
        cands = list(dict.fromkeys([*cands, now]))
        results = []
        for cfg in cands:
            try:
                y = launch(base, xin, cfg)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if not err < 5e-3:
                    log(f"  WRONG {cfg} err={err:.2e}")
                    continue
                t = graph_time_us([lambda l=l, cfg=cfg: launch(l, xin, cfg) for l in layers])
            except Exception as e:  # noqa: BLE001 - report and move on (e.g. out of shared memory)
                log(f"  skip {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            results.append((t, cfg))
        results.sort(key=lambda tc: tc[0])

        def timed(cfg, xin=xin, layers=layers):  # (defaults: the loop's current values)
            return graph_time_us([lambda l=l: launch(l, xin, cfg) for l in layers])

        results = best_of_three(results, now, timed)
        heur_t = next((t for t, c in results if c == cands[0]), float("nan")) if kernels is None else float("nan")
        now_t = next((t for t, c in results if c == now), float("nan"))
        t, cfg = results[0]
        t_fp = graph_time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in fp16_w])
        log(f"{family} K={k} N={n} M={m}: best {t:.1f} us ({t_fp / t:.2f}x cuBLAS {t_fp:.1f} us) "
            f"shipped {now_t:.1f} us heuristic {heur_t:.1f} us; {cfg}")
        for tc, c in results[:show]:
            log(f"    {tc:8.1f} us {'*' if c == now else ' '} {c}")
        for key in keys(m):
            best[key] = cfg
    del layers, fp16_w, base
    torch.cuda.empty_cache()
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sailfish.bench.tune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in LLAMA_SHAPES),
                    help="comma-separated KxN list")
    ap.add_argument("--m", default=",".join(map(str, M_LIST)), help="comma-separated M list")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="w4a16")
    ap.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=128)
    ap.add_argument("--asym", action="store_true")
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--out", default=None, help="config JSON to update")
    ap.add_argument("--experimental", action="store_true",
                    help="w4a16: also the tiles that pass every test but did not win where measured (the "
                         "GEMV's cp.async ring; the overlap kernels outside M = 9-128); each is checked against "
                         "the reference like every candidate")
    ap.add_argument("--kernels", default=None,
                    help="comma-separated Config.kernel names: time only their tiles and the shipped config")
    ap.add_argument("--show", type=int, default=0, metavar="N", help="log the N fastest candidates per problem")
    args = ap.parse_args(argv)
    try:
        shapes, ms = parse_shapes(args.shapes), parse_ints(args.m, "M")
    except ValueError as e:
        ap.error(str(e))
    if args.family != "w4a16" and args.group_size not in GROUP_SIZES_W4A8:
        ap.error(f"--group-size {args.group_size}: --family {args.family} takes {GROUP_SIZES_W4A8}")
    kernels = None if args.kernels is None else set(args.kernels.split(","))
    from ..ops.w4a16 import W4A16_KERNELS
    known = set(W4A16_KERNELS)
    if kernels is not None and not kernels <= known:
        ap.error(f"--kernels: unknown {sorted(kernels - known)}; the kernels are {sorted(known)}")
    if args.experimental and args.family != "w4a16":
        ap.error("--experimental has tiles for --family w4a16 only")
    if args.show < 0:
        ap.error(f"--show must be >= 0, got {args.show}")
    if not torch.cuda.is_available():
        print("tuning needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ["SAILFISH_AUTOTUNE"] = "0"
    from ..tuning import Config, gpu_key, save_table
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    entries = {}
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            entries = {k: Config(**v) for k, v in json.load(f).get("configs", {}).items()}
    t0 = time.time()
    for k, n in shapes:
        entries.update(tune_shape(args.family, k, n, ms, args.group_size, not args.asym, dtype,
                                  experimental=args.experimental, kernels=kernels,
                                  show=args.show))
        if args.out:
            save_table(args.out, gpu_key(torch.device("cuda")), entries,
                       {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "triton": __import__("triton").__version__})
    print(f"tuned in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
