"""Reading checkpoint files, below load_quantized (checkpoint.py) and the MoE experts
(checkpoint_moe.py), which both use it: quantization_config parsed into a _Spec, the
safetensors headers by the model's tensor names, the tensors each quantized layer stores,
and a layer read whole or as one tensor-parallel shard into a QuantizedWeight / QQQWeight.

safetensors is imported only when these functions run (the `hf` extra).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from .formats.awq import from_awq
from .formats.compressed_tensors import from_compressed_tensors
from .formats.gptq import CHECKPOINT_FORMATS, from_gptq
from .formats.int4 import GROUP_SIZES, QuantizedWeight, num_groups
from .formats.marlin import GROUP_SIZES_MARLIN, from_marlin
from .formats.qqq import from_qqq
from .formats.shard import _group_rows, shard_bounds, slice_weight

SUPPORTED = ('quant_method "gptq" (bits 4, checkpoint_format "gptq", "gptq_v2" or "marlin"), "awq" '
             '(bits 4, version "gemm", zero_point true or false), "compressed-tensors" '
             '(format "pack-quantized", 4-bit int weights only), "marlin" (group_size 128 or -1) or "qqq" '
             '(wbits 4, group_size 128 or -1)')
TILED = ("marlin", "qqq")  # Marlin's tile order (formats/marlin.py): B + scales per layer
CT = "compressed-tensors"
_CT_ACTORDER = {None: False, False: False, True: True, "group": True, "dynamic": True, "weight": False,
                "static": False}  # True: a weight_g_idx per layer ("dynamic" / "static" are aliases)
_INT = ("I32",)
_HALF = ("F16", "BF16")


# -- quantization_config -------------------------------------------------------------
@dataclass(frozen=True)
class _Spec:
    method: str  # "gptq", "awq", CT, "marlin" or "qqq"
    group_size: int
    checkpoint_format: str  # GPTQ: "gptq" (v1) or "gptq_v2"
    zero_point: bool  # AWQ: false = symmetric (qzeros all 8); CT: not symmetric (weight_zero_point)
    desc_act: bool  # GPTQ desc_act; CT actorder "group": a g_idx per layer
    not_convert: Tuple[str, ...]  # modules_to_not_convert; CT: ignore
    lm_head: Optional[bool] = None  # GPTQ / Marlin "lm_head", QQQ False; None: the tensors decide (AWQ, CT)


def _field_error(field: str, value, allowed: str) -> ValueError:
    return ValueError(f"quantization_config.{field}={value!r} is not supported; Sailfish loads {allowed}")


def _parse_quant_config(qc) -> _Spec:
    if not isinstance(qc, dict):
        raise ValueError("config.json has no quantization_config: this is not a GPTQ, AWQ or compressed-tensors "
                         "checkpoint (load it with transformers and quantize it with sailfish.quantize_model)")
    method = qc.get("quant_method")
    if method not in ("gptq", "awq", CT) + TILED:
        raise _field_error("quant_method", method, SUPPORTED)
    if method == CT:
        return _parse_compressed_tensors(qc)
    if method == "gptq" and (str(qc.get("checkpoint_format") or qc.get("format") or "").lower() == "marlin"
                             or qc.get("is_marlin_format") is True):
        # AutoGPTQ's Marlin checkpoints (checkpoint_format "marlin", before 0.8 is_marlin_format):
        # symmetric, in order, Marlin's B / s tensors; vLLM reads them as quant_method "marlin"
        for field, allowed in (("sym", (True, None)), ("desc_act", (False, None))):
            if qc.get(field) not in allowed:
                raise _field_error(field, qc[field], f"{field} {allowed[0]} for Marlin-format GPTQ checkpoints")
        method = "marlin"
    if method in TILED:
        return _parse_tiled(qc, method)
    if qc.get("bits") != 4:
        raise _field_error("bits", qc.get("bits"), "4-bit weights (bits=4)")
    group_size = qc.get("group_size", 128)
    if group_size not in GROUP_SIZES:
        raise _field_error("group_size", group_size, f"group sizes {GROUP_SIZES}")
    if method == "gptq":
        key = "checkpoint_format" if "checkpoint_format" in qc else "format"
        fmt = str(qc.get(key) or "gptq").lower()
        if fmt not in CHECKPOINT_FORMATS:
            raise _field_error(key, qc.get(key), 'GPTQ checkpoint_format "gptq" (v1: zero points stored '
                               'minus 0x11111111 per word) or "gptq_v2" (stored as they are)')
        if qc.get("dynamic"):
            raise _field_error("dynamic", qc["dynamic"], "one bits / group_size for every layer (no "
                               "per-module overrides)")
    else:
        key = "version" if "version" in qc else "format"
        fmt = qc.get(key) or "gemm"
        if str(fmt).lower() != "gemm":
            raise _field_error(key, fmt, 'AWQ version "gemm"')
        if str(qc.get("backend") or "").lower() == "llm-awq":
            raise _field_error("backend", qc["backend"], 'AutoAWQ "gemm" checkpoints (llm-awq packs '
                               "differently)")
        if qc.get("zero_point", True) not in (True, False):
            raise _field_error("zero_point", qc.get("zero_point"), "zero_point true (AWQ with zero points) "
                               "or false (symmetric: qzeros all 8)")
    not_convert = qc.get("modules_to_not_convert") or ()
    if isinstance(not_convert, str) or not all(isinstance(s, str) for s in not_convert):
        raise _field_error("modules_to_not_convert", not_convert, "a list of module names")
    return _Spec(method, group_size, fmt if method == "gptq" else "", qc.get("zero_point", True) is True,
                 bool(qc.get("desc_act", False)), tuple(not_convert),
                 _lm_head_flag(qc) if method == "gptq" else None)


def _lm_head_flag(qc) -> bool:
    """GPTQModel / vLLM's "lm_head": true when the output layer is quantized too."""
    value = qc.get("lm_head", False)
    if value not in (True, False):
        raise _field_error("lm_head", value, "lm_head true or false")
    return value


def _parse_tiled(qc, method: str) -> _Spec:
    """Marlin (vLLM: group_size, lm_head; AutoGPTQ's gptq config with checkpoint_format
    "marlin": bits 4) or QQQ (the QQQ repository / vLLM: wbits, group_size; no lm_head)."""
    bits_key = "wbits" if method == "qqq" else "bits"
    if qc.get(bits_key, 4) != 4:
        raise _field_error(bits_key, qc.get(bits_key), f"4-bit weights ({bits_key}=4)")
    group_size = qc.get("group_size")
    if group_size not in GROUP_SIZES_MARLIN:
        raise _field_error("group_size", group_size, f"group sizes {GROUP_SIZES_MARLIN} for quant_method {method!r}")
    lm_head = _lm_head_flag(qc) if method == "marlin" else False
    if method == "qqq" and "lm_head" in qc and qc["lm_head"] is not False:
        raise _field_error("lm_head", qc["lm_head"], 'lm_head false for quant_method "qqq" (QQQ keeps it in fp16)')
    not_convert = qc.get("modules_to_not_convert") or ()
    if isinstance(not_convert, str) or not all(isinstance(e, str) for e in not_convert):
        raise _field_error("modules_to_not_convert", not_convert, "a list of module names")
    return _Spec(method, group_size, "", False, False, tuple(not_convert), lm_head)


def _parse_compressed_tensors(qc) -> _Spec:
    """llm-compressor's W4A16: one config group targeting "Linear" with 4-bit int weights
    (group or channel strategy), no activation / kv-cache quantization, no sparsity."""
    if qc.get("format") != "pack-quantized":
        raise _field_error("format", qc.get("format"), 'compressed-tensors format "pack-quantized" (W4A16)')
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _field_error("quantization_status", qc.get("quantization_status"), '"compressed" checkpoints')
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(field):
            raise _field_error(field, qc[field], f"weight-only quantization (no {field})")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _field_error("config_groups", groups, "exactly one config group (one scheme for every Linear)")
    (gname, group), = groups.items()
    at = f"config_groups.{gname}"
    if not isinstance(group, dict):
        raise _field_error(at, group, "a scheme with targets and weights (not a preset name)")
    if group.get("targets") != ["Linear"]:
        raise _field_error(f"{at}.targets", group.get("targets"), 'targets ["Linear"]')
    for field in ("input_activations", "output_activations"):
        if group.get(field):
            raise _field_error(f"{at}.{field}", group[field], "W4A16: weights-only quantization (null)")
    if group.get("format") not in (None, "pack-quantized"):
        raise _field_error(f"{at}.format", group["format"], '"pack-quantized"')
    w = group.get("weights")
    if not isinstance(w, dict):
        raise _field_error(f"{at}.weights", w, "a weights scheme")
    for field, allowed in (("num_bits", (4,)), ("type", ("int",)), ("strategy", ("group", "channel")),
                           ("symmetric", (True, False)), ("dynamic", (False, None)),
                           ("block_structure", (None,)), ("actorder", tuple(_CT_ACTORDER))):
        if w.get(field) not in allowed:
            raise _field_error(f"{at}.weights.{field}", w.get(field), f"{field} in {allowed}")
    group_size = w.get("group_size")
    if w["strategy"] == "channel":
        if group_size not in (None, -1):
            raise _field_error(f"{at}.weights.group_size", group_size, 'none (or -1) for strategy "channel"')
        group_size = -1
    elif group_size not in GROUP_SIZES or group_size == -1:
        raise _field_error(f"{at}.weights.group_size", group_size, f"group sizes {GROUP_SIZES[:-1]} for strategy "
                           f'"group" (strategy "channel" for one group)')
    ignore = qc.get("ignore") or ()
    if isinstance(ignore, str) or not all(isinstance(e, str) for e in ignore):
        raise _field_error("ignore", ignore, "a list of module names or re: patterns")
    return _Spec(CT, group_size, "", not w["symmetric"], _CT_ACTORDER[w.get("actorder")], tuple(ignore))


def _ct_ignores(module_name: str, module: nn.Module, entry: str) -> bool:
    """compressed-tensors' ignore matching: "re:<pattern>" matched from the start of the
    name, else the module's full name or its class name."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module_name) is not None
    return entry in (module_name, type(module).__name__)


def _matches(module_name: str, entry: str) -> bool:
    """entry names the module or one of its ancestors, as whole dotted components anywhere in
    the name ("lm_head", "mlp.gate", "model.layers.0"; outer dots are dropped: AWQ checkpoints
    write "mlp.gate." and "model.layers.0." for vLLM's substring match)."""
    return f".{entry.strip('.')}." in f".{module_name}."


# -- safetensors headers ---------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    file: str
    shape: Tuple[int, ...]
    dtype: str  # safetensors dtype name: "I32", "F16", ...
    key: str  # the tensor's name in the file


class _Entries(dict):
    """The checkpoint's tensors by the model's names for them (transformers' key renamings
    applied, checkpoint_moe.KeyNames): name -> _Entry."""

    def __init__(self, entries: Dict[str, _Entry], naming=None):
        super().__init__()
        self.naming = naming
        for key, e in entries.items():
            name = naming.to_model(key) if naming is not None else key
            if name in self:
                raise ValueError(f"tensors {self[name].key} and {key} both load into {name}")
            self[name] = e

    def stored(self, name: str) -> str:
        """The key the files use (or would use) for the model's tensor `name`: for messages."""
        e = self.get(name)
        return e.key if e is not None else self.naming.to_checkpoint(name) if self.naming is not None else name


def _read_headers(path: str) -> _Entries:
    """Every tensor of the checkpoint: name -> (file, shape, dtype), from the headers only."""
    from safetensors import safe_open

    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_file} has no weight_map")
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {path}")
    entries: Dict[str, _Entry] = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{index_file} lists {name}, which does not exist")
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if weight_map is not None and weight_map.get(key) != name:
                    continue  # the index assigns this key to another shard
                if key in entries:
                    raise ValueError(f"tensor {key} is in both {entries[key].file} and {file}")
                s = f.get_slice(key)
                entries[key] = _Entry(file, tuple(s.get_shape()), s.get_dtype(), key)
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(entries))
        if missing:
            raise ValueError(f"{index_file} lists tensors that its shards do not hold: {missing[:5]}")
    return _Entries(entries)


def _check_tensor(entries, key: str, shape, dtypes) -> None:
    e = entries.get(key)
    if e is None:
        raise ValueError(f"the checkpoint has no tensor {entries.stored(key)}")
    if e.shape != tuple(shape) or e.dtype not in dtypes:
        raise ValueError(f"{e.key} must be {' or '.join(dtypes)} of shape {tuple(shape)}, "
                         f"got {e.dtype} {e.shape}")


# -- a quantized layer's tensors ----------------------------------------------------------
def _layer_tensors(spec: _Spec, linear: nn.Linear):
    """{suffix: (shape, allowed dtypes)} of a quantized layer's checkpoint tensors."""
    k, n = linear.in_features, linear.out_features
    g = num_groups(k, spec.group_size)
    if spec.method == "gptq":
        return {"qweight": ((k // 8, n), _INT), "qzeros": ((g, n // 8), _INT), "scales": ((g, n), _HALF)}
    if spec.method == "marlin":
        return {"B": ((k // 16, 2 * n), _INT), "s": ((g, n), ("F16",))}
    if spec.method == "qqq":  # per channel (QQQ: also K = group_size), s_group is empty or absent (_plan)
        group = {"s_group": ((g, n), ("F16",))} if g > 1 else {}
        return {"B": ((k // 16, 2 * n), _INT), "s_channel": ((1, n), ("F32",)), **group}
    if spec.method == CT:
        zero_point = {"weight_zero_point": ((n // 8, g), _INT)} if spec.zero_point else {}
        return {"weight_packed": ((n, k // 8), _INT), "weight_scale": ((n, g), _HALF),
                "weight_shape": ((2,), ("I32", "I64")), **zero_point}
    return {"qweight": ((k, n // 8), _INT), "qzeros": ((g, n // 8), _INT), "scales": ((g, n), _HALF)}


def _g_idx_key(spec: _Spec, name: str, entries) -> Optional[str]:
    """The layer's g_idx tensor, if it must be read: GPTQ's when present or desc_act,
    compressed-tensors' with actorder "group" (elsewhere it would be an unexpected tensor)."""
    if spec.method == "gptq" and (f"{name}.g_idx" in entries or spec.desc_act):
        return f"{name}.g_idx"
    return f"{name}.weight_g_idx" if spec.method == CT and spec.desc_act else None


# -- reading, whole or one tensor-parallel shard ---------------------------------------
class _Reader:
    """Reads checkpoint tensors, or only some of their bytes, each file opened once."""

    def __init__(self, entries: Dict[str, _Entry], stack: contextlib.ExitStack):
        self.entries, self.stack, self.files = entries, stack, {}

    def __call__(self, key: str, index: Optional[tuple] = None) -> torch.Tensor:
        """Tensor `key`, or its part `index` (one slice per dim): safetensors reads only that part."""
        from safetensors import safe_open
        e = self.entries[key]
        if e.file not in self.files:
            self.files[e.file] = self.stack.enter_context(safe_open(e.file, framework="pt"))
        f = self.files[e.file]
        return f.get_tensor(e.key) if index is None else f.get_slice(e.key)[index]


# What each axis of a layer's tensors indexes: (feature, elements per feature as num / den);
# "N" output features, "K" input features, "G" group rows, None an axis no split cuts. g_idx,
# bias and CT's weight_shape are handled apart.
_AXES = {
    "gptq": {"qweight": (("K", 1, 8), ("N", 1, 1)), "qzeros": (("G", 1, 1), ("N", 1, 8)),
             "scales": (("G", 1, 1), ("N", 1, 1))},
    "awq": {"qweight": (("K", 1, 1), ("N", 1, 8)), "qzeros": (("G", 1, 1), ("N", 1, 8)),
            "scales": (("G", 1, 1), ("N", 1, 1))},
    CT: {"weight_packed": (("N", 1, 1), ("K", 1, 8)), "weight_scale": (("N", 1, 1), ("G", 1, 1)),
         "weight_zero_point": (("N", 1, 8), ("G", 1, 1))},
    "marlin": {"B": (("K", 1, 16), ("N", 2, 1)), "s": (("G", 1, 1), ("N", 1, 1))},
    "qqq": {"B": (("K", 1, 16), ("N", 2, 1)), "s_channel": (None, ("N", 1, 1)), "s_group": (("G", 1, 1), ("N", 1, 1))},
}
_ZEROS = {"gptq": "qzeros", "awq": "qzeros", CT: "weight_zero_point"}


def _group_size(spec: _Spec, linear: nn.Linear) -> int:
    """The layer's group size as loaded (QQQ reads a layer whose K is the group size per channel)."""
    per_channel = spec.method == "qqq" and linear.in_features == spec.group_size
    return -1 if per_channel else spec.group_size


def _decode(spec: _Spec, t: Dict[str, torch.Tensor], g_idx: Optional[torch.Tensor], linear: nn.Linear):
    """The format's reader on the layer's tensors (all of them, or a shard's window of them);
    the Marlin / QQQ scale order and QQQ's per-channel reading follow the whole layer."""
    grouped = num_groups(linear.in_features, _group_size(spec, linear)) > 1
    if spec.method == "qqq":
        return from_qqq(t["B"], t["s_channel"], t.get("s_group"), group_size=spec.group_size,
                        per_channel=not grouped)
    if spec.method == "marlin":
        return from_marlin(t["B"], t["s"], group_size=spec.group_size, grouped=grouped)
    if spec.method == "gptq":
        return from_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx, group_size=spec.group_size,
                         checkpoint_format=spec.checkpoint_format)
    if spec.method == CT:
        return from_compressed_tensors(t["weight_packed"], t["weight_scale"], t["weight_shape"],
                                       t.get("weight_zero_point"), g_idx, group_size=spec.group_size)
    return from_awq(t["qweight"], t["qzeros"], t["scales"], group_size=spec.group_size, zero_point=spec.zero_point)


def _chunks(size: int, world: int):
    step = -(-size // world)
    return [(a, min(a + step, size)) for a in range(0, size, step)]


def _whole_matches(read: _Reader, key: str, axis: int, world: int, ok) -> bool:
    """ok(part, start) for every part of tensor `key` cut along `axis` into `world` pieces: a
    property of the whole tensor, read a shard's worth at a time."""
    shape = read.entries[key].shape
    for a, b in _chunks(shape[axis], world):
        index = tuple(slice(a, b) if d == axis else slice(None) for d in range(len(shape)))
        if not ok(read(key, index), a):
            return False
    return True


def _read_layer(read: _Reader, spec: _Spec, name: str, linear: nn.Linear, device, split=None):
    """The layer's weight (QuantizedWeight or QQQWeight) and bias, on `device`: all of it, or
    with split=(dim, rank, world, own g_idx if act-order) rank's tensor-parallel shard, equal
    to sailfish.parallel.shard_quantized / shard_bias of the whole, reading only the
    shard's windows of the tensors (plus g_idx, which a column shard keeps whole, and the
    scale rows of the groups an act-order row shard touches)."""
    g_key = _g_idx_key(spec, name, read.entries)
    if split is None:
        t = {s: read(f"{name}.{s}").to(device) for s in _layer_tensors(spec, linear)}
        bias = read(f"{name}.bias").to(device) if linear.bias is not None else None
        return _decode(spec, t, read(g_key).to(device) if g_key else None, linear), bias
    dim, rank, world, own = split
    n, k = linear.out_features, linear.in_features
    gs = _group_size(spec, linear)
    start, stop = shard_bounds(n, k, rank, world, dim)
    g_idx, rows = None, slice(None)
    if dim == 0:
        g_idx = read(g_key) if g_key else None  # a column shard keeps every input channel
    elif own is not None:  # act-order row shard: the scale rows of the groups it touches
        total = num_groups(k, gs)  # the scale rows the checkpoint stores
        lo, hi = int(own.min()), int(own.max()) + 1
        if lo < 0 or hi > total:
            raise ValueError(f"g_idx values must lie in [0, {total}) (one per row of scales)")
        m = max(hi - lo, num_groups(stop - start, gs))  # at least the rows a K' weight has
        lo = min(lo, total - m)
        rows, g_idx = slice(lo, lo + m), own.to(torch.int32) - lo
    else:
        rows = _group_rows(start, stop, k, gs)

    def window(axis):
        if axis is None:
            return slice(None)
        feature, num, den = axis
        if feature == "G":
            return rows
        if feature == "NK"[dim]:
            return slice(start * num // den, stop * num // den)
        return slice(None)

    t = {}
    for suffix in _layer_tensors(spec, linear):
        axes = _AXES[spec.method].get(suffix)
        t[suffix] = read(f"{name}.{suffix}", None if axes is None else tuple(window(a) for a in axes)).to(device)
    if spec.method == CT:
        shape = t["weight_shape"]
        t["weight_shape"] = torch.tensor([stop - start, k] if dim == 0 else [n, stop - start], dtype=shape.dtype)
    qw = _decode(spec, t, None if g_idx is None else g_idx.to(device), linear)
    zeros = f"{name}.{_ZEROS.get(spec.method)}"
    if isinstance(qw, QuantizedWeight) and qw.zeros is None and zeros in read.entries:
        # the readers call a layer symmetric when all its zero points are 8: all of them, not the shard's
        eights = 0x77777777 if spec.method == "gptq" and spec.checkpoint_format == "gptq" else 0x88888888
        axis = 0 if spec.method == CT else 1
        if not _whole_matches(read, zeros, axis, world, lambda p, a: bool(((p.long() & 0xFFFFFFFF) == eights).all())):
            if spec.method == "awq" and not spec.zero_point:
                raise ValueError("zero_point=False (symmetric AWQ) needs every qzeros nibble to be 8; "
                                 "some outside this rank's shard are not")
            qw = replace(qw, zeros=torch.full(qw.scales.shape, 8, dtype=torch.uint8, device=qw.scales.device))
    if linear.bias is None:
        bias = None
    elif dim == 0:
        bias = read(f"{name}.bias", (slice(start, stop),)).to(device)
    else:  # row parallel: rank 0 adds the bias once
        bias = read(f"{name}.bias").to(device) if rank == 0 else None
    return slice_weight(qw, dim, 0, stop - start), bias
