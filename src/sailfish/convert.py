"""quantize_model: replace a model's nn.Linear layers by Sailfish layers (round to nearest or
GPTQ), then fuse its q/k/v and gate/up projections. Above nn, fuse and calibrate, which it
combines."""
from __future__ import annotations

import logging
from typing import Iterable, Optional, Tuple

import torch
from torch import nn

from .calibrate.model import gptq_model, gptq_options
from .formats.int4 import _check_bits, _check_group_size, check_flag
from .formats.qqq import check_group_size_w4a8
from .fuse import check_fuse_flag, fuse_projections
from .moe import QuantExperts, experts_reason, is_experts_module
from .nn import QuantLinear, QuantLinearW4A8, _check_act_bits, _check_layer_dtype, check_shape

log = logging.getLogger("sailfish")


def module_names(names, arg: str) -> tuple:
    """A names argument (quantize_model's skip, SailfishConfig's modules_to_not_convert): one
    name as a str, or an iterable of str; a bare str would otherwise be read letter by letter."""
    if names is None:
        return ()
    if isinstance(names, str):
        return (names,)
    what = f"{arg} must be a module name (str) or an iterable of them, got"
    try:
        names = tuple(names)
    except TypeError:
        raise TypeError(f"{what} {names!r}") from None
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"{what} {bad[0]!r} in it")
    return names


# quantize_model's and SailfishConfig's default skip list: the lm_head stays in 16 bits (its
# rounding shows directly in the logits); lm_head=True quantizes it too. (Compared by
# identity, so that an explicit ("lm_head",) with lm_head=True is caught as a contradiction.)
DEFAULT_SKIP = ("lm_head",)


def skip_names(skip, lm_head: bool, arg: str = "skip") -> tuple:
    """The module names to leave alone: DEFAULT_SKIP unless lm_head=True (then none), else
    `skip` as given (module_names). ValueError when lm_head=True and `skip` names lm_head."""
    check_flag("lm_head", lm_head)
    if skip is DEFAULT_SKIP:
        return () if lm_head else DEFAULT_SKIP
    names = module_names(skip, arg)
    if lm_head and "lm_head" in names:
        raise ValueError(f"lm_head=True quantizes the lm_head, but {arg}={list(names)!r} leaves it alone; "
                         "drop 'lm_head' from one of them")
    return names


def _skip_match(name: str, skip: Iterable[str]) -> bool:
    parts = name.split(".")
    return any(s == name or s in parts for s in skip)


def quantize_model(model: nn.Module, *, bits: int = 4, group_size: int = 128, sym: bool = True,
                   skip: Iterable[str] = DEFAULT_SKIP, lm_head: bool = False, act_bits: int = 16,
                   dtype: Optional[torch.dtype] = None, fuse: bool = True, method: str = "rtn",
                   calibration=None, act_order: bool = False, static_groups: bool = False,
                   percdamp: float = 0.01, device=None, progress: Optional[bool] = None) -> nn.Module:
    """Replace, in place, every nn.Linear whose shape Sailfish supports.

    method="rtn" (default): round to nearest. method="gptq": GPTQ with the `calibration`
    batches (an iterable of input_ids tensors or dicts of model inputs), decoder layer by
    decoder layer (sailfish.calibrate.model: true sequential, each layer processed on
    `device`, default where it is, then moved back); act_order, static_groups, percdamp as
    calibrate.gptq_quantize. With act_bits=8 it is QQQ's method: each decoder layer's Linear
    inputs are first smoothed (per-channel scales searched on the calibration activations and
    folded exactly into the RMSNorm weights, and into v_proj / up_proj rows for o_proj /
    down_proj: sailfish.calibrate.smooth; the model's norm and projection weights change, its
    function does not), then GPTQ onto the W4A8 format (calibrate.gptq_quantize_qqq;
    act_order with group_size=128 uses static groups), with each quantized Linear's input
    quantized per token to int8 in the later passes, as QuantLinearW4A8 does. Linears
    outside the decoder layers (lm_head when not skipped) or never reached by the calibration
    are rounded to nearest. The report (below) gains "gptq": {name: {"seconds", "error",
    and for W4A8 "smoothing"}} (error: mean squared output error per calibration token,
    summed over outputs; calibrate.model.gptq_model). progress: a progress bar per decoder
    layer (tqdm if installed, else a line per layer on stderr); default None shows it only
    when stderr is a terminal, False never; per-Linear progress is logged (logger
    "sailfish", INFO) either way. If GPTQ fails (ValueError naming the module), the Linears
    it finished hold their quantized weights.

    act_bits=16: QuantLinear (W4A16); act_bits=8: QuantLinearW4A8 (group_size -1 or 128).
    dtype (W4A16 only): the layers' dtype, float16 or bfloat16; default, as in
    QuantLinear.from_linear, each Linear's own dtype if float16/bfloat16, else float16.
    Float32 Linears are quantized too: run the model in the layers' dtype afterwards
    (model.half(), a no-op for float16 QuantLinears), since the layers take only it.

    skip: module names (or name components) left alone; one name may be given as a str.
    Default: the lm_head (16 bits for accuracy; GPTQModel's "lm_head": false). lm_head=True
    quantizes it as well (W4A16 decode saves the most on it: docs/perf_log.md v36); an
    explicit skip replaces the default list (skip=() quantizes the lm_head too).
    A Linear reachable under several names (tied, e.g. shared by two attributes) is
    converted once and the one layer is set under every name (skipped under every name if
    any of them is in skip). Returns the model; what was quantized and what was skipped,
    with the reason, is logged and stored as model.sailfish_report = {"quantized": [names],
    "skipped": {name: reason}, "shared": {other name: the name listed above}}.
    MoE experts modules of transformers 5 (3-D gate_up_proj / down_proj: Mixtral, Qwen2-MoE,
    Qwen3-MoE, DeepSeek-V2/V3) become sailfish.QuantExperts (W4A16, round to nearest, also
    with method="gptq"), listed under the report's "experts" when there are any; routers stay
    in 16 bits, shared experts' Linears are quantized as any other (fuse=True then runs
    DeepSeek's inside the experts' block: sailfish.fuse.fold_shared_experts). A weight that cannot be
    quantized (NaN / Inf, or its scales under- or overflow the layer dtype) raises ValueError
    naming the module (the modules before it stay converted).

    fuse (default True): then run q/k/v and gate/up of supported transformers models as one
    layer each and DeepSeek-V2 / V3's shared experts inside the MoE block where exact
    (sailfish.fuse.fuse_projections; report keys "fused", "shared_experts_folded" and
    "not_fused"), and the
    row-wise ops, decode attention and MoE routers of known formulas in one launch each
    (sailfish.fuse.fuse_row_ops; report key "row_ops").
    """
    check_fuse_flag(fuse)
    _check_bits(bits)
    _check_act_bits(act_bits)
    check_flag("sym", sym)
    if act_bits == 8:
        check_group_size_w4a8(group_size)
        if not sym:
            raise ValueError("W4A8 (act_bits=8) weights are symmetric; sym=False is not supported")
    else:
        _check_group_size(group_size)
    _check_layer_dtype(dtype, act_bits)
    gptq = gptq_options(method, calibration, act_bits, act_order, static_groups, percdamp, device, progress)
    skip = skip_names(skip, lm_head)
    if not isinstance(model, nn.Module) or isinstance(model, nn.Linear):
        # (a Linear cannot replace itself in place: it would be returned unchanged)
        what = "an nn.Linear itself" if isinstance(model, nn.Module) else f"a {type(model).__name__}"
        raise TypeError(f"model must be an nn.Module holding nn.Linear layers, got {what}; for one Linear "
                        f"use QuantLinear.from_linear(linear)")
    names = {}  # Linear -> every name it has (named_modules would give a shared one once)
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, nn.Linear):
            names.setdefault(module, []).append(name)
    quantized, skipped, shared, targets = [], {}, {}, {}
    for module, (name, *others) in names.items():
        shared.update((other, name) for other in others)
        if any(_skip_match(n, skip) for n in (name, *others)):
            reason = "in skip list"
        elif isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
            # torch's mark for a Linear whose parent reads .weight instead of calling it
            # (nn.MultiheadAttention's out_proj): a QuantLinear there breaks the parent
            reason = "its parent reads its weight directly (nn.MultiheadAttention out_proj)"
        else:
            reason = check_shape(module.in_features, module.out_features)
        if reason:
            skipped[name] = reason
            log.info("sailfish: skipped %s (%s)", name, reason)
        else:
            targets[module] = name
    solved, stats = {}, None
    if gptq is not None:
        solved, stats = gptq_model(model, calibration, targets, group_size=group_size, sym=sym, dtype=dtype, **gptq)
    for module, name in targets.items():
        others = names[module][1:]
        try:
            layer = (QuantLinearW4A8 if act_bits == 8 else QuantLinear).from_quantized(solved[module], module.bias) \
                if module in solved else \
                QuantLinear.from_linear(module, bits=bits, group_size=group_size, sym=sym, dtype=dtype,
                                        act_bits=act_bits)
        except ValueError as e:
            raise ValueError(f"module {name!r}: {e}") from e
        for n in (name, *others):
            parent_name, _, child = n.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, layer)
        quantized.append(name)
    # MoE experts (transformers 5's 3-D experts modules) become QuantExperts (sailfish/moe.py)
    experts, experts_skipped = replace_experts(model, skip, group_size=group_size, sym=sym, dtype=dtype,
                                               act_bits=act_bits)
    skipped.update(experts_skipped)
    log.info("sailfish: quantized %d linear layers and %d experts modules, skipped %d%s", len(quantized),
             len(experts), len(skipped), f", {len(shared)} more names shared with them" if shared else "")
    model.sailfish_report = {"quantized": quantized, "skipped": skipped, "shared": shared}
    if experts:
        model.sailfish_report["experts"] = experts
    if stats is not None:
        model.sailfish_report["gptq"] = stats
    return fuse_projections(model) if fuse else model


def replace_experts(model: nn.Module, skip, *, group_size: int, sym: bool, dtype: Optional[torch.dtype],
                    act_bits: int) -> Tuple[list, dict]:
    """quantize_model's step for MoE models: replace, in place, every transformers experts module
    (is_experts_module) not in `skip` by a QuantExperts (round to nearest). Returns (the names
    replaced, {name: reason} of those left in 16 bits). A weight that cannot be quantized raises
    ValueError naming the module."""
    done, skipped = [], {}
    found = [(n, m) for n, m in model.named_modules() if n and is_experts_module(m)]
    for name, module in found:
        if _skip_match(name, skip):
            reason = "in skip list"
        elif act_bits != 16:
            reason = f"experts are W4A16 only (act_bits={act_bits})"
        else:
            reason = experts_reason(module)
        if reason:
            skipped[name] = reason
            continue
        try:
            layer = QuantExperts.from_experts(module, group_size=group_size, sym=sym, dtype=dtype)
        except ValueError as e:
            raise ValueError(f"module {name!r}: {e}") from e
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        done.append(name)
    return done, skipped
