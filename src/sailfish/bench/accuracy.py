"""What each quantization costs in accuracy, on real text, with nothing downloaded.

    python -m sailfish.bench.accuracy --out results.json      # H100: ~3-5 min in all (phases printed)
    python -m sailfish.bench.accuracy --smoke --out smoke.json  # CPU, tiny: every code path in < 1 min

Corpus: the CPython standard library's own .py source files (sysconfig's stdlib directory,
site-packages excluded), split by file: a file is held out when crc32(its relative path) % 10
== 0, so the split depends only on the file names (the same Python version gives the same
corpus; the JSON records the version and the sizes). Tokens are bytes (vocabulary 256).

Model: a transformers Llama (default hidden 512, 8 layers, 8 heads on 4 key/value heads,
intermediate 1536: ~25M parameters) trained from a fixed seed for --steps steps of --batch
random windows of --seq bytes from the training files (AdamW, warmup + cosine, bf16 autocast
on CUDA). Then, from the trained weights in float16, each variant is made with
sailfish.quantize_model (lm_head and embeddings stay fp16) and its perplexity (per byte)
measured on the held-out files' first --eval-windows non-overlapping windows:

    fp16, rtn-w4a16 (sym, group 128), gptq-w4a16 (group 128, act_order, --calib windows of the
    training files), rtn-w4a8 and qqq-w4a8 (group 128 and per channel; qqq = quantize_model(
    act_bits=8, method="gptq"): QQQ's smoothing + GPTQ onto the W4A8 format).

Writes --out (JSON: environment, corpus, model, training, and per variant the perplexity, its
ratio to fp16's, the quantization and evaluation seconds, and for the calibrated variants the
summed per-Linear output error of the report and how many Linears had their inputs smoothed) and prints a table and per-phase timings.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Dict, List, Tuple

import torch

VARIANTS = {  # name -> quantize_model arguments (None: the fp16 model itself)
    "fp16": None,
    "rtn-w4a16": dict(group_size=128),
    "gptq-w4a16": dict(group_size=128, method="gptq", act_order=True),
    "rtn-w4a8": dict(act_bits=8, group_size=128),
    "qqq-w4a8": dict(act_bits=8, group_size=128, method="gptq", act_order=True),
    "rtn-w4a8-channel": dict(act_bits=8, group_size=-1),
    "qqq-w4a8-channel": dict(act_bits=8, group_size=-1, method="gptq", act_order=True),
}


def corpus(limit: int = 0) -> Tuple[torch.Tensor, torch.Tensor, dict]:
    """(training bytes, held-out bytes) as uint8 tensors, files joined by blank lines, and a
    description. limit: only the first `limit` files in path order (0: all)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    if limit:
        files = files[:limit]
    parts: Dict[bool, List[bytes]] = {False: [], True: []}
    for p in files:
        rel = p.relative_to(root).as_posix()
        parts[zlib.crc32(rel.encode()) % 10 == 0].append(p.read_bytes())
    if not parts[True] or not parts[False]:
        raise RuntimeError(f"the standard library under {root} gave {len(parts[False])} training and "
                           f"{len(parts[True])} held-out files; need both")
    train, held = (torch.frombuffer(bytearray(b"\n\n".join(parts[k])), dtype=torch.uint8) for k in (False, True))
    info = {"root": str(root), "python": platform.python_version(), "train_files": len(parts[False]),
            "held_out_files": len(parts[True]), "train_bytes": train.numel(), "held_out_bytes": held.numel()}
    return train, held, info


def windows(data: torch.Tensor, count: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """count random windows (count, seq) int64 of data."""
    start = torch.randint(0, data.numel() - seq, (count,), generator=generator)
    return data[start[:, None] + torch.arange(seq)].long()


def build_model(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, seq: int):
    import transformers
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=seq,
                                      tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
                                      eos_token_id=None)
    return transformers.LlamaForCausalLM(config)


def train(model, data: torch.Tensor, args, device) -> dict:
    g = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_at(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses = []
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    for step in range(args.steps):
        x = windows(data, args.batch, args.seq, g).to(device)
        with autocast:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            losses.append((step, float(loss.detach())))
            print(f"  step {step:5d}  loss {losses[-1][1]:.4f}", flush=True)
    model.eval()
    return {"steps": args.steps, "loss_curve": losses}


@torch.no_grad()
def perplexity(model, data: torch.Tensor, args, device) -> float:
    """exp(mean next-byte NLL) over the first args.eval_windows non-overlapping windows."""
    n = min(args.eval_windows, data.numel() // args.seq)
    x = data[:n * args.seq].reshape(n, args.seq).long()
    total, count = 0.0, 0
    for i in range(0, n, args.eval_batch):
        ids = x[i:i + args.eval_batch].to(device)
        logits = model(input_ids=ids).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1),
                                                reduction="sum")
        total += float(nll)
        count += ids[:, 1:].numel()
    return math.exp(total / count)


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m sailfish.bench.accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="accuracy.json", help="JSON results file")
    p.add_argument("--smoke", action="store_true", help="tiny model and corpus on the CPU: every code path, fast")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--calib", type=int, default=128, help="calibration windows (of --seq bytes, training files)")
    p.add_argument("--eval-windows", type=int, default=512)
    p.add_argument("--eval-batch", type=int, default=32)
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.seq, args.hidden, args.layers = 20, 8, 64, 128, 1
        args.heads, args.kv_heads, args.intermediate, args.calib, args.eval_windows = 4, 2, 256, 8, 16
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; allowed: {list(VARIANTS)}")
    return args


def main(argv=None) -> dict:
    import sailfish
    args = parse(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    phases = {}
    t = time.perf_counter()
    train_data, held, corpus_info = corpus(limit=40 if args.smoke else 0)
    phases["corpus_s"] = time.perf_counter() - t
    print(f"corpus: {corpus_info}", flush=True)

    torch.manual_seed(args.seed)
    model = build_model(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.seq).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters; training {args.steps} steps of {args.batch} x {args.seq} bytes",
          flush=True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    t = time.perf_counter()
    training = train(model, train_data, args, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    phases["train_s"] = training["seconds"] = time.perf_counter() - t
    model = model.half()
    calibration = list(windows(train_data, args.calib, args.seq, torch.Generator().manual_seed(args.seed + 1))
                       .to(device).split(8))

    results = []
    for name in args.variants.split(","):
        kw = VARIANTS[name]
        t = time.perf_counter()
        if kw is None:
            m = model
        else:
            if kw.get("method") == "gptq":
                kw = dict(kw, calibration=calibration)
            m = sailfish.quantize_model(copy.deepcopy(model), **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        quantize_s = time.perf_counter() - t
        t = time.perf_counter()
        ppl = perplexity(m, held, args, device)
        eval_s = time.perf_counter() - t
        row = {"variant": name, "ppl": ppl, "quantize_s": quantize_s, "eval_s": eval_s}
        report = getattr(m, "sailfish_report", {}).get("gptq")
        if report:
            row["gptq_error_sum"] = sum(v["error"] for v in report.values())
            row["smoothed_linears"] = sum("smoothing" in v for v in report.values())
        results.append(row)
        phases[f"{name}_s"] = quantize_s + eval_s
        print(f"  {name:18s} ppl {ppl:8.4f}   quantize {quantize_s:6.1f} s   eval {eval_s:5.1f} s", flush=True)
        del m
    base = next((r["ppl"] for r in results if r["variant"] == "fp16"), None)
    for r in results:
        r["ppl_vs_fp16"] = r["ppl"] / base if base else None

    out = {"command": " ".join(["python -m sailfish.bench.accuracy"] + (sys.argv[1:] if argv is None else argv)),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "sailfish": sailfish.__version__, "corpus": corpus_info,
           "model": {"parameters": params, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                     "kv_heads": args.kv_heads, "intermediate": args.intermediate, "seq": args.seq},
           "training": training, "calibration_windows": args.calib, "eval_windows": args.eval_windows,
           "results": results, "phases_s": phases}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print("\nvariant              ppl/byte   vs fp16")
    for r in results:
        ratio = "" if r["ppl_vs_fp16"] is None else f"{r['ppl_vs_fp16']:.4f}"
        print(f"{r['variant']:18s} {r['ppl']:10.4f}   {ratio}")
    print("phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    return out


if __name__ == "__main__":
    main()
