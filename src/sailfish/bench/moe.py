"""MoE block benchmark: Sailfish's grouped W4A16 MoE kernels against a bf16/fp16 grouped GEMM
and a per-expert loop over Sailfish's dense QuantLinear, on the shapes of real MoE models.

    python -m sailfish.bench.moe --out benchmarks/results/moe_h100.json
    python -m sailfish.bench.moe --smoke --out /tmp/moe.json      # CPU, tiny, meaningless times

What is timed: the MoE block given the routing (the router itself is not: it is the same 16-bit
GEMM for every kernel), routed experts (both GEMMs, silu * up, routing weights, top-k sum, and the
routing prep of the kernels that need one) plus the shared experts where the model has them
(DeepSeek-V2-Lite: 2 shared experts, one MLP of width 2 x 1408; the Sailfish rows run them inside
the block, as 2 experts of width 1408 every token takes (the op's num_shared), the 16-bit rows as
one MLP with cuBLAS).

Kernels (rows' "kernel"):
- sailfish-moe-w4a16: sailfish::moe_w4a16 (one grouped launch per GEMM; ops/moe.py).
- bf16-grouped (fp16-grouped): torch._grouped_mm over the slots sorted by expert (a per-expert
  cuBLAS loop, "-loop", where this torch has no _grouped_mm), weights = the 4-bit experts'
  dequantized values in 16 bits (the same math as the Sailfish rows).
- sailfish-quantlinear-loop: one fused gate_up and one down QuantLinear per routed expert (the
  token lists per expert are computed once, outside the timed region: a favour to this baseline,
  which otherwise needs a host synchronisation per call).
- vllm-triton-moe: a peer, vLLM's Triton W4A16 MoE kernel (fused_moe_kernel_gptq_awq) on the same
  4-bit codes and scales, from an uncommitted file <--peers>/vllm_moe_wna16.py (bench/moe_peers.py
  says what runs around it); without the file the column is skipped with one line. Shared experts
  run as one MLP of two QuantLinears (as in the per-expert loop).
Routing: uniform (every token's top-k distinct experts uniformly at random, fixed seed) and
skewed (experts drawn with probability ~ 1 / (rank + 1), fixed seed; the model name gets
" skewed"). Routing weights: softmax of random logits over the top-k.

Method (docs/benchmarking.md, sailfish.bench.timing): every kernel's output is first checked
against the PyTorch reference (ops/moe.moe_w4a16_reference; relative Frobenius error); then R
copies of all weights (R x bytes >= 3 x L2), one CUDA graph calling the block once per copy,
median of --replays replays / R. limit_fraction = max(bytes / HBM copy rate, routed FLOPs /
fp16 tensor-core rate) / time, bytes = the weights of the experts the routing touches in the
kernel's own format (4-bit words + scales (+ zeros) for Sailfish rows, 16-bit for the grouped
baseline) + shared experts + x and y; FLOPs = 2 x slots x 3 x H x I (+ shared).
Rows: {"model", "kernel", "M", "time_us", "limit_fraction", "dtype", "group_size"}.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

MODELS = {  # name: (hidden H, expert width I, routed experts E, top-k, shared experts)
    "Qwen3-30B-A3B": (2048, 768, 128, 8, 0),
    "Mixtral-8x7B": (4096, 14336, 8, 2, 0),
    "DeepSeek-V2-Lite": (2048, 1408, 64, 6, 2),
}
SMOKE_MODELS = {"tiny": (128, 64, 4, 2, 0), "tiny-shared": (128, 96, 6, 3, 1)}
M_LIST = (1, 4, 16, 64, 256, 1024, 4096)
KERNELS = ("sailfish-moe-w4a16", "grouped", "sailfish-quantlinear-loop", "vllm-triton-moe")


def routing(M: int, E: int, topk: int, skewed: bool, device, seed: int = 0):
    """(topk_ids int64 (M, topk), topk_weights float32 (M, topk)), fixed seed."""
    g = torch.Generator().manual_seed(seed)
    if skewed:
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64)
        ids = torch.multinomial(p.expand(M, E), topk, replacement=False, generator=g)
    else:
        ids = torch.rand(M, E, generator=g).topk(topk, dim=1).indices
    w = torch.softmax(torch.randn(M, topk, generator=g), -1)
    return ids.to(device), w.to(device)


@dataclass
class Experts:
    """One copy of a model's weights in every form the kernels take."""
    q13: object  # PackedExperts (E, 2I, H): the routed experts
    q2: object   # PackedExperts (E, H, I)
    all13: object  # PackedExperts (E + S, 2I, H): the routed experts, then the S shared ones (q13 a view)
    all2: object
    w13: torch.Tensor  # (E, H, 2I) 16-bit, the dequantized values (grouped_mm's B layout, a view)
    w2: torch.Tensor   # (E, I, H)
    linears: Optional[list] = None  # per expert (gate_up QuantLinear, down QuantLinear)
    # the shared experts as one MLP: (gate_up QuantLinear, down QuantLinear, gate_up 16-bit, down 16-bit)
    shared: Optional[tuple] = None
    peer: Optional[object] = None  # moe_peers.VllmExperts (vllm-triton-moe)


def make_experts(H, I, E, shared, dtype, group_size, device, loop: bool, seed: int) -> Experts:
    from dataclasses import replace

    from ..formats.experts import quantize_experts
    from ..formats.shard import concat_quantized, slice_quantized
    from ..nn import QuantLinear

    g = torch.Generator(device=device).manual_seed(seed)  # (weights made and quantized on the device: fast)
    S = shared
    all13 = quantize_experts(torch.randn(E + S, 2 * I, H, generator=g, device=device) * 0.02, group_size, True, dtype)
    all2 = quantize_experts(torch.randn(E + S, H, I, generator=g, device=device) * 0.02, group_size, True, dtype)
    q13, q2 = (replace(q, qweight=q.qweight[:E], scales=q.scales[:E]) for q in (all13, all2))
    d13, d2 = q13.dequantize().to(dtype), q2.dequantize().to(dtype)
    linears = None
    if loop:
        linears = [(QuantLinear.from_quantized(a, None), QuantLinear.from_quantized(b, None))
                   for a, b in zip(q13.unstack(), q2.unstack())]
    sh = None
    if S:  # the S shared experts as the one MLP of width S * I they are (gate rows, then up rows)
        s13, s2 = all13.dequantize()[E:], all2.dequantize()[E:]  # (S, 2I, H), (S, H, I)
        gu = torch.cat([s13[:, :I].reshape(S * I, H), s13[:, I:].reshape(S * I, H)]).to(dtype)
        dn = s2.permute(1, 0, 2).reshape(H, S * I).to(dtype)
        # the QuantLinears of the loop and peer columns from the same codes and scales, joined exactly
        # (quantizing the dequantized values again moved them by ~12%: their checks failed, v47)
        p13, p2 = all13.unstack()[E:], all2.unstack()[E:]
        qgu = QuantLinear.from_quantized(concat_quantized([slice_quantized(q, 0, 0, I) for q in p13]
                                                          + [slice_quantized(q, 0, I, 2 * I) for q in p13]), None)
        qd = QuantLinear.from_quantized(concat_quantized(p2, 1), None)
        sh = (qgu, qd, gu, dn)
    return Experts(q13, q2, all13, all2, d13.transpose(1, 2), d2.transpose(1, 2), linears, sh)


def _silu_mul(gu: torch.Tensor) -> torch.Tensor:
    i = gu.shape[-1] // 2
    return torch.nn.functional.silu(gu[..., :i]) * gu[..., i:]


def _shared(x, ex: Experts, quantized: bool):
    gu_q, d_q, gu_w, d_w = ex.shared
    if quantized:
        return d_q(_silu_mul(gu_q(x)))
    return _silu_mul(x @ gu_w.T) @ d_w.T


def sailfish_block(x, ids, w, ex: Experts):
    """The routed and the shared experts in one block (num_shared)."""
    a, b = ex.all13, ex.all2
    return torch.ops.sailfish.moe_w4a16(x, ids, w, a.qweight, a.scales, a.zeros, b.qweight, b.scales, b.zeros,
                                        a.group_size, None, None, a.num_experts - ex.q13.num_experts)


def grouped_block(x, ids, w, ex: Experts):
    """16-bit block: slots sorted by expert, torch._grouped_mm for both GEMMs (a per-expert loop
    over the sorted slots without it), weighted rows summed over k."""
    M, topk = ids.shape
    E = ex.w13.shape[0]
    flat = ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    xs = x[order // topk]
    ends = torch.searchsorted(sorted_ids, torch.arange(1, E + 1, device=x.device)).to(torch.int32)
    if hasattr(torch, "_grouped_mm"):
        h = _silu_mul(torch._grouped_mm(xs, ex.w13, offs=ends))
        rows = torch._grouped_mm(h, ex.w2, offs=ends)
    else:  # (needs the counts on the host)
        bounds = [0] + ends.tolist()
        rows = torch.cat([_silu_mul(xs[a:b] @ ex.w13[e]) @ ex.w2[e] for e, (a, b) in
                          enumerate(zip(bounds, bounds[1:]))])
    out = torch.empty_like(rows)
    out[order] = rows
    y = (out.view(M, topk, -1).float() * w.view(M, topk, 1)).sum(1).to(x.dtype)
    return y if ex.shared is None else y + _shared(x, ex, False)


def peer_block_fn(M: int, topk: int, ex: Experts) -> Callable:
    """vllm-triton-moe for this M: its routed experts (moe_peers), shared experts as sailfish_block's."""
    routed = ex.peer.block_fn(M, topk)

    def run(x, ids, w):
        y = routed(x, ids, w)
        return y if ex.shared is None else y + _shared(x, ex, True)
    return run


def loop_block_fn(ids, ex: Experts) -> Callable:
    """The per-expert QuantLinear loop for this routing (token lists computed here, once)."""
    M, topk = ids.shape
    flat = ids.reshape(-1).cpu()
    groups = []
    for e in range(len(ex.linears)):
        slots = (flat == e).nonzero()[:, 0]
        if len(slots):
            groups.append((e, (slots // topk).to(ids.device), slots.to(ids.device)))

    def run(x, w):
        rows = torch.zeros((M * topk, x.shape[1]), dtype=torch.float32, device=x.device)
        wf = w.reshape(-1)
        for e, tok, slots in groups:
            gu, down = ex.linears[e]
            rows[slots] = down(_silu_mul(gu(x[tok]))).float() * wf[slots, None]
        y = rows.view(M, topk, -1).sum(1).to(x.dtype)
        return y if ex.shared is None else y + _shared(x, ex, True)
    return run


def limit_us(M, H, I, E, topk, shared, ids, kernel, dtype_bytes, group_size, hbm_gbps, peak_flop_us):
    """max(bytes / HBM rate, FLOPs / tensor-core rate) in us (module docstring)."""
    used = int(torch.unique(ids).numel())
    n_w = 3 * H * I  # weights of one expert
    if kernel == "grouped":
        wbytes = (used + shared) * n_w * dtype_bytes
    else:  # 4-bit words and one scale per group and row (symmetric)
        g = (lambda k: 1) if group_size == -1 else (lambda k: -(-k // group_size))
        wbytes = (used + shared) * (n_w / 2 + (2 * I * g(H) + H * g(I)) * dtype_bytes)
    nbytes = wbytes + 2 * M * H * dtype_bytes
    flops = 2 * M * (topk + shared) * n_w
    t = nbytes / (hbm_gbps * 1e3) if hbm_gbps else 0.0
    if peak_flop_us:
        t = max(t, flops / peak_flop_us)
    return t


def merge_previous(path: str, doc: dict) -> dict:
    """An existing result file at `path` from the same GPU keeps its rows and checks that this
    run did not measure (same model, kernel, M, dtype, group size: replaced), and its runs: so
    the models can be run one command each (a device call's time limit) into one file."""
    import json

    if not os.path.exists(path):
        return doc
    with open(path) as f:
        old = json.load(f)
    if old.get("gpu") != doc["gpu"]:
        return doc
    key = lambda r: (r["model"], r["kernel"], r["M"], r.get("dtype"), r.get("group_size"))  # noqa: E731
    new = {key(r) for r in doc["rows"]}
    ckey = lambda c: (c["model"], c["kernel"], c["M"])  # noqa: E731
    cnew = {ckey(c) for c in doc["checks"]}
    return {**doc, "runs": old.get("runs", []) + doc["runs"],
            "rows": [r for r in old.get("rows", []) if key(r) not in new] + doc["rows"],
            "checks": [c for c in old.get("checks", []) if ckey(c) not in cnew] + doc["checks"]}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sailfish.bench.moe", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[2:]))
    ap.add_argument("--models", help="comma-separated, from: " + ", ".join(MODELS) + " (default: all; --smoke: "
                                     + ", ".join(SMOKE_MODELS) + ")")
    ap.add_argument("--m", help="token counts M (default: " + ",".join(map(str, M_LIST)) + "; --smoke: 1,3)")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="from: " + ", ".join(KERNELS))
    ap.add_argument("--routing", default="uniform,skewed", help="uniform, skewed or both")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", required=True, help="JSON result path (e.g. benchmarks/results/moe_h100.json); an "
                                                 "existing file of the same GPU keeps the rows this run does not "
                                                 "measure")
    ap.add_argument("--peers", help="folder of the peer kernels' uncommitted sources (vllm-triton-moe: "
                                    "vllm_moe_wna16.py; default: .peers at the repo root)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes and M = 1, 3: checks the code path "
                                                         "(times meaningless, limit_fraction null)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    kernels = args.kernels.split(",")
    for k in kernels:
        if k not in KERNELS:
            ap.error(f"--kernels: {k!r} is not one of {', '.join(KERNELS)}")
    peer = None
    if "vllm-triton-moe" in kernels:  # (first: on a CPU it may set TRITON_INTERPRET, moe_peers.load_vllm)
        from .moe_peers import load_vllm

        peer, why = load_vllm(args.peers, cuda, dtype, args.group_size)
        if peer is None:
            print(why, flush=True)
            kernels.remove("vllm-triton-moe")
    import sailfish  # noqa: F401  (registers the ops)
    from ..ops.moe import moe_w4a16_reference
    from . import report, timing

    table = SMOKE_MODELS if args.smoke else MODELS
    names = list(table) if args.models is None else args.models.split(",")
    for n in names:
        if n not in table:
            ap.error(f"--models: {n!r} is not one of {', '.join(table)}")
    models = {n: table[n] for n in names}
    ms = tuple(int(m) for m in args.m.split(",")) if args.m else (1, 3) if args.smoke else M_LIST
    grouped_name = f"{args.dtype}-grouped" + ("" if hasattr(torch, "_grouped_mm") else "-loop")
    hbm = timing.hbm_ceiling_gbps() if cuda else None
    peak = timing.tensor_core_peaks().get("half") if cuda else None
    rows, checks = [], []
    for name, (H, I, E, topk, shared) in models.items():
        one = make_experts(H, I, E, shared, dtype, args.group_size, device, "sailfish-quantlinear-loop" in kernels, 0)
        # copies from the bytes a call reads at the smallest M (its routed experts, 4-bit): a
        # Qwen3 M = 1 call reads 18 MiB, so two copies would both stay in the H100's 50 MB L2
        per_expert = (one.q13.qweight[0].numel() + one.q2.qweight[0].numel()) * 4
        nbytes = min(E, min(ms) * topk) * per_expert
        copies = timing.copies_needed(nbytes) if cuda else 1
        exs = [one] + [make_experts(H, I, E, shared, dtype, args.group_size, device,
                                    "sailfish-quantlinear-loop" in kernels, r) for r in range(1, copies)]
        if peer is not None:
            from .moe_peers import VllmExperts

            for ex in exs:
                ex.peer = VllmExperts(peer, ex.q13, ex.q2)
        for skew in [r == "skewed" for r in args.routing.split(",")]:
            label = name + (" skewed" if skew else "")
            for M in ms:
                ids, w = routing(M, E, topk, skew, device)
                x = (torch.randn(M, H, generator=torch.Generator().manual_seed(M)) * 0.5).to(device, dtype)
                ex0 = exs[0]
                ref = moe_w4a16_reference(x, ids, w, ex0.all13.qweight, ex0.all13.scales, None, ex0.all2.qweight,
                                          ex0.all2.scales, None, args.group_size, num_shared=shared).float()
                for kernel in kernels:
                    if kernel == "sailfish-moe-w4a16":
                        fns = [lambda ex=ex: sailfish_block(x, ids, w, ex) for ex in exs]
                    elif kernel == "grouped":
                        fns = [lambda ex=ex: grouped_block(x, ids, w, ex) for ex in exs]
                    elif kernel == "vllm-triton-moe":
                        peers = [peer_block_fn(M, topk, ex) for ex in exs]
                        fns = [lambda f=f: f(x, ids, w) for f in peers]
                    else:
                        loops = [loop_block_fn(ids, ex) for ex in exs]
                        fns = [lambda f=f: f(x, w) for f in loops]
                    kname = grouped_name if kernel == "grouped" else kernel
                    try:
                        with torch.no_grad():
                            y = fns[0]().float()
                        err, why = float((y - ref).norm() / ref.norm().clamp_min(1e-30)), None
                    except Exception as e:  # noqa: BLE001 - reported, the run goes on
                        err, why = float("nan"), f"{type(e).__name__}: {e}"[:500]
                    tol = 1e-2 if dtype == torch.bfloat16 else 4e-3  # two intermediate roundings + the output's
                    checks.append({"model": label, "kernel": kname, "M": M, "rel_err": err, "ok": err <= tol,
                                   **({"error": why} if why else {})})
                    t = lim = None
                    if err <= tol:
                        with torch.no_grad():
                            if cuda:
                                t = timing.graph_time_us(fns, replays=args.replays)
                            else:
                                t = min(timing.call_times_us(fns[0], 2, False))
                        if cuda:
                            lim = limit_us(M, H, I, E, topk, shared, ids, kernel, 2, args.group_size, hbm, peak) / t
                    rows.append({"model": label, "kernel": kname, "M": M, "time_us": t, "limit_fraction": lim,
                                 "dtype": args.dtype, "group_size": args.group_size})
                    print(f"{label:28s} {kname:28s} M={M:5d} err={err:.2e} "
                          f"time={'-' if t is None else f'{t:.1f}'} us "
                          f"limit={'-' if lim is None else f'{lim:.2f}'}", flush=True)
        del exs, one
        if cuda:
            torch.cuda.empty_cache()
    import triton
    run = {"command": " ".join(["python -m sailfish.bench.moe"] + (argv if argv is not None else sys.argv[1:])),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "hbm_gbps": hbm, "half_flop_per_us": peak,
           "env": {k: v for k, v in os.environ.items() if k.startswith("SAILFISH_")}}
    doc = {"gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke: times meaningless)",
           "torch": torch.__version__, "triton": triton.__version__, "runs": [run], "rows": rows, "checks": checks}
    report.write_json(args.out, merge_previous(args.out, doc))
    bad = [c for c in checks if not c["ok"]]
    for c in bad:
        print(f"CHECK FAILED: {c}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
