"""Fused projections: q/k/v as one layer, gate/up as one, in transformers models.

Projections that read the same input (an attention's q_proj, k_proj, v_proj; an MLP's
gate_proj, up_proj) run as one GEMM over their weights stacked along N: one launch instead
of three (two), one weight stream, and for W4A8 one activation quantization. The stacking
is exact (formats.shard.concat_weight, the inverse of a slice along N), so every output
element is the same dot product as before; only the kernel's summation order may differ.

The layer. FusedQuantLinear / FusedQuantLinearW4A8 are a QuantLinear / QuantLinearW4A8
holding the stacked weight and its `segments`, ((name, width), ...) in N order. Its
state_dict holds the per-projection tensors an unfused model has, under the projections'
own names (`...self_attn.q_proj.qweight`, not `...qkv_proj.qweight`), and load_state_dict
reads them back, so state dicts and checkpoints (save_quantized) are the same for fused and
unfused models. shard() splits each segment across the ranks (rank r holds q_r, k_r, v_r),
as the unfused layers' shards would be.

The model. fuse_projections(model) (quantize_model, load_quantized and SailfishConfig
call it unless fuse=False) puts the fused layer next to the projections (`self_attn.qkv_proj`,
`mlp.gate_up_proj`), replaces each projection by a FusedOutput that returns its columns of
the fused output, and registers a forward pre-hook on the parent that feeds the fused layer's
output to the parent's unchanged forward in place of the input. transformers' own forward
then runs as written: `self.q_proj(hidden_states)` takes q's columns of qkv_proj(hidden_states).
No state is kept between calls and nothing depends on tensor identity, so it runs the same
eagerly, under torch.compile(fullgraph=True) and in CUDA graphs.

That rewrite is exact only if the forward uses its input solely as the argument of those
projections (and for its leading shape, `x.shape[:-1]`, which the fused output shares), and
calls the projections with nothing else. It is applied only to the classes in SUPPORTED,
and for each the forward's source is checked for exactly that (_input_only_through); a
module of another class, a forward that fails the check, hooks or an instance-level forward
already on the module, projections that are not Sailfish layers of one format, or act-order
weights with different g_idx leave the projections separate, each with its reason in
model.sailfish_report["not_fused"].
"""
from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .formats.shard import concat_weight, shard_bias, shard_quantized, slice_weight
from .nn import QuantLinear, QuantLinearW4A8

log = logging.getLogger("sailfish")

# (fused layer's name, the projections it replaces), in N order.
PROJECTIONS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
# Classes whose forward takes its input only through those projections (each class's forward
# source is checked once per process, so a transformers release that changes them is caught).
SUPPORTED = {
    "transformers.models.llama.modeling_llama": ("LlamaAttention", "LlamaMLP"),
    "transformers.models.mistral.modeling_mistral": ("MistralAttention", "MistralMLP"),
    "transformers.models.qwen2.modeling_qwen2": ("Qwen2Attention", "Qwen2MLP"),
    "transformers.models.qwen3.modeling_qwen3": ("Qwen3Attention", "Qwen3MLP"),
}
ARCHITECTURES = "Llama, Mistral, Qwen2, Qwen3"


def _parent_prefix(prefix: str) -> str:
    """'model.layers.0.self_attn.qkv_proj.' -> 'model.layers.0.self_attn.' ('' at the top)."""
    parent = prefix[:-1].rpartition(".")[0]
    return parent + "." if parent else ""


class _Fused:
    """What a fused layer adds to its base class (QuantLinear or QuantLinearW4A8)."""

    segments: Tuple[Tuple[str, int], ...] = ()

    @classmethod
    def _base(cls):
        return next(b for b in cls.__mro__ if b in (QuantLinear, QuantLinearW4A8))

    @staticmethod
    def _settings(layer) -> dict:
        """from_quantized's module settings beyond the weight: W4A8's activation type."""
        return {"act_dtype": layer.act_dtype} if isinstance(layer, QuantLinearW4A8) else {}

    @classmethod
    def from_layers(cls, layers: Sequence[nn.Module], names: Sequence[str]):
        """One layer computing `layers` (plain QuantLinear or QuantLinearW4A8 layers of one
        format reading one input) stacked along N; segments = (names[i], layers[i].out_features).
        ValueError naming what differs when they cannot be stacked exactly."""
        if len(layers) != len(names) or len(layers) < 2:
            raise ValueError(f"layers and names must have the same length >= 2, got {len(layers)} and {len(names)}")
        base = cls._base()
        for name, layer in zip(names, layers):
            if type(layer) is not base:
                raise TypeError(f"{name} is a {type(layer).__name__}; {cls.__name__} stacks {base.__name__} layers")
        biases = [layer.bias is not None for layer in layers]
        if len(set(biases)) > 1:
            raise ValueError(f"{', '.join(n for n, b in zip(names, biases) if b)} have a bias and "
                             f"{', '.join(n for n, b in zip(names, biases) if not b)} do not")
        act_dtypes = {getattr(layer, "act_dtype", None) for layer in layers}
        if len(act_dtypes) > 1:
            raise ValueError(f"the layers have different act_dtype {sorted(act_dtypes)}")
        try:
            qw = concat_weight([layer.quantized_weight() for layer in layers])
        except ValueError as e:  # name the layers instead of parts[i]
            message = str(e)
            for i, name in enumerate(names):
                message = message.replace(f"parts[{i}]", name)
            raise ValueError(message) from None
        bias = torch.cat([layer.bias for layer in layers]) if biases[0] else None
        fused = cls.from_quantized(qw, bias, **cls._settings(layers[0]))
        fused.segments = tuple((name, layer.out_features) for name, layer in zip(names, layers))
        return fused

    def parts(self) -> List[Tuple[str, nn.Module]]:
        """[(name, layer)]: each segment as the plain layer it was (exactly: the inverse of
        from_layers), on the fused layer's device."""
        qw, out, start = self.quantized_weight(), [], 0
        for name, width in self.segments:
            bias = None if self.bias is None else self.bias[start:start + width]
            part = slice_weight(qw, 0, start, start + width)
            out.append((name, self._base().from_quantized(part, bias, **self._settings(self))))
            start += width
        return out

    def _template(self, width: int) -> nn.Module:
        """An empty plain layer of this layer's format with `width` output features."""
        dev = self.qweight.device
        if self._base() is QuantLinearW4A8:
            return QuantLinearW4A8(self.in_features, width, self.bias is not None, group_size=self.group_size,
                                   act_dtype=self.act_dtype, device=dev)
        groups = self.scales.shape[1] if self.act_order and self.group_size != -1 else None
        return QuantLinear(self.in_features, width, self.bias is not None, bits=self.bits,
                           group_size=self.group_size, sym=self.sym, act_order=self.act_order,
                           dtype=self.dtype, device=dev, groups=groups)

    # -- state dict: the per-projection tensors, under the projections' names ---------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        parent = _parent_prefix(prefix)
        for name, part in self.parts():
            part._save_to_state_dict(destination, f"{parent}{name}.", keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # load_state_dict hands each module only the keys under its own prefix, so inside a
        # model the parent's pre-hook (_load_fused) reads the projections' keys; a fused layer
        # loaded on its own (prefix "") reads them here.
        mine = tuple(f"{_parent_prefix(prefix)}{name}." for name, _ in self.segments)
        if strict:  # the fused layer's own names never occur in a state dict
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and not k.startswith(mine))
        if not prefix:
            self._load_parts(state_dict, "", local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _load_parts(self, state_dict, parent, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """Load the projections' tensors (keys parent + name + '.*') as the plain layers they
        are, check that they stack (equal g_idx, ...) and copy the stacked weight in."""
        errors, missing, parts = len(error_msgs), len(missing_keys), []
        for name, width in self.segments:
            part = self._template(width)
            part._load_from_state_dict(state_dict, f"{parent}{name}.", local_metadata, strict, missing_keys,
                                       unexpected_keys, error_msgs)
            if isinstance(part, QuantLinear):
                part._sync_flags()
            parts.append(part)
        if len(error_msgs) > errors or len(missing_keys) > missing:
            return
        names = [n for n, _ in self.segments]
        try:
            new = type(self).from_layers(parts, names)
        except (TypeError, ValueError) as e:
            error_msgs.append(f"{parent}{{{','.join(names)}}}: these projections cannot be fused: {e}")
            return
        for key, value in new._buffers.items():
            mine = self._buffers.get(key)
            if (mine is None) != (value is None) or (value is not None and mine.shape != value.shape):
                error_msgs.append(f"{parent}{{{','.join(names)}}}: the stacked {key} has shape "
                                  f"{None if value is None else tuple(value.shape)}, the fused layer "
                                  f"{None if mine is None else tuple(mine.shape)}")
                return
        with torch.no_grad():
            for key, value in new._buffers.items():
                if value is not None:
                    self._buffers[key].copy_(value)
        if isinstance(self, QuantLinear):
            self._sync_flags()

    def shard(self, rank: int, world_size: int, dim: int):
        """Tensor-parallel shard (sailfish.parallel): dim=0 splits every segment across the
        ranks (rank r holds segment_0[r], segment_1[r], ...), dim=1 the input features."""
        return shard_fused(self, rank, world_size, dim)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", segments=" + "+".join(f"{n}:{w}" for n, w in self.segments)


class FusedQuantLinear(_Fused, QuantLinear):
    """A QuantLinear holding several projections stacked along N (see the module doc)."""


class FusedQuantLinearW4A8(_Fused, QuantLinearW4A8):
    """A QuantLinearW4A8 holding several projections stacked along N (see the module doc)."""


def shard_fused(layer: _Fused, rank: int, world_size: int, dim: int) -> _Fused:
    """Rank `rank`'s shard of a fused layer: along N per segment (the fused shard of the
    unfused layers' shards), along K as any layer (the segments unchanged)."""
    if dim == 0:
        names = [n for n, _ in layer.segments]
        shards = [part.shard(rank, world_size, 0) for _, part in layer.parts()]
        return type(layer).from_layers(shards, names)
    qw = shard_quantized(layer.quantized_weight(), rank, world_size, dim)
    new = type(layer).from_quantized(qw, shard_bias(layer.bias, rank, world_size, dim), **layer._settings(layer))
    new.segments = layer.segments
    return new


# ----------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------
class FusedOutput(nn.Module):
    """Stands where a projection was: returns its columns of the fused layer's output.

    The columns are kept as fractions of the fused width (start / total, width / total), so
    they stay right when the fused layer is replaced by a tensor-parallel shard, which splits
    every segment evenly. No parameters: the weights live in the fused layer, whose
    state_dict writes them under this module's name; loading them is left to it."""

    def __init__(self, start: int, width: int, total: int):
        super().__init__()
        self.start, self.width, self.total = start, width, total

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        n = y.shape[-1]
        return y.narrow(-1, self.start * n // self.total, self.width * n // self.total)

    def _load_from_state_dict(self, *args, **kwargs):
        pass  # the fused sibling reads (and checks) the keys under this name

    def extra_repr(self) -> str:
        return f"columns [{self.start}, {self.start + self.width}) of {self.total}"


def _feed_fused(attr: str, param: str, module: nn.Module, args, kwargs):
    """Forward pre-hook: the fused layer's output in place of the forward's input."""
    fused = module._modules[attr]
    if args:
        return (fused(args[0]), *args[1:]), kwargs
    return args, {**kwargs, param: fused(kwargs[param])}


def _load_fused(attr: str, module: nn.Module, state_dict, prefix, *args) -> None:
    """Load-state-dict pre-hook of a fused layer's parent: the projections' keys, which
    load_state_dict would hand only to the FusedOutput modules, go to the fused layer."""
    module._modules[attr]._load_parts(state_dict, prefix, *args)


def _is_self_attr(node, names) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _is_leading_shape(node, parents) -> bool:
    """node is the `x.shape` of `x.shape[:-1]`."""
    sub = parents.get(node)
    s = getattr(sub, "slice", None)
    return (isinstance(sub, ast.Subscript) and sub.value is node and isinstance(s, ast.Slice)
            and s.lower is None and s.step is None and isinstance(s.upper, ast.UnaryOp)
            and isinstance(s.upper.op, ast.USub) and getattr(s.upper.operand, "value", None) == 1)


def _input_only_through(cls: type, names: Sequence[str]) -> Optional[str]:
    """None if cls.forward uses its first argument x only as `self.<p>(x)` for p in names
    (and as x.shape[:-1]) and calls those projections only that way; else why not."""
    fn = inspect.unwrap(cls.forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError) as e:
        return f"the source of {cls.__name__}.forward cannot be read ({e})"
    func = tree.body[0]
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(func.args.args) < 2 \
            or func.args.posonlyargs:
        return f"{cls.__name__}.forward does not take its input as its first argument"
    x = func.args.args[1].arg
    parents = {child: node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}
    called = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Name) and node.id == x:
            p = parents.get(node)
            if isinstance(p, ast.Call) and _is_self_attr(p.func, names) and p.args == [node] and not p.keywords:
                called.add(p.func.attr)
            elif not (isinstance(p, ast.Attribute) and p.attr == "shape" and _is_leading_shape(p, parents)):
                return (f"{cls.__name__}.forward uses its input {x!r} other than as the argument of "
                        f"{', '.join(names)} (line {node.lineno} of its source)")
        elif _is_self_attr(node, names):
            p = parents.get(node)
            if not (isinstance(p, ast.Call) and p.func is node and len(p.args) == 1
                    and isinstance(p.args[0], ast.Name) and p.args[0].id == x and not p.keywords):
                return f"{cls.__name__}.forward uses self.{node.attr} other than as self.{node.attr}({x})"
    if called != set(names):
        return f"{cls.__name__}.forward does not call {', '.join(sorted(set(names) - called))}"
    return None


@functools.lru_cache(maxsize=None)
def _class_check(cls: type, names: Tuple[str, ...]) -> Optional[str]:
    if cls.__name__ not in SUPPORTED.get(cls.__module__, ()):
        return (f"{cls.__module__}.{cls.__qualname__} is not a module whose forward Sailfish has "
                f"checked (fused: {ARCHITECTURES} attention and MLP)")
    return _input_only_through(cls, names)


def _fuse_reason(module: nn.Module, attr: str, names: Tuple[str, ...]) -> Optional[str]:
    """Why `names` of `module` cannot be fused, or None."""
    layers = [module._modules[n] for n in names]
    kinds = {type(m) for m in layers}
    if len(kinds) > 1 or not kinds <= {QuantLinear, QuantLinearW4A8}:
        return ("the projections are not Sailfish layers of one format: "
                + ", ".join(f"{n} is {type(m).__name__}" for n, m in zip(names, layers)))
    reason = _class_check(type(module), names)
    if reason:
        return reason
    if "forward" in module.__dict__ or module._forward_hooks or module._forward_pre_hooks:
        return f"{type(module).__name__} has hooks or an instance-level forward (e.g. accelerate's device hooks)"
    if attr in module._modules or hasattr(module, attr):
        return f"{type(module).__name__} already has an attribute {attr!r}"
    return None


def check_fuse_flag(fuse) -> None:
    """fuse= of quantize_model / load_quantized / SailfishConfig must be a bool."""
    if not isinstance(fuse, bool):
        raise TypeError(f"fuse={fuse!r} must be a bool (True: fuse q/k/v and gate/up where exact)")


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse, in place, the q/k/v and gate/up projections of every supported module whose
    projections are Sailfish layers (see the module doc). When the model has such groups of
    projections, records model.sailfish_report["fused"] = {fused layer name: [projection
    names]} and ["not_fused"] = {would-be fused layer name: reason}; returns the model."""
    fused: Dict[str, List[str]] = {}
    not_fused: Dict[str, str] = {}
    for name, module in list(model.named_modules()):
        for attr, names in PROJECTIONS:
            if not all(n in module._modules for n in names):
                continue
            if any(isinstance(module._modules[n], FusedOutput) for n in names):
                continue  # fused already
            where = f"{name}.{attr}" if name else attr
            reason = _fuse_reason(module, attr, names)
            if reason is None:
                layers = [module._modules[n] for n in names]
                cls = FusedQuantLinear if isinstance(layers[0], QuantLinear) else FusedQuantLinearW4A8
                try:
                    layer = cls.from_layers(layers, names)
                except (TypeError, ValueError) as e:
                    reason = str(e)
            if reason:
                not_fused[where] = reason
                log.info("sailfish: %s left unfused: %s", where, reason)
                continue
            module.add_module(attr, layer)
            total, start = layer.out_features, 0
            for n, width in layer.segments:
                module._modules[n] = FusedOutput(start, width, total)
                start += width
            sig = inspect.signature(inspect.unwrap(type(module).forward))
            param = list(sig.parameters)[1]
            module.register_forward_pre_hook(functools.partial(_feed_fused, attr, param), with_kwargs=True)
            module.register_load_state_dict_pre_hook(functools.partial(_load_fused, attr))
            fused[where] = list(names)
    if fused or not_fused:  # (a model without such projections keeps its report as it was)
        log.info("sailfish: fused %d projection groups, left %d unfused", len(fused), len(not_fused))
        report = getattr(model, "sailfish_report", None)
        model.sailfish_report = {**(report if isinstance(report, dict) else {}), "fused": fused,
                                 "not_fused": not_fused}
    return model


def unfused_layers(model: nn.Module) -> Dict[str, nn.Module]:
    """{name: layer} of every Sailfish layer of the model, a fused layer given as its
    projections (plain layers, under their own names): what a checkpoint stores."""
    out: Dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, _Fused):
            parent = name.rpartition(".")[0]
            out.update({f"{parent}.{n}" if parent else n: part for n, part in module.parts()})
        elif isinstance(module, (QuantLinear, QuantLinearW4A8)):
            out[name] = module
    return out


__all__ = ["check_fuse_flag", "FusedQuantLinear", "FusedQuantLinearW4A8", "FusedOutput", "fuse_projections", "unfused_layers",
           "shard_fused", "SUPPORTED", "ARCHITECTURES"]
