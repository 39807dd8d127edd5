"""Tensor parallelism for Sailfish layers (Megatron-style, over torch.distributed).

A linear layer y = x @ W^T + b, W of shape (N, K), is split over `world_size` ranks:

    dim=0 (column parallel): rank r keeps output features [r*N/w, (r+1)*N/w) and their bias;
          every rank takes the whole x and the outputs are concatenated.
    dim=1 (row parallel):    rank r keeps input features [r*K/w, (r+1)*K/w) (original channel
          order) and takes that slice of x; the outputs are summed (an all-reduce). Only
          rank 0 keeps the bias, so that it is added once.

`shard_quantized` cuts a canonical weight (QuantizedWeight / QQQWeight, formats/shard.py)
and checks that every shard obeys the kernels' shape rules, so a loader can shard each
layer's unpacked checkpoint tensors before packing (no full layer on one GPU);
`shard_layer` (QuantLinear.shard, QuantLinearW4A8.shard) does the same for a built layer
by unpacking, slicing and packing again, independent of the packed layout.

W4A8 row shards quantize their own slice of x per token, as an unsharded layer quantizes
all of x: the summed output is sum_r Q(x_r) @ W_r^T, which differs from the unsharded
Q(x) @ W^T by activation rounding only (each slice gets its own, finer, scale).

`SailfishColwiseParallel` / `SailfishRowwiseParallel` are torch.distributed.tensor.parallel
ParallelStyles, so a plan for `parallelize_module` can name Sailfish layers next to
torch's own styles. They shard the module in place (parallelize_module does not put a
returned module back into its parent) and keep inputs and outputs as plain local tensors:
the layers run custom ops, which DTensor has no sharding rules for. The row-parallel
style sums the outputs with DTensor (Partial -> Replicate, what RowwiseParallel does) or
with a plain in-place torch.distributed.all_reduce (`reduce="c10d"`).
"""
from __future__ import annotations

from fnmatch import fnmatch
from functools import partial
from typing import Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import ParallelStyle

from .formats.int4 import QuantizedWeight
from .formats.qqq import QQQWeight
from .formats.shard import shard_bias, shard_bounds, shard_quantized, shard_range  # noqa: F401  (re-exported)
from .fuse import PROJECTIONS, _Fused, shard_fused
from .nn import QuantLinear, QuantLinearW4A8

Weight = Union[QuantizedWeight, QQQWeight]
Layer = Union[QuantLinear, QuantLinearW4A8]
REDUCE_MODES = ("dtensor", "c10d")


def shard_layer(layer: Layer, rank: int, world_size: int, dim: int) -> Layer:
    """A new layer of the same class holding rank `rank`'s shard of `layer` (see the
    module doc); `layer` is left unchanged. Goes through the canonical weight
    (unpack -> slice -> pack), so it does not depend on the packed layout."""
    if not isinstance(layer, (QuantLinear, QuantLinearW4A8)):
        raise TypeError(f"layer must be a QuantLinear or a QuantLinearW4A8, got {type(layer).__name__}")
    if isinstance(layer, _Fused):  # q, k, v (gate, up) each split across the ranks
        return shard_fused(layer, rank, world_size, dim)
    qw = shard_quantized(layer.quantized_weight(), rank, world_size, dim)
    return type(layer).from_quantized(qw, shard_bias(layer.bias, rank, world_size, dim))


# ----------------------------------------------------------------------------------
# torch.distributed.tensor.parallel styles
# ----------------------------------------------------------------------------------
def _mesh_rank_world(device_mesh) -> Tuple[int, int]:
    if device_mesh.ndim != 1:
        raise ValueError(f"Sailfish parallel styles need a 1-D device mesh, got {device_mesh.ndim}-D "
                         f"(slice the tensor-parallel dimension, e.g. mesh['tp'])")
    return device_mesh.get_local_rank(), device_mesh.size()


def _become(module: nn.Module, new: nn.Module) -> None:
    """Give `module` the state of `new` (buffers, shapes, flags) but keep its own hooks, so
    a module can be sharded in place, as parallelize_module's dict plans require."""
    for key, value in vars(new).items():
        if "hook" not in key:
            module.__dict__[key] = value


def all_reduce_sum(y: torch.Tensor, device_mesh, reduce: str = "dtensor") -> torch.Tensor:
    """The sum of every rank's `y` (row-parallel partial outputs) over a 1-D mesh."""
    if reduce == "dtensor":
        return DTensor.from_local(y, device_mesh, [Partial()], run_check=False).full_tensor()
    if reduce == "c10d":
        dist.all_reduce(y, group=device_mesh.get_group())
        return y
    raise ValueError(f"reduce={reduce!r} is not supported; allowed: {REDUCE_MODES}")


def _check_layer(style: str, module: nn.Module) -> None:
    if not isinstance(module, (QuantLinear, QuantLinearW4A8)):
        raise TypeError(f"{style} applies to QuantLinear and QuantLinearW4A8, got "
                        f"{type(module).__name__} (torch's own styles handle nn.Linear)")


class SailfishColwiseParallel(ParallelStyle):
    """Column parallel: each rank keeps N / world output features. The input is the whole
    x on every rank (replicated), the output the rank's slice of the last dimension, both
    plain local tensors; typically the next layer is row parallel and consumes it as is.
    shard=False: the module already is this rank's shard (a loader cut it with
    shard_quantized), so nothing is done."""

    def __init__(self, *, shard: bool = True):
        super().__init__()
        self.shard = shard

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_layer(type(self).__name__, module)
        rank, world = _mesh_rank_world(device_mesh)
        if self.shard:
            _become(module, shard_layer(module, rank, world, 0))
        return module


class SailfishRowwiseParallel(ParallelStyle):
    """Row parallel: each rank keeps K / world input features and takes that slice of x
    (a local tensor, e.g. a column-parallel layer's output); the partial outputs are summed
    over the mesh, so every rank gets the whole y. reduce: "dtensor" (DTensor Partial ->
    Replicate, functional collectives) or "c10d" (in-place torch.distributed.all_reduce).
    shard=False: the module already is this rank's shard; only the sum is added."""

    def __init__(self, *, reduce: str = "dtensor", shard: bool = True):
        super().__init__()
        if reduce not in REDUCE_MODES:
            raise ValueError(f"reduce={reduce!r} is not supported; allowed: {REDUCE_MODES}")
        self.reduce, self.shard = reduce, shard

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_layer(type(self).__name__, module)
        rank, world = _mesh_rank_world(device_mesh)
        if self.shard:
            _become(module, shard_layer(module, rank, world, 1))
        module.register_forward_hook(partial(_reduce_output, device_mesh, self.reduce))
        return module


def _reduce_output(device_mesh, reduce: str, module, inputs, output: torch.Tensor) -> torch.Tensor:
    return all_reduce_sum(output, device_mesh, reduce)


# ----------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------
_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")
_FUSED_COLUMN = ("self_attn.qkv_proj", "mlp.gate_up_proj")


def default_plan(reduce: str = "dtensor", *, fused: bool = False) -> dict:
    """The Megatron plan for transformers' Llama-family models (Llama, Mistral, Qwen2/3):
    q/k/v and gate/up column parallel, o and down row parallel (their outputs summed), by
    parallelize_module's pattern syntax. fused=True names the fused layers (qkv_proj,
    gate_up_proj) of a model that fuse_projections rewrote, as parallelize_module needs;
    load_quantized(device_mesh=...) takes either form (it shards per projection, then fuses)."""
    col, row = SailfishColwiseParallel(), SailfishRowwiseParallel(reduce=reduce)
    return {**{f"model.layers.*.{p}": col for p in (_FUSED_COLUMN if fused else _COLUMN)},
            **{f"model.layers.*.{p}": row for p in _ROW}}


def _plan_matches(pattern: str, name: str) -> bool:
    """parallelize_module's matching: one fnmatch pattern per dotted component."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch(p, a) for p, a in zip(parts, atoms))


def resolve_plan(plan: dict, names) -> Dict[str, Tuple[int, ParallelStyle]]:
    """{layer name: (dim, style)} for the layers `names` (a checkpoint's projections) that the
    plan shards: dim 0 for SailfishColwiseParallel, 1 for SailfishRowwiseParallel. A pattern
    naming a fused layer (qkv_proj, gate_up_proj) applies to the projections it stacks.
    ValueError for a pattern that names none of them, TypeError for another style."""
    fused_name = {p: f for f, parts in PROJECTIONS for p in parts}
    if not isinstance(plan, dict):
        raise TypeError(f"tp_plan must be a dict of module-name pattern -> SailfishColwiseParallel / "
                        f"SailfishRowwiseParallel, got {type(plan).__name__}")
    out: Dict[str, Tuple[int, ParallelStyle]] = {}
    for pattern, style in plan.items():
        if not isinstance(style, (SailfishColwiseParallel, SailfishRowwiseParallel)):
            raise TypeError(f"tp_plan[{pattern!r}] is a {type(style).__name__}; allowed: SailfishColwiseParallel, "
                            f"SailfishRowwiseParallel (layers the plan does not name stay whole on every rank)")
        dim = 0 if isinstance(style, SailfishColwiseParallel) else 1
        hits = []
        for name in names:
            parent, _, leaf = name.rpartition(".")
            alias = f"{parent}.{fused_name[leaf]}" if leaf in fused_name else None
            if _plan_matches(pattern, name) or (alias and _plan_matches(pattern, alias)):
                hits.append(name)
        if not hits:
            raise ValueError(f"tp_plan[{pattern!r}] names no quantized layer of the checkpoint (e.g. "
                             f"{next(iter(names), None)!r}); allowed: patterns of quantized layers' names")
        for name in hits:
            if name in out and out[name][0] != dim:
                raise ValueError(f"tp_plan makes {name} both column and row parallel")
            out[name] = (dim, style)
    return out


__all__ = ["shard_range", "shard_bounds", "default_plan", "resolve_plan", "shard_quantized", "shard_bias", "shard_layer", "all_reduce_sum",
           "SailfishColwiseParallel", "SailfishRowwiseParallel", "REDUCE_MODES"]
