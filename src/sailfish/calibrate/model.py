"""GPTQ over a whole decoder model, one decoder layer at a time ("true sequential").

The inputs of the first decoder layer are captured on the calibration batches (a pre-hook
that stops the forward there). Then, layer by layer: the layer's Linears are quantized in
the order the layer runs them, each from the Hessian of its inputs as they are with every
Linear before it already quantized (Linears fed the same tensor, such as q/k/v or gate/up,
share one pass); the layer's outputs, recomputed with all its Linears quantized, are the
next layer's inputs. A quantized Linear keeps running as an nn.Linear holding its
effective weight (QuantizedWeight.dequantize(), exactly what a QuantLinear multiplies)
until quantize_model swaps the QuantLinears in.
"""
from __future__ import annotations

import inspect
import logging
import time
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..formats.int4 import QuantizedWeight, check_flag
from .gptq import Hessian, _check_percdamp, gptq_quantize

log = logging.getLogger("sailfish")


class _Stop(Exception):
    """Raised by a pre-hook that has what it needs: the rest of the forward is not run."""


def decoder_layers(model: nn.Module) -> Tuple[str, nn.ModuleList]:
    """The model's decoder layers: the longest nn.ModuleList whose every entry holds an
    nn.Linear (model.layers in transformers' Llama / Mistral / Qwen, transformer.h in GPT-2...)."""
    best = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and all(
                any(isinstance(x, nn.Linear) for x in layer.modules()) for layer in m):
            if best is None or len(m) > len(best[1]):
                best = (name, m)
    if best is None:
        raise ValueError(f"method='gptq' found no decoder layers in the {type(model).__name__}: it needs an "
                         f"nn.ModuleList of blocks holding nn.Linear layers (as transformers' decoder models have)")
    return best


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def capture_inputs(model: nn.Module, first: nn.Module, calibration: Iterable, device) -> List[Tuple[tuple, dict]]:
    """(args, kwargs) of `first` (the first decoder layer) for every calibration batch, on `device`.
    A batch is a tensor (input_ids) or a dict of model inputs."""
    if isinstance(calibration, (torch.Tensor, dict, str, bytes)) or not hasattr(calibration, "__iter__"):
        raise TypeError(f"calibration must be an iterable of batches (input_ids tensors or dicts of model "
                        f"inputs), got a {type(calibration).__name__}")
    captured = []

    def hook(module, args, kwargs):
        captured.append(_to((args, kwargs), device))
        raise _Stop

    no_cache = "use_cache" in inspect.signature(model.forward).parameters
    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for i, batch in enumerate(calibration):
            if not isinstance(batch, (torch.Tensor, dict)):
                raise TypeError(f"calibration batch {i} is a {type(batch).__name__}; allowed: an input_ids tensor "
                                f"or a dict of model inputs")
            inputs = dict(batch) if isinstance(batch, dict) else {"input_ids": batch}
            if no_cache:  # a KV cache would grow each time the captured layer inputs are replayed
                inputs["use_cache"] = False
            try:
                with torch.no_grad():
                    model(**inputs)
            except _Stop:
                continue
            except Exception as e:  # the model's own complaint, said to be about this batch
                raise ValueError(f"calibration batch {i} does not run through the model: {e}") from e
            raise ValueError(f"calibration batch {i} ran through the model without reaching its decoder layers")
    finally:
        handle.remove()
    if not captured:
        raise ValueError("calibration is empty; allowed: at least one batch of model inputs")
    return captured


def _run(layer: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    if args:
        out = layer(hidden, *args[1:], **kwargs)
    else:
        out = layer(**{**kwargs, "hidden_states": hidden})
    return out[0] if isinstance(out, (tuple, list)) else out


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def gptq_model(model: nn.Module, calibration: Iterable, targets: Dict[nn.Linear, str], *, device=None,
               **options) -> Tuple[Dict[nn.Linear, QuantizedWeight], Dict[str, dict]]:
    """GPTQ-quantize the `targets` (Linear -> name) inside the model's decoder layers, layer by
    layer; options go to gptq_quantize. Returns (Linear -> QuantizedWeight, on the Linear's
    device, for those the calibration reached: each of them then holds its effective weight;
    the caller rounds the rest to nearest), and name -> {"seconds", "error"} of each (error:
    the mean squared output error per calibration token, summed over the outputs).
    device: where each decoder layer is processed (default: where it is); the layer is moved
    back afterwards, so only one is on `device` at a time."""
    _, layers = decoder_layers(model)
    home = next(layers[0].parameters()).device
    device = home if device is None else torch.device(device)
    inputs = capture_inputs(model, layers[0], calibration, device)
    hidden = [_hidden(a, kw) for a, kw in inputs]
    solved, stats = {}, {}
    for index, layer in enumerate(layers):
        layer_home = next(layer.parameters()).device
        layer.to(device)
        remaining = [m for m in layer.modules() if m in targets]
        while remaining:
            group = _one_pass(layer, remaining, hidden, inputs, solved, stats, targets, options)
            if not group:  # the calibration never reaches these: the caller rounds them to nearest
                log.info("sailfish: gptq: %s never ran on the calibration data; rounded to nearest",
                         ", ".join(targets[m] for m in remaining))
                break
            remaining = [m for m in remaining if m not in group]
        with torch.no_grad():
            hidden = [_run(layer, h, a, kw) for h, (a, kw) in zip(hidden, inputs)]
        layer.to(layer_home)
        for m in layer.modules():
            if m in solved and solved[m].qweight.device != layer_home:
                qw = solved[m]
                solved[m] = QuantizedWeight(*(None if t is None else t.to(layer_home) for t in (
                    qw.qweight, qw.scales, qw.zeros, qw.g_idx)), qw.group_size)
        log.info("sailfish: gptq: decoder layer %d of %d done", index + 1, len(layers))
    return solved, stats


def _one_pass(layer, remaining, hidden, inputs, solved, stats, targets, options) -> list:
    """Quantize the first of the `remaining` Linears that the layer runs, with those fed the
    same tensor (one Hessian for them all), from their inputs on the calibration batches.
    Returns those quantized (none if the calibration never runs any)."""
    seen = {}  # Linear -> its input, in the order they ran, in the first batch that runs any

    def record(module, args):
        seen.setdefault(module, args[0])

    hessian, lead = None, None

    def accumulate(module, args):  # the group's input: the rest of the layer is not needed
        hessian.add(args[0])
        raise _Stop

    with torch.no_grad():
        for h, (a, kw) in zip(hidden, inputs):
            if lead is None:
                handles = [m.register_forward_pre_hook(record) for m in remaining]
                try:
                    _run(layer, h, a, kw)
                finally:
                    for handle in handles:
                        handle.remove()
                if not seen:
                    continue
                lead, x = next(iter(seen.items()))
                group = [m for m, y in seen.items() if y is x]
                hessian = Hessian(lead.in_features, lead.weight.device)
                hessian.add(x)
                seen.clear()
                continue
            handle = lead.register_forward_pre_hook(accumulate)
            try:
                _run(layer, h, a, kw)
            except _Stop:
                pass
            finally:
                handle.remove()
    if lead is None:
        return []
    h = hessian.value()
    for m in group:
        start = time.perf_counter()
        try:
            qw = gptq_quantize(m.weight, h, **options)
        except ValueError as e:
            raise ValueError(f"module {targets[m]!r}: {e}") from e
        effective = qw.dequantize()
        d = m.weight.detach().float() - effective
        # the mean squared output error per token that the quantization leaves, summed over outputs
        error = float((d @ h * d).sum()) / 2
        with torch.no_grad():
            m.weight.copy_(effective.to(m.weight.dtype))
        solved[m] = qw
        stats[targets[m]] = {"seconds": time.perf_counter() - start, "error": error}
        log.info("sailfish: gptq: %s quantized in %.2f s, output error %.4g", targets[m],
                 stats[targets[m]]["seconds"], error)
    return group


def gptq_options(method, calibration, act_bits, act_order, static_groups, percdamp, device) -> Optional[dict]:
    """quantize_model's calibration arguments: None for method="rtn" (which takes none of
    them), else the options of calibrate.model.gptq_model."""
    if method not in ("rtn", "gptq"):
        raise ValueError(f"method={method!r} is not supported; allowed: 'rtn' (round to nearest), 'gptq'")
    check_flag("act_order", act_order)
    check_flag("static_groups", static_groups)
    if method == "rtn":
        given = [n for n, v in (("calibration", calibration), ("device", device)) if v is not None]
        given += [n for n, v, default in (("act_order", act_order, False), ("static_groups", static_groups, False),
                                          ("percdamp", percdamp, 0.01)) if v != default]
        if given:
            raise ValueError(f"{', '.join(given)} belong to method='gptq'; method='rtn' (round to nearest) takes "
                             f"no calibration")
        return None
    if act_bits != 16:
        raise ValueError("method='gptq' is for W4A16 (act_bits=16); act_bits=8 (QQQ's smoothing + GPTQ) is not "
                         "supported yet")
    if calibration is None:
        raise ValueError("method='gptq' needs calibration= (an iterable of input_ids tensors or dicts of model "
                         "inputs)")
    _check_percdamp(percdamp)
    return dict(act_order=act_order, static_groups=static_groups, percdamp=percdamp, device=device)
