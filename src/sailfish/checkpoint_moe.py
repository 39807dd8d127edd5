"""MoE checkpoints: the per-expert 4-bit tensors of GPTQ, AWQ and compressed-tensors
checkpoints <-> QuantExperts' stacked layout (formats/experts.py), for load_quantized and
save_quantized (checkpoint.py), on checkpoint_io.py's readers.

Checkpoints store every expert's projections as separate 2-D layers, under the names the
models had before transformers 5 merged them (as GPTQModel, AutoAWQ, llm-compressor and
Qwen's GPTQ-Int4 builds write them, and vLLM reads them):

    Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, ...:
        model.layers.{i}.mlp.experts.{e}.gate_proj / up_proj / down_proj.{qweight, qzeros, ...}
    Mixtral: model.layers.{i}.block_sparse_moe.experts.{e}.w1 / w3 / w2.{qweight, ...}

transformers 5 holds a block's experts in one module with 3-D `gate_up_proj` (E, 2I, H; gate
rows first) and `down_proj` (E, H, I), and its loader renames keys (Mixtral:
".block_sparse_moe." -> ".mlp.") and merges the per-expert weights, following its
conversion mapping. KeyNames takes the renamings and the per-expert projection names (w1 /
w3 / w2 for Mixtral, gate_proj / up_proj / down_proj otherwise) from that same mapping, so
Sailfish reads the keys transformers reads and save_quantized writes them back the way
transformers' save_pretrained does.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .checkpoint_io import (CT, _check_tensor, _ct_ignores, _field_error, _g_idx_key, _HALF, _layer_tensors, _matches,
                            _read_layer)
from .formats.experts import pack_into
from .formats.int4 import QuantizedWeight, cast_scales, unpack
from .formats.shard import slice_weight
from .moe import QuantExperts, experts_reason, is_experts_module

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # transformers' per-expert names without a mapping
_METHODS = ("gptq", "awq", CT)
_EXPERT_KEY = re.compile(r"^(.+)\.(\d+)\.([^.]+)\.([^.]+)$")  # {experts module}.{e}.{projection}.{tensor}


class KeyNames:
    """transformers' key renamings for `model` (its conversion mapping; none before
    transformers 5): to_model(checkpoint key), to_checkpoint(model key), and the checkpoint's
    names of an expert's gate, up and down projections (`projections`)."""

    def __init__(self, model: nn.Module):
        self.forward: list = []
        self.reverse: list = []
        self.projections: Tuple[str, str, str] = PROJECTIONS
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
        except ImportError:  # transformers 4: experts are ModuleLists of Linears, nothing is renamed
            return
        conversions = get_model_conversion_mapping(model, add_legacy=False)
        # as transformers' save_pretrained (revert_weight_conversion): renamings without prefix changes
        self.forward = [c for c in conversions if isinstance(c, WeightRenaming) and not isinstance(c, PrefixChange)]
        self.reverse = [c.reverse_transform() for c in self.forward[::-1]]
        found = {}
        for c in conversions:  # e.g. [".experts.*.w1.weight", ".experts.*.w3.weight"] -> ".experts.gate_up_proj"
            if not isinstance(c, WeightConverter):
                continue
            sources = [re.search(r"experts\.\*\.(\w+)\.weight$", s.replace("\\", "")) for s in c.source_patterns]
            for target in c.target_patterns:
                for attr in ("gate_up_proj", "down_proj"):
                    if target.endswith(f"experts.{attr}") and all(sources):
                        found[attr] = tuple(m.group(1) for m in sources)
        if len(found.get("gate_up_proj", ())) == 2 and len(found.get("down_proj", ())) == 1:
            self.projections = found["gate_up_proj"] + found["down_proj"]

    @staticmethod
    def _apply(key: str, renamings: list) -> str:
        for r in renamings:
            key, _ = r.rename_source_key(key)
        return key

    def to_model(self, key: str) -> str:
        return self._apply(key, self.forward)

    def to_checkpoint(self, key: str) -> str:
        return self._apply(key, self.reverse)


@dataclass(frozen=True)
class _Dims:
    """The shape of one expert projection, where the dense helpers take an nn.Linear."""
    in_features: int
    out_features: int
    bias: None = None


@dataclass
class ExpertsPlan:
    """One experts module whose experts the checkpoint stores per expert: quantized (a
    QuantExperts), or 16-bit `.weight`s (left unquantized, e.g. by modules_to_not_convert),
    which load into the module's own 3-D parameters."""
    num_experts: int
    hidden: int
    inter: int
    projections: Tuple[str, str, str]  # the checkpoint's gate, up, down names
    quantized: bool
    keys: List[str] = field(default_factory=list)  # every checkpoint tensor its experts use (model names)
    scale_dtype: Optional[torch.dtype] = None  # every expert's scales' (quantized)

    def dims(self) -> Dict[str, _Dims]:
        gate, up, down = self.projections
        return {gate: _Dims(self.hidden, self.inter), up: _Dims(self.hidden, self.inter),
                down: _Dims(self.inter, self.hidden)}


def plan_experts(model: nn.Module, entries, spec, naming: KeyNames) -> Tuple[Dict[str, ExpertsPlan], list]:
    """({experts module name: plan}, zero bias keys) for every transformers experts module whose
    experts the checkpoint stores per expert, every tensor checked from the headers: each
    expert present, with the shapes and dtypes the format gives its projections (16-bit:
    (I, H) gate / up and (H, I) down weights), one scale dtype for all. Raise ValueError
    naming the key otherwise."""
    modules = {n: m for n, m in model.named_modules() if n and is_experts_module(m)}
    found: Dict[str, list] = {}
    for key in entries:
        m = _EXPERT_KEY.match(key)
        if m and m.group(1) in modules:
            found.setdefault(m.group(1), []).append(m)
    marker = {CT: "weight_packed", "marlin": "B", "qqq": "B"}.get(spec.method, "qweight")
    plans, zero_biases = {}, []
    for name, matches in found.items():
        module = modules[name]
        quantized = [m.group(0) for m in matches if m.group(4) == marker]
        first = entries.stored((quantized or [matches[0].group(0)])[0])
        if quantized and spec.method not in _METHODS:
            raise _field_error("quant_method", spec.method, f"MoE experts (such as {first}) from quant_method "
                               f"{_METHODS}")
        reason = experts_reason(module)
        if reason:
            raise ValueError(f"{first}: the checkpoint stores {name}'s experts one by one, but its "
                             f"{type(module).__name__} cannot take them (as a QuantExperts or stacked): {reason}")
        e_count, two_i, hidden = module.gate_up_proj.shape
        plan = plans[name] = ExpertsPlan(e_count, hidden, two_i // 2, naming.projections, bool(quantized))
        dims = plan.dims()
        for m in matches:
            e, proj = int(m.group(2)), m.group(3)
            if e >= e_count or proj not in dims:
                raise ValueError(f"{entries.stored(m.group(0))}: {name} has experts 0..{e_count - 1} with "
                                 f"projections {tuple(dims)}; the checkpoint holds expert {e}, projection {proj!r}")
        if not quantized:
            for e in range(e_count):
                for proj, d in dims.items():
                    key = f"{name}.{e}.{proj}.weight"
                    _check_tensor(entries, key, (d.out_features, d.in_features), _HALF + ("F32",))
                    plan.keys.append(key)
            continue
        where = "ignore" if spec.method == CT else "modules_to_not_convert"
        for e in range(e_count):
            for proj, d in dims.items():
                base = f"{name}.{e}.{proj}"
                skipped = [s for s in spec.not_convert
                           if (_ct_ignores(base, None, s) if spec.method == CT else _matches(base, s))]
                if skipped:
                    raise ValueError(f"{entries.stored(base)} is quantized in the checkpoint but "
                                     f"quantization_config.{where} lists {skipped[0]!r}")
                for suffix, (shape, dtypes) in _layer_tensors(spec, d).items():
                    _check_tensor(entries, f"{base}.{suffix}", shape, dtypes)
                    plan.keys.append(f"{base}.{suffix}")
                g_idx = _g_idx_key(spec, base, entries)
                if g_idx:
                    _check_tensor(entries, g_idx, (d.in_features,), ("I32", "I64"))
                    plan.keys.append(g_idx)
                if f"{base}.bias" in entries:  # experts have no bias: old AutoGPTQ writes zeros
                    _check_tensor(entries, f"{base}.bias", (d.out_features,), _HALF + ("F32",))
                    plan.keys.append(f"{base}.bias")
                    zero_biases.append(f"{base}.bias")
        scales = [k for k in plan.keys if k.endswith((".scales", ".weight_scale"))]
        odd = [k for k in scales if entries[k].dtype != entries[scales[0]].dtype]
        if odd:
            raise ValueError(f"{entries.stored(odd[0])} is {entries[odd[0]].dtype} but {entries.stored(scales[0])} "
                             f"is {entries[scales[0]].dtype}; allowed: one scale dtype for all experts of {name}")
        plan.scale_dtype = {"F16": torch.float16, "BF16": torch.bfloat16}[entries[scales[0]].dtype]
    return plans, zero_biases


def read_float_experts(read, name: str, plan: ExpertsPlan, module: nn.Module, device) -> None:
    """16-bit per-expert weights into the module's own gate_up_proj (E, 2I, H; gate rows first)
    and down_proj (E, H, I), expert by expert, in the dtype transformers gave them."""
    gate, up, down = plan.projections
    like = module.gate_up_proj
    gate_up = torch.empty(like.shape, dtype=like.dtype, device=device)
    down_proj = torch.empty(module.down_proj.shape, dtype=module.down_proj.dtype, device=device)
    for e in range(plan.num_experts):
        for proj, out, rows in ((gate, gate_up, slice(0, plan.inter)), (up, gate_up, slice(plan.inter, None)),
                                (down, down_proj, slice(None))):
            out[e, rows] = read(f"{name}.{e}.{proj}.weight").to(device=device, dtype=out.dtype)
    for attr, value in (("gate_up_proj", gate_up), ("down_proj", down_proj)):
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)


def read_experts(read, spec, name: str, plan: ExpertsPlan, dtype: torch.dtype, device, *,
                 allow_lossy_scales: bool, how: str) -> Tuple[QuantExperts, float]:
    """The QuantExperts of `name`, read expert by expert into its preallocated stacked buffers
    (peak memory: the stack plus one expert; zero points and act-order permutations are
    allocated up front, the size of the scales and less, and dropped at the end if every expert
    is symmetric / has none), and the largest relative change of a weight that casting the
    scales to `dtype` made (0.0: exact). Act-order experts (GPTQ desc_act: a g_idx that sorts
    to k // group_size) take a permutation of their input channels (formats/experts.py); a
    general g_idx, or a gate and up with different g_idx, raise ValueError naming the tensor."""
    layer = QuantExperts(plan.num_experts, plan.hidden, plan.inter, group_size=spec.group_size, sym=False,
                         act_order=True, dtype=dtype, device=device)
    w13, w2 = layer.packed()
    gate, up, down = plan.projections
    dims = plan.dims()
    asym, change = False, 0.0
    for e in range(plan.num_experts):
        for stacked, parts in ((w13, ((gate, 0), (up, plan.inter))), (w2, ((down, 0),))):
            weights = []
            for proj, row in parts:
                base = f"{name}.{e}.{proj}"
                try:
                    qw, _ = _read_layer(read, spec, base, dims[proj], device)
                    qw, c = cast_scales(qw, dtype, allow_lossy_scales=allow_lossy_scales, how=how)
                except (ValueError, TypeError) as err:
                    raise type(err)(f"{read.entries.stored(base)} (experts {name}): {err}") from err
                change = max(change, c)
                asym |= qw.zeros is not None
                weights.append((row, qw))
            try:
                pack_into(stacked, e, weights)
            except ValueError as err:
                raise ValueError(f"{read.entries.stored(f'{name}.{e}.{parts[0][0]}')} (experts {name}): {err}") from err
    if not asym:  # every expert symmetric: the layer is too
        layer.w13_zeros = layer.w2_zeros = None
    if all(p.expert(e).perm is None for p in (w13, w2) for e in range(plan.num_experts)):
        layer.w13_perm = layer.w2_perm = None  # no act-order at all: the kernels without the gather
    return layer, change


def experts_weights(model: nn.Module, naming: KeyNames) -> Dict[str, QuantizedWeight]:
    """{model name of an expert projection ({experts}.{e}.{proj}): its QuantizedWeight} for every
    QuantExperts of `model` (formats.experts' exact unstacking): save_quantized writes each
    as a layer, under the projection names transformers reads."""
    out = {}
    gate, up, down = naming.projections
    for name, layer in model.named_modules():
        if not isinstance(layer, QuantExperts):
            continue
        w13, w2 = layer.packed()
        i = layer.intermediate_dim
        for e in range(layer.num_experts):
            gate_up = unpack(w13.expert(e))
            out[f"{name}.{e}.{gate}"] = slice_weight(gate_up, 0, 0, i)
            out[f"{name}.{e}.{up}"] = slice_weight(gate_up, 0, i, 2 * i)
            out[f"{name}.{e}.{down}"] = unpack(w2.expert(e))
    return out


def float_experts_weights(model: nn.Module, naming: KeyNames) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """({model name of an expert's weight ({experts}.{e}.{proj}.weight): the weight}, [module
    names]) of the experts modules left in 16 bits that load_quantized can read back per
    expert: save_quantized writes them per expert, as transformers' save_pretrained does."""
    out, modules = {}, []
    gate, up, down = naming.projections
    for name, module in model.named_modules():
        if not (is_experts_module(module) and experts_reason(module) is None):
            continue  # (a module of another layout keeps its own parameters in the file)
        modules.append(name)
        i = module.down_proj.shape[2]
        for e in range(module.gate_up_proj.shape[0]):
            out[f"{name}.{e}.{gate}.weight"] = module.gate_up_proj[e, :i]
            out[f"{name}.{e}.{up}.weight"] = module.gate_up_proj[e, i:]
            out[f"{name}.{e}.{down}.weight"] = module.down_proj[e]
    return out, modules
