"""compressed-tensors "pack-quantized" W4A16 (llm-compressor's int4 weight format, loaded by
vLLM and transformers), converted exactly to and from `QuantizedWeight`.

    weight_packed     int32 (N, K / 8): input channel k of output row n is the nibble at
                      bits 4 * (k % 8) of word k // 8, holding q + 8 for the signed code
                      q in [-8, 7]
    weight_scale      fp16 / bf16 (N, G): G = ceil(K / group_size), 1 for strategy "channel"
    weight_zero_point int32 (N / 8, G), asymmetric only: output channel n is the nibble at
                      bits 4 * (n % 8) of row n // 8, holding zp + 8 for the signed zero
                      point zp in [-8, 7]
    weight_shape      int (2,) = (N, K)
    weight_g_idx      int32 (K,), actorder "group" only (absent: k // group_size)

    W[n, k] = weight_scale[n, g] * (q[n, k] - zp[n, g]),  g = g_idx[k]

The +8 offsets of codes and zero points cancel, so the stored nibbles are exactly the
codes and zero points of a QuantizedWeight (symmetric: zero point 8); compressed-tensors
dequantizes (q - zp) * scale in the scale dtype, the effective weight Sailfish computes.
"""
from __future__ import annotations

from typing import Optional

import torch

from .gptq import check_scales, check_zeros_fit
from .int4 import QuantizedWeight, default_g_idx, num_groups
from .nibbles import pack_along, unpack_along


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_shape: torch.Tensor,
                            weight_zero_point: Optional[torch.Tensor] = None,
                            weight_g_idx: Optional[torch.Tensor] = None, *, group_size: int = 128) -> QuantizedWeight:
    """Read one layer's pack-quantized tensors (see module docstring) into a
    QuantizedWeight, exactly. group_size: the config's, -1 for strategy "channel"."""
    if weight_shape.shape != (2,) or weight_shape.is_floating_point():
        raise ValueError(f"weight_shape must be 2 integers (N, K), got {weight_shape.dtype} "
                         f"{tuple(weight_shape.shape)}")
    n, k = (int(v) for v in weight_shape)
    if n <= 0 or k <= 0 or n % 8 or k % 8:
        raise ValueError(f"weight_shape=({n}, {k}) is not supported; allowed: N and K positive multiples of 8")
    g = num_groups(k, group_size)
    if weight_g_idx is not None and weight_scale.dim() == 2 and weight_scale.shape[1] > g:
        g = weight_scale.shape[1]  # a g_idx picks each channel's column: a tensor-parallel K slice keeps more
    for name, t, shape in (("weight_packed", weight_packed, (n, k // 8)),
                           ("weight_zero_point", weight_zero_point, (n // 8, g))):
        if t is not None and (t.dtype != torch.int32 or t.shape != shape):
            raise ValueError(f"{name} must be int32 of shape {shape} (weight_shape ({n}, {k})), "
                             f"got {t.dtype} {tuple(t.shape)}")
    if weight_scale.dtype not in (torch.float16, torch.bfloat16) or weight_scale.shape != (n, g):
        raise ValueError(f"weight_scale must be float16 or bfloat16 of shape {(n, g)} (weight_shape ({n}, {k}), "
                         f"group_size {group_size}), got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    check_scales(weight_scale, "weight_scale")
    zeros = None
    if weight_zero_point is not None:
        zeros = unpack_along(weight_zero_point, dim=0).T.contiguous()  # (G, N)
        if bool((zeros == 8).all()):
            zeros = None
    g_idx = None
    if weight_g_idx is not None:
        if weight_g_idx.shape != (k,) or weight_g_idx.is_floating_point():
            raise ValueError(f"weight_g_idx must be {k} integers, got {weight_g_idx.dtype} "
                             f"{tuple(weight_g_idx.shape)}")
        g_idx = weight_g_idx.to(torch.int32)
        if g == num_groups(k, group_size) and torch.equal(g_idx, default_g_idx(k, group_size, g_idx.device)):
            g_idx = None  # k // group_size: no act-order
    q = unpack_along(weight_packed, dim=1)  # (N, K)
    return QuantizedWeight(q, weight_scale.T.contiguous(), zeros, g_idx, group_size)


def to_compressed_tensors(qw: QuantizedWeight, *, symmetric: bool, actorder: bool) -> dict:
    """Write a QuantizedWeight as pack-quantized tensors (the inverse of
    from_compressed_tensors). symmetric / actorder: the config group's ("weights.symmetric",
    actorder "group"), which decide whether weight_zero_point / weight_g_idx are stored: a
    symmetric layer in an asymmetric group stores zero points 8, a layer without act-order in
    an actorder group its k // group_size g_idx."""
    n, k = qw.qweight.shape
    if n % 8 or k % 8:
        raise ValueError(f"compressed-tensors pack-quantized needs N and K multiples of 8, got N={n}, K={k}")
    if qw.scales.shape[0] != num_groups(k, qw.group_size):
        raise ValueError(f"compressed-tensors stores ceil(K / group_size) = {num_groups(k, qw.group_size)} scale "
                         f"columns; this weight has {qw.scales.shape[0]} (a tensor-parallel slice of an act-order "
                         f"weight?)")
    if qw.g_idx is not None and not actorder:
        raise ValueError("an act-order weight (g_idx) needs actorder \"group\"")
    if qw.zeros is not None and symmetric:
        raise ValueError("an asymmetric weight (zero points) needs symmetric false")
    check_scales(qw.scales, "scales")
    out = {"weight_packed": pack_along(qw.qweight, dim=1), "weight_scale": qw.scales.T.contiguous(),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not symmetric:
        zeros = torch.full_like(qw.scales, 8, dtype=torch.uint8) if qw.zeros is None else qw.zeros
        check_zeros_fit(zeros, "compressed-tensors")
        out["weight_zero_point"] = pack_along(zeros.T.contiguous(), dim=0)
    if actorder:
        out["weight_g_idx"] = qw.group_index().to(torch.int32)
    return out
