"""`tune(model, m=[...])`: benchmark the tile configs of every distinct problem of a model's
Sailfish layers (the tuners of tuning.py, run on the layers themselves inside a
tuning_session) and optionally save them as a config table."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .nn import QuantLinear, QuantLinearW4A8
from .tuning import M_BUCKETS, Config, gpu_key, m_bucket, save_tuned, tuning_session


def _quant_layers(model_or_layers) -> List[Tuple[str, torch.nn.Module]]:
    kinds = (QuantLinear, QuantLinearW4A8)
    if isinstance(model_or_layers, torch.nn.Module):
        return [(name or type(mod).__name__, mod) for name, mod in model_or_layers.named_modules()
                if isinstance(mod, kinds)]
    if isinstance(model_or_layers, (str, bytes)) or not isinstance(model_or_layers, Iterable):
        raise TypeError("model_or_layers must be an nn.Module or an iterable of QuantLinear / "
                        f"QuantLinearW4A8 layers, got {type(model_or_layers).__name__}")
    layers = list(model_or_layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, kinds):
            raise TypeError(f"model_or_layers[{i}] is a {type(layer).__name__}, not a QuantLinear "
                            "or QuantLinearW4A8")
    return [(f"[{i}]", layer) for i, layer in enumerate(layers)]


def _layer_signature(layer: torch.nn.Module) -> tuple:
    """Layers with equal signatures pose the same problems (shape, format, device)."""
    bufs = tuple((n, tuple(b.shape), b.dtype, b.device) for n, b in layer.named_buffers())
    return (type(layer), layer.group_size, getattr(layer, "_general_g_idx", False), bufs)


def _check_on_cuda(name: str, layer: torch.nn.Module) -> None:
    if layer.qweight.device.type != "cuda":
        raise ValueError(f"tune() benchmarks on CUDA; layer {name} is on {layer.qweight.device}")


def tune(model_or_layers, m: Sequence[int] = M_BUCKETS, save: Optional[str] = None, *,
         w4a8_dtype: torch.dtype = torch.float16) -> Dict[str, Config]:
    """Benchmark the candidate configs of every distinct problem of a model's Sailfish layers.

    model_or_layers: an nn.Module (its QuantLinear / QuantLinearW4A8 submodules) or an
    iterable of such layers, on CUDA. m: batch sizes (rows); each M bucket is tuned once per
    distinct layer shape and format. w4a8_dtype: the activation dtype W4A8 layers are tuned
    for (W4A16 layers use their own dtype). The results go into the in-process cache, so the
    model's later calls (eager or CUDA-graph captured) use them; save=path also writes them,
    merged over the entries already in that file, as a config table for SAILFISH_CONFIG_FILE.
    Returns {table key: Config}. Takes seconds per problem (each candidate is compiled and
    timed); forward itself never tunes unless SAILFISH_AUTOTUNE=1. Candidates that fail are
    reported with warnings.warn and skipped.
    """
    layers = _quant_layers(model_or_layers)
    if not layers:
        raise ValueError("model_or_layers holds no QuantLinear or QuantLinearW4A8 layer")
    if isinstance(m, int) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in m):
        raise ValueError(f"m must be a sequence of positive ints, got {m!r}")
    if w4a8_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"w4a8_dtype={w4a8_dtype} is not supported; allowed: torch.float16, torch.bfloat16")
    for name, layer in layers:
        _check_on_cuda(name, layer)
    devices = {layer.qweight.device for _, layer in layers}
    if save is not None and len({gpu_key(d) for d in devices}) > 1:
        raise ValueError(f"save={save!r}: the layers are on GPUs of different kinds; one table "
                         "holds one kind")
    buckets = sorted({m_bucket(v) for v in m})
    seen = set()
    with tuning_session() as tuned, torch.no_grad():
        for _, layer in layers:
            sig = _layer_signature(layer)
            if sig in seen:
                continue
            seen.add(sig)
            dtype = w4a8_dtype if isinstance(layer, QuantLinearW4A8) else layer.dtype
            for mb in buckets:
                layer(torch.randn(mb, layer.in_features, dtype=dtype, device=layer.qweight.device))
        result = {key: cfg for (_, _, key), cfg in tuned.items()}
    if save is not None:
        save_tuned(save, result, next(iter(devices)))
    return result
