"""AWQ checkpoint format (AutoAWQ "gemm" version, as AutoAWQ / GPTQModel write it and
transformers / vLLM load it), converted exactly to and from a `QuantizedWeight`.

    qweight int32 (K, N / 8): row k holds input channel k; word c of the row holds the
                              eight output channels 8c .. 8c + 7 in AWQ's interleaved
                              order: the nibble at bits 4 * i holds channel 8c + AWQ_ORDER[i]
    qzeros  int32 (G, N / 8): the zero points, packed along N in the same order, stored as
                              they are (no offset, unlike GPTQ's zero - 1), in [0, 15]
    scales  fp16  (G, N)

    W[n, k] = scales[g, n] * (q[k, n] - zero[g, n]),  g = k // group_size

Reading nibble i back into channel 8c + AWQ_ORDER[i] is the inverse of AutoAWQ's packer
(WQLinear_GEMM.from_linear ORs channel 8c + order_map[i] into bits 4 * i of word c) and
matches the reverse order (0, 4, 1, 5, 2, 6, 3, 7) its unpackers apply to low-nibble-first
words. AWQ has no act-order (no g_idx). GPTQModel's symmetric AWQ (quantization_config zero_point
false) stores qzeros all 8. Sailfish's effective weight is s * (q - z) rounded
once to the scale dtype; AWQ's own CUDA kernel computes q * s - z * s in fp16 and can differ
from it by one fp16 rounding.
"""
from __future__ import annotations

import torch

from .gptq import check_packed, check_scales, check_zeros_fit
from .int4 import QuantizedWeight
from .nibbles import pack_nibbles, unpack_along

# Nibble i (bits 4 * i) of a word holds output channel 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 (R, C) -> uint8 (R, 8C), column 8c + j being output channel 8c + j."""
    nibbles = unpack_along(words, dim=1).reshape(words.shape[0], words.shape[1], 8)
    cols = torch.empty_like(nibbles)
    cols[..., list(AWQ_ORDER)] = nibbles  # channel AWQ_ORDER[i] <- nibble i
    return cols.reshape(words.shape[0], words.shape[1] * 8)


def _pack_awq(cols: torch.Tensor) -> torch.Tensor:
    """Inverse of `_unpack_awq`: (R, 8C) codes -> int32 (R, C)."""
    nibbles = cols.reshape(cols.shape[0], -1, 8)[..., list(AWQ_ORDER)]  # nibble i <- channel AWQ_ORDER[i]
    return pack_nibbles(nibbles).contiguous()


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, bits: int = 4,
             group_size: int = 128, zero_point: bool = True) -> QuantizedWeight:
    """Read AWQ GEMM tensors (see module docstring) into a QuantizedWeight, exactly.

    A layer whose zero points are all 8 imports as a symmetric weight (same values).
    zero_point=False (symmetric AWQ) requires exactly that."""
    check_packed(qweight, qzeros, scales, bits, group_size, packed_dim=1)
    q = _unpack_awq(qweight).T.contiguous()  # (N, K)
    zeros = _unpack_awq(qzeros)  # (G, N), stored as is
    if bool((zeros == 8).all()):
        zeros = None
    elif not zero_point:
        raise ValueError(f"zero_point=False (symmetric AWQ) needs every qzeros nibble to be 8; "
                         f"{int((zeros != 8).sum())} of {zeros.numel()} are not")
    return QuantizedWeight(q, scales.contiguous(), zeros, None, group_size)


def to_awq(qw: QuantizedWeight) -> dict:
    """Write a QuantizedWeight as AWQ GEMM tensors: {qweight, qzeros, scales} (the inverse
    of from_awq). AWQ has no g_idx, and its loaders need K to be a whole number of groups."""
    n, k = qw.qweight.shape
    if qw.g_idx is not None:
        raise ValueError("an act-order weight (g_idx) cannot be stored in AWQ format (no g_idx); "
                         'allowed: format "gptq"')
    if qw.group_size != -1 and k % qw.group_size:
        raise ValueError(f"AWQ needs in_features to be a multiple of group_size; got K={k}, "
                         f"group_size={qw.group_size}")
    if n % 8:
        raise ValueError(f"AWQ needs N a multiple of 8, got N={n}")
    check_scales(qw.scales)
    zeros = torch.full_like(qw.scales, 8, dtype=torch.uint8) if qw.zeros is None else qw.zeros
    check_zeros_fit(zeros, "AWQ")
    return {"qweight": _pack_awq(qw.qweight.T.contiguous()), "qzeros": _pack_awq(zeros),
            "scales": qw.scales.contiguous()}
