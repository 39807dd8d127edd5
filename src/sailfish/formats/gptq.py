"""GPTQ checkpoint format (checkpoint_format "gptq", as AutoGPTQ / GPTQModel write it
and transformers loads it), converted exactly to and from `QuantizedWeight`.

    qweight int32 (K / 8, N): input channel k is the nibble at bits 4 * (k % 8) of row k // 8
    qzeros  int32 (G, N / 8): output channel n is the nibble at bits 4 * (n % 8) of column
                              n // 8, stored as zero - 1 (a stored 15 means zero 16)
    scales  fp16  (G, N)
    g_idx   int32 (K,)       (absent: k // group_size)

    W[n, k] = scales[g, n] * (q[k, n] - (stored_zero[g, n] + 1)),  g = g_idx[k]

Symmetric GPTQ checkpoints store 7 for every zero; they import as symmetric weights.
"""
from __future__ import annotations

from typing import Optional

import torch

from .int4 import QuantizedWeight, _check_bits, _check_group_size, default_g_idx, num_groups
from .nibbles import pack_nibbles, unpack_nibbles

def _unpack_nibbles(t: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 tensor -> uint8 nibbles, 8 per word, expanded along `dim` (low nibble first)."""
    q = unpack_nibbles(t)  # (R, C, 8)
    if dim == 0:  # (R, C, 8) -> (R, 8, C) -> (8R, C)
        return q.permute(0, 2, 1).reshape(t.shape[0] * 8, t.shape[1])
    return q.reshape(t.shape[0], t.shape[1] * 8)  # (R, C, 8) -> (R, 8C)


def _pack_nibbles(q: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `_unpack_nibbles`: codes in [0, 15] -> int32 words."""
    if dim == 0:
        q = q.reshape(q.shape[0] // 8, 8, q.shape[1]).permute(0, 2, 1)
    else:
        q = q.reshape(q.shape[0], q.shape[1] // 8, 8)
    return pack_nibbles(q).contiguous()


def check_packed(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int,
                 group_size: int, packed_dim: int):
    """Check a checkpoint's int32 qweight / qzeros and fp16 / bf16 scales (G, N); return (K, N).
    qweight packs 8 codes per word along `packed_dim` (GPTQ: 0, K; AWQ: 1, N); qzeros (G, N/8)."""
    _check_bits(bits)
    _check_group_size(group_size)
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise TypeError(f"{name} must be a 2-D torch.int32 tensor, got {t.dtype} {tuple(t.shape)}")
    if scales.dim() != 2 or scales.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"scales must be a 2-D float16 tensor, got {scales.dtype} {tuple(scales.shape)}")
    rows, cols = qweight.shape
    k, n = (rows * 8, cols) if packed_dim == 0 else (rows, cols * 8)
    g = scales.shape[0]
    if scales.shape[1] != n:
        raise ValueError(f"scales has {scales.shape[1]} columns but qweight has N={n}")
    # scales before qzeros: G is read from scales, so a wrong G must blame scales
    if g != num_groups(k, group_size):
        raise ValueError(f"scales has {g} groups but K={k} with group_size={group_size} needs "
                         f"ceil(K / group_size) = {num_groups(k, group_size)}")
    if qzeros.shape != (g, n // 8) or n % 8:
        raise ValueError(f"qzeros must have shape (G={g}, N/8={n // 8}), got {tuple(qzeros.shape)}")
    return k, n


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: Optional[torch.Tensor] = None, *, bits: int = 4,
              group_size: int = 128) -> QuantizedWeight:
    """Read GPTQ tensors (see module docstring) into a QuantizedWeight, exactly."""
    k, n = check_packed(qweight, qzeros, scales, bits, group_size, packed_dim=0)
    if g_idx is not None:
        if g_idx.shape != (k,):
            raise ValueError(f"g_idx must have shape (K={k},), got {tuple(g_idx.shape)}")
        g_idx = g_idx.to(torch.int32)
        if torch.equal(g_idx, default_g_idx(k, group_size, g_idx.device)):
            g_idx = None  # plain k // group_size order: no act-order
    q = _unpack_nibbles(qweight, dim=0).T.contiguous()  # (N, K)
    zeros = (_unpack_nibbles(qzeros, dim=1) + 1).to(torch.uint8)  # stored zero - 1; (G, N)
    if bool((zeros == 8).all()):
        zeros = None  # symmetric checkpoint
    return QuantizedWeight(q, scales.contiguous(), zeros, g_idx, group_size)


def to_gptq(qw: QuantizedWeight) -> dict:
    """Write a QuantizedWeight as GPTQ tensors: {qweight, qzeros, scales, g_idx}.

    Zero points must lie in [1, 16] to be representable (GPTQ stores zero - 1 in a
    nibble); a zero point of 0 raises ValueError.
    """
    if not isinstance(qw, QuantizedWeight):  # a layer, or a W4A8 QQQWeight (no GPTQ form)
        raise TypeError(f"to_gptq takes a W4A16 QuantizedWeight (e.g. QuantLinear.quantized_weight()), "
                        f"got {type(qw).__name__}")
    n, k = qw.qweight.shape
    if k % 8 or n % 8:
        raise ValueError(f"GPTQ needs K and N multiples of 8, got K={k}, N={n}")
    if qw.scales.shape[0] != num_groups(k, qw.group_size):
        raise ValueError(f"GPTQ stores ceil(K / group_size) = {num_groups(k, qw.group_size)} scale rows; this "
                         f"weight has {qw.scales.shape[0]} (a tensor-parallel slice of an act-order weight?)")
    zeros = torch.full_like(qw.scales, 8, dtype=torch.uint8) if qw.zeros is None else qw.zeros
    if bool((zeros == 0).any()):
        raise ValueError("a zero point of 0 cannot be stored in GPTQ format (it stores zero - 1)")
    return {
        "qweight": _pack_nibbles(qw.qweight.T.contiguous(), dim=0),
        "qzeros": _pack_nibbles((zeros.to(torch.int64) - 1), dim=1),
        "scales": qw.scales.contiguous(),
        "g_idx": qw.group_index().to(torch.int32),
    }
