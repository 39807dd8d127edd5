"""Drop-in modules: QuantLinear and quantize_model."""
from __future__ import annotations

import logging
from typing import Dict, Iterable, Optional

import torch
from torch import nn

from . import ops  # noqa: F401  (registers torch.ops.sailfish.*)
from .formats.gptq import from_gptq as _read_gptq
from .formats.int4 import (GROUP_SIZES, HALF_DTYPES, PackedW4, QuantizedWeight, _check_bits,
                           _check_group_size, default_g_idx, pack, padded_k, quantize, unpack)

log = logging.getLogger("sailfish")


def check_shape(in_features: int, out_features: int) -> Optional[str]:
    """None if the kernels support this (K, N), else the rule it breaks."""
    if in_features <= 0 or in_features % 16:
        return f"in_features={in_features} must be a positive multiple of 16"
    if out_features <= 0 or out_features % 8:
        return f"out_features={out_features} must be a positive multiple of 8"
    return None


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W stored in 4 bits (W4A16), run by Sailfish's Triton kernels.

    Buffers (formats.int4.PackedW4 layout): qweight int32 (N, Kp/8); scales (N, Gp) and,
    asymmetric, zeros (N, Gp) in the layer dtype; act-order: perm int32 (K,) and
    sorted_g_idx int32 (Kp,); bias (N,) in the layer dtype. Kp = K rounded up to 256.

    forward(x): x (..., K) in the layer dtype (float16 or bfloat16) -> (..., N).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int = 4,
                 group_size: int = 128, sym: bool = True, act_order: bool = False,
                 dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        _check_bits(bits)
        _check_group_size(group_size)
        err = check_shape(in_features, out_features)
        if err:
            raise ValueError(err)
        if dtype not in HALF_DTYPES:
            raise TypeError(f"dtype={dtype} is not supported; allowed: torch.float16, torch.bfloat16")
        if act_order and group_size == -1:
            raise ValueError("act_order=True needs a group size (group_size=-1 has one group)")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.sym, self.act_order = bits, group_size, sym, act_order
        kp = padded_k(in_features)
        gp = 1 if group_size == -1 else kp // group_size
        self.register_buffer("qweight", torch.zeros((out_features, kp // 8), dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros((out_features, gp), dtype=dtype, device=device))
        self.register_buffer("zeros", None if sym else torch.zeros((out_features, gp), dtype=dtype, device=device))
        self.register_buffer("perm", torch.arange(in_features, dtype=torch.int32, device=device) if act_order else None)
        self.register_buffer("sorted_g_idx", None)
        if act_order:
            g = torch.zeros(kp, dtype=torch.int32, device=device)
            g[:in_features] = default_g_idx(in_features, group_size, device)
            self.sorted_g_idx = g
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        self._general_g_idx = False
        self.register_load_state_dict_post_hook(lambda module, _: module._sync_flags())

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> "QuantLinear":
        p = pack(qw)  # a g_idx equal to k // group_size packs without permutation
        layer = cls(qw.in_features, qw.out_features, bias is not None, bits=qw.bits,
                    group_size=qw.group_size, sym=qw.sym, act_order=p.perm is not None,
                    dtype=qw.dtype, device=qw.qweight.device)
        layer.qweight.copy_(p.qweight)
        layer.scales.copy_(p.scales)
        if p.zeros is not None:
            layer.zeros.copy_(p.zeros)
        if layer.act_order:
            layer.perm.copy_(p.perm)
            if p.sorted_g_idx is not None:
                layer.sorted_g_idx.copy_(p.sorted_g_idx)
        if bias is not None:
            layer.bias.copy_(bias.detach().to(qw.dtype))
        layer._sync_flags()
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, bits: int = 4, group_size: int = 128, sym: bool = True,
                    dtype: Optional[torch.dtype] = None) -> "QuantLinear":
        """Quantize an nn.Linear (round to nearest). dtype: layer dtype, default the
        linear's dtype if float16/bfloat16, else float16."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        err = check_shape(linear.in_features, linear.out_features)
        if err:
            raise ValueError(err)
        qw = quantize(linear.weight, bits=bits, group_size=group_size, sym=sym, dtype=dtype)
        return cls.from_quantized(qw, linear.bias)

    @classmethod
    def from_gptq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  g_idx: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, *,
                  bits: int = 4, group_size: int = 128, dtype: Optional[torch.dtype] = None) -> "QuantLinear":
        """Load GPTQ checkpoint tensors (formats.gptq). dtype: layer dtype, default scales.dtype."""
        err = check_shape(qweight.shape[0] * 8, qweight.shape[1]) if qweight.dim() == 2 else None
        if err:
            raise ValueError(err)
        if dtype is not None and dtype not in HALF_DTYPES:
            raise TypeError(f"dtype={dtype} is not supported; allowed: torch.float16, torch.bfloat16")
        qw = _read_gptq(qweight, qzeros, scales, g_idx, bits=bits, group_size=group_size)
        if dtype is not None and dtype != qw.dtype:
            qw = QuantizedWeight(qw.qweight, qw.scales.to(dtype), qw.zeros, qw.g_idx, qw.group_size)
        return cls.from_quantized(qw, bias)

    def _sync_flags(self) -> None:
        """Python-side flags derived from buffers (kept out of forward for torch.compile)."""
        self._general_g_idx = False
        if self.act_order:
            k = self.in_features
            uniform = default_g_idx(k, self.group_size, self.sorted_g_idx.device)
            self._general_g_idx = not torch.equal(self.sorted_g_idx[:k], uniform)

    # -- use --------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    def packed(self) -> PackedW4:
        return PackedW4(self.qweight, self.scales, self.zeros, self.perm,
                        self.sorted_g_idx if self._general_g_idx else None,
                        self.in_features, self.group_size)

    def quantized_weight(self) -> QuantizedWeight:
        return unpack(self.packed())

    def dequantize(self) -> torch.Tensor:
        """float32 (N, K): exactly the weight the kernels multiply by."""
        return unpack(self.packed()).dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"input dtype {x.dtype} does not match the layer dtype {self.dtype}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input last dim {x.shape[-1]} != in_features={self.in_features}")
        lead = x.shape[:-1]
        y = torch.ops.sailfish.w4a16_gemm(
            x.reshape(-1, self.in_features), self.qweight, self.scales, self.zeros, self.perm,
            self.sorted_g_idx if self._general_g_idx else None, self.bias,
            self.in_features, self.group_size)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, bits={self.bits}, group_size={self.group_size}, "
                f"sym={self.sym}, act_order={self.act_order}, dtype={str(self.dtype)[6:]}")


def _skip_match(name: str, skip: Iterable[str]) -> bool:
    parts = name.split(".")
    return any(s == name or s in parts for s in skip)


def quantize_model(model: nn.Module, *, bits: int = 4, group_size: int = 128, sym: bool = True,
                   skip: Iterable[str] = ("lm_head",)) -> nn.Module:
    """Replace, in place, every nn.Linear whose shape and dtype Sailfish supports.

    skip: module names (or name components) left alone. Returns the model; what was
    quantized and what was skipped, with the reason, is logged and stored as
    model.sailfish_report = {"quantized": [names], "skipped": {name: reason}}.
    """
    _check_bits(bits)
    _check_group_size(group_size)
    skip = tuple(skip)
    quantized, skipped = [], {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or isinstance(module, QuantLinear):
            continue
        reason = None
        if _skip_match(name, skip):
            reason = "in skip list"
        elif module.weight.dtype not in HALF_DTYPES:
            reason = f"dtype {module.weight.dtype}: convert the model to float16/bfloat16 first"
        else:
            reason = check_shape(module.in_features, module.out_features)
        if reason:
            skipped[name] = reason
            log.info("sailfish: skipped %s (%s)", name, reason)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear.from_linear(module, bits=bits, group_size=group_size, sym=sym))
        quantized.append(name)
    log.info("sailfish: quantized %d linear layers, skipped %d", len(quantized), len(skipped))
    model.sailfish_report = {"quantized": quantized, "skipped": skipped}
    return model
