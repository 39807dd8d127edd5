"""GPTQ over a whole decoder model, one decoder layer at a time ("true sequential").

The inputs of the first decoder layer are captured on the calibration batches (a pre-hook
that stops the forward there). Then, layer by layer: the layer's Linears are quantized in
the order the layer runs them, each from the Hessian of its inputs as they are with every
Linear before it already quantized (Linears fed the same tensor, such as q/k/v or gate/up,
share one pass); the layer's outputs, recomputed with all its Linears quantized, are the
next layer's inputs. A quantized Linear keeps running as an nn.Linear holding its
effective weight (QuantizedWeight.dequantize(), exactly what a QuantLinear multiplies)
until quantize_model swaps the QuantLinears in.

W4A8 (act_bits=8, QQQ): before its Linears are quantized, each decoder layer is smoothed
(calibrate.smooth: per-channel scales searched on the layer's calibration inputs, folded into
the RMSNorm weights and the v_proj / up_proj rows); the Linears are then GPTQ-quantized onto
the W4A8 format (gptq_quantize_qqq), and a quantized Linear quantizes its input per token to
int8 (formats.qqq.quantize_activations), as QuantLinearW4A8 does, in every later pass.
"""
from __future__ import annotations

import inspect
import logging
import sys
import time
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..formats.int4 import QuantizedWeight, check_flag
from ..formats.qqq import QQQWeight, quantize_activations
from . import smooth
from .gptq import Hessian, _check_percdamp, gptq_quantize, gptq_quantize_qqq

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
               act_bits: int = 16, progress: Optional[bool] = None, **options):
    """GPTQ-quantize the `targets` (Linear -> name) inside the model's decoder layers, layer by
    layer; options go to gptq_quantize (act_bits=8: smoothing, then gptq_quantize_qqq with
    group_size, act_order, static_groups, percdamp). Returns (Linear -> QuantizedWeight (QQQWeight for W4A8),
    on the Linear's device, for those the calibration reached: each of them then holds its
    effective weight; the caller rounds the rest to nearest), and name -> {"seconds", "error"}
    of each (error: the mean squared output error per calibration token, summed over the
    outputs; W4A8 adds "smoothing": {"into", "max_scale", "search_error": [unsmoothed,
    smoothed] (RTN W4A8 squared output error on the search rows), "seconds"} to the Linears
    whose inputs were smoothed). device: where each decoder layer is processed (default: where
    it is); the layer is moved back afterwards, so only one is on `device` at a time.
    progress: a bar per decoder layer (tqdm if installed, else a line per layer on stderr);
    None: only when stderr is a terminal."""
    _, layers = decoder_layers(model)
    home = next(layers[0].parameters()).device
    device = home if device is None else torch.device(device)
    if act_bits == 8:
        solver = gptq_quantize_qqq
        options = {k: options[k] for k in ("group_size", "act_order", "static_groups", "percdamp") if k in options}
    else:
        solver = gptq_quantize
    inputs = capture_inputs(model, layers[0], calibration, device)
    hidden = [_hidden(a, kw) for a, kw in inputs]
    solved, stats, hooks = {}, {}, []
    bar = _progress(len(layers), progress)
    try:
        for index, layer in enumerate(layers):
            layer_home = next(layer.parameters()).device
            layer.to(device)
            start = time.perf_counter()
            if act_bits == 8:
                _smooth_layer(layer, hidden, inputs, targets, options.get("group_size", -1), stats)
            remaining = [m for m in layer.modules() if m in targets]
            while remaining:
                group = _one_pass(layer, remaining, hidden, inputs, solved, stats, targets, solver, options)
                if not group:  # the calibration never reaches these: the caller rounds them to nearest
                    log.info("sailfish: gptq: %s never ran on the calibration data; rounded to nearest",
                             ", ".join(targets[m] for m in remaining))
                    break
                if act_bits == 8:  # from now on the Linear sees its input as the W4A8 layer will
                    hooks += [m.register_forward_pre_hook(_quantize_input) for m in group]
                remaining = [m for m in remaining if m not in group]
            with torch.no_grad():
                hidden = [_run(layer, h, a, kw) for h, (a, kw) in zip(hidden, inputs)]
            layer.to(layer_home)
            for m in layer.modules():
                if m in solved and solved[m].qweight.device != layer_home:
                    solved[m] = _moved(solved[m], layer_home)
            errors = [stats[targets[m]]["error"] for m in layer.modules() if m in targets and targets[m] in stats]
            bar(index, time.perf_counter() - start, sum(errors))
    finally:
        for handle in hooks:
            handle.remove()
        bar(None, 0, 0)
    return solved, stats


def _moved(qw, device):
    if isinstance(qw, QQQWeight):
        return QQQWeight(qw.qweight.to(device), qw.s_ch.to(device), None if qw.s_g is None else qw.s_g.to(device),
                         qw.group_size)
    return QuantizedWeight(*(None if t is None else t.to(device) for t in (
        qw.qweight, qw.scales, qw.zeros, qw.g_idx)), qw.group_size)


def _quantize_input(module, args):
    """Forward pre-hook: the input quantized per token to int8 and back, as QuantLinearW4A8 reads it."""
    x = args[0]
    xq, xs = quantize_activations(x.reshape(-1, x.shape[-1]))
    return ((xq.float() * xs[:, None]).to(x.dtype).reshape(x.shape),) + tuple(args[1:])


def _progress(total: int, progress: Optional[bool]):
    """bar(index, seconds, error) after each decoder layer; bar(None, ...) closes it."""
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        def log_only(index, seconds, error):
            if index is not None:
                log.info("sailfish: gptq: decoder layer %d of %d done in %.2f s, output error %.4g", index + 1,
                         total, seconds, error)
        return log_only
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    bar = tqdm(total=total, desc="sailfish gptq", unit="layer") if tqdm is not None else None

    def update(index, seconds, error):
        if index is None:
            if bar is not None:
                bar.close()
        elif bar is not None:
            bar.set_postfix_str(f"layer {index + 1}: {seconds:.1f} s, error {error:.3g}")
            bar.update(1)
        else:
            print(f"sailfish gptq: decoder layer {index + 1}/{total}: {seconds:.1f} s, output error {error:.4g}",
                  file=sys.stderr, flush=True)
    return update


def _input_groups(layer, hidden, inputs) -> List[Tuple[List[nn.Linear], Optional[nn.Module]]]:
    """The layer's Linears grouped by the input tensor they share, in the order they run (first
    batch), each with the module whose output that tensor is if it has a per-channel weight
    (a norm), else None."""
    seen, made = {}, {}

    def record(module, args):
        seen.setdefault(module, args[0])

    def record_output(module, args, out):
        made.setdefault(module, out)

    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    norms = [m for m in layer.modules() if not isinstance(m, nn.Linear) and isinstance(
        getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 1]
    handles = [m.register_forward_pre_hook(record) for m in linears]
    handles += [m.register_forward_hook(record_output) for m in norms]
    try:
        with torch.no_grad():
            _run(layer, hidden[0], *inputs[0])
    finally:
        for handle in handles:
            handle.remove()
    groups = []
    for m, x in seen.items():
        for g in groups:
            if seen[g[0][0]] is x:
                g[0].append(m)
                break
        else:
            groups.append(([m], next((n for n, out in made.items() if out is x and n.weight.numel() == x.shape[-1]),
                                     None)))
    return groups


def _feed(layer, module, batches, take) -> None:
    """Run the layer on each (hidden, (args, kwargs)) batch as far as `module`, handing take()
    the module's input (the rest of the layer is not needed)."""
    def hook(m, args):
        take(args[0])
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for h, (a, kw) in batches:
                try:
                    _run(layer, h, a, kw)
                except _Stop:
                    pass
    finally:
        handle.remove()


def _rows(layer, module, hidden, inputs, stride: int) -> torch.Tensor:
    """Every stride-th row of `module`'s input on the calibration batches."""
    rows = []
    _feed(layer, module, zip(hidden, inputs), lambda x: rows.append(x.reshape(-1, x.shape[-1])[::stride].float()))
    return torch.cat(rows)


def _smooth_layer(layer, hidden, inputs, targets, group_size, stats) -> None:
    """Smooth the inputs of each group of the layer's target Linears that share an input and
    whose producer can take 1 / s exactly (calibrate.smooth), in the order they run."""
    names = {m: n for n, m in layer.named_modules()}
    for group, norm in _input_groups(layer, hidden, inputs):
        quantized = [m for m in group if m in targets]
        producer, repeat, head_dim = (norm, 1, None) if norm is not None else _row_producer(layer, group, names)
        if not quantized or producer is None:
            continue
        start = time.perf_counter()
        stride = -(-sum(h.numel() // h.shape[-1] for h in hidden) // smooth.SEARCH_ROWS)  # <= SEARCH_ROWS rows
        x = _rows(layer, group[0], hidden, inputs, stride)
        weight = torch.cat([m.weight for m in quantized])
        s, before, after = smooth.search_scales(x, weight, group_size, repeat=repeat, head_dim=head_dim)
        if bool((s == 1).all()):
            continue

        def fold(scales):
            if producer is norm:
                smooth.fold_into_norm(norm, group, scales)
            else:
                smooth.fold_into_rows(producer, group[0], scales, repeat, head_dim)

        fold(s)
        check = _rows(layer, group[0], hidden[:1], inputs[:1], stride)  # the first batch's rows come first in x
        if not smooth.exact_within(x[:len(check)], check, smooth.expand_heads(s, repeat, head_dim),
                                   group[0].weight.dtype):
            log.info("sailfish: smoothing the input of %s does not fold into %s exactly; left unsmoothed",
                     names[group[0]], names[producer])
            fold(1 / s)
            continue
        info = {"into": names[producer], "max_scale": float(s.max()), "search_error": [before, after],
                "seconds": time.perf_counter() - start}
        for m in quantized:
            stats.setdefault(targets[m], {})["smoothing"] = info
        log.info("sailfish: smoothed the input of %s (into %s, largest scale %g): RTN W4A8 error %.4g -> %.4g",
                 ", ".join(targets[m] for m in quantized), names[producer], info["max_scale"], before, after)


# Linears whose input is (a per-row linear function of) a sibling Linear's output rows: QQQ's
# o_proj <- v_proj (attention mixes v rows over tokens) and down_proj <- up_proj (act(gate) * up)
_ROW_PRODUCERS = {"o_proj": "v_proj", "down_proj": "up_proj"}


def _row_producer(layer, group, names):
    """(producer Linear, repeat, head_dim) for a lone o_proj / down_proj, else (None, 1, None).
    repeat: query heads per key/value head (o_proj's input is repeat times v_proj's output)."""
    if len(group) != 1:
        return None, 1, None
    parent, _, leaf = names[group[0]].rpartition(".")
    source = f"{parent}.{_ROW_PRODUCERS[leaf]}" if leaf in _ROW_PRODUCERS else None
    producer = dict(layer.named_modules()).get(source.lstrip(".")) if source else None
    if not isinstance(producer, nn.Linear) or group[0].in_features % producer.out_features:
        return None, 1, None
    repeat = group[0].in_features // producer.out_features
    head_dim = getattr(layer.get_submodule(parent) if parent else layer, "head_dim", None)
    if repeat > 1 and not isinstance(head_dim, int):
        return None, 1, None
    return producer, repeat, head_dim


def _one_pass(layer, remaining, hidden, inputs, solved, stats, targets, solver, options) -> list:
    """Quantize the first of the `remaining` Linears that the layer runs, with those fed the
    same tensor (one Hessian for them all), from their inputs on the calibration batches.
    Returns those quantized (none if the calibration never runs any)."""
    seen = {}  # Linear -> its input, in the order they ran, in the first batch that runs any

    def record(module, args):
        seen.setdefault(module, args[0])

    batches = list(zip(hidden, inputs))
    lead = None
    for i, (h, (a, kw)) in enumerate(batches):
        handles = [m.register_forward_pre_hook(record) for m in remaining]
        try:
            with torch.no_grad():
                _run(layer, h, a, kw)
        finally:
            for handle in handles:
                handle.remove()
        if seen:
            lead, x = next(iter(seen.items()))
            group = [m for m, y in seen.items() if y is x]
            hessian = Hessian(lead.in_features, lead.weight.device)
            hessian.add(x)
            seen.clear()
            _feed(layer, lead, batches[i + 1:], hessian.add)
            break
    if lead is None:
        return []
    h = hessian.value()
    for m in group:
        start = time.perf_counter()
        try:
            qw = solver(m.weight, h, **options)
        except ValueError as e:
            raise ValueError(f"module {targets[m]!r}: {e}") from e
        effective = qw.dequantize()
        d = m.weight.detach().float() - effective
        # the mean squared output error per token that the quantization leaves, summed over outputs
        error = float((d @ h * d).sum()) / 2
        with torch.no_grad():
            m.weight.copy_(effective.to(m.weight.dtype))
        solved[m] = qw
        stats.setdefault(targets[m], {}).update(seconds=time.perf_counter() - start, error=error)
        log.info("sailfish: gptq: %s quantized in %.2f s, output error %.4g", targets[m],
                 stats[targets[m]]["seconds"], error)
    return group


def gptq_options(method, calibration, act_bits, act_order, static_groups, percdamp, device,
                 progress=None) -> Optional[dict]:
    """quantize_model's calibration arguments: None for method="rtn" (which takes none of
    them), else the options of calibrate.model.gptq_model."""
    if method not in ("rtn", "gptq"):
        raise ValueError(f"method={method!r} is not supported; allowed: 'rtn' (round to nearest), 'gptq'")
    check_flag("act_order", act_order)
    check_flag("static_groups", static_groups)
    if progress is not None:
        check_flag("progress", progress)
    if method == "rtn":
        given = [n for n, v in (("calibration", calibration), ("device", device), ("progress", progress))
                 if v is not None]
        given += [n for n, v, default in (("act_order", act_order, False), ("static_groups", static_groups, False),
                                          ("percdamp", percdamp, 0.01)) if v != default]
        if given:
            raise ValueError(f"{', '.join(given)} belong to method='gptq'; method='rtn' (round to nearest) takes "
                             f"no calibration")
        return None
    if calibration is None:
        raise ValueError("method='gptq' needs calibration= (an iterable of input_ids tensors or dicts of model "
                         "inputs)")
    _check_percdamp(percdamp)
    return dict(act_order=act_order, static_groups=static_groups, percdamp=percdamp, device=device,
                act_bits=act_bits, progress=progress)
