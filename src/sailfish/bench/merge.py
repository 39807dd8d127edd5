"""Merge result files of several `python -m sailfish.bench` runs on one GPU into one file
(and its plots), e.g. the 8B and 70B shape sets run as two device calls:

    python -m sailfish.bench.merge benchmarks/results/h200.json h200_8b.json h200_70b.json

Rows are kept as measured: each row's roofline fraction uses its own run's HBM ceiling and
its speedup the cuBLAS fp16 time of its own run. A row measured again in a later input
(same kernel, dtype, group size, K, N, M) replaces the earlier one, so a re-run of some
kernels can be merged into an existing file. The merged "hbm_gbps" is the mean of the
runs' ceilings, and "runs" lists every run's command, date, ceiling and SAILFISH_*
environment (an input that is itself a merged file contributes its runs).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .report import write_json, write_plots


def merge(docs: list) -> dict:
    gpus = {d["gpu"] for d in docs}
    if len(gpus) != 1:
        raise ValueError(f"results come from different GPUs: {sorted(gpus)}")
    out = dict(docs[0])
    rows = {}
    for d in docs:
        for r in d["rows"]:
            rows[(r["kernel"], r["dtype"], r["group_size"], r["K"], r["N"], r["M"])] = r
    out["rows"] = list(rows.values())
    for key in ("checks", "skipped"):
        out[key] = [c for d in docs for c in d.get(key, [])]
    for key in ("configs", "kernel_notes", "bytes_models"):
        merged = {}
        for d in docs:
            merged.update(d.get(key, {}))
        out[key] = merged
    runs = []
    for d in docs:  # an input that is itself a merge contributes its own runs
        for r in d.get("runs") or [{"command": d.get("command"), "date": d.get("date"),
                                     "hbm_gbps": d["hbm_gbps"]}]:
            runs.append(dict(r, env=r.get("env", d.get("env", {}))))
    out["runs"] = runs
    out["hbm_gbps"] = sum(r["hbm_gbps"] for r in runs) / len(runs)
    out["command"] = " && ".join(r.get("command") or "?" for r in runs)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sailfish.bench.merge", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="merged JSON to write (plots go beside it)")
    ap.add_argument("inputs", nargs="+", help="bench JSON files of one GPU")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    docs = []
    for path in args.inputs:
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as e:  # a missing file, or not JSON
            ap.error(f"cannot read {path}: {e}")
    doc = merge(docs)
    write_json(args.out, doc)
    print(f"wrote {args.out} ({len(doc['rows'])} rows)")
    if not args.no_plots:
        labels = {(c["kernel"], c["dtype"], c["group_size"]): c["label"] for c in doc["configs"].values()}
        rows = [dict(r, label=labels.get((r["kernel"], r["dtype"], r["group_size"]), r["kernel"]))
                for r in doc["rows"]]
        shapes = list(dict.fromkeys((r["K"], r["N"]) for r in rows))
        order = list(dict.fromkeys(r["label"] for r in rows))
        name = os.path.splitext(os.path.basename(args.out))[0]
        for path in write_plots(os.path.dirname(os.path.abspath(args.out)), name, rows, order, shapes,
                                doc["gpu"], baseline_label=labels.get(("cublas-fp16", "fp16", 0), "")):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
