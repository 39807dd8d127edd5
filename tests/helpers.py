"""Test helpers: tolerances, random 4-bit weights, act-order group indices."""
from typing import Optional

import torch

from sailfish.formats.int4 import QuantizedWeight, num_groups

# Relative Frobenius error ||y - ref|| / ||ref|| allowed between a kernel's output and
# the fp32 reference x.float() @ W_eff.T (+ bias), W_eff = layer.dequantize(). The
# kernels multiply by exactly W_eff, so the only differences are fp32 accumulation
# order (< 1e-4 relative) and the final rounding of y to the output dtype.
TOL = {
    # fp16 output rounding is at most u = 2**-11 ~ 4.9e-4 relative per element.
    torch.float16: 2e-3,
    # bf16 keeps 8 significant bits: round-to-nearest output rounding alone is up to
    # u = 2**-8 ~ 3.9e-3 relative per element (a correctly rounded result measured
    # 2.57e-3); fp32 accumulation-order differences add < 1e-4. Kernel bugs (a wrong
    # nibble, scale or group) give errors of 1e-2 and up.
    torch.bfloat16: 4e-3,
}

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.detach().float(), ref.detach().float()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def desc_act_g_idx(k: int, group_size: int, device=None) -> torch.Tensor:
    """GPTQ desc_act: columns are quantized in the order of a permutation `perm`, and
    the i-th column processed joins group i // group_size: g_idx[k] = perm_inv[k] // gs."""
    perm = torch.randperm(k, device=device)
    perm_inv = torch.empty_like(perm)
    perm_inv[perm] = torch.arange(k, device=device)
    return (perm_inv // group_size).to(torch.int32)


def general_g_idx(k: int, group_size: int, device=None) -> torch.Tensor:
    """A non-uniform g_idx: random group sizes, every group present."""
    g = num_groups(k, group_size)
    idx = torch.randint(0, g, (k,), device=device)
    idx[torch.randperm(k, device=device)[:g]] = torch.arange(g, device=device)
    return idx.to(torch.int32)


def make_g_idx(mode: str, k: int, group_size: int, device=None) -> Optional[torch.Tensor]:
    return {"none": lambda: None,
            "descact": lambda: desc_act_g_idx(k, group_size, device),
            "gidx": lambda: general_g_idx(k, group_size, device)}[mode]()


def random_quantized(k: int, n: int, group_size: int, sym: bool, dtype: torch.dtype,
                     g_idx: Optional[torch.Tensor] = None, device=None) -> QuantizedWeight:
    """Random codes, scales (both signs) and zero points in their full ranges."""
    g = num_groups(k, group_size)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
    scales = (torch.rand(g, n, device=device) * 0.02 + 0.002)
    scales = (scales * torch.where(torch.rand(g, n, device=device) < 0.1, -1.0, 1.0)).to(dtype)
    zeros = None if sym else torch.randint(0, 17, (g, n), dtype=torch.uint8, device=device)
    return QuantizedWeight(q, scales, zeros, g_idx, group_size)
