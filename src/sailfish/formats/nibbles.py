"""Eight 4-bit codes per int32 word, the packing every Sailfish format uses at the bit level:
code j of a group of 8 sits in bits 4j .. 4j+3 (the lowest nibble first). Formats differ
only in which channels form a word (formats/int4.py, qqq.py, gptq.py, awq.py,
compressed_tensors.py)."""
from __future__ import annotations

import torch


def _shifts(device) -> torch.Tensor:
    return torch.arange(0, 32, 4, dtype=torch.int64, device=device)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Integer (..., 8) codes in [0, 15] -> int32 (...) words, code j in bits 4j .. 4j+3."""
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] != 8:
        raise ValueError(f"codes must have a last dimension of 8, got shape {tuple(codes.shape)}")
    words = (codes.to(torch.int64) << _shifts(codes.device)).sum(dim=-1)  # disjoint bit fields
    # words lie in [0, 2**32): the upper half wraps to the negative int32 with the same bits
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 (...) words -> uint8 (..., 8) codes: the exact inverse of pack_nibbles."""
    if words.dtype != torch.int32:
        raise TypeError(f"words must be int32, got {words.dtype}")
    return ((words.to(torch.int64).unsqueeze(-1) >> _shifts(words.device)) & 0xF).to(torch.uint8)


def unpack_along(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 (R, C) words -> uint8 codes, 8 per word, expanded along `dim` (low nibble
    first): dim 0 gives (8R, C), row 8r + j being nibble j of row r; dim 1 gives (R, 8C)."""
    q = unpack_nibbles(words)  # (R, C, 8)
    if dim == 0:  # (R, C, 8) -> (R, 8, C) -> (8R, C)
        return q.permute(0, 2, 1).reshape(words.shape[0] * 8, words.shape[1])
    return q.reshape(words.shape[0], words.shape[1] * 8)


def pack_along(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `unpack_along`: (R, C) codes in [0, 15] -> int32 words, 8 codes of `dim` each."""
    if dim == 0:
        codes = codes.reshape(codes.shape[0] // 8, 8, codes.shape[1]).permute(0, 2, 1)
    else:
        codes = codes.reshape(codes.shape[0], codes.shape[1] // 8, 8)
    return pack_nibbles(codes).contiguous()
