"""Marlin-format 4-bit weights, read exactly into `QuantizedWeight` (pure PyTorch).

The format (Marlin's `Layer.pack()`, the layers of vLLM's quant_method "marlin" and of
AutoGPTQ's checkpoint_format "marlin"; QQQ stores its W4A8 weights in the same tile order,
formats/qqq.py): a (K, N) matrix of codes q in [0, 15] (signed value q - 8, symmetric) and
scales s (G, N), G = K / 128 or 1 (per output channel):

    B int32 (K / 16, 2 N): row t holds the 16 x 16 tiles (k, n) in [16 t, 16 t + 16) x
      [16 j, 16 j + 16), j = 0 .. N / 16 - 1, one after the other, each tile row-major
      (element 16 r + c of tile j is k = 16 t + r, n = 16 j + c). Every 1024 consecutive
      elements of such a row (4 tiles) are stored permuted: position p holds element
      perm[p] of that run. Then 8 consecutive positions make a word, position 8 w + i in
      bits 4 i .. 4 i + 3 of word w.
      perm, for the 32 threads i of a warp: thread i takes column c = i // 4 and c + 8 of
      rows R(i % 4) of each of the 4 tiles j, in the order j, (column c, c + 8), R;
      then each run of 8 is reordered by an interleave. Marlin: R(u) = (2u, 2u + 1,
      2u + 8, 2u + 9), interleave (0, 2, 4, 6, 1, 3, 5, 7). QQQ: R(u) = (4u .. 4u + 3),
      interleave (0, 2, 4, 6, 1, 3, 5, 7) per group, (4, 0, 5, 1, 6, 2, 7, 3) per channel.
    s (G, N): flattened, every 64 consecutive values (G > 1) are stored with position
      8 a + b holding value a + 8 b; with one row (per channel, or K = group size) every 32
      with position 8 a + b holding value 2 a + (0, 1, 8, 9, 16, 17, 24, 25)[b].

    W[n, k] = s[k // group, n] * (q[k, n] - 8)

Loading inverts the permutations (an exact index map); nothing is rounded.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .gptq import check_scales
from .int4 import QuantizedWeight
from .nibbles import pack_nibbles, unpack_nibbles

TILE = 16
PERM_LEN = 1024  # elements of one permuted run: 4 tiles of 16 x 16
GROUP_SIZES_MARLIN = (-1, 128)
MARLIN_ROWS = (0, 1, 8, 9)  # R(u) = 2 u + these
QQQ_ROWS = (0, 1, 2, 3)  # R(u) = 4 u + these
INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)
INTERLEAVE_QQQ_CHANNEL = (4, 0, 5, 1, 6, 2, 7, 3)


def weight_perm(rows: Tuple[int, ...], row_step: int, interleave: Tuple[int, ...]) -> torch.Tensor:
    """int64 (1024,): position p of a permuted run holds element perm[p] (module docstring)."""
    i = torch.arange(32).view(32, 1, 1, 1)
    j = torch.arange(4).view(1, 4, 1, 1)
    half = torch.arange(2).view(1, 1, 2, 1)  # column c or c + 8
    r = row_step * (i % 4) + torch.tensor(rows).view(1, 1, 1, 4)
    perm = 256 * j + 16 * r + i // 4 + 8 * half  # (thread, tile, half, row)
    return perm.reshape(-1, 8)[:, list(interleave)].reshape(-1)


def scale_perm(grouped: bool) -> torch.Tensor:
    """int64 (64,) or (32,): position p of a run of scales holds value perm[p]."""
    if grouped:
        return torch.arange(64).view(8, 8).T.reshape(-1)  # 8 a + b -> a + 8 b
    a = torch.arange(4).view(4, 1)
    return (2 * a + torch.tensor([0, 1, 8, 9, 16, 17, 24, 25])).reshape(-1)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    return torch.argsort(perm)


def unpermute_scales(s: torch.Tensor, n: int, grouped: bool) -> torch.Tensor:
    """(G, N) scales in Marlin's order -> natural (G, N)."""
    perm = scale_perm(grouped)
    return s.reshape(-1, perm.numel())[:, _inverse(perm).to(s.device)].reshape(-1, n).contiguous()


def tile_codes(B: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """int32 B (K / 16, 2 N) -> uint8 codes (N, K), the nibbles exactly as stored (no offset)."""
    kt, n = B.shape[0], B.shape[1] // 2  # shapes checked by check_tile_shapes
    runs = unpack_nibbles(B).reshape(kt, -1, PERM_LEN)  # (K/16, N/64, 1024), stored order
    runs = runs[..., _inverse(perm).to(B.device)]  # element order: 4 tiles, row-major each
    tiles = runs.reshape(kt, n // TILE, TILE, TILE)  # (t, j, r, c)
    return tiles.permute(1, 3, 0, 2).reshape(n, kt * TILE).contiguous()  # (j, c, t, r) = (n, k)


def pack_tiles(codes: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """uint8 codes (N, K) (the nibbles to store) -> int32 B (K / 16, 2 N): the exact inverse of
    tile_codes. N must be a multiple of 64, K of 16."""
    n, k = codes.shape
    tiles = codes.reshape(n // TILE, TILE, k // TILE, TILE).permute(2, 0, 3, 1)  # (t, j, r, c)
    runs = tiles.reshape(k // TILE, -1, PERM_LEN)[..., perm.to(codes.device)]  # position p holds element perm[p]
    return pack_nibbles(runs.reshape(k // TILE, -1, 8)).contiguous()


def permute_scales(s: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Natural (G, N) scales -> Marlin's order: the exact inverse of unpermute_scales."""
    perm = scale_perm(grouped)
    return s.reshape(-1, perm.numel())[:, perm.to(s.device)].reshape(s.shape).contiguous()


def check_tile_shapes(B: torch.Tensor, s: torch.Tensor, group_size: int, name: str = "s") -> Tuple[int, int]:
    """Shapes of a Marlin-order weight: B (K/16, 2N) int32 and scales (G, N); return (K, N)."""
    if group_size not in GROUP_SIZES_MARLIN:
        raise ValueError(f"group_size={group_size!r} is not supported; allowed: {GROUP_SIZES_MARLIN}")
    if B.dtype != torch.int32 or B.dim() != 2:
        raise TypeError(f"B must be a 2-D torch.int32 tensor, got {B.dtype} {tuple(B.shape)}")
    k, n = B.shape[0] * TILE, B.shape[1] // 2
    if B.shape[1] % (PERM_LEN // 8):
        raise ValueError(f"B must have shape (K / 16, 2 N) with N a multiple of 64 (whole 1024-element "
                         f"runs), got {tuple(B.shape)}")
    if group_size != -1 and k % group_size:
        raise ValueError(f"K={k} (from B) must be a multiple of group_size={group_size}")
    g = 1 if group_size == -1 else k // group_size
    if s.dim() != 2 or tuple(s.shape) != (g, n):
        raise ValueError(f"{name} must have shape (G={g}, N={n}) for K={k}, group_size={group_size}; "
                         f"got {tuple(s.shape)}")
    return k, n


def from_marlin(B: torch.Tensor, s: torch.Tensor, *, group_size: int = 128,
                grouped: Optional[bool] = None) -> QuantizedWeight:
    """Read a Marlin-format weight (module docstring) into a symmetric QuantizedWeight, exactly.

    B: int32 (K / 16, 2 N); s: float16 (or bfloat16) (K / 128, N) for group_size=128, (1, N)
    for group_size=-1 (per output channel), finite and > 0. grouped: whether s is in the
    order of a weight with more than one scale row; default: s has more than one row (a
    tensor-parallel K slice of a grouped layer may hold one row and passes True)."""
    check_tile_shapes(B, s, group_size)
    if s.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"s must be float16 or bfloat16, got {s.dtype}")
    check_scales(s, "s")
    q = tile_codes(B, weight_perm(MARLIN_ROWS, 2, INTERLEAVE))
    grouped = s.shape[0] > 1 if grouped is None else grouped  # one row: the per-channel order
    scales = unpermute_scales(s, s.shape[1], grouped=grouped)
    return QuantizedWeight(q, scales, None, None, group_size)


__all__ = ["GROUP_SIZES_MARLIN", "from_marlin", "pack_tiles", "permute_scales", "tile_codes", "unpermute_scales", "weight_perm", "scale_perm"]
