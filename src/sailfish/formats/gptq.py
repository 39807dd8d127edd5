"""GPTQ checkpoint formats (checkpoint_format "gptq" = v1, as AutoGPTQ / GPTQModel write it
and transformers / vLLM load it, and "gptq_v2", GPTQModel's), converted exactly to and from
`QuantizedWeight`.

    qweight int32 (K / 8, N): input channel k is the nibble at bits 4 * (k % 8) of row k // 8
    qzeros  int32 (G, N / 8): output channel n is the nibble at bits 4 * (n % 8) of the word
                              Z of column n // 8, Z being
                                v2: the word of the zero points, stored as they are
                                v1: the stored word + 0x11111111 (mod 2**32)
    scales  fp16  (G, N)
    g_idx   int32 (K,)       (absent: k // group_size)

    W[n, k] = scales[g, n] * (q[k, n] - zero[g, n]),  g = g_idx[k]

v1 stores the word of the zero points minus 0x11111111 and is read back by adding that
constant to the whole word, as GPTQModel does: a zero point of 0 borrows from the next
nibble, and reading each nibble + 1 instead (AutoGPTQ's and vLLM's kernels) gives that
layer a zero point of 16 and its neighbour one too small. Both readings agree on every word
whose zero points are all >= 1, so to_gptq writes v1 only for those (gptq_v2 otherwise).
Symmetric GPTQ checkpoints store zero 8 everywhere (v1 words 0x77777777); they import as
symmetric weights.
"""
from __future__ import annotations

from typing import Optional

import torch

from .int4 import QuantizedWeight, _check_bits, _check_group_size, default_g_idx, num_groups
from .nibbles import pack_along, unpack_along

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
_V1_OFFSET = 0x11111111  # v1 stores the zero-point word minus one in every nibble


def _check_format(checkpoint_format) -> None:
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format={checkpoint_format!r} is not supported; allowed: "
                         f"{CHECKPOINT_FORMATS}")


def _add_words(words: torch.Tensor, delta: int) -> torch.Tensor:
    """int32 words + delta modulo 2**32 (carries and borrows cross nibbles), as int32."""
    w = (words.to(torch.int64) + delta) & 0xFFFFFFFF
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def check_scales(scales: torch.Tensor, name: str = "scales") -> None:
    """Checkpoint scales must be finite and > 0: GPTQ, AWQ and compressed-tensors quantizers
    never write anything else, so a NaN or negative scale is a corrupt file, never a weight."""
    bad = ~(scales.isfinite() & (scales > 0))
    if bool(bad.any()):
        i, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} must be finite and > 0; {int(bad.sum())} of {scales.numel()} are not "
                         f"(first: {name}[{i}, {j}] = {scales[i, j].item()!r})")


def check_packed(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int,
                 group_size: int, packed_dim: int, act_order: bool = False):
    """Check a checkpoint's int32 qweight / qzeros and fp16 / bf16 scales (G, N); return (K, N).
    qweight packs 8 codes per word along `packed_dim` (GPTQ: 0, K; AWQ: 1, N); qzeros (G, N/8).
    act_order (a g_idx picks each channel's row): more rows than ceil(K / group_size) are
    allowed, as a tensor-parallel K slice of an act-order weight keeps every group it touches."""
    _check_bits(bits)
    _check_group_size(group_size)
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise TypeError(f"{name} must be a 2-D torch.int32 tensor, got {t.dtype} {tuple(t.shape)}")
    if scales.dim() != 2 or scales.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"scales must be a 2-D float16 tensor, got {scales.dtype} {tuple(scales.shape)}")
    check_scales(scales)
    rows, cols = qweight.shape
    k, n = (rows * 8, cols) if packed_dim == 0 else (rows, cols * 8)
    g = scales.shape[0]
    if scales.shape[1] != n:
        raise ValueError(f"scales has {scales.shape[1]} columns but qweight has N={n}")
    # scales before qzeros: G is read from scales, so a wrong G must blame scales
    if g != num_groups(k, group_size) and not (act_order and g > num_groups(k, group_size)):
        raise ValueError(f"scales has {g} groups but K={k} with group_size={group_size} needs "
                         f"ceil(K / group_size) = {num_groups(k, group_size)}")
    if qzeros.shape != (g, n // 8) or n % 8:
        raise ValueError(f"qzeros must have shape (G={g}, N/8={n // 8}), got {tuple(qzeros.shape)}")
    return k, n


def check_zeros_fit(zeros: torch.Tensor, fmt: str) -> None:
    """Checkpoint formats store zero points in one nibble: 16 (a QuantizedWeight allows it) cannot."""
    if bool((zeros > 15).any()):
        raise ValueError(f"a zero point of 16 cannot be stored in {fmt} format (zero points are one "
                         f"nibble: allowed 0..15)")


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: Optional[torch.Tensor] = None, *, bits: int = 4, group_size: int = 128,
              checkpoint_format: str = "gptq") -> QuantizedWeight:
    """Read GPTQ tensors (see module docstring; checkpoint_format "gptq" = v1 or "gptq_v2")
    into a QuantizedWeight, exactly."""
    _check_format(checkpoint_format)
    k, n = check_packed(qweight, qzeros, scales, bits, group_size, packed_dim=0, act_order=g_idx is not None)
    if g_idx is not None:
        if g_idx.shape != (k,):
            raise ValueError(f"g_idx must have shape (K={k},), got {tuple(g_idx.shape)}")
        g_idx = g_idx.to(torch.int32)
        if scales.shape[0] == num_groups(k, group_size) and torch.equal(g_idx, default_g_idx(k, group_size, g_idx.device)):
            g_idx = None  # plain k // group_size order: no act-order
    q = unpack_along(qweight, dim=0).T.contiguous()  # (N, K)
    if checkpoint_format == "gptq":
        qzeros = _add_words(qzeros, _V1_OFFSET)
    zeros = unpack_along(qzeros, dim=1)  # (G, N)
    if bool((zeros == 8).all()):
        zeros = None  # symmetric checkpoint
    return QuantizedWeight(q, scales.contiguous(), zeros, g_idx, group_size)


def to_gptq(qw: QuantizedWeight, checkpoint_format: str = "gptq") -> dict:
    """Write a QuantizedWeight as GPTQ tensors: {qweight, qzeros, scales, g_idx}.

    Zero points must lie in [0, 15] (one nibble); "gptq" (v1) also needs them >= 1, so that
    every reader of v1 (whole-word or per-nibble) gets them back: use "gptq_v2" otherwise.
    """
    if not isinstance(qw, QuantizedWeight):  # a layer, or a W4A8 QQQWeight (no GPTQ form)
        raise TypeError(f"to_gptq takes a W4A16 QuantizedWeight (e.g. QuantLinear.quantized_weight()), "
                        f"got {type(qw).__name__}")
    _check_format(checkpoint_format)
    n, k = qw.qweight.shape
    if k % 8 or n % 8:
        raise ValueError(f"GPTQ needs K and N multiples of 8, got K={k}, N={n}")
    if qw.scales.shape[0] != num_groups(k, qw.group_size):
        raise ValueError(f"GPTQ stores ceil(K / group_size) = {num_groups(k, qw.group_size)} scale rows; this "
                         f"weight has {qw.scales.shape[0]} (a tensor-parallel slice of an act-order weight?)")
    check_scales(qw.scales)
    zeros = torch.full_like(qw.scales, 8, dtype=torch.uint8) if qw.zeros is None else qw.zeros
    check_zeros_fit(zeros, "GPTQ")
    if checkpoint_format == "gptq" and bool((zeros == 0).any()):
        raise ValueError('a zero point of 0 cannot be stored in checkpoint_format "gptq" (v1 stores '
                         'zero - 1, which per-nibble readers misread); allowed: "gptq_v2"')
    qzeros = pack_along(zeros, dim=1)
    return {
        "qweight": pack_along(qw.qweight.T.contiguous(), dim=0),
        "qzeros": _add_words(qzeros, -_V1_OFFSET) if checkpoint_format == "gptq" else qzeros,
        "scales": qw.scales.contiguous(),
        "g_idx": qw.group_index().to(torch.int32),
    }
