"""QQQ's adaptive smoothing (Zhang et al., "QQQ: Quality Quattuor-Bit Quantization for Large
Language Models", 2024, section 3.1; the QQQ repository's "os+" migration search, after
Outlier Suppression+): before W4A8 GPTQ, the input channels of a group of Linears that share
one input X (q/k/v, gate/up, o_proj, down_proj) are divided by per-channel scales s, and the
Linears' weight columns multiplied by them, X W^T = (X / s) (W s)^T, so that the few outlier
channels that would dominate every token's int8 scale are tamed, at the weights' expense.

    s_j = max(1, max|X_j| / t)

Only channels above the threshold t are smoothed; t is searched on a grid (from max|X|, no
smoothing, down to the smallest channel maximum, every channel equalised; geometric steps)
minimising the summed squared output error of the group's Linears with both operands
quantized as the W4A8 kernels quantize them: per-token int8 activations
(formats.qqq.quantize_activations) and round-to-nearest W4A8 weights in the target format
(formats.qqq.quantize_qqq). (QQQ measures the error after the attention / SiLU product of
the block; here the Linears' own outputs: cheaper, and no knowledge of the block needed.)
Sailfish rounds each s_j to a power of two, so the folds below are exact in any float dtype
(no product or quotient is rounded, barring underflow): the smoothed model computes the
same function as the original.

1 / s goes into the module that produces X: the RMSNorm weight before q/k/v and gate/up
(RMSNorm(x) = w * x / rms(x); a LayerNorm's weight and bias), v_proj's output rows before o_proj (attention outputs are
convex combinations of v rows; with grouped-query attention one scale per v row serves all
the query heads that read it), up_proj's output rows before down_proj (act(gate) * up), as
in QQQ's export. Every fold is checked on the calibration data (the producer's new output
times s must reproduce the old one) and undone if it does not hold, e.g. for a norm of the
form (1 + w) * x.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from ..formats.qqq import quantize_activations, quantize_qqq

# Rows of calibration inputs the search uses (evenly strided over all tokens): the error of
# each candidate is one (rows x K) x (K x N) product; QQQ searches on one batch.
SEARCH_ROWS = 4096
GRID = 20


def w4a8_output_error(x: torch.Tensor, weight: torch.Tensor, s: torch.Tensor, group_size: int,
                      reference: torch.Tensor) -> float:
    """Squared error of the W4A8 layer (x / s) (W s)^T, both operands quantized as the kernels
    do, against `reference` = x W^T (float32)."""
    xq, xs = quantize_activations(x / s)
    w = quantize_qqq(weight * s, group_size).dequantize()
    return float(((xq.float() * xs[:, None]) @ w.T - reference).square().sum())


def search_scales(x: torch.Tensor, weight: torch.Tensor, group_size: int, *, repeat: int = 1,
                  head_dim: Optional[int] = None, grid: int = GRID):
    """The smoothing scales of inputs x (M, K) to a Linear (or Linears stacked along N) of
    weight (N, K), by the threshold search above: float32 powers of two >= 1, one per input
    channel, or per producer row (K / repeat of them, expand_heads) for o_proj under
    grouped-query attention. Returns (s, error without smoothing, error with s)."""
    x, weight = x.float(), weight.detach().float()
    cmax = shared_over_heads(x.abs().amax(dim=0), repeat, head_dim)
    ones = torch.ones_like(cmax)
    reference = x @ weight.T
    base = w4a8_output_error(x, weight, torch.ones(x.shape[1], device=x.device), group_size, reference)
    best = (base, ones)
    live = cmax[cmax > 0]
    if not live.numel() or float(live.min()) == float(cmax.max()):
        return ones, base, base
    top, bottom = float(cmax.max()), float(live.min())
    seen = set()
    for i in range(1, grid):
        t = top * (bottom / top) ** (i / (grid - 1))
        s = torch.exp2(torch.round(torch.log2((cmax / t).clamp(min=1))))
        key = tuple(s.tolist())
        if key in seen:
            continue
        seen.add(key)
        err = w4a8_output_error(x, weight, expand_heads(s, repeat, head_dim), group_size, reference)
        if err < best[0]:  # ties keep the milder smoothing
            best = (err, s)
    return best[1], base, best[0]


def fold_into_norm(norm: nn.Module, consumers: List[nn.Linear], s: torch.Tensor) -> None:
    """norm.weight (and a LayerNorm's bias) /= s, consumer weight columns *= s (exact: s powers of two)."""
    with torch.no_grad():
        norm.weight.div_(s.to(norm.weight))
        if isinstance(getattr(norm, "bias", None), torch.Tensor):
            norm.bias.div_(s.to(norm.bias))
        for m in consumers:
            m.weight.mul_(s.to(m.weight))


def fold_into_rows(producer: nn.Linear, consumer: nn.Linear, s: torch.Tensor,
                   repeat: int = 1, head_dim: Optional[int] = None) -> None:
    """producer rows (and bias) /= s, consumer columns *= s expanded over the `repeat` query
    heads of each key/value head (head_dim channels each) when consumer reads repeat times
    as many channels as producer writes."""
    with torch.no_grad():
        producer.weight.div_(s.to(producer.weight)[:, None])
        if producer.bias is not None:
            producer.bias.div_(s.to(producer.bias))
        consumer.weight.mul_(expand_heads(s, repeat, head_dim).to(consumer.weight))


def expand_heads(s: torch.Tensor, repeat: int, head_dim: Optional[int]) -> torch.Tensor:
    """Per producer row (kv_heads * head_dim) -> per consumer channel (kv_heads * repeat *
    head_dim): query head h reads key/value head h // repeat (transformers' repeat_kv)."""
    if repeat == 1:
        return s
    return s.reshape(-1, 1, head_dim).expand(-1, repeat, head_dim).reshape(-1)


def shared_over_heads(cmax: torch.Tensor, repeat: int, head_dim: Optional[int]) -> torch.Tensor:
    """Consumer channel maxima -> one per producer row (the max over the query heads that
    share it), so that a scale per producer row can serve all of them."""
    if repeat == 1:
        return cmax
    return cmax.reshape(-1, repeat, head_dim).amax(dim=1).reshape(-1)


def exact_within(before: torch.Tensor, after: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a fold held: after * s reproduces before (float32 copies of tensors computed in
    `dtype`) to a few units of dtype's rounding of each row's largest value (the producer's
    arithmetic may round a value near the subnormal range differently; a fold that does not
    hold is off by a factor of s)."""
    b, a = before.float(), after.float() * s
    tol = 8 * torch.finfo(dtype).eps * b.abs().amax(dim=-1, keepdim=True)
    return bool(((a - b).abs() <= tol).all())
