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

DeepSeek-V2 / V3's shared experts (fold_shared_experts, called by fuse_projections first): a MoE
block's shared MLP of width S * I runs inside its QuantExperts as S experts of the routed width
I (moe.py), where the block's forward and the layers are of the checked form; the block takes
a Sailfish forward (SharedExpertsMoE) and keeps the unfolded block's state_dict keys.
"""
from __future__ import annotations

import ast
import functools
import inspect
import logging
import sys
import textwrap
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from . import generation, inductor
from .formats.shard import concat_weight, shard_bias, shard_quantized, slice_weight
from .moe import SHARED_MLP, SHARED_PROJECTIONS, QuantExperts
from .nn import QuantLinear, QuantLinearW4A8, parent_prefix
from .ops.rowwise import (quantize_per_token_torch, rms_norm, rms_norm_impl, rms_norm_quant, rms_norm_quant_fp8,
                          rms_norm_quant_fp8_impl, rms_norm_quant_impl, rms_norm_torch, silu_mul, silu_mul_impl,
                          silu_mul_quant, silu_mul_quant_fp8, silu_mul_quant_fp8_impl, silu_mul_quant_impl,
                          silu_mul_torch)
from .ops.attention import decode_attention, decode_attention_launch, decode_attention_problem
from .ops.moe import MAX_TOPK
from .ops.router import ROUTER_MAX_EXPERTS, router_linear_topk, router_linear_topk_impl, router_topk_reference
from .runtime.device import use_triton
from .runtime.dispatch import direct_call_ok

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
    # mixtures of experts: the attention, and the dense MLPs (Qwen2-MoE's shared expert, Qwen3-MoE's
    # mlp_only_layers); the experts are QuantExperts (moe.py)
    "transformers.models.mixtral.modeling_mixtral": ("MixtralAttention",),
    "transformers.models.qwen2_moe.modeling_qwen2_moe": ("Qwen2MoeAttention", "Qwen2MoeMLP"),
    "transformers.models.qwen3_moe.modeling_qwen3_moe": ("Qwen3MoeAttention", "Qwen3MoeMLP"),
    # DeepSeek-V2 / V3: the MLPs (shared experts, the first dense layers); their attention is MLA
    "transformers.models.deepseek_v2.modeling_deepseek_v2": ("DeepseekV2MLP",),
    "transformers.models.deepseek_v3.modeling_deepseek_v3": ("DeepseekV3MLP",),
}
ARCHITECTURES = "Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 / V3 (MLPs)"


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
        parent = parent_prefix(prefix)
        for name, part in self.parts():
            part._save_to_state_dict(destination, f"{parent}{name}.", keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # load_state_dict hands each module only the keys under its own prefix, so inside a
        # model the parent's pre-hook (_load_fused) reads the projections' keys; a fused layer
        # loaded on its own (prefix "") reads them here.
        mine = tuple(f"{parent_prefix(prefix)}{name}." for name, _ in self.segments)
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


def _build_unless(reason: Optional[str], build):
    """(build(), None) where there is no reason against it and build() succeeds; else (None, the
    reason, or the TypeError / ValueError build() raised): the fusing passes' refusal rule."""
    if reason is not None:
        return None, reason
    try:
        return build(), None
    except (TypeError, ValueError) as e:
        return None, str(e)


def check_fuse_flag(fuse) -> None:
    """fuse= of quantize_model / load_quantized / SailfishConfig must be a bool."""
    if not isinstance(fuse, bool):
        raise TypeError(f"fuse={fuse!r} must be a bool (True: fuse q/k/v and gate/up where exact)")


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse, in place, the q/k/v and gate/up projections of every supported module whose
    projections are Sailfish layers (see the module doc), after running DeepSeek's shared MLPs
    inside their experts (fold_shared_experts). When the model has such groups of
    projections, records model.sailfish_report["fused"] = {fused layer name: [projection
    names]}, ["shared_experts_folded"] = [MoE block names] and ["not_fused"] = {would-be fused
    layer or shared_experts name: reason}; returns the model."""
    folded, not_fused = fold_shared_experts(model)  # (before gate / up of the shared MLPs fuse)
    fused: Dict[str, List[str]] = {}
    for name, module in list(model.named_modules()):
        for attr, names in PROJECTIONS:
            if not all(n in module._modules for n in names):
                continue
            if any(isinstance(module._modules[n], FusedOutput) for n in names):
                continue  # fused already
            where = f"{name}.{attr}" if name else attr
            layers = [module._modules.get(n) for n in names]
            cls = FusedQuantLinear if isinstance(layers[0], QuantLinear) else FusedQuantLinearW4A8
            layer, reason = _build_unless(_fuse_reason(module, attr, names), lambda: cls.from_layers(layers, names))
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
    rows = fuse_row_ops(model)
    if fused or folded or not_fused or any(rows.values()):  # (a model without any keeps its report as it was)
        log.info("sailfish: fused %d projection groups, folded %d shared MLPs into their experts, left %d "
                 "unfused; row ops: %s", len(fused), len(folded), len(not_fused),
                 ", ".join(f"{len(v)} {k}" for k, v in rows.items()))
        report = getattr(model, "sailfish_report", None)
        model.sailfish_report = {**(report if isinstance(report, dict) else {}), "fused": fused,
                                 "shared_experts_folded": folded, "not_fused": not_fused, "row_ops": rows}
    return model


# ----------------------------------------------------------------------------------
# Row-wise ops around the GEMMs: RMSNorm and silu(gate) * up in one launch each, and for
# W4A8 the activation quantization fused into them (ops/rowwise.py; issue 39 items 2, 3)
# ----------------------------------------------------------------------------------
# transformers' RMSNorm classes that are Llama's formula (each class's forward is also checked
# against it, _same_forward), and the decoder layers whose norm outputs feed only their
# attention / MLP (checked too, _feeds_only).
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MixtralRMSNorm", "Qwen2MoeRMSNorm",
         "Qwen3MoeRMSNorm")
_NORM_FORWARD = """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""
_MLP_FORWARD = """
def forward(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
"""
# (op, its implementation) of the quantizing row ops by W4A8 act_dtype
_NORM_QUANT = {"int8": (rms_norm_quant, rms_norm_quant_impl), "fp8": (rms_norm_quant_fp8, rms_norm_quant_fp8_impl)}
_SILU_QUANT = {"int8": (silu_mul_quant, silu_mul_quant_impl), "fp8": (silu_mul_quant_fp8, silu_mul_quant_fp8_impl)}
_SILU_FORWARD = """
def forward(self, input):
    return nn.functional.silu(input)
"""


def _function_ast(source: str) -> Optional[str]:
    """ast.dump of a forward's source with what does not change its meaning taken out
    (decorators, annotations, the docstring) and a final `v = e; return v` read as `return e`."""
    try:
        func = ast.parse(textwrap.dedent(source)).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(func, ast.FunctionDef):
        return None
    func.decorator_list, func.returns, func.name = [], None, "forward"
    for a in func.args.args + func.args.kwonlyargs:
        a.annotation = None
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    if (len(body) >= 2 and isinstance(body[-1], ast.Return) and isinstance(body[-1].value, ast.Name)
            and isinstance(body[-2], ast.Assign) and len(body[-2].targets) == 1
            and isinstance(body[-2].targets[0], ast.Name) and body[-2].targets[0].id == body[-1].value.id):
        body = body[:-2] + [ast.Return(body[-2].value)]
    func.body = body
    return ast.dump(func, annotate_fields=False, include_attributes=False)


@functools.lru_cache(maxsize=None)
def _same_forward(cls: type, canonical: str) -> bool:
    """cls.forward is, statement for statement, the canonical source (see _function_ast)."""
    try:
        source = inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return False
    mine = _function_ast(source)
    return mine is not None and mine == _function_ast(canonical)


@functools.lru_cache(maxsize=None)
def _feeds_only(cls: type, norm: str, consumer: str) -> bool:
    """cls.forward computes `v = self.<norm>(...)` and the next statement assigns v again from a
    call of self.<consumer> that takes v once, as an argument: the norm's output goes to the
    consumer and nowhere else, and self.<norm> is called nowhere else."""
    try:
        func = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    if not isinstance(func, ast.FunctionDef):
        return False
    uses = [n for n in ast.walk(func) if _is_self_attr(n, (norm,))]
    body = func.body
    for i, stmt in enumerate(body[:-1]):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and isinstance(stmt.value, ast.Call) and _is_self_attr(stmt.value.func, (norm,))):
            continue
        v, nxt = stmt.targets[0].id, body[i + 1]
        if len(uses) != 1 or not (isinstance(nxt, ast.Assign) and isinstance(nxt.value, ast.Call)
                                  and _is_self_attr(nxt.value.func, (consumer,))):
            return False
        targets = [t for tg in nxt.targets for t in ast.walk(tg) if isinstance(t, ast.Name)]
        reads = [n for n in ast.walk(nxt.value) if isinstance(n, ast.Name) and n.id == v]
        args = list(nxt.value.args) + [k.value for k in nxt.value.keywords]
        return (any(t.id == v for t in targets) and len(reads) == 1 and any(a is reads[0] for a in args))
    return False


def _formula_only(x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> bool:
    """Where the row-wise kernels cannot stand in for the formula: with a gradient to compute
    (they have no derivative), or where the kernel's dtype rule does not hold (fp32, a weight of
    another dtype: the formula's own promotion then applies)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return True
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return True
    return weight is not None and weight.dtype != x.dtype


def _torch_path(x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> bool:
    """Run the plain-torch form of a 16-bit row op: where the kernels cannot (_formula_only), and
    under torch.compile, where inductor fuses the formula with its neighbours (the residual add
    before a norm) into fewer launches than the op would leave. The quantizing forms stay ops under
    compile: inductor's own norm + per-token quantization measured slower (docs/perf_log.md v43)."""
    return torch.compiler.is_compiling() or _formula_only(x, weight)


class SailfishRMSNorm(nn.Module):
    """transformers' RMSNorm (Llama's formula) as one launch of sailfish::rms_norm instead of
    the eight small kernels of its eager forward; the same `weight` parameter (and state_dict
    key), equal outputs up to the order of the sum of squares (ops/rowwise.py)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if _torch_path(hidden_states, self.weight):
            return rms_norm_torch(hidden_states, self.weight, self.variance_epsilon)
        return _row_op(rms_norm, rms_norm_impl, hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class DeferredRMSNorm(SailfishRMSNorm):
    """A decoder layer's norm whose only consumer (its attention's fused q/k/v, or its MLP's
    fused gate/up, a W4A8 layer) applies it itself, fused with the int8 / fp8 quantization of
    its input (sailfish::rms_norm_quant): here the input passes through unchanged. Installed
    only where the decoder layer's forward hands the norm's output to that consumer and to
    nothing else (_feeds_only)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def extra_repr(self) -> str:
        return super().extra_repr() + ", applied by its consumer with the activation quantization"


def _plain(module: nn.Module) -> bool:
    return not (module._forward_hooks or module._forward_pre_hooks)


def _takes_quantized(layer: nn.Module) -> bool:
    """May the caller hand `layer` its input quantized (forward_quantized)? A W4A8 layer without
    hooks (a tensor-parallel style's hooks must run; a reference model may hold an nn.Linear)."""
    return isinstance(layer, QuantLinearW4A8) and _plain(layer)


def _row_op(op, impl, x: torch.Tensor, *args):
    """A row-wise op called as a plain function where the dispatcher would add only its cost
    (runtime/dispatch.direct_call_ok), else through torch.ops."""
    return impl(x, *args) if direct_call_ok(x) else op(x, *args)


def _is_silu(act) -> bool:
    cls = type(act)
    return cls is nn.SiLU or (cls.__name__ == "SiLUActivation" and cls.__module__.startswith("transformers.")
                              and _same_forward(cls, _SILU_FORWARD))


def _normed_into(layer: nn.Module, x: torch.Tensor, norm: DeferredRMSNorm) -> torch.Tensor:
    """layer(norm(x)); for a W4A8 layer that takes its input quantized, the norm and the
    activation quantization in one op."""
    if not _takes_quantized(layer):
        return layer(SailfishRMSNorm.forward(norm, x))
    x2 = x.reshape(-1, x.shape[-1])
    if _formula_only(x, norm.weight):
        x_q, s = quantize_per_token_torch(rms_norm_torch(x2, norm.weight, norm.variance_epsilon), layer.act_dtype)
    else:
        x_q, s = _row_op(*_NORM_QUANT[layer.act_dtype], x2, norm.weight, norm.variance_epsilon)
    return layer.forward_quantized(x_q, s, x.dtype).reshape(*x.shape[:-1], layer.out_features)


def _feed_fused_norm(attr: str, param: str, norm: DeferredRMSNorm, module: nn.Module, args, kwargs):
    """Forward pre-hook of an attention whose input norm is deferred to it: the fused q/k/v of
    norm(x), the norm fused with the activation quantization."""
    x = args[0] if args else kwargs[param]
    y = _normed_into(module._modules[attr], x, norm)
    return ((y, *args[1:]), kwargs) if args else (args, {**kwargs, param: y})


class GatedMLP(nn.Module):
    """Stands where a gated MLP (`down(act(gate(x)) * up(x))`, act SiLU, gate/up fused) was,
    with its children (so its state_dict keys are the MLP's) and its attributes: silu(gate) * up
    as one launch on the fused gate_up output (sailfish::silu_mul), for a W4A8 down_proj fused
    with that input's quantization (silu_mul_quant), and the post-attention norm applied here
    where it is deferred (DeferredRMSNorm)."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        for k, v in vars(mlp).items():
            if not k.startswith("_") and k != "training":
                setattr(self, k, v)
        for name, child in mlp._modules.items():
            self.add_module(name, child)
        self.replaces = type(mlp).__name__
        self.register_load_state_dict_pre_hook(functools.partial(_load_fused, "gate_up_proj"))
        self._sailfish_norm: Optional[DeferredRMSNorm] = None  # not a submodule: the decoder layer holds it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down, norm = self._modules["gate_up_proj"], self._modules["down_proj"], self._sailfish_norm
        gu = gate_up(x) if norm is None else _normed_into(gate_up, x, norm)
        if _takes_quantized(down):
            g2 = gu.reshape(-1, gu.shape[-1])
            if _formula_only(gu):
                h_q, s = quantize_per_token_torch(silu_mul_torch(g2), down.act_dtype)
            else:
                h_q, s = _row_op(*_SILU_QUANT[down.act_dtype], g2)
            return down.forward_quantized(h_q, s, gu.dtype).reshape(*gu.shape[:-1], down.out_features)
        return down(silu_mul_torch(gu) if _torch_path(gu) else _row_op(silu_mul, silu_mul_impl, gu))

    def extra_repr(self) -> str:
        return f"{self.replaces} with silu(gate) * up on the fused gate_up output"


def _gated_ok(mlp: nn.Module) -> bool:
    """mlp computes down(silu(gate(x)) * up(x)) (its class's forward checked), gate/up fused
    by fuse_projections (its pre-hook the only one), no other hooks."""
    hooks = list(mlp._forward_pre_hooks.values())
    return (isinstance(mlp._modules.get("gate_up_proj"), _Fused)
            and isinstance(mlp._modules.get("gate_proj"), FusedOutput) and _is_silu(mlp._modules.get("act_fn"))
            and len(hooks) == 1 and getattr(hooks[0], "func", None) is _feed_fused and not mlp._forward_hooks
            and "forward" not in mlp.__dict__ and _same_forward(type(mlp), _MLP_FORWARD))


def _norm_ok(module: nn.Module) -> bool:
    cls = type(module)
    return (cls.__name__ in NORMS and cls.__module__.startswith("transformers.models.")
            and _same_forward(cls, _NORM_FORWARD) and isinstance(getattr(module, "weight", None), torch.Tensor)
            and module.weight.dim() == 1 and isinstance(getattr(module, "variance_epsilon", None), float)
            and _plain(module) and "forward" not in module.__dict__)


def fuse_row_ops(model: nn.Module) -> Dict[str, List[str]]:
    """Swap, in place, the model's Llama-formula RMSNorms for SailfishRMSNorm, every fused
    gate/up MLP of the checked form for a GatedMLP, and for W4A8 fused layers
    defer the norm that feeds them into their input quantization (DeferredRMSNorm), with the pass
    that folds each residual add into that norm under torch.compile (inductor.install); run
    its decode attention through sailfish::decode_attention (use_decode_attention); and its MoE
    routers of a known formula through sailfish::router_linear_topk (SailfishTopKRouter); and give
    transformers' generate() its decode step in CUDA graphs of Sailfish's (generation.install).
    Returns {"norms": [...], "gated_mlp": [...], "deferred_norms": [...], "attention": [...],
    "routers": [...]} (module names) and "generate": [...] (the functions installed)."""
    done: Dict[str, List[str]] = {"norms": [], "gated_mlp": [], "deferred_norms": [],
                                  "attention": use_decode_attention(model), "routers": []}
    done["generate"] = generation.install(model)
    mods = list(model.named_modules())
    for name, module in mods:
        for attr, child in list(module._modules.items()):
            flags = None if child is None else _router_flags(child)
            if flags is not None:
                module._modules[attr] = SailfishTopKRouter.replacing(child, *flags)
                done["routers"].append(f"{name}.{attr}" if name else attr)
    for name, module in mods:  # gated MLPs first: a decoder layer's norm may be deferred into them
        for attr, child in list(module._modules.items()):
            if child is not None and _gated_ok(child):
                module._modules[attr] = GatedMLP(child)
                done["gated_mlp"].append(f"{name}.{attr}" if name else attr)
    for name, module in mods:
        for attr, child in list(module._modules.items()):
            if child is None or not _norm_ok(child):
                continue
            full = f"{name}.{attr}" if name else attr
            new = _deferred(module, attr, child)
            if new is not None:
                done["deferred_norms"].append(full)
            else:
                new = SailfishRMSNorm(child)
                done["norms"].append(full)
            module._modules[attr] = new
    if done["deferred_norms"]:  # under torch.compile: each residual add into the norm op after it
        inductor.install()
    return done


def _remove_pre_hook(module: nn.Module, key: int) -> None:
    del module._forward_pre_hooks[key]
    module._forward_pre_hooks_with_kwargs.pop(key, None)


def _deferred(layer: nn.Module, attr: str, norm: nn.Module) -> Optional[DeferredRMSNorm]:
    """A DeferredRMSNorm for `layer.<attr>` where its only consumer is a W4A8 fused layer that
    can apply it (the attention's q/k/v through its pre-hook, a gated MLP's gate/up), else None."""
    for consumer in ("self_attn", "mlp"):
        target = layer._modules.get(consumer)
        if target is None or not _feeds_only(type(layer), attr, consumer):
            continue
        fused = target._modules.get("qkv_proj" if consumer == "self_attn" else "gate_up_proj")
        if not isinstance(fused, FusedQuantLinearW4A8):
            return None
        new = DeferredRMSNorm(norm)
        if consumer == "mlp":
            if not isinstance(target, GatedMLP):
                return None
            object.__setattr__(target, "_sailfish_norm", new)  # a reference, not a second parent
            return new
        hooks = list(target._forward_pre_hooks.items())
        if len(hooks) != 1 or getattr(hooks[0][1], "func", None) is not _feed_fused:
            return None
        _, param = hooks[0][1].args
        _remove_pre_hook(target, hooks[0][0])
        target.register_forward_pre_hook(functools.partial(_feed_fused_norm, "qkv_proj", param, new), with_kwargs=True)
        return new
    return None


# ----------------------------------------------------------------------------------
# MoE routers: linear, softmax + top-k (+ renormalisation) in one launch (ops/router.py; issue 41)
# ----------------------------------------------------------------------------------
# transformers 5's TopKRouter forwards, by formula: (renormalize, fp32_weights) of each, None for
# "the router's norm_topk_prob". A transformers class whose forward is one of them, statement for
# statement (_same_forward), is replaced whatever its name (transformers 5.24: Qwen3-MoE, Qwen2-MoE,
# OLMoE, Qwen3-Next, FlexOlmo, ... share the first; Mixtral, MiniMax the second; Qwen3.5-MoE,
# Qwen3-VL-MoE the third, which always renormalizes).
_ROUTER_FORWARDS = {
    """
def forward(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    router_scores = router_top_value
    return router_logits, router_scores, router_indices
""": (None, False),
    """
def forward(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_scores = router_top_value
    return router_logits, router_scores, router_indices
""": (True, True),
    """
def forward(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    router_scores = router_top_value
    return router_logits, router_scores, router_indices
""": (True, False),
}


def _router_flags(module: nn.Module) -> Optional[Tuple[bool, bool]]:
    """(renormalize, fp32_weights) if `module` is a transformers router of a known formula that
    sailfish::router_linear_topk can compute (class forward checked, the names it reads bound to torch's,
    its attributes in range, no hooks), else None."""
    cls = type(module)
    if not cls.__module__.startswith("transformers.models.") or not _plain(module) or "forward" in module.__dict__:
        return None
    flags = next((f for src, f in _ROUTER_FORWARDS.items() if _same_forward(cls, src)), None)
    scope = vars(sys.modules.get(cls.__module__, object))
    if flags is None or scope.get("F") is not F or scope.get("torch") is not torch:
        return None
    renormalize = module.__dict__.get("norm_topk_prob") if flags[0] is None else flags[0]
    w, k, h = module._parameters.get("weight"), module.__dict__.get("top_k"), module.__dict__.get("hidden_dim")
    if not (isinstance(renormalize, bool) and isinstance(w, torch.Tensor) and w.dim() == 2 and type(h) is int
            and w.shape[1] == h and 1 <= w.shape[0] <= ROUTER_MAX_EXPERTS and type(k) is int
            and 1 <= k <= w.shape[0]):
        return None
    return renormalize, flags[1]


class SailfishTopKRouter(nn.Module):
    """Stands where a transformers TopKRouter was: its F.linear (its `weight`, under its
    state_dict key), softmax + top-k (+ renormalisation) in one launch of
    sailfish::router_linear_topk instead of cuBLAS's GEMM and the softmax, sort, gather and
    division kernels, returning (router_logits, weights, ids) as the router did (logits: fp32
    sums rounded once, as F.linear's; ids: the same; weights: within a few fp32 ulps before their
    cast, ops/router.py). Under torch.compile it stays the op (the point: it replaces the GEMM,
    inductor's softmax and torch.topk's two kernels); with a gradient to compute it runs the
    formula (the op has no derivative).

    Each instance is of a subclass of the router's own class (SailfishTopKRouter.replacing), so
    isinstance checks on the router class (transformers' output_router_logits recorder, weight
    init) still find it."""

    renormalize: bool
    fp32_weights: bool

    @classmethod
    def replacing(cls, router: nn.Module, renormalize: bool, fp32_weights: bool) -> "SailfishTopKRouter":
        sub = _router_class(cls, type(router))
        new = sub.__new__(sub)
        nn.Module.__init__(new)  # (not the router class's __init__: it builds from a config)
        for k, v in vars(router).items():
            if not k.startswith("_"):
                setattr(new, k, v)
        new.weight = router.weight
        new.renormalize, new.fp32_weights = renormalize, fp32_weights
        return new

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        if torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad):
            router_logits = F.linear(hidden_states, self.weight)
            weights, ids = router_topk_reference(router_logits, self.top_k, self.renormalize, self.fp32_weights)
            return router_logits, weights, ids
        if hidden_states.stride(-1) != 1:  # (the op takes unit-stride rows; F.linear took any)
            hidden_states = hidden_states.contiguous()
        return _row_op(router_linear_topk, router_linear_topk_impl, hidden_states, self.weight, self.top_k,
                       self.renormalize, self.fp32_weights)

    def __reduce_ex__(self, protocol):
        # pickle (torch.save of the whole model, copy.deepcopy) by the router class, not by the
        # generated subclass, which a fresh process has not made yet
        return _rebuild_router, (type(self).__bases__[1], self.__getstate__())

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, top_k={self.top_k}, renormalize={self.renormalize}, "
                f"fp32_weights={self.fp32_weights}: linear + softmax + top-k in one launch")


@functools.lru_cache(maxsize=None)
def _router_class(base: type, router_cls: type) -> type:
    """SailfishTopKRouter's subclass of router_cls (one per class, so repeated fusing reuses it)."""
    return type(f"Sailfish{router_cls.__name__}", (base, router_cls), {"__module__": __name__})


def _rebuild_router(router_cls: type, state: dict) -> SailfishTopKRouter:
    sub = _router_class(SailfishTopKRouter, router_cls)
    new = sub.__new__(sub)
    new.__setstate__(state)
    return new


# ----------------------------------------------------------------------------------
# MoE shared experts: DeepSeek-V2 / V3's shared MLP run inside the experts' block (moe.py)
# ----------------------------------------------------------------------------------
# transformers 5's DeepseekV2Moe / DeepseekV3MoE forward (5.24: the same text in both): the routed
# experts' sum plus the shared MLP of the block's input. A class whose forward is this, statement
# for statement (_same_forward), folds whatever its name.
_SHARED_MOE_FORWARD = """
def forward(self, hidden_states):
    residuals = hidden_states
    orig_shape = hidden_states.shape
    _, topk_weights, topk_indices = self.gate(hidden_states)
    hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
    hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)
    hidden_states = hidden_states + self.shared_experts(residuals)
    return hidden_states
"""


def _fold_reason(block: nn.Module) -> Optional[str]:
    """None if the block's shared MLP is exactly shared experts its QuantExperts can run (see
    fold_shared_experts), else why not."""
    cls, experts, shared = type(block), block._modules["experts"], block._modules[SHARED_MLP]
    if not _same_forward(cls, _SHARED_MOE_FORWARD):
        return (f"{cls.__qualname__}.forward is not transformers' DeepSeek-V2 / V3 MoE forward (the routed "
                f"experts plus {SHARED_MLP}(x))")
    if type(experts) is not QuantExperts:
        return f"experts is a {type(experts).__name__}, not a QuantExperts"
    if experts.act_order:
        return "the experts have act-order (GPTQ desc_act); shared experts go only with experts without it"
    if not (_same_forward(type(shared), _MLP_FORWARD) and _is_silu(shared._modules.get("act_fn"))):
        return f"{SHARED_MLP} ({type(shared).__name__}) does not compute down(silu(gate(x)) * up(x))"
    layers = [shared._modules.get(n) for n in SHARED_PROJECTIONS]
    for n, m in zip(SHARED_PROJECTIONS, layers):
        if type(m) is not QuantLinear:
            return f"{SHARED_MLP}.{n} is a {type(m).__name__}, not a W4A16 QuantLinear"
        got, want = (m.group_size, m.sym, m.dtype), (experts.group_size, experts.sym, experts.dtype)
        if m.bias is not None or m.act_order or got != want:
            return (f"{SHARED_MLP}.{n} has (group_size, sym, dtype) {got}{', a bias' if m.bias is not None else ''}"
                    f"{', act-order' if m.act_order else ''}; the experts' are {want}, no bias, no act-order")
    for name, m in (("the block", block), ("experts", experts), (SHARED_MLP, shared), *zip(SHARED_PROJECTIONS, layers)):
        if not _plain(m) or "forward" in m.__dict__:
            return f"{name} has hooks or an instance-level forward (e.g. accelerate's device hooks)"
    gate, up, down = layers
    i, h, w = experts.intermediate_dim, experts.hidden_dim, gate.out_features
    if (gate.in_features, up.in_features, up.out_features, down.in_features, down.out_features) != (h, h, w, w, h):
        return f"{SHARED_MLP}'s projections are not gate / up ({w}, {h}) and down ({h}, {w}), H the experts' {h}"
    configured = getattr(getattr(block, "config", None), "n_shared_experts", None)
    if w != (configured if type(configured) is int else 0) * i:
        return (f"{SHARED_MLP} has width {w}, not config.n_shared_experts={configured!r} times the experts' "
                f"intermediate size {i} (e.g. a tensor-parallel shard)")
    if experts.group_size != -1 and i % experts.group_size:
        return (f"the experts' intermediate size {i} is not a multiple of group_size={experts.group_size}: a group "
                f"of {SHARED_MLP}.down_proj would span two shared experts")
    top_k = getattr(block._modules.get("gate"), "top_k", None)
    if type(top_k) is not int or top_k + configured > MAX_TOPK:
        return f"the router's top_k={top_k!r} plus {configured} shared experts is not an int of at most {MAX_TOPK}"
    if len({m.qweight.device for m in layers} | {experts.w13_qweight.device}) > 1:
        return f"{SHARED_MLP} and experts are on different devices"
    return None


class SharedExpertsMoE(nn.Module):
    """What a DeepSeek-V2 / V3 MoE block whose shared MLP was folded into its experts runs
    (fold_shared_experts; each such block is of a subclass of its own class and this one,
    _folded_class): the router, then the QuantExperts with its num_shared shared experts, one
    sailfish::moe_w4a16 call that adds the shared MLP's output too. No state between calls
    (torch.compile(fullgraph=True), CUDA graphs). load_state_dict hands the shared MLP's keys
    (`shared_experts.*`, which the experts module writes) to the experts module."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        orig_shape = hidden_states.shape
        _, topk_weights, topk_indices = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        return self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        shared = f"{prefix}{SHARED_MLP}."
        self._modules["experts"]._load_shared(state_dict, shared, *args)
        super()._load_from_state_dict({k: v for k, v in state_dict.items() if not k.startswith(shared)}, prefix, *args)

    def __reduce_ex__(self, protocol):
        # pickle by the block's own class, not by the generated subclass (as SailfishTopKRouter)
        return _rebuild_folded, (type(self).__bases__[1], self.__getstate__())

    def extra_repr(self) -> str:
        return f"{SHARED_MLP} run as the experts' last {self._modules['experts'].num_shared}"


@functools.lru_cache(maxsize=None)
def _folded_class(block_cls: type) -> type:
    return type(f"Sailfish{block_cls.__name__}", (SharedExpertsMoE, block_cls), {"__module__": __name__})


def _rebuild_folded(block_cls: type, state: dict) -> nn.Module:
    sub = _folded_class(block_cls)
    new = sub.__new__(sub)
    new.__setstate__(state)
    return new


def fold_shared_experts(model: nn.Module) -> Tuple[List[str], Dict[str, str]]:
    """Run, in place, the shared MLP of every DeepSeek-V2 / V3 MoE block inside its QuantExperts
    (moe.py: its width S * I as S shared experts of the routed width I, sailfish::moe_w4a16's
    num_shared), where that is exact: the block's class forward is transformers' (checked
    statement for statement), its experts a QuantExperts without act-order, its shared MLP
    down(silu(gate(x)) * up(x)) of plain W4A16 QuantLinears of the experts' group size,
    symmetry and dtype, without bias or act-order, of width config.n_shared_experts * I with I
    a multiple of the group size (or per-channel scales), no hooks. The block then drops
    its shared_experts module and takes a Sailfish forward (SharedExpertsMoE); its state_dict
    keeps the unfolded block's keys (moe.py). Returns ([folded block names], {block's
    shared_experts name: why it was left as it is}) for the blocks that have experts and
    shared_experts."""
    folded: List[str] = []
    not_folded: Dict[str, str] = {}
    for name, block in list(model.named_modules()):
        if isinstance(block, SharedExpertsMoE) or not {"experts", SHARED_MLP} <= block._modules.keys():
            continue
        where = f"{name}.{SHARED_MLP}" if name else SHARED_MLP
        layers = [block._modules[SHARED_MLP]._modules.get(n) for n in SHARED_PROJECTIONS]
        experts, reason = _build_unless(_fold_reason(block), lambda: block._modules["experts"].with_shared(
            *(m.quantized_weight() for m in layers)))
        if reason:
            not_folded[where] = reason
            log.info("sailfish: %s left outside the experts: %s", where, reason)
            continue
        block._modules["experts"] = experts
        del block._modules[SHARED_MLP]
        block.__class__ = _folded_class(type(block))
        folded.append(name)
    return folded, not_folded


# ----------------------------------------------------------------------------------
# Decode attention
# ----------------------------------------------------------------------------------
ATTENTION = "sailfish"  # the name registered with transformers' attention and mask interfaces
# Models whose attention calls transformers' attention interface with the query, the cache's
# K / V and the 4-D mask sdpa gets (each class's forward is checked for that call).
ATTENTION_MODELS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
_NOT_DECODE = ("softcap", "s_aux", "sinks", "position_bias", "head_mask")  # sdpa's own path, or its error


def _decode_ok(query, key, value, mask, dropout: float, scale: float, kwargs) -> bool:
    """Whether sailfish::decode_attention computes what transformers' sdpa path would: operands
    the kernel takes (ops/attention.decode_attention_problem: one query token, half precision, a
    supported head dim, a boolean or additive mask of sdpa's shape) on one GPU (or the
    interpreter), and no dropout, gradient, or extra term."""
    if dropout or kwargs.get("output_attentions") or any(kwargs.get(k) is not None for k in _NOT_DECODE):
        return False
    if not use_triton(query) or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)):
        return False
    if any(t is not None and t.device != query.device for t in (key, value, mask)):
        return False
    return decode_attention_problem(query, key, value, mask, scale) is None


def sailfish_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                       **kwargs):
    """transformers' attention function "sailfish": a decode step (one query token) in one launch
    of sailfish::decode_attention over the cache (no repeat_kv copy of it), everything else
    (prefill, or what _decode_ok refuses) through transformers' sdpa_attention_forward."""
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    if _decode_ok(query, key, value, attention_mask, dropout, scale, kwargs):
        if direct_call_ok(query):  # (checked above: the launch itself, as the op's implementation would run it)
            return decode_attention_launch(query, key, value, attention_mask, scale), None
        return decode_attention(query, key, value, attention_mask, scale), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


@functools.lru_cache(maxsize=None)
def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, sailfish_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the masks sdpa gets


@functools.lru_cache(maxsize=None)
def _calls_interface(cls: type) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def use_decode_attention(model: nn.Module) -> List[str]:
    """Switch a transformers model running sdpa attention (transformers' default on GPUs) of an
    ATTENTION_MODELS type to "sailfish" (sdpa with the decode step in one launch). Returns the
    attention modules that now run it ([]: nothing changed: another attention implementation
    chosen by the user or already switched, another model type, or an attention class that does
    not call the interface)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in ATTENTION_MODELS or \
            getattr(config, "_attn_implementation", None) != "sdpa":
        return []
    names = [n for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    if not names or not all(_calls_interface(type(model.get_submodule(n))) for n in names):
        return []
    _register_attention()
    config._attn_implementation = ATTENTION
    return names


def unfused_layers(model: nn.Module) -> Dict[str, nn.Module]:
    """{name: layer} of every Sailfish layer of the model, a fused layer given as its
    projections (plain layers, under their own names), a shared MLP folded into its experts as
    its projections too: what a checkpoint stores."""
    out: Dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        if isinstance(module, _Fused):
            out.update({f"{parent}.{n}" if parent else n: part for n, part in module.parts()})
        elif isinstance(module, QuantExperts) and module.num_shared:  # a folded shared MLP (fold_shared_experts)
            mlp = f"{parent}.{SHARED_MLP}" if parent else SHARED_MLP
            out.update({f"{mlp}.{n}": part for n, part in module.shared_layers()})
        elif isinstance(module, (QuantLinear, QuantLinearW4A8)):
            out[name] = module
    return out


__all__ = ["check_fuse_flag", "FusedQuantLinear", "FusedQuantLinearW4A8", "FusedOutput", "fuse_projections", "unfused_layers",
           "shard_fused", "SUPPORTED", "ARCHITECTURES", "fuse_row_ops", "SailfishRMSNorm", "DeferredRMSNorm",
           "GatedMLP", "NORMS", "SailfishTopKRouter", "fold_shared_experts", "SharedExpertsMoE",
           "sailfish_attention", "use_decode_attention", "ATTENTION_MODELS"]
