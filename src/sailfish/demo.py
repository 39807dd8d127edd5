"""Sailfish demo: the linear layers of Llama-3-8B in 4 bits.

    python -m sailfish.demo        (or: make demo)

Quantizes random weights of the seven Llama-3-8B projection shapes with Sailfish (W4A16,
symmetric, group 128, fp16), runs them, and prints for each layer and batch size M the
relative error of Sailfish's output against the unquantized fp16 layer (quantization
error included) and against the quantized reference x @ W_eff^T (kernel error only).
On a GPU it also times each layer (CUDA graph over enough weight copies to defeat L2,
sailfish.bench.timing) against cuBLAS fp16 (F.linear, timed the same way).

Without a GPU it runs the same Triton kernels in Triton's interpreter, at shapes
divided by 16 and M = 1, 4, and does not time anything.
"""
import os
import sys

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Must precede the first import of sailfish's kernels (triton reads it when the
    # @triton.jit functions are defined); `import sailfish` itself does not import them.
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import copy  # noqa: E402
import math  # noqa: E402
import functools  # noqa: E402

import torch.nn.functional as F  # noqa: E402

from sailfish import QuantLinear  # noqa: E402

# Llama-3-8B projections: (name, K = in_features, N = out_features)
LLAMA3_8B = [
    ("q_proj", 4096, 4096), ("k_proj", 4096, 1024), ("v_proj", 4096, 1024),
    ("o_proj", 4096, 4096), ("gate_proj", 4096, 14336), ("up_proj", 4096, 14336),
    ("down_proj", 14336, 4096),
]
GROUP_SIZE = 128


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def run_layer(name: str, k: int, n: int, ms, device: str, timed: bool):
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(torch.float16)
    linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.float16)
    with torch.no_grad():
        linear.weight.copy_(w)
    layer = QuantLinear.from_linear(linear, group_size=GROUP_SIZE, sym=True)
    w_eff = layer.dequantize()  # float32 (N, K): exactly what the kernel multiplies by
    if timed:
        # R distinct copies of each weight so that R * bytes >= 3 x L2: every call reads
        # its weight from HBM, as in a model's decode step (sailfish.bench.timing).
        from sailfish.bench.timing import copies_needed, graph_time_us

        q_bytes = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
        layers = [layer] + [copy.deepcopy(layer) for _ in range(copies_needed(q_bytes) - 1)]
        weights = [w] + [w.clone() for _ in range(copies_needed(w.numel() * 2) - 1)]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=device).to(torch.float16)
        with torch.no_grad():
            y = layer(x)
            row = {"layer": name, "K": k, "N": n, "M": m,
                   "err_fp16": rel_err(y, F.linear(x, w)),
                   "err_qref": rel_err(y, x.float() @ w_eff.T)}
            if timed:
                sf_calls = [functools.partial(lq, x) for lq in layers]
                cb_calls = [functools.partial(F.linear, x, wc) for wc in weights]
                for call in sf_calls + cb_calls:  # compile, pick configs outside the graph
                    call()
                row["t_sf"], row["t_cublas"] = graph_time_us(sf_calls), graph_time_us(cb_calls)
        print_row(row, timed)
        rows.append(row)
    if timed:
        del layers, weights
        torch.cuda.empty_cache()
    return rows


def print_header(timed: bool) -> None:
    head = f"{'layer':<10} {'K':>6} {'N':>6} {'M':>4}  {'err vs fp16':>11}  {'err vs qref':>11}"
    if timed:
        head += f"  {'sailfish us':>11}  {'cuBLAS us':>9}  {'speedup':>7}"
    print(head)
    print("-" * len(head))


def print_row(r: dict, timed: bool) -> None:
    line = (f"{r['layer']:<10} {r['K']:>6} {r['N']:>6} {r['M']:>4}  "
            f"{r['err_fp16']:>11.2e}  {r['err_qref']:>11.2e}")
    if timed:
        line += f"  {r['t_sf']:>11.1f}  {r['t_cublas']:>9.1f}  {r['t_cublas'] / r['t_sf']:>6.2f}x"
    print(line, flush=True)


def main(argv=None) -> int:
    # no options: the parser gives --help (and refuses stray arguments) before anything runs
    argparse.ArgumentParser(prog="python -m sailfish.demo", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    torch.manual_seed(0)
    if CUDA:
        device, shrink, ms = "cuda", 1, (1, 16, 256)
        print(f"Sailfish W4A16 demo on {torch.cuda.get_device_name()}: Llama-3-8B linear layers, "
              f"int4 symmetric, group {GROUP_SIZE}, fp16 activations")
    else:
        device, shrink, ms = "cpu", 16, (1, 4)
        print("Sailfish W4A16 demo on CPU (no CUDA GPU found).")
        print("The Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1): this checks the")
        print("numbers, not the speed. Shapes are Llama-3-8B's divided by 16; no timings.")
        print(f"int4 symmetric, group {GROUP_SIZE}, fp16 activations")
    print("err vs fp16: ||y - x W^T|| / ||x W^T|| against the unquantized fp16 layer (4-bit error)")
    print("err vs qref: the same against x W_eff^T, W_eff = the dequantized 4-bit weight (kernel error)")
    if CUDA:
        print("times: median per call, CUDA graph over enough weight copies to exceed 3x L2; "
              "speedup = cuBLAS fp16 time / Sailfish time")
    print()
    print_header(timed=CUDA)
    rows = []
    for name, k, n in LLAMA3_8B:
        rows += run_layer(name, k // shrink, n // shrink, ms, device, timed=CUDA)
    ok = all(r["err_qref"] <= 2e-3 for r in rows)  # False for NaN too
    errs = [r["err_qref"] for r in rows]
    worst = float("nan") if any(math.isnan(e) for e in errs) else max(errs)
    print(f"\nlargest kernel error vs the quantized reference: {worst:.2e}"
          f" ({'ok' if ok else 'FAILED: above 2e-3 or not finite'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
