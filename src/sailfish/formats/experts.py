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

Act-order (GPTQ desc_act): as the dense PackedW4, each expert's K channels are sorted by group
(a stable sort of its g_idx), so that its groups are `group_size` consecutive channels again
and the scales keep the layout above; the kernel then reads x through the expert's
permutation, x[:, perm[e]]:

    perm:    int32 (E, K), or None (no expert has act-order); an expert without act-order has
             the identity. The gate and up rows of a gate_up expert share one permutation
             (their input is the same x; GPTQ gives them one g_idx, from one Hessian).

Only a g_idx whose sorted values are k // group_size (GPTQ desc_act's) can be stacked; a
general one (the dense layer's `sorted_g_idx`) is refused with a ValueError.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

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
    perm: Optional[torch.Tensor] = None  # int32 (E, K): act-order (module docstring)

    def __post_init__(self) -> None:
        if self.perm is not None:
            check_perms("perm", self.perm, self.num_experts, self.in_features, values=False)

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
        """Expert e's weight as a PackedW4 (views, no copy; an identity permutation as none)."""
        z = None if self.zeros is None else self.zeros[e]
        perm = None if self.perm is None or _is_identity(self.perm[e]) else self.perm[e]
        return PackedW4(self.qweight[e], self.scales[e], z, perm, None, self.in_features, self.group_size)

    def unstack(self) -> List[QuantizedWeight]:
        """Exact inverse of `stack`: the experts' QuantizedWeights."""
        return [unpack(self.expert(e)) for e in range(self.num_experts)]

    def dequantize(self, rounded: bool = True) -> torch.Tensor:
        """float32 (E, N, K): every expert's effective weight (QuantizedWeight.dequantize: what
        the kernels multiply; rounded=False: s * (q - z) exactly, a SCALE_ACC kernel's weight)."""
        return torch.stack([qw.dequantize(rounded) for qw in self.unstack()])


def _is_identity(perm: torch.Tensor) -> bool:
    return torch.equal(perm, torch.arange(perm.shape[-1], dtype=perm.dtype, device=perm.device))


def check_perms(name: str, perm, num_experts: int, k: int, values: bool = True) -> None:
    """ValueError unless `perm` is an int32 (num_experts, k) contiguous tensor whose every row is
    a permutation of 0 .. k - 1 (values=False: the shape, dtype and layout only, which need no
    look at the data: the kernel reads x at these indices without bounds checks)."""
    if not isinstance(perm, torch.Tensor) or perm.dtype != torch.int32 or tuple(perm.shape) != (num_experts, k):
        got = f"{perm.dtype} {tuple(perm.shape)}" if isinstance(perm, torch.Tensor) else type(perm).__name__
        raise ValueError(f"{name} must be an int32 (E={num_experts}, K={k}) tensor (each expert's permutation "
                         f"of its input channels) or None, got {got}")
    if not perm.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if values and perm.device.type != "meta" and perm.numel():
        rows = perm.sort(dim=1).values != torch.arange(k, dtype=perm.dtype, device=perm.device)
        if bool(rows.any()):
            e = int(rows.any(dim=1).nonzero()[0, 0])
            raise ValueError(f"{name}[{e}] is not a permutation of 0 .. {k - 1}; allowed: each input channel "
                             "exactly once per expert")


def _expert_perm(packed: Sequence[PackedW4], what: str) -> Optional[torch.Tensor]:
    """The one permutation (None: the identity) of PackedW4s packed from one expert's weights
    (a gate_up expert's gate and up), which must share it; ValueError for a general g_idx."""
    for p in packed:
        if p.sorted_g_idx is not None:
            raise ValueError(f"{what} has a g_idx whose sorted values are not k // group_size (a general "
                             "g_idx); allowed for experts: no g_idx, k // group_size, or a permutation of "
                             "it (GPTQ desc_act)")
    first = packed[0].perm
    for p in packed[1:]:
        if (p.perm is None) != (first is None) or (first is not None and not torch.equal(p.perm, first)):
            raise ValueError(f"{what}: the projections of one expert that share an input (gate and up) have "
                             "different g_idx; allowed: one g_idx for both (one permutation of x)")
    return first


def padded_k_experts(in_features: int) -> int:
    """K of the stacked layout: in_features rounded up to a whole K_CHUNK."""
    return -(-in_features // K_CHUNK) * K_CHUNK


def _stacked_groups(in_features: int, group_size: int) -> int:
    """Gp, the scale columns of the stacked layout. (An act-order weight may carry scale rows
    past it, QuantizedWeight; with a g_idx that sorts to k // group_size nothing reads them.)"""
    return 1 if group_size == -1 else -(-padded_k_experts(in_features) // group_size)


def stack(weights: Sequence[QuantizedWeight]) -> PackedExperts:
    """Stack E experts' QuantizedWeights (one shape, group size, dtype and symmetry; a g_idx
    only if it sorts to k // group_size: module docstring) into the kernel layout; exactly
    inverted by PackedExperts.unstack() (but for scale rows that no channel reads)."""
    if isinstance(weights, QuantizedWeight) or not len(weights):
        raise ValueError(f"weights must be a non-empty sequence of QuantizedWeight (one per expert), got "
                         f"{type(weights).__name__ if isinstance(weights, QuantizedWeight) else 'an empty one'}")
    first = weights[0]
    for e, qw in enumerate(weights):
        if not isinstance(qw, QuantizedWeight):
            raise TypeError(f"weights[{e}] must be a QuantizedWeight, got {type(qw).__name__}")
        for what, a, b in (("shape (N, K)", tuple(qw.qweight.shape), tuple(first.qweight.shape)),
                           ("group_size", qw.group_size, first.group_size), ("dtype", qw.dtype, first.dtype),
                           ("sym", qw.sym, first.sym)):
            if a != b:
                raise ValueError(f"weights[{e}] has {what} {a}, weights[0] {b}; allowed: one format for "
                                 "all experts")
    packed = [pack(qw, k_multiple=K_CHUNK) for qw in weights]
    perms = [_expert_perm([p], f"weights[{e}]") for e, p in enumerate(packed)]
    perm = None
    if any(p is not None for p in perms):  # act-order: the others get the identity
        arange = torch.arange(first.in_features, dtype=torch.int32, device=first.qweight.device)
        perm = torch.stack([arange if p is None else p for p in perms])
    gp = _stacked_groups(first.in_features, first.group_size)
    zeros = None if first.sym else torch.stack([p.zeros[:, :gp] for p in packed])
    return PackedExperts(torch.stack([p.qweight for p in packed]), torch.stack([p.scales[:, :gp] for p in packed]),
                         zeros, first.in_features, first.group_size, perm)


def pack_into(stacked: PackedExperts, e: int, parts: Sequence[Tuple[int, QuantizedWeight]]) -> None:
    """Pack one expert's weights into its rows of a preallocated stack (checkpoint loading: one
    expert at a time, no second copy of the stack): parts (row, (N', K) weight) fill rows
    [row, row + N') of expert e, all of one input (a transformers gate_up expert: its gate at
    row 0 and its up at row I), so they must share their act-order permutation, which goes to
    stacked.perm[e] (a stack without perm takes only weights without act-order). A symmetric
    weight in a stack with zero points gets zero point 8 on its groups (0 on groups that only
    cover K padding), exactly what packing it with explicit zero points 8 gives."""
    gp = stacked.scales.shape[-1]
    packed = []
    for row, qw in parts:
        if qw.in_features != stacked.in_features or qw.group_size != stacked.group_size or qw.dtype != stacked.dtype:
            raise ValueError(f"weight (K={qw.in_features}, group_size={qw.group_size}, {qw.dtype}) does not fit the "
                             f"stack (K={stacked.in_features}, group_size={stacked.group_size}, {stacked.dtype})")
        if qw.zeros is not None and stacked.zeros is None:
            raise ValueError("an asymmetric weight (zero points) cannot go into a symmetric stack")
        packed.append(pack(qw, k_multiple=K_CHUNK))
    perm = _expert_perm(packed, f"expert {e}")
    if stacked.perm is not None:
        stacked.perm[e] = torch.arange(stacked.in_features, dtype=torch.int32, device=stacked.perm.device) \
            if perm is None else perm
    elif perm is not None:
        raise ValueError("an act-order weight (a g_idx other than k // group_size) cannot go into a stack "
                         "without permutations (perm None)")
    for (row, qw), p in zip(parts, packed):
        rows = slice(row, row + qw.out_features)
        stacked.qweight[e, rows] = p.qweight
        stacked.scales[e, rows] = p.scales[:, :gp]
        if stacked.zeros is not None:
            if p.zeros is None:
                p.zeros = torch.zeros_like(p.scales)
                p.zeros[:, :num_groups(qw.in_features, qw.group_size)] = 8
            stacked.zeros[e, rows] = p.zeros[:, :gp]


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
