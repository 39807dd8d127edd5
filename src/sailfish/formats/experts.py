"""Stacked 4-bit experts: the weights of E experts in one tensor each, for the grouped MoE
kernels (kernels/moe.py). Pure PyTorch, exact.

Expert e's (N, K) weight is a formats.int4.QuantizedWeight laid out exactly as PackedW4
(fragment order, so kernels/w4a16's in-register dequantization applies unchanged), and the
E layouts are stacked along a leading expert dimension:

    qweight: int32 (E, N, Kp // 8), Kp = K rounded up to a whole K_CHUNK (128 channels) only:
             the grouped kernel's K tiles are one or two chunks and it masks x past K, so the
             dense layout's padding to 256 would only waste bytes (a 1408-wide DeepSeek-V2-Lite
             expert: 9%; here 0)
    scales:  (E, N, Gp) float16/bfloat16, Gp = ceil(Kp / group_size) (1 per channel); groups
             that only cover K padding have scale 0, padded channels code 0
    zeros:   (E, N, Gp) in the scale dtype (integers 0..16), or None (symmetric: 8)

A transformers `gate_up_proj` (E, 2I, H) is stacked as it is: gate rows [0, I), up rows
[I, 2I) of every expert; the kernel reads the matching gate and up rows of a tile itself.
Act-order (a g_idx) is not supported for experts yet: refused with a ValueError.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from .int4 import (K_CHUNK, HALF_DTYPES, PackedW4, QuantizedWeight, check_flag, num_groups, pack, quantize,
                   unpack)


@dataclass
class PackedExperts:
    """E experts' 4-bit (N, K) weights in the stacked kernel layout (module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    in_features: int
    group_size: int

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def sym(self) -> bool:
        return self.zeros is None

    def expert(self, e: int) -> PackedW4:
        """Expert e's weight as a PackedW4 (views, no copy)."""
        z = None if self.zeros is None else self.zeros[e]
        return PackedW4(self.qweight[e], self.scales[e], z, None, None, self.in_features, self.group_size)

    def unstack(self) -> List[QuantizedWeight]:
        """Exact inverse of `stack`: the experts' QuantizedWeights."""
        return [unpack(self.expert(e)) for e in range(self.num_experts)]

    def dequantize(self) -> torch.Tensor:
        """float32 (E, N, K): every expert's effective weight (QuantizedWeight.dequantize: what
        the kernels multiply)."""
        return torch.stack([qw.dequantize() for qw in self.unstack()])


def padded_k_experts(in_features: int) -> int:
    """K of the stacked layout: in_features rounded up to a whole K_CHUNK."""
    return -(-in_features // K_CHUNK) * K_CHUNK


def stack(weights: Sequence[QuantizedWeight]) -> PackedExperts:
    """Stack E experts' QuantizedWeights (one shape, group size, dtype and symmetry; no g_idx)
    into the kernel layout; exactly inverted by PackedExperts.unstack()."""
    if isinstance(weights, QuantizedWeight) or not len(weights):
        raise ValueError(f"weights must be a non-empty sequence of QuantizedWeight (one per expert), got "
                         f"{type(weights).__name__ if isinstance(weights, QuantizedWeight) else 'an empty one'}")
    first = weights[0]
    for e, qw in enumerate(weights):
        if not isinstance(qw, QuantizedWeight):
            raise TypeError(f"weights[{e}] must be a QuantizedWeight, got {type(qw).__name__}")
        if qw.g_idx is not None:
            raise ValueError(f"weights[{e}] has a g_idx (act-order); allowed for experts: none (act-order "
                             "experts are not supported yet)")
        for what, a, b in (("shape (N, K)", tuple(qw.qweight.shape), tuple(first.qweight.shape)),
                           ("group_size", qw.group_size, first.group_size), ("dtype", qw.dtype, first.dtype),
                           ("sym", qw.sym, first.sym)):
            if a != b:
                raise ValueError(f"weights[{e}] has {what} {a}, weights[0] {b}; allowed: one format for "
                                 "all experts")
    packed = [pack(qw, k_multiple=K_CHUNK) for qw in weights]
    zeros = None if first.sym else torch.stack([p.zeros for p in packed])
    return PackedExperts(torch.stack([p.qweight for p in packed]), torch.stack([p.scales for p in packed]),
                         zeros, first.in_features, first.group_size)


def pack_into(stacked: PackedExperts, e: int, row: int, qw: QuantizedWeight) -> None:
    """Pack one expert's (N', K) weight (no g_idx) into rows [row, row + N') of expert e of a
    preallocated stack (checkpoint loading: one expert at a time, no second copy of the stack;
    a transformers gate_up expert is its gate at row 0 and its up at row I). A symmetric
    weight in a stack with zero points gets zero point 8 on its groups (0 on groups that only
    cover K padding), exactly what packing it with explicit zero points 8 gives."""
    if qw.g_idx is not None:
        raise ValueError("an act-order weight (g_idx) cannot be stacked; allowed for experts: no g_idx")
    if qw.in_features != stacked.in_features or qw.group_size != stacked.group_size or qw.dtype != stacked.dtype:
        raise ValueError(f"weight (K={qw.in_features}, group_size={qw.group_size}, {qw.dtype}) does not fit the "
                         f"stack (K={stacked.in_features}, group_size={stacked.group_size}, {stacked.dtype})")
    if qw.zeros is not None and stacked.zeros is None:
        raise ValueError("an asymmetric weight (zero points) cannot go into a symmetric stack")
    p = pack(qw, k_multiple=K_CHUNK)
    rows = slice(row, row + qw.out_features)
    stacked.qweight[e, rows] = p.qweight
    stacked.scales[e, rows] = p.scales
    if stacked.zeros is not None:
        if p.zeros is None:
            p.zeros = torch.zeros_like(p.scales)
            p.zeros[:, :num_groups(qw.in_features, qw.group_size)] = 8
        stacked.zeros[e, rows] = p.zeros


def quantize_experts(weight: torch.Tensor, group_size: int = 128, sym: bool = True,
                     dtype: Optional[torch.dtype] = None) -> PackedExperts:
    """Round-to-nearest 4-bit quantization of E experts' weights, float (E, N, K): each expert
    exactly as formats.int4.quantize quantizes a (N, K) weight (same grid, same checks; a
    ValueError names the expert), then `stack`."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 3-D (experts, out_features, in_features) tensor, got {got}")
    check_flag("sym", sym)
    if dtype is None:
        dtype = weight.dtype if weight.dtype in HALF_DTYPES else torch.float16
    out = []
    for e in range(weight.shape[0]):
        try:
            out.append(quantize(weight[e], group_size=group_size, sym=sym, dtype=dtype))
        except ValueError as err:
            raise ValueError(f"expert {e}: {err}") from err
    return stack(out)
