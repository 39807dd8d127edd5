"""Tensor-parallel decode step of a Llama-shaped block stack with Sailfish layers.

    torchrun --nproc-per-node 2 -m sailfish.bench.tp            # one process per GPU, NCCL
    python -m sailfish.bench.tp --nproc 2                         # spawns the processes itself
    python -m sailfish.bench.tp --nproc 2 --preset tiny           # CPU: gloo, seconds

The model: `layers` decoder blocks, each RMSNorm -> q/k/v projections -> attention of one
new token per sequence over a static KV cache of `ctx` positions (grouped-query, no RoPE:
position handling does not change what is sharded) -> o projection, then RMSNorm -> SwiGLU
MLP (gate/up -> down), with residuals. Random weights (std 1/sqrt(fan_in), so every block
changes the residual stream by O(1)), quantized with sailfish.quantize_model.

Tensor parallelism through torch.distributed.tensor.parallel.parallelize_module with the
Megatron plan: q/k/v/gate/up column parallel (sailfish.parallel.SailfishColwiseParallel),
o/down row parallel with a sum over ranks (SailfishRowwiseParallel), attention and KV cache
split by heads (KVHeadsParallel below). Every rank builds the same full model (rank 0's
buffers are broadcast), shards a copy of it, and checks the sharded output against the
unsharded one. They differ by rounding only: the ranks' partial sums are each rounded to
the activation dtype before they are added, and W4A8 row shards quantize their own slice of x
per token (finer scales than the whole row). So the check is that TP and 1 GPU differ by no
more than the 1-GPU model's own rounding error against the fp32 model (the same dequantized
weights, unquantized fp32 activations): rel_err(TP, 1 GPU) <= 2 x rel_err(1 GPU, fp32), where
two independent errors of that size would differ by about 1.4 x. A wrong shard, a missing or
doubled sum or bias gives errors of 10 % and more.

On CUDA each step is captured in one CUDA graph (capture_error_mode "thread_local", as NCCL
inside a graph needs); step time = median of --replays replays (max over ranks). Rank 0
also times the unsharded model (world size 1) in the same run. On the CPU the step runs
eagerly on the PyTorch reference path (no TRITON_INTERPRET): a correctness run of the
distributed code, and its times mean nothing. NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set when unset: no NVLink multicast.

Writes --json (default tp.json): world_size, backend, device, model config, check
{rel_err, bound, passed, ...}, step_ms {"1": unsharded, "<world>": sharded}.
Exit status 0 when the check passed, 1 when not.
"""
from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import logging
import math
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..formats.int4 import GROUP_SIZES

PRESETS = {
    # hidden, heads, kv_heads, head_dim, ffn, layers, ctx
    "tiny": (128, 4, 2, 64, 256, 2, 16),      # row shards of 128 channels at world size 2
    "8b": (4096, 32, 8, 128, 14336, 4, 1024),     # Llama-3-8B block shapes
    "70b": (8192, 64, 8, 128, 28672, 2, 1024),    # Llama-3-70B block shapes
}
FORMATS = ("w4a16", "w4a8")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# TP and 1 GPU differ by rounding noise of the kind the 1-GPU model carries against exact
# arithmetic (e); two independent noises of size e differ by about sqrt(2) e.
NOISE_RATIO = 2.0


@dataclass
class Config:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    ctx: int
    batch: int = 1


# ----------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, dtype, device, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def _linear(k: int, n: int, dtype, device, gen) -> nn.Linear:
    lin = nn.Linear(k, n, bias=False, dtype=dtype, device=device)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, device=device, generator=gen) / math.sqrt(k))
    lin.requires_grad_(False)
    return lin


class Attention(nn.Module):
    """One new token per sequence attends to a static cache whose last slot it overwrites.
    Head counts come from the projections, so a head-sharded copy runs the same code."""

    def __init__(self, cfg: Config, dtype, device, gen):
        super().__init__()
        h, d = cfg.hidden, cfg.head_dim
        self.head_dim = d
        self.q_proj = _linear(h, cfg.heads * d, dtype, device, gen)
        self.k_proj = _linear(h, cfg.kv_heads * d, dtype, device, gen)
        self.v_proj = _linear(h, cfg.kv_heads * d, dtype, device, gen)
        self.o_proj = _linear(cfg.heads * d, h, dtype, device, gen)
        shape = (cfg.batch, cfg.kv_heads, cfg.ctx, d)
        self.register_buffer("k_cache", torch.randn(shape, device=device, generator=gen).to(dtype))
        self.register_buffer("v_cache", torch.randn(shape, device=device, generator=gen).to(dtype))

    def forward(self, x):
        m, d = x.shape[0], self.head_dim
        kv = self.k_cache.shape[1]
        q = self.q_proj(x).view(m, kv, -1, d)                     # (M, KV, heads per KV, d)
        self.k_cache[:, :, -1] = self.k_proj(x).view(m, kv, d)
        self.v_cache[:, :, -1] = self.v_proj(x).view(m, kv, d)
        s = torch.matmul(q, self.k_cache.transpose(-1, -2)).float() / math.sqrt(d)
        p = torch.softmax(s, dim=-1).to(x.dtype)                   # (M, KV, rep, ctx)
        return self.o_proj(torch.matmul(p, self.v_cache).reshape(m, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Config, dtype, device, gen):
        super().__init__()
        self.gate_proj = _linear(cfg.hidden, cfg.ffn, dtype, device, gen)
        self.up_proj = _linear(cfg.hidden, cfg.ffn, dtype, device, gen)
        self.down_proj = _linear(cfg.ffn, cfg.hidden, dtype, device, gen)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: Config, dtype, device, gen):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.hidden, dtype, device), RMSNorm(cfg.hidden, dtype, device)
        self.attn, self.mlp = Attention(cfg, dtype, device, gen), MLP(cfg, dtype, device, gen)

    def forward(self, x):
        h = x + self.attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class BlockStack(nn.Module):
    def __init__(self, cfg: Config, dtype, device, gen):
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg, dtype, device, gen) for _ in range(cfg.layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build_model(cfg: Config, fmt: str, group_size: int, dtype, device, seed: int = 0) -> BlockStack:
    import sailfish
    gen = torch.Generator(device=device).manual_seed(seed)
    model = BlockStack(cfg, dtype, device, gen)
    sailfish.quantize_model(model, act_bits=16 if fmt == "w4a16" else 8, group_size=group_size, skip=())
    if model.sailfish_report["skipped"]:
        raise ValueError(f"layers not quantized: {model.sailfish_report['skipped']}")
    return model


def float_reference(model: BlockStack) -> BlockStack:
    """The same model in float32 with each Sailfish layer replaced by its dequantized weight."""
    from sailfish import QuantLinear, QuantLinearW4A8
    ref = copy.deepcopy(model)
    for name, mod in list(ref.named_modules()):
        if isinstance(mod, (QuantLinear, QuantLinearW4A8)):
            lin = nn.Linear(mod.in_features, mod.out_features, bias=False, device=mod.qweight.device)
            lin.weight.data = mod.dequantize()
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, lin)
    return ref.float().requires_grad_(False)


# ----------------------------------------------------------------------------------
# Tensor-parallel plan
# ----------------------------------------------------------------------------------
def heads_error(kv_heads: int, world: int) -> str:
    return f"kv_heads={kv_heads} is not divisible by world_size={world}"


def _styles():
    from torch.distributed.tensor.parallel import ParallelStyle

    class KVHeadsParallel(ParallelStyle):
        """Attention split by heads: each rank keeps KV / world of the cache's KV heads (the
        ones its column-parallel k/v projections produce)."""

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            rank, world = device_mesh.get_local_rank(), device_mesh.size()
            kv = module.k_cache.shape[1]
            if kv % world:
                raise ValueError(heads_error(kv, world))
            part = kv // world
            for name in ("k_cache", "v_cache"):
                cache = getattr(module, name)
                setattr(module, name, cache[:, rank * part:(rank + 1) * part].clone())
            return module

    return KVHeadsParallel


def tp_plan(reduce: str) -> dict:
    from sailfish.parallel import SailfishColwiseParallel, SailfishRowwiseParallel
    col, row = SailfishColwiseParallel(), SailfishRowwiseParallel(reduce=reduce)
    plan = {"layers.*.attn": _styles()()}
    plan.update({f"layers.*.{p}": col for p in
                 ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj")})
    plan.update({f"layers.*.{p}": row for p in ("attn.o_proj", "mlp.down_proj")})
    return plan


# ----------------------------------------------------------------------------------
# One rank
# ----------------------------------------------------------------------------------
def _rel_err(y, ref) -> float:
    y, ref = y.detach().float(), ref.detach().float()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def _broadcast_state(model: nn.Module) -> None:
    import torch.distributed as dist
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)


def _step_ms(fn, device, replays: int, capture_mode: str, out: Optional[dict] = None) -> float:
    """Median time of one call of fn (ms): a CUDA graph on CUDA (its output kept in
    out["y"]), eager wall time on the CPU."""
    if device.type == "cuda":
        from .timing import capture_graph, replay_time_us
        static = {}
        graph = capture_graph([lambda: static.__setitem__("y", fn())], capture_error_mode=capture_mode)
        graph.replay()
        torch.cuda.synchronize()
        if out is not None:
            out["y"] = static["y"].clone()
        t = replay_time_us(graph, replays) / 1e3
        del graph
        return t
    times = []
    for _ in range(replays):
        t0 = time.perf_counter()
        y = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    if out is not None:
        out["y"] = y
    return sorted(times)[len(times) // 2]


def run_rank(rank: int, world: int, args) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local} has no GPU ({torch.cuda.device_count()} visible); "
                               f"use fewer processes or --cpu")
        torch.cuda.set_device(local)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                **({"device_id": device} if cuda else {}))
    mesh = init_device_mesh(device.type, (world,))
    dtype = DTYPES[args.dtype]
    cfg = Config(*PRESETS[args.preset], batch=args.batch)
    if args.layers:
        cfg.layers = args.layers
    if args.ctx:
        cfg.ctx = args.ctx

    replays = args.replays or (20 if cuda else 3)
    torch.set_grad_enabled(False)
    full = build_model(cfg, args.format, args.group_size, dtype, device, args.seed)
    _broadcast_state(full)  # identical weights and caches on every rank, whatever the RNG
    tp = parallelize_module(copy.deepcopy(full), mesh, tp_plan(args.reduce))
    x = torch.randn(cfg.batch, cfg.hidden, device=device).to(dtype)
    dist.broadcast(x, src=0)

    y_full, y_tp = full(x), tp(x)  # eager: also runs autotuning outside the graphs
    ref = float_reference(full)(x.float())
    check = {"rel_err_tp_vs_1": _rel_err(y_tp, y_full), "rel_err_1_vs_fp32": _rel_err(y_full, ref),
             "rel_err_tp_vs_fp32": _rel_err(y_tp, ref)}
    del ref
    check.update(rel_err=check["rel_err_tp_vs_1"], bound=NOISE_RATIO * check["rel_err_1_vs_fp32"],
                 criterion=f"rel_err(TP, 1 GPU) <= {NOISE_RATIO:g} x rel_err(1 GPU, fp32 model)")

    mode = "thread_local"
    graph_out: dict = {}
    t_tp = _step_ms(lambda: tp(x), device, replays, mode, graph_out)
    if cuda:  # the graph replays must give the eager result
        check["rel_err_graph_vs_eager"] = _rel_err(graph_out["y"], y_tp)
    worst = torch.tensor([check["rel_err"], t_tp, check.get("rel_err_graph_vs_eager", 0.0)],
                         dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    check["rel_err"], t_tp, graph_err = (float(v) for v in worst)
    if cuda:
        check["rel_err_graph_vs_eager"] = graph_err
    t_1 = _step_ms(lambda: full(x), device, replays, mode) if rank == 0 else None
    dist.barrier()
    passed = check["rel_err"] <= check["bound"] and (not cuda or graph_err <= check["bound"])
    check["passed"] = bool(passed)
    times = {"1": t_1, str(world): t_tp} if world > 1 else {"1": t_tp}
    return {
        "world_size": world, "backend": backend, "reduce": args.reduce, "format": args.format,
        "group_size": args.group_size, "dtype": args.dtype, "preset": args.preset, "config": asdict(cfg),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "cuda_graph": cuda, "check": check, "step_ms": times,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "command": " ".join(sys.argv),
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                               "SAILFISH_AUTOTUNE", "SAILFISH_CONFIG_FILE")},
    }


def _report(res: dict, path: str) -> None:
    c = res["check"]
    print(f"{res['preset']} x{res['config']['layers']} layers, {res['format']} g{res['group_size']} "
          f"{res['dtype']}, batch {res['config']['batch']}, {res['device']}, {res['backend']} "
          f"({res['reduce']}), CUDA graph: {res['cuda_graph']}")
    print(f"check: rel_err(TP, 1 GPU) {c['rel_err']:.3e}, bound {c['bound']:.3e}: "
          f"{'passed' if c['passed'] else 'FAILED'} ({c['criterion']}; 1 GPU vs fp32 "
          f"{c['rel_err_1_vs_fp32']:.3e}, TP vs fp32 {c['rel_err_tp_vs_fp32']:.3e})")
    for w, t in res["step_ms"].items():
        print(f"world size {w}: step {t:.4f} ms" if t is not None else f"world size {w}: not timed")
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {path}")


def _worker(rank: int, world: int, args) -> None:
    res = run_rank(rank, world, args)
    import torch.distributed as dist
    dist.destroy_process_group()
    if rank == 0:
        _report(res, args.json)
        if not res["check"]["passed"]:
            raise SystemExit(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sailfish.bench.tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="8b")
    p.add_argument("--layers", type=int, default=0, help="number of blocks (default: the preset's)")
    p.add_argument("--ctx", type=int, default=0, help="KV cache length (default: the preset's)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded per step (M)")
    p.add_argument("--format", choices=FORMATS, default="w4a16")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--reduce", choices=("dtensor", "c10d"), default="dtensor",
                   help="row-parallel sum: DTensor Partial->Replicate or torch.distributed.all_reduce")
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn when not under torchrun")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU even when CUDA is available")
    p.add_argument("--replays", type=int, default=0, help="timed steps (default: 20 on CUDA, 3 on the CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="tp.json")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, low in (("nproc", 1), ("batch", 1), ("layers", 0), ("ctx", 0), ("replays", 0)):
        if getattr(args, name) < low:
            parser.error(f"--{name}={getattr(args, name)} must be >= {low}")
    kv = PRESETS[args.preset][2]
    if "RANK" not in os.environ and kv % args.nproc:  # before building the model (minutes for 8b)
        parser.error(f"--nproc {args.nproc}: {heads_error(kv, args.nproc)} of --preset {args.preset}")
    # Never NVLink multicast (NVLS / symmetric-memory multicast) on the shared machines.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if "RANK" in os.environ:  # torchrun
        _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import torch.multiprocessing as mp
    # (spawn logs a warning per process it terminates after one failed: noise next to the error)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        mp.spawn(_worker, args=(args.nproc, args), nprocs=args.nproc)
    except mp.ProcessExitedException as e:
        print(f"a worker failed: {e}", file=sys.stderr)
        return 1
    except mp.ProcessRaisedException as e:
        # the message holds the worker's whole traceback; its last line is the error itself,
        # e.g. a --nproc that does not divide the model's heads
        print(f"{parser.prog}: error: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
