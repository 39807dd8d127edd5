"""Benchmark Sailfish and peer kernels with the decode-step method (docs/benchmarking.md
in the repository; summarised below).

    python -m sailfish.bench                       # all Llama-3 8B + 70B shapes, all M, all kernels
    python -m sailfish.bench --quick               # 4096x4096 + 8192x8192, M in {1,16,64,256,1024}
    python -m sailfish.bench --shapes 8b --m 1,16,256 --kernels sailfish-w4a16,tinygemm
    python -m sailfish.bench --check-only          # reference checks only, no timing

For each shape, kernel (configuration) and M: the kernel's output is checked against its own
reference math on random data (a kernel above tolerance is never timed); then one CUDA graph
calling the kernel once on each of R distinct weight copies (R x bytes >= 3 x L2, R >= 2) is
replayed --replays times; time = median replay / R. The HBM ceiling (>= 1 GiB device copy)
is measured once in the same process; roofline = (kernel's minimum bytes / time) / ceiling;
speedup = cuBLAS fp16 time (same shape, M, run) / time. cuBLAS fp16 always runs first per
shape when speedups are needed, and is reported when requested or by default.

Writes <out-dir>/<name>.json (rows: kernel, K, N, M, dtype, group_size, time_us, gbps,
roofline, speedup_vs_fp16; group_size 0 = not group-quantized, -1 = per channel) and
<name>_speedup.png / <name>_roofline.png (matplotlib, optional).

Without CUDA: correctness mode. TRITON_INTERPRET=1 is set before triton is imported, tiny
shapes (256x128, 512x256; M 1 and 16) run through the Triton interpreter, only the Sailfish
kernels are checked; no timings, no plots; JSON (time_us null) only with --out-dir/--name.
Exit status: 0 when every Sailfish check passed, 1 when one failed, 2 when nothing ran.
Config choice follows the library (shipped table, then heuristic; SAILFISH_AUTOTUNE=1 adds a
one-time benchmark where the table has no entry, SAILFISH_HEURISTICS_ONLY=1 skips the table).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import os
import shlex
import sys
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .shapes import LLAMA_SHAPES, M_LIST, parse_m, parse_shapes

QUICK_SHAPES = [(4096, 4096), (8192, 8192)]
QUICK_M = [1, 16, 64, 256, 1024]
CPU_SHAPES = [(256, 128), (512, 256)]
CPU_M = [1, 16]
MIN_REPLAYS = 10


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sailfish.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None,
                    help="8b, 70b, all, or KxN list, e.g. 4096x4096,8192x8192 (default all; "
                         "--quick: 4096x4096,8192x8192; CPU: 256x128,512x256)")
    ap.add_argument("--m", default=None,
                    help="comma list of M or 'all' (default all: " + ",".join(map(str, M_LIST)) +
                         "; --quick: " + ",".join(map(str, QUICK_M)) + "; CPU: 1,16)")
    ap.add_argument("--kernels", default=None,
                    help="comma list of kernel names or spec ids (default: all available)")
    ap.add_argument("--quick", action="store_true", help="a small subset of shapes and M")
    ap.add_argument("--out-dir", default=None, help="where to write results (default benchmarks/results)")
    ap.add_argument("--name", default=None, help="file stem (default the GPU key, e.g. h200)")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument("--replays", type=int, default=20, help=f"graph replays per row (>= {MIN_REPLAYS})")
    ap.add_argument("--check-only", action="store_true",
                    help="reference checks only, no timing (implied without CUDA)")
    ap.add_argument("--seed", type=int, default=0, help="random data seed")
    ap.add_argument("--list", action="store_true", help="list the registered kernels and exit")
    return ap


def _enable_interpreter() -> Optional[str]:
    """CPU mode: Triton's interpreter must be on before triton (and Sailfish's kernels) load."""
    os.environ["TRITON_INTERPRET"] = "1"
    if "sailfish.kernels.w4a16" in sys.modules:
        return ("warning: Sailfish's Triton kernels were imported before TRITON_INTERPRET=1 was set; "
                "set TRITON_INTERPRET=1 in the environment")
    return None


# ----------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    cpu_mode = not cuda
    warn = _enable_interpreter() if cpu_mode else None
    check_only = args.check_only or cpu_mode

    from . import kernels as KR
    from . import report as RP
    from .timing import copies_needed, graph_time_us, hbm_ceiling_gbps, tensor_core_peaks

    if args.list:
        for s in KR.REGISTRY.values():
            why = s.available()
            print(f"{s.id:<34} kernel={s.kernel:<16} dtype={s.dtype:<5} group_size={s.group_size:<4}"
                  f"{' cpu' if s.cpu else ''}{'  (unavailable: ' + why + ')' if why else ''}")
        return 0

    try:
        if args.shapes is not None:
            shapes = parse_shapes(args.shapes)
        else:
            shapes = CPU_SHAPES if cpu_mode else (QUICK_SHAPES if args.quick else list(LLAMA_SHAPES))
        if args.m is not None:
            ms = parse_m(args.m)
        else:
            ms = CPU_M if cpu_mode else (QUICK_M if args.quick else list(M_LIST))
        requested = None if args.kernels is None else [t.strip() for t in args.kernels.split(",") if t.strip()]
        specs = KR.select(requested)
    except ValueError as e:
        ap.error(str(e))
    if args.replays < MIN_REPLAYS:
        ap.error(f"--replays must be >= {MIN_REPLAYS}")

    # which specs run
    notes: List[str] = []
    run_specs: List[KR.KernelSpec] = []
    for s in specs:
        why = s.available()
        if why:
            if not (requested is None and s.optional):
                notes.append(f"skip {s.id}: {why}")
            continue
        if cpu_mode and not s.cpu:
            if requested is not None:
                notes.append(f"skip {s.id}: needs CUDA (CPU mode checks the Sailfish kernels only)")
            continue
        run_specs.append(s)
    base_spec = KR.REGISTRY[KR.BASELINE_ID]
    report_base = base_spec in run_specs
    if not check_only and any(not s.baseline for s in run_specs) and not report_base:
        run_specs.insert(0, base_spec)          # timed for speedups, not reported
    run_specs.sort(key=lambda s: not s.baseline)  # baseline first within each shape
    if not run_specs:
        for n in notes:
            print(n)
        print("nothing to run")
        return 2

    # environment
    import triton  # after TRITON_INTERPRET is settled

    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        from ..tuning import gpu_key
        props = torch.cuda.get_device_properties(0)
        gpu, key = torch.cuda.get_device_name(0), gpu_key(device)
        l2, sms = int(props.L2_cache_size), int(props.multi_processor_count)
    else:
        gpu, key, l2, sms = "cpu", "cpu", None, None
    name = args.name or key
    out_dir = args.out_dir or os.path.join("benchmarks", "results")
    write_files = not cpu_mode or args.out_dir is not None or args.name is not None
    command = "python -m sailfish.bench" + ("" if not argv else " " + shlex.join(argv))

    print(f"sailfish.bench: {gpu} | torch {torch.__version__} | triton {triton.__version__}"
          + (f" | L2 {l2 / 2**20:.0f} MiB, {sms} SMs" if cuda else ""))
    if warn:
        print(warn)
    if cpu_mode:
        print("CPU correctness mode (no CUDA): Triton interpreter (TRITON_INTERPRET=1), reference "
              "checks of the Sailfish kernels only -- NO timings, NO plots.")
    elif check_only:
        print("check-only mode: reference checks, no timings.")
    for n in notes:
        print(n)
    hbm = None
    if not check_only:
        for nbytes in (2 << 30, 1 << 30):
            try:
                hbm = hbm_ceiling_gbps(nbytes)
                break
            except torch.cuda.OutOfMemoryError:
                gc.collect()
                torch.cuda.empty_cache()
        if hbm is None:
            print("error: could not measure the HBM ceiling (out of memory)")
            return 2
        print(f"HBM ceiling (device copy, read + write): {hbm:.0f} GB/s")
        peaks = tensor_core_peaks()
        print("cuBLAS dense peaks (8192^3): " + ", ".join(f"{k} {v / 1e6:.0f} TFLOP/s" for k, v in peaks.items()))
    print(f"shapes: {', '.join(f'{k}x{n}' for k, n in shapes)} | M: {','.join(map(str, ms))} | "
          f"kernels: {', '.join(s.id + ('' if s is not base_spec or report_base else ' (baseline only)') for s in run_specs)}"
          + ("" if check_only else f" | replays {args.replays}"))
    RP.set_shape_order(shapes)

    ctx = KR.BuildContext(device=device, copies=(lambda nb: 1) if check_only else copies_needed, seed=args.seed)
    prog = RP.Progress(len(shapes) * len(ms) * len(run_specs))
    prog.line(RP.row_header())
    t_start = time.time()
    res = Results()
    interrupted = False
    try:
        run_benchmark(run_specs, shapes, ms, ctx=ctx,
                      timer=None if check_only else (lambda calls: graph_time_us(calls, replays=args.replays)),
                      hbm_gbps=hbm, base_spec=base_spec, report_base=report_base, prog=prog, res=res)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        prog.close()
    if interrupted:
        print("\ninterrupted: reporting the rows finished so far")
    elapsed = time.time() - t_start
    rows, checks, skipped, failures = res.rows, res.checks, res.skipped, res.failures
    RP.add_limit_fractions(rows, hbm, None if check_only else peaks)
    kernel_notes, base_us = res.kernel_notes, res.base_us

    # ---- tail: what the lead reads -------------------------------------------------
    reported_rows = [r for r in rows if r["reported"]]
    labels = list(dict.fromkeys(s.label for s in run_specs if not s.baseline))
    print()
    n_ok = sum(c["ok"] for c in checks)
    print(f"reference checks: {n_ok}/{len(checks)} passed"
          + (f"; {len(skipped)} rows skipped or failed" if skipped else "") + f" ({elapsed:.0f} s)")
    reasons: Dict[str, int] = {}
    for s in skipped:
        key2 = f"{s['id']}: {s['reason']}"
        reasons[key2] = reasons.get(key2, 0) + 1
    for why, cnt in reasons.items():
        print(f"  {cnt}x {why}")
    for sid, note in kernel_notes.items():
        print(f"  note {sid}: {note}")

    doc_extra = {
        "mode": "correctness only" if check_only else "timing",
        "partial": interrupted,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "device": gpu, "gpu_key": key, "l2_bytes": l2, "sm_count": sms,
        "cuda": getattr(torch.version, "cuda", None),
        "replays": None if check_only else args.replays,
        "method": "decode-step: R distinct weight copies (R*bytes >= 3*L2, R >= 2) in one CUDA graph, "
                  "median of replays / R; roofline = min bytes / time / hbm_gbps; limit_fraction = "
                  "max(min bytes / hbm_gbps, 2MNK / best cuBLAS rate of the kernel's tensor-core "
                  "family in the run: its rows or an 8192^3 probe, tensor_core_peaks_tflops) / time",
        "group_size_convention": "0 = not group-quantized (cuBLAS fp16/bf16/int8/fp8); -1 = per output channel",
        "bytes_models": {
            "w4a16": "N*K/2 + 2*N*ceil(K/g)*(2 if zeros else 1) + 2*M*K + 2*M*N",
            "fp16/bf16": "2*N*K + 2*M*K + 2*M*N",
            "int8 (W8A8)": "N*K + M*K + 2*M*N (torch._int_mm actually writes int32)",
            "fp8 (W8A8)": "N*K + M*K + 2*M*N + 8 (per-tensor fp32 scales)"},
        "configs": {s.id: {"kernel": s.kernel, "dtype": s.dtype, "group_size": s.group_size,
                           "sym": s.sym, "label": s.label} for s in run_specs},
        "env": {k2: v for k2, v in os.environ.items() if k2.startswith(("SAILFISH_", "TRITON_INTERPRET"))},
        "checks": checks,
        "skipped": skipped,
        "kernel_notes": kernel_notes,
    }
    if not check_only:
        doc_extra["tensor_core_peaks_tflops"] = {k: round(v / 1e6, 1) for k, v in peaks.items()}
    if not report_base and base_us:
        doc_extra["baseline_rows"] = [RP.json_row(r) for r in rows if not r["reported"]]
    if not check_only:
        print()
        print(f"Speedup over cuBLAS fp16 (roofline fraction in brackets); {gpu}, HBM {hbm:.0f} GB/s, "
              f"replays {args.replays}:")
        print(RP.summary_table(reported_rows, base_us, labels))

    doc = RP.build_document({"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                             "hbm_gbps": hbm}, reported_rows, doc_extra)
    problems = RP.validate_document(doc)
    if problems:
        print("internal error: result document does not match the schema: " + "; ".join(problems[:5]))
    if write_files:
        path = os.path.join(out_dir, f"{name}.json")
        RP.write_json(path, doc)
        print(f"wrote {path}")
        if not check_only and not args.no_plots:
            plot_labels = [s.label for s in run_specs if s is not base_spec or report_base]
            for p in RP.write_plots(out_dir, name, reported_rows, plot_labels, shapes, gpu,
                                    baseline_label=base_spec.label):
                print(f"wrote {p}")
    else:
        print("correctness only: no JSON written (pass --out-dir or --name to write one)")

    if interrupted:
        return 130
    if failures:
        print(f"FAILED: {len(failures)} Sailfish rows failed:")
        for f in failures[:20]:
            print(f"  {f}")
        return 1
    if not checks:
        print("nothing was checked")
        return 2
    ours = [c for c in checks if any(s.id == c["id"] and s.ours for s in run_specs)]
    print(f"OK: {len(ours)} Sailfish checks passed, none failed" + (" (correctness only)" if check_only else ""))
    return 0


@dataclass
class Results:
    rows: List[dict] = field(default_factory=list)        # finished rows (reported or not)
    checks: List[dict] = field(default_factory=list)
    skipped: List[dict] = field(default_factory=list)
    failures: List[str] = field(default_factory=list)     # Sailfish rows that failed
    kernel_notes: Dict[str, str] = field(default_factory=dict)
    base_us: Dict[Tuple[int, int, int], float] = field(default_factory=dict)


def run_benchmark(run_specs, shapes, ms, *, ctx, timer: Optional[Callable[[list], float]],
                  hbm_gbps: Optional[float], base_spec, report_base: bool, prog,
                  res: Optional[Results] = None) -> Results:
    """Shapes outer, kernel specs (baseline first) next, M inner: every M of one
    (kernel, shape) reuses its weights, which are freed before the next is built.
    timer(calls) -> us per call, or None for correctness only. Results accumulate in `res`
    (a new Results if None), so a caller keeps what finished if the run is interrupted."""
    import torch

    from . import kernels as KR
    from . import report as RP

    res = Results() if res is None else res
    cuda = ctx.device.type == "cuda"

    def skip(spec, k, n, m, reason, *, fail=False, count=1):
        res.skipped.append({"id": spec.id, "kernel": spec.kernel, "dtype": spec.dtype,
                            "group_size": spec.group_size, "K": k, "N": n, "M": m, "reason": reason})
        where = f"M={m}" if m is not None else "all M"
        prog.line(f"{'FAIL' if fail else 'skip'} {spec.id} {k}x{n} {where}: {reason}", counted=True)
        if fail:
            res.failures.append(f"{spec.id} K={k} N={n} {where}: {reason}")
        prog.step(count)

    for k, n in shapes:
        for spec in run_specs:
            reported = spec is not base_spec or report_base
            prog.set_status(f"{spec.label} {k}x{n}: building")
            built = None
            try:
                built = spec.builder(k, n, ctx)
            except KR.Skip as e:
                skip(spec, k, n, None, str(e), fail=spec.ours, count=len(ms))
            except Exception as e:  # noqa: BLE001 - one kernel must not end the run
                skip(spec, k, n, None, f"build failed: {KR._short(e)}", fail=spec.ours, count=len(ms))
            if built is None:
                _free(torch, cuda)
                continue
            if built.note:
                res.kernel_notes[spec.id] = built.note
            for m in ms:
                prog.set_status(f"{spec.label} {k}x{n} M={m}")
                case = None
                try:
                    case = built.case(m)
                    err = float(case.check())
                except KR.Skip as e:
                    skip(spec, k, n, m, str(e), fail=spec.ours)
                    continue
                except Exception as e:  # noqa: BLE001
                    case = None
                    _sync(torch, cuda)
                    skip(spec, k, n, m, f"error: {KR._short(e)}", fail=spec.ours)
                    _free(torch, cuda)
                    continue
                ok = err <= case.tol
                res.checks.append({"id": spec.id, "kernel": spec.kernel, "dtype": spec.dtype,
                                   "group_size": spec.group_size, "K": k, "N": n, "M": m,
                                   "err": err if math.isfinite(err) else None, "tol": case.tol, "ok": ok})
                if not ok:
                    skip(spec, k, n, m, f"WRONG: rel error {err:.2e} > tol {case.tol:.0e} (not timed)",
                         fail=spec.ours)
                    continue
                row = {"kernel": spec.kernel, "K": k, "N": n, "M": m, "dtype": spec.dtype,
                       "group_size": spec.group_size, "time_us": None, "gbps": None,
                       "roofline": None, "speedup_vs_fp16": None, "label": spec.label, "id": spec.id,
                       "R": built.copies, "err": err, "reported": reported, "ours": spec.ours}
                if timer is not None:
                    try:
                        t = float(timer(case.calls))
                    except Exception as e:  # noqa: BLE001
                        case = None
                        _sync(torch, cuda)
                        skip(spec, k, n, m, f"timing failed: {KR._short(e)}", fail=spec.ours)
                        _free(torch, cuda)
                        continue
                    if spec.baseline:
                        res.base_us[(k, n, m)] = t
                    gbps = case.min_bytes / (t * 1e3)     # bytes / us -> GB/s
                    base = res.base_us.get((k, n, m))
                    row.update(time_us=t, gbps=gbps, roofline=gbps / hbm_gbps if hbm_gbps else None,
                               speedup_vs_fp16=base / t if base is not None else None)
                res.rows.append(row)
                prog.line(RP.format_row(row) + ("" if reported else "  (baseline, not reported)"),
                          counted=True)
                prog.step()
                case = None
            built.release()
            built = None
            _free(torch, cuda)
    return res


def _sync(torch, cuda: bool = True) -> None:
    if not cuda:
        return
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass


def _free(torch, cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
