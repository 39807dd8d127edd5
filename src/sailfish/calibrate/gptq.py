"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", ICLR 2023) for one linear layer, onto Sailfish's 4-bit grid.

A layer y = x W^T with inputs X (n, K) has the output error ||X W^T - X Q^T||^2, whose
Hessian in W's rows is H = 2 X^T X / n (`Hessian`). GPTQ quantizes W column by column (in
the order of decreasing diag(H) with act_order) and after each column j spreads its
rounding error over the columns not yet quantized, the optimal correction for that
quadratic (Optimal Brain Surgeon):

    e = (w_j - q_j) / U[j, j],   w_k -= e * U[j, k]   (k > j),

U the upper Cholesky factor of H^-1 (H^-1 = U^T U): row j of U is row j of the inverse
Hessian of the columns j.. once the columns before j are eliminated, over the square root of
its diagonal (the paper's Cholesky reformulation). Updates are applied lazily: within a
block of `block_size` columns at once, to the columns past the block in one matmul.

The grid is formats.int4's (`grid`, `codes`, the rule of RTN `quantize`): a group's scale
(and zero point) come from its weights as updated when GPTQ reaches the group's first
column (static_groups: from the original weights, before any update), and the error fed
back is against the effective weight s * (q - z) rounded to the scale dtype, the number the
kernels multiply. All math is float32, on the weight's device.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..formats.qqq import (QQQWeight, channel_scales, check_group_size_w4a8, codes_qqq, group_scales,
                           int8_levels, num_groups_w4a8)
from ..formats.int4 import (HALF_DTYPES, QuantizedWeight, _check_bits, _check_group_size, check_flag,
                            check_half_dtype, check_scales, check_weight_arg, check_weight_values, codes,
                            grid, num_groups)


class Hessian:
    """Accumulates H = 2 X^T X / n (float32, K x K) over the calibration inputs of a linear
    layer with K input features: `add(x)` with x (..., K), any number of times; `value()`."""

    def __init__(self, in_features: int, device=None):
        if type(in_features) is not int or in_features <= 0:
            raise ValueError(f"in_features={in_features!r} must be a positive int")
        self.in_features = in_features
        self.sum = torch.zeros((in_features, in_features), dtype=torch.float32, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"calibration input of shape {got} does not fit a layer with in_features="
                             f"{self.in_features}; allowed: (..., {self.in_features})")
        x = x.detach().reshape(-1, self.in_features).to(self.sum.device, torch.float32)
        self.sum.addmm_(x.T, x)
        self.rows += x.shape[0]

    def value(self) -> torch.Tensor:
        if self.rows == 0:
            raise ValueError("the Hessian has no calibration rows (add() was never given a non-empty input); "
                             "allowed: at least one calibration input row")
        return self.sum * (2.0 / self.rows)


def _check_percdamp(percdamp) -> None:
    if (isinstance(percdamp, bool) or not isinstance(percdamp, (int, float)) or not math.isfinite(percdamp)
            or percdamp < 0):
        raise ValueError(f"percdamp={percdamp!r} is not supported; allowed: a finite number >= 0 (the damping "
                         f"added to diag(H), as a fraction of its mean; GPTQ uses 0.01)")


def _check_block_size(block_size, group_size: int) -> None:
    # A group whose grid is set must lie in one block, or start at a block's start (where every
    # column to its right is up to date): block and group sizes divide one another.
    ok = type(block_size) is int and block_size > 0
    if ok and group_size != -1:
        ok = block_size % group_size == 0 or group_size % block_size == 0
    if not ok:
        raise ValueError(f"block_size={block_size!r} is not supported with group_size={group_size}; allowed: a "
                         f"positive int that divides the group size or is a multiple of it (default 128)")


def _check_hessian(hessian, k: int) -> None:
    if not isinstance(hessian, torch.Tensor) or hessian.shape != (k, k) or not hessian.is_floating_point():
        got = f"{hessian.dtype} {tuple(hessian.shape)}" if isinstance(hessian, torch.Tensor) else \
            type(hessian).__name__
        raise ValueError(f"hessian must be a floating-point (in_features, in_features) = ({k}, {k}) tensor, got "
                         f"{got}")
    bad = ~torch.isfinite(hessian)
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"the hessian holds {int(bad.sum())} non-finite value(s), first hessian[{i}, {j}] = "
                         f"{float(hessian[i, j])} (non-finite calibration inputs?); allowed: finite values only")


def _inverse_cholesky(h: torch.Tensor, percdamp: float, damp: float) -> torch.Tensor:
    """U upper triangular with U^T U = h^-1 (h damped already); ValueError if h is not
    positive definite (in float32) even so."""
    lower, info = torch.linalg.cholesky_ex(h)
    if int(info) == 0:
        upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
        if int(info) == 0 and bool(torch.isfinite(upper).all()):
            return upper
    raise ValueError(f"the hessian is not positive definite even with damping percdamp={percdamp} (adding "
                     f"{damp:.3g} to its diagonal): its Cholesky factorization fails at column {int(info) - 1}; "
                     f"allowed: a positive semi-definite H = 2 X^T X / n, with a larger percdamp (e.g. 0.1) if "
                     f"X is nearly rank-deficient")


def _prepare(weight: torch.Tensor, hessian: torch.Tensor, percdamp: float, act_order: bool):
    """The float32 weight (dead input channels zeroed), U of the damped Hessian (both in the
    order GPTQ takes the columns) and that order (None: channel order)."""
    n, k = weight.shape
    _check_hessian(hessian, k)
    w = weight.detach().to(torch.float32).clone()
    check_weight_values(w)
    h = hessian.detach().to(w.device, torch.float32).clone()
    dead = torch.diag(h) == 0
    if bool(dead.all()):
        raise ValueError("the hessian's diagonal is all zero: the calibration inputs of this layer were all zero; "
                         "allowed: calibration data that reaches the layer")
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(h), descending=True, stable=True)
        w, h = w[:, perm], h[perm][:, perm]
    damp = percdamp * float(torch.diag(h).mean())
    h.diagonal().add_(damp)
    return w, _inverse_cholesky(h, percdamp, damp), perm


def _solve(w: torch.Tensor, u: torch.Tensor, block_size: int, column) -> torch.Tensor:
    """GPTQ's blocked loop over the columns of w (updated in place), U^T U the inverse Hessian.
    column(j, col, upcoming) -> (code, effective) quantizes column j (col, its current
    weights); upcoming(width) is the current (N, width) weights from column j on, for a grid
    set at a group's first column (a group starting inside a block lies in it,
    _check_block_size; at a block's start w itself is current). Returns the codes (N, K)."""
    k = w.shape[1]
    q = torch.empty_like(w)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1, u1 = w[:, i1:i2].clone(), u[i1:i2, i1:i2]
        err = torch.empty_like(w1)
        for i in range(i2 - i1):
            j = i1 + i

            def upcoming(width, i=i, j=j):
                return w[:, j:j + width] if i == 0 else w1[:, i:i + width]

            col = w1[:, i]
            code, effective = column(j, col, upcoming)
            e = (col - effective) / u1[i, i]
            w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
            err[:, i] = e
            q[:, j] = code
        w[:, i2:] -= err @ u[i1:i2, i2:]
    return q


def _channel_order(w: torch.Tensor, perm) -> torch.Tensor:
    return w if perm is None else w[:, torch.argsort(perm)]


def _padded_groups(w: torch.Tensor, n_groups: int, gs: int) -> torch.Tensor:
    """(N, K) -> (N, n_groups, gs), zero-padded: one group per row of the last dimension."""
    return torch.nn.functional.pad(w, (0, n_groups * gs - w.shape[1])).reshape(w.shape[0], n_groups, gs)


def _static_order(k: int, gs: int, perm) -> list:
    """The group of the j-th column processed, for static groups (a list: no device sync per column)."""
    return (torch.arange(k) if perm is None else perm.cpu()).div(gs, rounding_mode="floor").tolist()


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, *, bits: int = 4, group_size: int = 128,
                  sym: bool = True, act_order: bool = False, static_groups: bool = False,
                  percdamp: float = 0.01, block_size: int = 128,
                  dtype: Optional[torch.dtype] = None) -> QuantizedWeight:
    """GPTQ-quantize a (N, K) weight given the Hessian (K, K) of its layer's inputs (`Hessian`).

    group_size, sym, dtype: as formats.int4.quantize (dtype: the scale dtype, default the
    weight's if float16/bfloat16, else float16). act_order (GPTQ's desc_act): columns in the
    order of decreasing diag(H); groups are then runs of group_size columns in that order,
    and the result's g_idx says which group each input channel belongs to (None without
    act_order, or with static_groups). static_groups: the grid of every group of group_size
    consecutive channels is fixed from the original weight before GPTQ starts, so act_order
    needs no g_idx (the kernels' plain layout) while its error compensation keeps the order.
    percdamp: percdamp * mean(diag(H)) is added to diag(H) so that it can be inverted.
    Input channels that the calibration never activated (diag(H) = 0, "dead") get weight 0,
    as in GPTQ: the outputs seen never depended on them.
    ValueError: a Hessian of the wrong shape, non-finite, all zero, or not positive definite
    even after damping; a non-finite weight; scales the dtype cannot hold (as quantize).
    """
    _check_bits(bits)
    _check_group_size(group_size)
    check_weight_arg(weight)
    for name, flag in (("sym", sym), ("act_order", act_order), ("static_groups", static_groups)):
        check_flag(name, flag)
    _check_percdamp(percdamp)
    _check_block_size(block_size, group_size)
    if dtype is None:
        dtype = weight.dtype if weight.dtype in HALF_DTYPES else torch.float16
    check_half_dtype(dtype)
    n, k = weight.shape
    gs = k if group_size == -1 else group_size
    n_groups = num_groups(k, group_size)
    w, u, perm = _prepare(weight, hessian, percdamp, act_order)
    static = None
    if static_groups:  # every group's grid from the original weight, groups in channel order
        padded = _padded_groups(_channel_order(w, perm), n_groups, gs)
        static = grid(padded, sym, dtype)
    grids = [None] * n_groups  # (exact, s, z) per group, each (N,)
    static_group = _static_order(k, gs, perm)
    current = [None, None]  # (s, z) of the group being quantized

    def column(j, col, upcoming):
        if static is not None:
            g = static_group[j]
            current[:] = static[1][:, g], None if sym else static[2][:, g]
        elif j % gs == 0:  # a new group: its grid from the weights as updated so far
            grids[j // gs] = grid(upcoming(gs), sym, dtype)
            current[:] = grids[j // gs][1:]
        s, z = current
        code = codes(col, s, z)
        return code, (s.float() * (code - (8 if z is None else z))).to(dtype).float()

    q = _solve(w, u, block_size, column)
    g_idx = None
    if perm is not None:
        q = q[:, torch.argsort(perm)]
        if static is None and group_size != -1:
            g_idx = (torch.arange(k, device=w.device, dtype=torch.int32) // gs)[torch.argsort(perm)].contiguous()
    if static is not None:
        exact, s, z = (None if t is None else t.T for t in static)  # (G, N)
    else:
        exact, s, z = (None if part[0] is None else torch.stack(part) for part in zip(*grids))
    zeros = None if sym else z.to(torch.uint8).contiguous()
    qw = QuantizedWeight(q.to(torch.uint8).contiguous(), s.contiguous(), zeros, g_idx, group_size)
    check_scales(exact, s, qw.dequantize())
    return qw


def gptq_quantize_qqq(weight: torch.Tensor, hessian: torch.Tensor, *, group_size: int = -1,
                      act_order: bool = False, static_groups: bool = False, percdamp: float = 0.01,
                      block_size: int = 128) -> QQQWeight:
    """GPTQ onto the W4A8 (QQQ) weight format (formats.qqq): the effective weight the error
    is fed back against is exactly the kernels' s_ch * w8.

    group_size=-1: s_ch = max|W[n]| / 7.5 from the original row, codes as quantize_qqq.
    group_size=128 (two levels): s_ch = max|W[n]| / 119 from the original row; each group's
    fp16 scale s_g from its int8 levels clamp(rne(w / s_ch), +-119) when GPTQ reaches the
    group (static_groups, and always with act_order since the W4A8 kernels take no g_idx: from
    the original weight); a column's code from its int8 level, w8 = clamp(rne(s_g (q - 8)),
    +-127). With H = I (no cross-column update) this is quantize_qqq exactly.
    act_order, percdamp, block_size, dead channels, errors: as gptq_quantize."""
    check_group_size_w4a8(group_size)
    check_weight_arg(weight)
    check_flag("act_order", act_order)
    check_flag("static_groups", static_groups)
    _check_percdamp(percdamp)
    _check_block_size(block_size, group_size)
    n, k = weight.shape
    w, u, perm = _prepare(weight, hessian, percdamp, act_order)
    exact, s_ch = channel_scales(w, group_size)  # a permutation of columns leaves row maxima alone
    gs = k if group_size == -1 else group_size
    n_groups = num_groups_w4a8(k, group_size)
    static = None
    if group_size != -1 and (act_order or static_groups):
        static = group_scales(_padded_groups(int8_levels(_channel_order(w, perm), s_ch), n_groups, gs))  # (N, G)
    s_g = [None] * n_groups
    static_group = _static_order(k, gs, perm)
    current = [None]

    def column(j, col, upcoming):
        if group_size == -1:
            code = codes_qqq(col, s_ch)
            return code, s_ch * (code - 8)
        if static is not None:
            current[0] = static[:, static_group[j]]
        elif j % gs == 0:
            s_g[j // gs] = current[0] = group_scales(int8_levels(upcoming(gs), s_ch))
        sg = current[0]
        code = codes_qqq(int8_levels(col, s_ch), sg)
        return code, s_ch * ((code - 8) * sg.float()).round().clamp(-127, 127)

    q = _solve(w, u, block_size, column)
    if perm is not None:
        q = q[:, torch.argsort(perm)]
    groups = None if group_size == -1 else (static.T if static is not None else torch.stack(s_g))
    qw = QQQWeight(q.to(torch.uint8).contiguous(), s_ch.contiguous(),
                   None if groups is None else groups.contiguous(), group_size)
    check_scales(exact.double(), s_ch, qw.dequantize())
    return qw
