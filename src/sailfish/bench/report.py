"""Output of `python -m sailfish.bench`: progress line, terminal tables, JSON, plots."""
from __future__ import annotations

import json
import math
import os
import sys
import textwrap
from typing import Dict, List, Optional, Sequence, Tuple

ROW_KEYS = ("kernel", "K", "N", "M", "dtype", "group_size", "time_us", "gbps", "roofline",
            "speedup_vs_fp16", "limit_fraction")
TOP_KEYS = ("gpu", "torch", "triton", "hbm_gbps", "rows")


# ----------------------------------------------------------------------------------
# progress + per-row lines
# ----------------------------------------------------------------------------------
class Progress:
    """A progress bar with lines printed above it. On a terminal: tqdm's bar when tqdm is
    installed, else `[#####.....] i/n` rewritten in place. Not a terminal (a log): no bar, and
    lines printed with counted=True get an `[i/n]` prefix."""

    def __init__(self, total: int, stream=None, width: int = 30):
        self.total, self.done, self.width = max(1, total), 0, width
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar_shown = False
        self.status = ""
        self.prefix = 0 if self.tty else len(f"[{self.total}/{self.total}] ")
        self._tqdm = None
        if self.tty:
            try:  # optional: the built-in bar below is the fallback
                from tqdm import tqdm
                self._tqdm = tqdm(total=self.total, file=self.stream, dynamic_ncols=True, leave=False)
            except ImportError:
                pass

    def _bar(self) -> str:
        filled = int(self.width * self.done / self.total)
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {self.status}"

    def _clear(self) -> None:
        if self.tty and self._bar_shown:
            self.stream.write("\r\x1b[2K")
            self._bar_shown = False

    def line(self, text: str, counted: bool = False) -> None:
        """Print a line above the bar (counted=True: prefix [i/n] when not a tty)."""
        if self._tqdm is not None:
            self._tqdm.write(text, file=self.stream)
            return
        self._clear()
        if not self.tty:
            tag = f"[{min(self.total, self.done + 1)}/{self.total}]" if counted else ""
            text = "\n".join(tag.ljust(self.prefix) + t if i == 0 else " " * self.prefix + t
                             for i, t in enumerate(text.split("\n")))
        self.stream.write(text + "\n")
        self._show()

    def step(self, n: int = 1, status: Optional[str] = None) -> None:
        self.done = min(self.total, self.done + n)
        if status is not None:
            self.status = status
        self._refresh()

    def set_status(self, status: str) -> None:
        self.status = status
        self._refresh()

    def _refresh(self) -> None:
        if self._tqdm is not None:
            self._tqdm.n = self.done
            self._tqdm.set_postfix_str(self.status, refresh=True)
            return
        self._clear()
        self._show()

    def _show(self) -> None:
        if self.tty:
            self.stream.write(self._bar())
            self._bar_shown = True
        self.stream.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
        self._clear()
        self.stream.flush()


ROW_FMT = "{:<31} {:>6} {:>6} {:>5} {:>4} {:>10} {:>8} {:>6} {:>7} {:>8}{}"


def row_header() -> str:
    h = ROW_FMT.format("kernel/dtype/group", "K", "N", "M", "R", "time_us", "GB/s", "roof",
                       "vs fp16", "rel err", "")
    return h + "\n" + "-" * len(h)


def _f(v, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


def format_row(r: dict) -> str:
    err = r.get("err")
    check = "-" if err is None else f"{err:.1e}"
    note = r.get("note", "")
    return ROW_FMT.format(r.get("id", r["kernel"])[:31], r["K"], r["N"], r["M"], r.get("R", "-"), _f(r.get("time_us"), ".2f"), _f(r.get("gbps"), ".0f"),
                          _f(r.get("roofline"), ".3f"), _f(r.get("speedup_vs_fp16"), ".2f"), check,
                          ("  " + note) if note else "")


# ----------------------------------------------------------------------------------
# summary (what the lead reads: the tail of the output)
# ----------------------------------------------------------------------------------
def summary_table(rows: Sequence[dict], baseline: Dict[Tuple[int, int, int], float],
                  labels: Sequence[str]) -> str:
    """Markdown table: one line per (K x N, M); fp16 cuBLAS us, then per kernel config
    `speedup (roofline)`; '-' where the row was skipped or wrong."""
    by: Dict[Tuple[int, int, int, str], dict] = {}
    for r in rows:
        by[(r["K"], r["N"], r["M"], r["label"])] = r
    keys = sorted({(r["K"], r["N"], r["M"]) for r in rows} | set(baseline),
                  key=lambda t: (_shape_order(t[0], t[1]), t[2]))
    head = ["K x N", "M", "fp16 cuBLAS us"] + list(labels)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k, n, m in keys:
        base = baseline.get((k, n, m))
        cells = [f"{k}x{n}", str(m), _f(base, ".1f")]
        for lab in labels:
            r = by.get((k, n, m, lab))
            if r is None or r.get("time_us") is None:
                cells.append("-")
            else:
                sp, rf = r.get("speedup_vs_fp16"), r.get("roofline")
                cells.append(f"{_f(sp, '.2f')} ({_f(rf, '.2f')})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


_SHAPE_INDEX: Dict[Tuple[int, int], int] = {}


def set_shape_order(shapes: Sequence[Tuple[int, int]]) -> None:
    _SHAPE_INDEX.clear()
    _SHAPE_INDEX.update({s: i for i, s in enumerate(shapes)})


def _shape_order(k: int, n: int) -> int:
    return _SHAPE_INDEX.get((k, n), len(_SHAPE_INDEX))


# ----------------------------------------------------------------------------------
# JSON
# ----------------------------------------------------------------------------------
def _tensor_core_family(kernel: str) -> str:
    """Which cuBLAS rate bounds a kernel: int8 / fp8 tensor cores (W4A8, W8A8; Hopper runs
    both at one peak) or fp16 / bf16 (everything else)."""
    return "8bit" if kernel.startswith(("sailfish-w4a8", "cublas-int8", "cublas-fp8")) else "half"


def add_limit_fractions(rows: Sequence[dict], hbm_gbps: Optional[float],
                        peaks: Optional[Dict[str, float]] = None) -> None:
    """Set each row's `limit_fraction`, the fraction of the physical limit (docs/benchmarking.md):
    max(min bytes / HBM ceiling, 2MNK / P), P = the best dense rate cuBLAS reached in the same
    run for the kernel's tensor-core family: its cuBLAS rows or `peaks` (timing.tensor_core_peaks,
    flop per us), whichever is higher. A run of small-M rows alone would otherwise take a
    memory-bound rate for P and overstate the fraction at M >= 32 (seen: 1.06 for a kernel at
    half the HBM rate). Without either only the HBM term counts; untimed rows (or no HBM
    ceiling) get None."""
    peak: Dict[str, float] = dict(peaks or {})
    for r in rows:
        if r.get("time_us") and r["kernel"].startswith("cublas"):
            fam = _tensor_core_family(r["kernel"])
            peak[fam] = max(peak.get(fam, 0.0), 2.0 * r["M"] * r["N"] * r["K"] / r["time_us"])  # flop/us
    for r in rows:
        t, gbps = r.get("time_us"), r.get("gbps")
        if not t or not gbps or not hbm_gbps:
            r["limit_fraction"] = None
            continue
        limit_us = gbps * t / hbm_gbps  # = min bytes / ceiling, in us
        p = peak.get(_tensor_core_family(r["kernel"]))
        if p:
            limit_us = max(limit_us, 2.0 * r["M"] * r["N"] * r["K"] / p)
        r["limit_fraction"] = limit_us / t


def json_row(r: dict) -> dict:
    """Exactly the documented row keys (floats to 6 significant digits; None stays null)."""
    out = {}
    for key in ROW_KEYS:
        v = r.get(key)
        if isinstance(v, float):
            v = None if not math.isfinite(v) else float(f"{v:.6g}")
        out[key] = v
    return out


def build_document(meta: dict, rows: Sequence[dict], extra: Optional[dict] = None) -> dict:
    doc = {"gpu": meta["gpu"], "torch": meta["torch"], "triton": meta["triton"],
           "hbm_gbps": meta.get("hbm_gbps"), "rows": [json_row(r) for r in rows]}
    for k, v in (extra or {}).items():
        if k not in doc:
            doc[k] = v
    return doc


def validate_document(doc: dict) -> List[str]:
    """Problems with a result document against the schema (empty list = valid)."""
    errs = []
    for k, t in (("gpu", str), ("torch", str), ("triton", str)):
        if not isinstance(doc.get(k), t):
            errs.append(f"top-level {k!r} must be {t.__name__}")
    if not (doc.get("hbm_gbps") is None or isinstance(doc.get("hbm_gbps"), (int, float))):
        errs.append("hbm_gbps must be a number (or null in correctness-only mode)")
    if not isinstance(doc.get("rows"), list):
        return errs + ["rows must be a list"]
    types = {"kernel": str, "K": int, "N": int, "M": int, "dtype": str, "group_size": int}
    for i, r in enumerate(doc["rows"]):
        if set(r) != set(ROW_KEYS):
            errs.append(f"row {i}: keys {sorted(r)} != {sorted(ROW_KEYS)}")
            continue
        for k, t in types.items():
            if not isinstance(r[k], t) or isinstance(r[k], bool):
                errs.append(f"row {i}: {k} must be {t.__name__}")
        for k in ("time_us", "gbps", "roofline", "speedup_vs_fp16", "limit_fraction"):
            if r[k] is not None and not isinstance(r[k], (int, float)):
                errs.append(f"row {i}: {k} must be a number or null")
    return errs


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


# ----------------------------------------------------------------------------------
# plots (matplotlib is optional)
# ----------------------------------------------------------------------------------
def write_plots(out_dir: str, name: str, rows: Sequence[dict], labels: Sequence[str],
                shapes: Sequence[Tuple[int, int]], gpu: str, baseline_label: str = "") -> List[str]:
    """<name>_speedup.png and <name>_roofline.png (one panel per shape, one line per kernel
    config, log2 M axis); the baseline is drawn in the roofline plot only. Returns the paths."""
    shapes = [s for s in shapes if any((r["K"], r["N"]) == s for r in rows)]
    if not shapes:
        return []
    written = []
    for metric, ylabel, fname in (("speedup_vs_fp16", "speedup over cuBLAS fp16", "speedup"),
                                  ("roofline", "fraction of HBM roofline", "roofline")):
        panels = []
        for k, n in shapes:
            series = []
            for li, lab in enumerate(labels):
                if metric == "speedup_vs_fp16" and lab == baseline_label:
                    continue
                pts = sorted((r["M"], r[metric]) for r in rows
                             if r["label"] == lab and (r["K"], r["N"]) == (k, n) and r.get(metric) is not None)
                series.append((lab, pts, "--" if lab.startswith("cublas") else "-", li))
            panels.append((f"K={k} N={n}", series))
        speedup = metric == "speedup_vs_fp16"
        path = line_panels(os.path.join(out_dir, f"{name}_{fname}.png"), panels,
                           title=f"{gpu}: {ylabel}", xlabel="M (tokens)", ylabel=ylabel,
                           hline=1.0, hline_style="-" if speedup else ":", ylim0=not speedup)
        if path:
            written.append(path)
    return written


def line_panels(path: str, panels: Sequence[Tuple[str, Sequence[tuple]]], *, title: str, xlabel: str,
                ylabel: str, hline: Optional[float] = None, hline_style: str = "-",
                ylim0: bool = False) -> Optional[str]:
    """Write one PNG: a grid of panels (at most 4 a row), each (panel title, series), a series
    being (label, [(x, y), ...], line style, colour index); log2 x axis with the data's x values
    as ticks, one legend for the figure. Returns the path, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"note: plots skipped, matplotlib is not importable ({type(e).__name__}: {e})")
        return None
    ncol = min(4, max(1, len(panels)))
    nrow = -(-len(panels) // ncol)
    width = max(4.2 * ncol, 8.0)  # room for the title and legend even with one panel
    fig, axes = plt.subplots(nrow, ncol, figsize=(width, 3.4 * nrow), squeeze=False)
    for idx, (panel_title, series) in enumerate(panels):
        ax = axes[idx // ncol][idx % ncol]
        xs = set()
        for label, pts, style, color in series:
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=label,
                        color=plt.get_cmap("tab20")(color % 20))  # > 10 lines: the default cycle repeats
                xs.update(p[0] for p in pts)
        if hline is not None:
            ax.axhline(hline, color="grey", lw=0.8, ls=hline_style)
        if ylim0:
            ax.set_ylim(bottom=0)
        ax.set_xscale("log", base=2)
        if xs:
            xs = sorted(xs)
            step = max(1, -(-len(xs) // 7))
            ax.set_xticks(xs[::step])
            ax.set_xticklabels([str(v) for v in xs[::step]])
            ax.minorticks_off()
        ax.set_title(panel_title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    for idx in range(len(panels), nrow * ncol):
        axes[idx // ncol][idx % ncol].axis("off")
    handles, leg = [], []
    for row in axes:
        for ax in row:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in leg:
                    handles.append(h)
                    leg.append(lab)
    # legend columns as wide as the longest label allows (about 13 characters an inch at size 8)
    leg_cols = max(1, min(5, len(leg), int(width * 13 / (max(map(len, leg), default=1) + 6))))
    leg_rows = -(-len(leg) // leg_cols)
    fig.legend(handles, leg, loc="lower center", ncol=leg_cols, fontsize=8)
    fig.suptitle(textwrap.fill(title, int(width * 11)), fontsize=10)
    fig.tight_layout(rect=(0, (0.03 + 0.045 * leg_rows) / nrow, 1, 0.93 if len(title) > width * 11 else 0.96))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
