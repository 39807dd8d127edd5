"""Decode speedups over the 16-bit model from `python -m sailfish.bench.e2e` result files, as one
PNG: a panel per mode (one CUDA graph, torch.compile + graph), a group of bars per (model, batch),
a bar per variant; the height is the variant's `speedup_vs_fp16` (or `_vs_bf16`) of the same run.

    python benchmarks/plot_e2e.py benchmarks/results/e2e_h100_8b_v45.json \
        benchmarks/results/e2e_h100_70b_v45.json benchmarks/results/e2e_h100_qwen3moe_v45.json \
        --out benchmarks/results/e2e_h100_v45_speedups.png

Needs matplotlib (the `bench` extra). Reads only the JSON: every number comes from the run that
wrote it (its GPU is in the title).
"""
import argparse
import json
import os

MODES = (("graph", "one CUDA graph"), ("compile", "torch.compile + CUDA graph"))
LABELS = {"w4a16": "W4A16", "w4a16-bf16": "W4A16", "w4a8": "W4A8",
          "fp16-rowops": "16-bit + Sailfish norms / attention", "bf16-rowops": "16-bit + Sailfish norms / attention"}
COLORS = {"W4A16": "#1f77b4", "W4A8": "#ff7f0e", "16-bit + Sailfish norms / attention": "#9e9e9e"}


def model_name(res: dict) -> str:
    m = res["model"]
    return m["name"] + (f"\n({m['layers']} of {m['model_layers']} layers)" if m.get("extrapolated") else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.load(open(p)) for p in a.results]
    gpus = sorted({r["gpu"] for r in runs})
    fig, axes = plt.subplots(1, len(MODES), figsize=(13, 4.6), sharey=True)
    for ax, (mode, title) in zip(axes, MODES):
        groups, x0 = [], 0.0
        for res in runs:
            for batch in sorted({r["batch"] for r in res["decode"]}):
                rows = {r["variant"]: r for r in res["decode"] if r["mode"] == mode and r["batch"] == batch}
                bars = [(LABELS[v], r["speedup_vs_fp16"] or r["speedup_vs_bf16"]) for v, r in rows.items()
                        if v in LABELS]
                for i, (label, value) in enumerate(bars):
                    ax.bar(x0 + i * 0.8 / len(bars), value, 0.8 / len(bars), color=COLORS[label], label=label)
                    ax.text(x0 + i * 0.8 / len(bars), value + 0.05, f"{value:.2f}", ha="center", fontsize=7)
                groups.append((x0 + 0.4 - 0.4 / max(1, len(bars)), f"{model_name(res)}\nbatch {batch}"))
                x0 += 1.0
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([g[0] for g in groups], [g[1] for g in groups], fontsize=7)
        ax.set_title(title)
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
    axes[0].set_ylabel("decode step speedup over the 16-bit model")
    fig.legend(uniq.values(), uniq.keys(), loc="upper center", ncol=len(uniq), frameon=False)
    fig.suptitle(f"Sailfish end to end, {', '.join(gpus)}", y=0.03, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 0.92))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
