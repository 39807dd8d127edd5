"""Exact slices of 4-bit weights along output (N) or input (K) features: the format half
of tensor parallelism. Pure PyTorch, on the canonical (unpacked) weights, so a slice never
depends on a kernel's packed layout: a layer is unpacked, sliced here, then packed again.

    dim=0, [start, stop) of N:  every tensor indexed by n is cut; groups are untouched.
    dim=1, [start, stop) of K:  codes and g_idx are cut; the scale rows are those of the
                                groups the slice touches.

Plain group layouts (no g_idx) can only be cut on group boundaries (a multiple of the group
size, or K itself), since a group's scale row is shared by its channels in both halves.

Concatenation along N (concat_weight) is the exact inverse of dim=0 slices: the parts of a
fused projection (q, k, v or gate, up) stacked into one weight. Every tensor indexed by n is
joined; what the parts share (K, group size, dtype, symmetry, g_idx) must be equal, so an
act-order weight joins only parts with the same g_idx (GPTQ gives projections that read one
input the same g_idx; parts with different ones cannot share one K order and raise).
Concatenation along K (concat_quantized(parts, dim=1), W4A16 without g_idx) is the exact
inverse of dim=1 slices on group boundaries: a shared MLP's down projection put back together
from the shared experts it was split into (moe.py). Codes and scale / zero rows are joined;
every part but the last must be whole groups; per-channel parts (group_size -1) must have equal
scales and zero points, which the result keeps.

Act-order (g_idx) weights can be cut anywhere: the slice keeps its channels in the original
order, its g_idx is renumbered 0 .. T-1 over the T groups it touches (in increasing order,
so the kernels' sort by group still visits each group's channels in the original order),
and the scale / zero rows are those T groups'. A g_idx weight may hold more scale rows than
ceil(K' / group_size) (formats.int4.QuantizedWeight): the slice keeps the group size and
stores max(T, ceil(K' / group_size)) rows (unused ones with scale 0), which the usual case needs
-- GPTQ desc_act scatters every group over all of K, so each shard touches nearly all of them.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .int4 import QuantizedWeight, check_shape, num_groups
from .qqq import QQQWeight

Weight = Union[QuantizedWeight, QQQWeight]


def _check_range(dim: int, start: int, stop: int, n: int, k: int) -> int:
    """Validate a slice request; return the size of the sliced dimension."""
    if dim not in (0, 1):
        raise ValueError(f"dim={dim!r} is not supported; allowed: 0 (output features), 1 (input features)")
    for name, v in (("start", start), ("stop", stop)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    size = n if dim == 0 else k
    what = "out_features" if dim == 0 else "in_features"
    if not 0 <= start < stop <= size:
        raise ValueError(f"slice [{start}, {stop}) is not a non-empty range inside {what}={size}")
    return size


def _group_rows(start: int, stop: int, k: int, group_size: int) -> slice:
    """The scale rows of the plain groups [start, stop) of K covers, which must start and end
    on group boundaries (stop == K ends the ragged last group)."""
    if group_size == -1:
        return slice(0, 1)
    for edge in (start, stop):
        if edge % group_size and edge != k:
            raise ValueError(
                f"input-feature slice [{start}, {stop}) of in_features={k} cuts a group of "
                f"group_size={group_size}: a slice of a grouped weight must start and end on a "
                f"group boundary (a multiple of {group_size}, or in_features)")
    return slice(start // group_size, -(-stop // group_size))


def _act_order_slice(qw: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    g_idx = qw.g_idx[start:stop]
    touched, local = torch.unique(g_idx.long(), sorted=True, return_inverse=True)
    t, k_new = touched.numel(), stop - start
    group_size = qw.group_size
    rows = max(num_groups(k_new, group_size), t)
    n = qw.out_features

    def gather(t_full: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t_full is None:
            return None
        out = torch.zeros((rows, n), dtype=t_full.dtype, device=t_full.device)
        out[:t] = t_full[touched]
        return out

    return QuantizedWeight(_cut(qw.qweight, (slice(None), slice(start, stop))), gather(qw.scales), gather(qw.zeros),
                           local.to(torch.int32), group_size, qw.bits)


def _cut(t: Optional[torch.Tensor], index) -> Optional[torch.Tensor]:
    # A compact copy, never a view: a shard must not keep the full tensor's storage alive.
    return None if t is None else t[index].clone(memory_format=torch.contiguous_format)


def slice_quantized(qw: QuantizedWeight, dim: int, start: int, stop: int) -> QuantizedWeight:
    """Output features (dim=0) or input features (dim=1) [start, stop) of a W4A16 weight,
    exactly: the slice's dequantize() equals the same slice of qw.dequantize()."""
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight, got {type(qw).__name__}")
    _check_range(dim, start, stop, *qw.qweight.shape)
    if dim == 0:  # scales / zeros are (G, N)
        cols = (slice(None), slice(start, stop))
        return QuantizedWeight(_cut(qw.qweight, slice(start, stop)), _cut(qw.scales, cols),
                               _cut(qw.zeros, cols), _cut(qw.g_idx, slice(None)), qw.group_size, qw.bits)
    if qw.g_idx is not None:
        return _act_order_slice(qw, start, stop)
    rows = _group_rows(start, stop, qw.in_features, qw.group_size)
    return QuantizedWeight(_cut(qw.qweight, (slice(None), slice(start, stop))), _cut(qw.scales, rows),
                           _cut(qw.zeros, rows), None, qw.group_size, qw.bits)


def slice_qqq(qw: QQQWeight, dim: int, start: int, stop: int) -> QQQWeight:
    """Output features (dim=0) or input features (dim=1) [start, stop) of a W4A8 (QQQ)
    weight, exactly: the slice's int8_weight() and dequantize() equal the same slices of qw's."""
    if not isinstance(qw, QQQWeight):
        raise TypeError(f"qw must be a QQQWeight, got {type(qw).__name__}")
    _check_range(dim, start, stop, *qw.qweight.shape)
    if dim == 0:  # s_ch is (N,), s_g (G, N)
        return QQQWeight(_cut(qw.qweight, slice(start, stop)), _cut(qw.s_ch, slice(start, stop)),
                         _cut(qw.s_g, (slice(None), slice(start, stop))), qw.group_size)
    rows = _group_rows(start, stop, qw.in_features, qw.group_size)
    # s_ch is per output channel: every input slice keeps all of it.
    return QQQWeight(_cut(qw.qweight, (slice(None), slice(start, stop))), qw.s_ch.clone(),
                     _cut(qw.s_g, rows), qw.group_size)


def _check_parts(parts, kind) -> None:
    if not isinstance(parts, (list, tuple)) or not parts:
        raise ValueError(f"parts must be a non-empty list of {kind.__name__}s, got {parts!r}")
    for i, p in enumerate(parts):
        if not isinstance(p, kind):
            raise TypeError(f"parts[{i}] must be a {kind.__name__}, got {type(p).__name__}")


def _check_shared(parts, what: str, value, along: str = "output features") -> None:
    """Every part's value(part) must equal parts[0]'s: the features the parts of one weight share."""
    first = value(parts[0])
    for i, p in enumerate(parts[1:], 1):
        v = value(p)
        if isinstance(first, torch.Tensor):
            if not torch.equal(v, first):
                raise ValueError(f"parts[{i}] has a different {what} than parts[0]: a concatenation "
                                 f"along {along} needs one {what} for all parts")
        elif v != first:
            raise ValueError(f"parts[{i}] has {what}={v!r} but parts[0] has {what}={first!r}: a "
                             f"concatenation along {along} needs equal {what}")


def _join(ts, dim: int) -> Optional[torch.Tensor]:
    return None if ts[0] is None else torch.cat(ts, dim=dim)


def concat_quantized(parts, dim: int = 0) -> QuantizedWeight:
    """W4A16 weights stacked along output features (N, dim=0), exactly: the result's dequantize()
    is torch.cat of the parts' along dim 0, and slice_quantized(result, 0, ...) over each
    part's rows gives that part back bit for bit. The parts must share in_features, group
    size, bits, dtype, symmetry, device, the number of scale rows and g_idx (None for all,
    or equal: ValueError otherwise). dim=1: joined along input features (K), the same
    guarantees for dim=1 slices (module docstring: no g_idx, whole groups)."""
    _check_parts(parts, QuantizedWeight)
    if dim == 1:
        return _concat_k(parts)
    if dim != 0:
        raise ValueError(f"dim={dim!r} is not supported; allowed: 0 (output features), 1 (input features)")
    for what, value in (("in_features", lambda p: p.in_features), ("group_size", lambda p: p.group_size),
                        ("bits", lambda p: p.bits), ("dtype", lambda p: p.dtype), ("sym", lambda p: p.sym),
                        ("device", lambda p: p.qweight.device), ("scale rows", lambda p: p.scales.shape[0]),
                        ("act-order (g_idx given)", lambda p: p.g_idx is not None)):
        _check_shared(parts, what, value)
    if parts[0].g_idx is not None:
        _check_shared(parts, "g_idx", lambda p: p.g_idx)
    return QuantizedWeight(torch.cat([p.qweight for p in parts]), _join([p.scales for p in parts], 1),
                           _join([p.zeros for p in parts], 1), _cut(parts[0].g_idx, slice(None)),
                           parts[0].group_size, parts[0].bits)


def _concat_k(parts) -> QuantizedWeight:
    along = "input features"
    for what, value in (("out_features", lambda p: p.out_features), ("group_size", lambda p: p.group_size),
                        ("bits", lambda p: p.bits), ("dtype", lambda p: p.dtype), ("sym", lambda p: p.sym),
                        ("device", lambda p: p.qweight.device)):
        _check_shared(parts, what, value, along)
    for i, p in enumerate(parts):
        if p.g_idx is not None:
            raise ValueError(f"parts[{i}] has a g_idx (act-order); a concatenation along input features takes "
                             "weights without one")
    gs = parts[0].group_size
    if gs == -1:  # one scale per output channel over all of K: every part holds the same
        _check_shared(parts, "scales", lambda p: p.scales, along)
        _check_shared(parts, "zeros", lambda p: p.zeros, along)
        scales, zeros = _cut(parts[0].scales, slice(None)), _cut(parts[0].zeros, slice(None))
    else:
        for i, p in enumerate(parts[:-1]):
            if p.in_features % gs:
                raise ValueError(f"parts[{i}] has in_features={p.in_features}, not a multiple of group_size={gs}: "
                                 "a group would span two parts")
        scales, zeros = _join([p.scales for p in parts], 0), _join([p.zeros for p in parts], 0)
    return QuantizedWeight(torch.cat([p.qweight for p in parts], 1), scales, zeros, None, gs, parts[0].bits)


def concat_qqq(parts) -> QQQWeight:
    """W4A8 (QQQ) weights stacked along output features, exactly (the inverse of slice_qqq
    along dim 0). The parts must share in_features, group size and device."""
    _check_parts(parts, QQQWeight)
    for what, value in (("in_features", lambda p: p.in_features), ("group_size", lambda p: p.group_size),
                        ("device", lambda p: p.qweight.device)):
        _check_shared(parts, what, value)
    return QQQWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.s_ch for p in parts]),
                     _join([p.s_g for p in parts], 1), parts[0].group_size)


def concat_weight(parts) -> Weight:
    """concat_quantized or concat_qqq, by the parts' type."""
    if isinstance(parts, (list, tuple)) and parts and isinstance(parts[0], QQQWeight):
        return concat_qqq(parts)
    return concat_quantized(parts)


def slice_weight(qw: Weight, dim: int, start: int, stop: int) -> Weight:
    """slice_quantized or slice_qqq, by the weight's type."""
    if isinstance(qw, QQQWeight):
        return slice_qqq(qw, dim, start, stop)
    if isinstance(qw, QuantizedWeight):
        return slice_quantized(qw, dim, start, stop)
    raise TypeError(f"qw must be a QuantizedWeight or a QQQWeight, got {type(qw).__name__}")


__all__ = ["slice_quantized", "slice_qqq", "slice_weight", "concat_quantized", "concat_qqq", "concat_weight"]


# ----------------------------------------------------------------------------------
# Tensor-parallel shards (sailfish.parallel, QuantLinear.shard)
# ----------------------------------------------------------------------------------
def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def shard_range(size: int, rank: int, world_size: int, dim: int) -> Tuple[int, int]:
    """[start, stop) of rank `rank` when `size` features along `dim` are split evenly."""
    for name, v in (("rank", rank), ("world_size", world_size), ("dim", dim)):
        _check_int(name, v)
    if dim not in (0, 1):
        raise ValueError(f"dim={dim} is not supported; allowed: 0 (column parallel: output "
                         f"features), 1 (row parallel: input features)")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    what = "out_features" if dim == 0 else "in_features"
    if size % world_size:
        raise ValueError(f"{what}={size} is not divisible by world_size={world_size}: dim={dim} "
                         f"splits it into equal shards")
    part = size // world_size
    return rank * part, (rank + 1) * part


def shard_bounds(n: int, k: int, rank: int, world_size: int, dim: int) -> Tuple[int, int]:
    """shard_range of an (N, K) layer's split dimension, checked against the kernels' shape
    rules for the shard (what shard_quantized cuts, from the shape alone)."""
    start, stop = shard_range(n if dim == 0 else k, rank, world_size, dim)
    n_s, k_s = (stop - start, k) if dim == 0 else (n, stop - start)
    err = check_shape(k_s, n_s)
    if err:
        raise ValueError(f"shard {rank} of {world_size} along dim={dim} of a (N={n}, K={k}) weight "
                         f"has (N={n_s}, K={k_s}), which breaks the shape rule: {err}")
    return start, stop


def shard_quantized(qw: Weight, rank: int, world_size: int, dim: int) -> Weight:
    """Rank `rank`'s shard of a canonical weight (QuantizedWeight or QQQWeight), ready for
    from_quantized: dim=0 keeps output features, dim=1 input features (see the module doc).

    Raises ValueError when the shard would break the kernels' shape rules (K a multiple of
    16, N a multiple of 8), cut a group (dim=1 of a grouped weight without g_idx: K / world
    must be a multiple of group_size), or the split is uneven."""
    if not isinstance(qw, (QuantizedWeight, QQQWeight)):
        raise TypeError(f"qw must be a QuantizedWeight or a QQQWeight, got {type(qw).__name__}")
    start, stop = shard_bounds(*qw.qweight.shape, rank, world_size, dim)
    return slice_weight(qw, dim, start, stop)


def shard_bias(bias: Optional[torch.Tensor], rank: int, world_size: int, dim: int) -> Optional[torch.Tensor]:
    """The bias a shard keeps: its slice (dim=0), or all of it on rank 0 and none elsewhere (dim=1)."""
    if dim == 0 and bias is not None:
        start, stop = shard_range(bias.shape[0], rank, world_size, dim)
        return bias.detach()[start:stop].clone()
    shard_range(world_size, rank, world_size, dim)  # validates the arguments
    return None if bias is None or rank != 0 else bias.detach().clone()
