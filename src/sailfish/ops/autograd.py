"""Backward formulas: the gradient with respect to the input activations only.

The 4-bit weights, their scales and the bias are frozen buffers (no gradient), so a
Sailfish layer can sit under trainable adapters (LoRA): with y = x @ W_eff^T + b,

    dx = dy @ W_eff,        W_eff (N, K) = the effective weight the kernels multiply by.

The backward dequantizes W_eff in PyTorch from the op's own arguments (formats: exact,
whatever the packed layout; ops sailfish::w4a16_dequantize / sailfish::w4a8_dequantize) on
every call, so it holds transient (N, K) copies of the weight.

W4A16 (sailfish::w4a16_gemm): W_eff is representable in the layer dtype (it is s * (q - z)
rounded to it), so dx = dy @ W_eff.to(dy.dtype) is the exact derivative of the op up to
the matmul's own rounding.

W4A8: the forward rounds x to int8 per token, which has a zero derivative almost
everywhere; the integer tensor x_q cannot carry a gradient either. The composite op
sailfish::w4a8_linear (quantize_per_token + w4a8_gemm, the path QuantLinearW4A8 takes when
its input needs a gradient) uses the straight-through estimator: the rounding counts as
the identity, so dx = dy @ W_eff with W_eff = s_ch[n] * w8[n, k] (QuantLinearW4A8.dequantize()),
computed in float32 and rounded to dy's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formats.int4 import PackedW4, unpack
from ..formats.qqq import PackedQQQ, unpack_qqq
from ..runtime.dispatch import define_op
from .w4a8 import W4A8_LINEAR_SCHEMA, _w4a8_linear_fake, w4a8_linear_impl


# ----------------------------------------------------------------------------------
# W4A16
# ----------------------------------------------------------------------------------
@torch.library.custom_op("sailfish::w4a16_dequantize", mutates_args=())
def w4a16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     perm: Optional[torch.Tensor], sorted_g_idx: Optional[torch.Tensor],
                     in_features: int, group_size: int) -> torch.Tensor:
    """W_eff (N, K) in the scales' dtype (exact: W_eff is rounded to it) from the op's
    arguments. An op of its own so that torch.compile traces the backward through it (the
    format code checks values, which a traced graph cannot)."""
    p = PackedW4(qweight, scales, zeros, perm, sorted_g_idx, in_features, group_size)
    # contiguous: the fake below promises row-major, and inductor checks the strides
    return unpack(p).dequantize().to(scales.dtype).contiguous()


@w4a16_dequantize.register_fake
def _(qweight, scales, zeros, perm, sorted_g_idx, in_features, group_size):
    return scales.new_empty((qweight.shape[0], in_features))


def _w4a16_setup(ctx, inputs, output) -> None:
    x, qweight, scales, zeros, perm, sorted_g_idx, bias, in_features, group_size = inputs
    ctx.save_for_backward(qweight, scales, zeros, perm, sorted_g_idx)
    ctx.in_features, ctx.group_size = in_features, group_size


def _w4a16_backward(ctx, dy):
    qweight, scales, zeros, perm, sorted_g_idx = ctx.saved_tensors
    dx = None
    if ctx.needs_input_grad[0]:
        w = torch.ops.sailfish.w4a16_dequantize(qweight, scales, zeros, perm, sorted_g_idx,
                                                ctx.in_features, ctx.group_size)
        dx = dy @ w.to(dy.dtype)
    return dx, None, None, None, None, None, None, None, None


torch.library.register_autograd("sailfish::w4a16_gemm", _w4a16_backward, setup_context=_w4a16_setup)


# ----------------------------------------------------------------------------------
# W4A8: straight-through estimator on the composite op
# ----------------------------------------------------------------------------------
# x (M, K) float16/bfloat16 -> y (M, N) in x's dtype: sailfish::quantize_per_token, then
# sailfish::w4a8_gemm in one op (the same numbers as calling the two ops), with the
# straight-through backward below (module docstring).
w4a8_linear = define_op("w4a8_linear", W4A8_LINEAR_SCHEMA, w4a8_linear_impl, _w4a8_linear_fake)


@torch.library.custom_op("sailfish::w4a8_dequantize", mutates_args=())
def w4a8_dequantize(qweight: torch.Tensor, s_ch: torch.Tensor, s_g: Optional[torch.Tensor],
                    in_features: int, group_size: int) -> torch.Tensor:
    """W_eff (N, K) float32 = s_ch[n] * w8[n, k] from the op's arguments (see w4a16_dequantize)."""
    return unpack_qqq(PackedQQQ(qweight, s_ch, s_g, in_features, group_size)).dequantize().contiguous()


@w4a8_dequantize.register_fake
def _(qweight, s_ch, s_g, in_features, group_size):
    return s_ch.new_empty((qweight.shape[0], in_features))


def _w4a8_setup(ctx, inputs, output) -> None:
    x, qweight, s_ch, s_g, bias, in_features, group_size = inputs
    ctx.save_for_backward(qweight, s_ch, s_g)
    ctx.in_features, ctx.group_size = in_features, group_size


def _w4a8_backward(ctx, dy):
    qweight, s_ch, s_g = ctx.saved_tensors
    dx = None
    if ctx.needs_input_grad[0]:
        w = torch.ops.sailfish.w4a8_dequantize(qweight, s_ch, s_g, ctx.in_features, ctx.group_size)
        dx = (dy.float() @ w).to(dy.dtype)
    return dx, None, None, None, None, None, None


torch.library.register_autograd("sailfish::w4a8_linear", _w4a8_backward, setup_context=_w4a8_setup)


# ----------------------------------------------------------------------------------
# No derivative: the int8 activation quantization and the GEMM on its output
# ----------------------------------------------------------------------------------
def _no_derivative(name: str):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"sailfish::{name} has no derivative (the int8 / fp8 rounding of the activations); "
            "QuantLinearW4A8 (sailfish::w4a8_linear) gives its input a straight-through gradient")
    return backward


torch.library.register_autograd("sailfish::quantize_per_token", _no_derivative("quantize_per_token"))
torch.library.register_autograd("sailfish::quantize_per_token_fp8", _no_derivative("quantize_per_token_fp8"))
torch.library.register_autograd("sailfish::w4a8_gemm", _no_derivative("w4a8_gemm"))
