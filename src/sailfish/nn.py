"""Drop-in modules: QuantLinear (W4A16) and QuantLinearW4A8."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .formats.awq import from_awq as _read_awq
from .formats.gptq import from_gptq as _read_gptq
from .formats.marlin import from_marlin as _read_marlin
from .formats.int4 import (HALF_DTYPES, LAYOUT_VERSION, PackedW4, QuantizedWeight, _check_bits,
                           _check_group_size, cast_scales, check_flag, check_half_dtype, check_int_choice,
                           checked_cast, check_shape, default_g_idx, natural_to_fragment_order, pack, padded_k, quantize,
                           relative_change, unpack, warn_lossy_cast)
from .formats.shard import shard_bias, shard_quantized
from .formats.qqq import (LAYOUT_VERSION_W4A8, PackedQQQ, QQQWeight, check_act_dtype, check_group_size_w4a8,
                          fp8_weight, from_qqq, natural_to_fragment_order_w4a8, pack_qqq, quantize_qqq,
                          unpack_qqq)
from .ops import direct_call_ok
from .ops.autograd import w4a8_linear
from .ops.w4a8 import w4a8_gemm_impl, w4a8_linear_fp8_impl, w4a8_linear_impl, w4a8_linear_nograd
from .ops.w4a16 import w4a16_gemm, w4a16_gemm_nograd, w4a16_layer_impl

def _upgrade_qweight_layout(state_dict, prefix: str, current: int, from_v1, what: str) -> None:
    """qweight's layout version travels as a buffer (not module metadata) so that it survives
    formats that drop metadata, e.g. safetensors. Version 1 (no such buffer: the natural
    nibble order of Sailfish 0.1.0) is re-packed with from_v1; load_state_dict works on its
    own copy of the dict, so it is rewritten in place."""
    key = prefix + "qweight_layout"
    if prefix + "qweight" in state_dict:
        version = int(state_dict[key]) if key in state_dict else 1
        if version == 1:
            state_dict[prefix + "qweight"] = from_v1(state_dict[prefix + "qweight"])
        elif version != current:
            raise ValueError(f"{key}={version} is not supported; this Sailfish reads {what}layout "
                             f"versions 1 and {current} (a newer Sailfish wrote it?)")
        state_dict[key] = torch.tensor(current, dtype=torch.int32)


_SCALE_BUFFERS = ("scales", "zeros", "s_ch", "s_g")


def parent_prefix(prefix: str) -> str:
    """'model.layers.0.self_attn.qkv_proj.' -> 'model.layers.0.self_attn.' ('' at the top): where a
    layer that stands in for its siblings (fuse.FusedQuantLinear, a QuantExperts holding shared
    experts) writes and reads their state_dict keys."""
    parent = prefix[:-1].rpartition(".")[0]
    return parent + "." if parent else ""


def _check_loaded(module: nn.Module, state_dict, prefix: str, error_msgs: list) -> bool:
    """A load error (True: appended to error_msgs) for a tensor of the wrong dtype or non-finite
    scales. load_state_dict would copy_ a float16 checkpoint into a bfloat16 layer (or float
    codes into int32 ones), converting the values without a word, and NaN scales make every
    output that reads them NaN."""
    for name, b in module._buffers.items():
        t = state_dict.get(prefix + name)
        if not isinstance(t, torch.Tensor) or b is None:
            continue
        if t.dtype != b.dtype and name in ("scales", "zeros", "bias") and {t.dtype, b.dtype} <= set(HALF_DTYPES):
            # fp16 <-> bf16: exact values load, re-rounding them without a word does not
            # (formats.int4 cast_scales); the error names the way to opt in
            try:
                checked_cast(t, b.dtype, prefix + name, allow_lossy_scales=False,
                             how=f"loading into a {t.dtype} layer, then layer.to_dtype({b.dtype}, "
                                 f"allow_lossy_scales=True)")
            except ValueError as e:
                error_msgs.append(str(e))
                return True
        elif t.dtype != b.dtype:
            error_msgs.append(f"{prefix}{name}: the checkpoint has dtype {t.dtype} but the layer has dtype "
                              f"{b.dtype}; allowed: {b.dtype}")
            return True
        if name in _SCALE_BUFFERS and t.device.type != "meta" and not bool(torch.isfinite(t).all()):
            error_msgs.append(f"{prefix}{name}: the checkpoint's values include NaN or Inf; allowed: finite values")
            return True
    # act-order indices: the kernels read x and the scales at them, without bounds checks
    perm, g, scales = (state_dict.get(prefix + n) for n in ("perm", "sorted_g_idx", "scales"))
    k = getattr(module, "in_features", 0)
    if isinstance(perm, torch.Tensor) and perm.device.type != "meta" and not torch.equal(
            perm.long().sort().values, torch.arange(k, device=perm.device)):
        error_msgs.append(f"{prefix}perm: the checkpoint's perm is not a permutation of 0 .. in_features - 1 = "
                          f"{k - 1}; allowed: each input channel once")
        return True
    if (isinstance(g, torch.Tensor) and isinstance(scales, torch.Tensor) and g.device.type != "meta" and g.numel()
            and (int(g.min()) < 0 or int(g.max()) >= scales.shape[-1])):
        error_msgs.append(f"{prefix}sorted_g_idx: the checkpoint's group indices span [{int(g.min())}, "
                          f"{int(g.max())}]; allowed: [0, {scales.shape[-1]}), the columns of its scales")
        return True
    return False


def _sync_flags_after_load(module: "QuantLinear", incompatible_keys) -> None:
    module._sync_flags()


def _check_bias_flag(bias, cls_name: str) -> None:
    if not isinstance(bias, bool):
        raise TypeError(f"bias must be a bool in the constructor, got {type(bias).__name__}; pass a "
                        f"bias tensor to {cls_name}.from_quantized(qw, bias)")


def _check_layer_dtype(dtype: Optional[torch.dtype], act_bits: int) -> None:
    """dtype= of from_linear / quantize_model: a half dtype for W4A16, None for W4A8."""
    if act_bits == 8 and dtype is not None:
        raise ValueError("dtype does not apply to W4A8 (act_bits=8): the layer takes "
                         "float16 and bfloat16 inputs and outputs the input dtype")
    if dtype is not None:
        check_half_dtype(dtype)


def _check_weight_type(qw, want: type, cls_name: str, other: str) -> None:
    if not isinstance(qw, want):
        hint = f" ({other}.from_quantized takes a {type(qw).__name__})" if isinstance(
            qw, (QuantizedWeight, QQQWeight)) else ""
        raise TypeError(f"{cls_name}.from_quantized takes a {want.__name__}, got {type(qw).__name__}{hint}")


def _check_bias(bias: Optional[torch.Tensor], out_features: int) -> None:
    """A bias must be a floating (out_features,) tensor; say which rule it breaks."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        got = type(bias).__name__ if not isinstance(bias, torch.Tensor) else bias.dtype
        raise TypeError(f"bias must be a floating-point tensor, got {got}")
    if bias.shape != (out_features,):
        raise ValueError(f"bias must have shape (out_features,) = ({out_features},), "
                         f"got {tuple(bias.shape)}")


def _input_shape_error(x: torch.Tensor, k: int) -> ValueError:
    got = f"input last dim {x.shape[-1]} != in_features={k}" if x.dim() else "the input is 0-D"
    return ValueError(f"{got}; allowed: an input of shape (..., {k}), got {tuple(x.shape)}")


def _check_linear(linear) -> None:
    """from_linear's argument: an nn.Linear of a supported shape, with values to quantize."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
    err = check_shape(linear.in_features, linear.out_features)
    if err:
        raise ValueError(err)
    dev = linear.weight.device
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"linear.weight is on the {dev} device, which holds no values to quantize; allowed: "
                         "a CUDA or CPU weight (load the weights first, or build QuantLinear / QuantLinearW4A8 "
                         "layers and load a quantized state_dict into them)")


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W stored in 4 bits (W4A16), run by Sailfish's Triton kernels.

    Buffers (formats.int4.PackedW4 layout): qweight int32 (N, Kp/8); scales (N, Gp) and,
    asymmetric, zeros (N, Gp) in the layer dtype; act-order: perm int32 (K,) and
    sorted_g_idx int32 (Kp,); bias (N,) in the layer dtype. Kp = K rounded up to 256;
    Gp = Kp / group_size, or `groups` for an act-order layer whose g_idx uses more scale rows
    (a tensor-parallel slice of a GPTQ desc_act weight: formats/shard.py).
    qweight_layout: int32 scalar, the layout version of qweight (formats.int4.LAYOUT_VERSION).
    A state_dict without it (Sailfish 0.1.0, natural nibble order) is re-packed on load.

    forward(x): x (..., K) in the layer dtype (float16 or bfloat16) -> (..., N).

    Dtype: the layer dtype is fixed at construction (`dtype=`, `from_linear(dtype=)`).
    `.to(device)`, `.cuda()`, `.cpu()` move the buffers; `.half()` / `.to(torch.float16)`
    on a float16 layer (so `model.half()` on a model of float16 QuantLinears) are no-ops.
    Any other dtype change of its floating buffers (`.float()`, `.bfloat16()` on a float16
    layer, ...) raises TypeError and leaves the layer as it was, because the scales define
    the weight and re-rounding them would silently change it. `layer.to_dtype(dtype)`
    converts scales, zeros and bias to the other half dtype when every value is exactly
    representable there, and raises ValueError otherwise, unless allow_lossy_scales=True
    (rounds them, with a warning stating the largest change). load_state_dict and
    from_gptq / from_awq(dtype=) follow the same rule.

    Autograd: the weights are frozen buffers; backward gives the input gradient
    dx = dy @ W_eff (W_eff = dequantize(), ops/autograd.py), so adapters such as LoRA can
    be trained on top of the layer.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int = 4,
                 group_size: int = 128, sym: bool = True, act_order: bool = False,
                 dtype: torch.dtype = torch.float16, device=None, groups: Optional[int] = None):
        super().__init__()
        _check_bits(bits)
        _check_group_size(group_size)
        _check_bias_flag(bias, "QuantLinear")
        err = check_shape(in_features, out_features)
        if err:
            raise ValueError(err)
        check_half_dtype(dtype)
        check_flag("sym", sym)
        check_flag("act_order", act_order)
        if act_order and group_size == -1:
            raise ValueError("act_order=True needs a group size (group_size=-1 has one group)")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.sym, self.act_order = bits, group_size, sym, act_order
        kp = padded_k(in_features)
        gp = 1 if group_size == -1 else kp // group_size
        if groups is not None:  # scale rows of an act-order layer (formats.int4.QuantizedWeight)
            if type(groups) is not int or not act_order or groups < gp:
                raise ValueError(f"groups={groups!r} is only for act_order layers and must be an int, at least "
                                 f"padded in_features / group_size = {gp}")
            gp = groups
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
        self.register_buffer("qweight_layout", torch.tensor(LAYOUT_VERSION, dtype=torch.int32, device=device))
        self._general_g_idx = False
        # a module-level function, not a lambda: the hook is pickled with the module
        self.register_load_state_dict_post_hook(_sync_flags_after_load)

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> "QuantLinear":
        _check_weight_type(qw, QuantizedWeight, "QuantLinear", "QuantLinearW4A8")
        _check_bias(bias, qw.out_features)
        p = pack(qw)  # a g_idx equal to k // group_size packs without permutation
        act_order = p.perm is not None
        layer = cls(qw.in_features, qw.out_features, bias is not None, bits=qw.bits,
                    group_size=qw.group_size, sym=qw.sym, act_order=act_order,
                    dtype=qw.dtype, device=qw.qweight.device,
                    groups=p.scales.shape[1] if act_order and qw.group_size != -1 else None)
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
                    dtype: Optional[torch.dtype] = None, act_bits: int = 16) -> nn.Module:
        """Quantize an nn.Linear (round to nearest). dtype: layer dtype (float16 or
        bfloat16), default the linear's dtype if float16/bfloat16, else float16: a float32
        (or float64) Linear is accepted and gives a float16 layer unless dtype= says
        otherwise (quantize_model follows the same rule).

        act_bits=16 (default): a W4A16 QuantLinear. act_bits=8: a QuantLinearW4A8 (int8
        per-token activations, QQQ weights; group_size -1 or 128, sym only, no dtype:
        the layer takes float16 and bfloat16 inputs)."""
        _check_act_bits(act_bits)
        _check_layer_dtype(dtype, act_bits)
        if act_bits == 8:
            _check_bits(bits)
            if not sym:
                raise ValueError("W4A8 (act_bits=8) weights are symmetric; sym=False is not supported")
            return QuantLinearW4A8.from_linear(linear, group_size=group_size)
        _check_linear(linear)
        check_flag("sym", sym)
        qw = quantize(linear.weight, bits=bits, group_size=group_size, sym=sym, dtype=dtype)
        return cls.from_quantized(qw, linear.bias)

    @classmethod
    def from_gptq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  g_idx: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, *,
                  bits: int = 4, group_size: int = 128, dtype: Optional[torch.dtype] = None,
                  checkpoint_format: str = "gptq", allow_lossy_scales: bool = False) -> "QuantLinear":
        """Load GPTQ checkpoint tensors (formats.gptq; checkpoint_format "gptq" = v1 or "gptq_v2").
        dtype: layer dtype, default scales.dtype; scales that dtype cannot hold exactly need
        allow_lossy_scales=True (formats.int4.cast_scales), which warns with the largest change."""
        shape = (qweight.shape[0] * 8, qweight.shape[1]) if qweight.dim() == 2 else None
        return cls._from_checkpoint(shape, dtype, bias, allow_lossy_scales, lambda: _read_gptq(
            qweight, qzeros, scales, g_idx, bits=bits, group_size=group_size,
            checkpoint_format=checkpoint_format))

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 bias: Optional[torch.Tensor] = None, *, bits: int = 4, group_size: int = 128,
                 dtype: Optional[torch.dtype] = None, allow_lossy_scales: bool = False) -> "QuantLinear":
        """Load AWQ GEMM checkpoint tensors (formats.awq). dtype: layer dtype, default
        scales.dtype; a lossy scale cast needs allow_lossy_scales=True, as in from_gptq."""
        shape = (qweight.shape[0], qweight.shape[1] * 8) if qweight.dim() == 2 else None
        return cls._from_checkpoint(shape, dtype, bias, allow_lossy_scales, lambda: _read_awq(
            qweight, qzeros, scales, bits=bits, group_size=group_size))

    @classmethod
    def from_marlin(cls, B: torch.Tensor, s: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                    group_size: int = 128, dtype: Optional[torch.dtype] = None,
                    allow_lossy_scales: bool = False) -> "QuantLinear":
        """Load a Marlin-format layer (Marlin's Layer.pack() B / s, vLLM's quant_method "marlin";
        formats.marlin): symmetric, group_size 128 or -1. dtype: as in from_gptq."""
        shape = (B.shape[0] * 16, B.shape[1] // 2) if B.dim() == 2 else None
        return cls._from_checkpoint(shape, dtype, bias, allow_lossy_scales, lambda: _read_marlin(
            B, s, group_size=group_size))

    @classmethod
    def _from_checkpoint(cls, shape, dtype, bias, allow_lossy_scales, read) -> "QuantLinear":
        """Shared by from_gptq / from_awq: check the layer shape (K, N) and dtype before
        `read()` converts the tensors, then cast the scales to `dtype` (exact, or said)."""
        err = check_shape(*shape) if shape else None
        if err:
            raise ValueError(err)
        if dtype is not None:
            check_half_dtype(dtype)
        qw = read()
        if dtype is not None and dtype != qw.dtype:
            src = qw.dtype
            qw, change = cast_scales(qw, dtype, allow_lossy_scales=allow_lossy_scales)
            if change:
                warn_lossy_cast("QuantLinear.from_gptq / from_awq", src, dtype, change)
        return cls.from_quantized(qw, bias)

    def _sync_flags(self) -> None:
        """Python-side flags derived from buffers (kept out of forward for torch.compile)."""
        self._general_g_idx = False
        if self.act_order:
            k = self.in_features
            uniform = default_g_idx(k, self.group_size, self.sorted_g_idx.device)
            self._general_g_idx = not torch.equal(self.sorted_g_idx[:k], uniform)

    # -- dtype ------------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        # Follow device moves; refuse dtype changes (class docstring), restoring the
        # buffers first so that the layer is unchanged when the error is raised.
        before = {k: b for k, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        changed = {k: self._buffers[k].dtype for k, b in before.items()
                   if b.is_floating_point() and self._buffers[k].dtype != b.dtype}
        if changed:
            self._buffers.update(before)
            new = next(iter(changed.values()))
            how = (f"use layer.to_dtype({new}) (exact; ValueError when a scale is not "
                   f"representable, unless allow_lossy_scales=True)"
                   if new in HALF_DTYPES else "QuantLinear runs float16 or bfloat16 only")
            raise TypeError(f"QuantLinear has dtype {self.dtype}; .to()/.half()/.float()/.bfloat16() "
                            f"do not change it (that would re-round its scales) and {new} was "
                            f"requested: {how}")
        return self

    def to_dtype(self, dtype: torch.dtype, *, allow_lossy_scales: bool = False) -> "QuantLinear":
        """Convert the layer, in place, to the other half dtype. Exact by default: every
        scale, zero point and bias value must be representable in `dtype` (else ValueError
        naming the buffer, layer unchanged). allow_lossy_scales=True rounds them instead and
        warns with the largest relative change of a dequantized weight (and of the bias).
        The effective weight s * (q - z) is then rounded to `dtype`, as for any layer of that
        dtype. Returns self."""
        check_half_dtype(dtype)
        if dtype == self.dtype:
            return self
        src, bias = self.dtype, self.bias
        qw, change = cast_scales(self.quantized_weight(), dtype, allow_lossy_scales=allow_lossy_scales,
                                 how=f"to_dtype({dtype}, allow_lossy_scales=True)")
        converted = {"scales": self.scales.to(dtype)}  # the padded buffer: its values are qw's
        for name in ("zeros", "bias"):
            if self._buffers[name] is not None:
                converted[name] = checked_cast(self._buffers[name], dtype, name, allow_lossy_scales=allow_lossy_scales,
                                               how=f"to_dtype({dtype}, allow_lossy_scales=True)")[0]
        self._buffers.update(converted)
        bias_change = 0.0 if bias is None else relative_change(bias, self.bias)
        if change or bias_change:
            warn_lossy_cast("QuantLinear.to_dtype", src, dtype, change, bias_change)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if _check_loaded(self, state_dict, prefix, error_msgs):
            return
        _upgrade_qweight_layout(state_dict, prefix, LAYOUT_VERSION, natural_to_fragment_order, "")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

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

    def shard(self, rank: int, world_size: int, dim: int) -> "QuantLinear":
        """Tensor-parallel shard as a new layer: dim=0 output features (column parallel),
        dim=1 input features (row parallel, bias on rank 0 only); see sailfish.parallel."""
        qw = shard_quantized(self.quantized_weight(), rank, world_size, dim)
        return type(self).from_quantized(qw, shard_bias(self.bias, rank, world_size, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Eager decode calls are host-bound (bench/overhead.py), so this path is lean: the
        # buffers come from _buffers (nn.Module.__getattr__ costs ~1.5 us per name), 2-D
        # inputs skip the reshapes, and without a gradient to compute the op runs without
        # an autograd formula, as a plain function call where the dispatcher would add
        # nothing but its cost (ops.direct_call_ok).
        buf = self._buffers
        scales = buf["scales"]
        if x.dtype is not scales.dtype:
            raise TypeError(f"input dtype {x.dtype} does not match the layer dtype {scales.dtype}")
        k = self.in_features
        if x.dim() == 0 or x.shape[-1] != k:
            raise _input_shape_error(x, k)
        if x.requires_grad and torch.is_grad_enabled():
            op = w4a16_gemm
        else:
            op = w4a16_layer_impl if direct_call_ok(x) else w4a16_gemm_nograd
        flat = x.dim() == 2
        y = op(x if flat else x.reshape(-1, k), buf["qweight"], scales, buf["zeros"], buf["perm"],
               buf["sorted_g_idx"] if self._general_g_idx else None, buf["bias"], k, self.group_size)
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, bits={self.bits}, group_size={self.group_size}, "
                f"sym={self.sym}, act_order={self.act_order}, dtype={str(self.dtype)[6:]}")


ACT_BITS = (16, 8)


def _check_act_bits(act_bits: int) -> None:
    check_int_choice("act_bits", act_bits, ACT_BITS, " (16: W4A16, 8: W4A8)")


class QuantLinearW4A8(nn.Module):
    """y = x @ W^T + b with int8 per-token activations and 4-bit weights (W4A8, QQQ), run
    on int8 tensor cores by Sailfish's Triton kernels. Math: formats/qqq.py.

    forward(x): x (..., K) float16 or bfloat16 -> (..., N) in x's dtype, computed as
        x_q, s_tok = quantize_per_token(x)      # int8 (M, K), float32 (M,)
        y = s_tok[m] * s_ch[n] * (x_q @ w8^T)[m, n] + bias[n]

    Buffers (formats.qqq.PackedQQQ layout): qweight int32 (N, Kp/8), Kp = K rounded up to
    256; s_ch float32 (N,); s_g float16 (N, Kp/128) for group_size=128 (None for -1);
    bias float32 (N,) or None; qweight_layout int32 scalar, the layout version of qweight
    (formats.qqq.LAYOUT_VERSION_W4A8; state dicts without it, from Sailfish <= 0.2, hold
    version 1 and are re-packed on load). Their dtypes are part of the format: .half(), .to(dtype)
    and friends move them between devices but never change their dtype.

    act_dtype="fp8": the activations are quantized per token to float8 e4m3 instead
    (quantize_per_token_fp8, s_tok = max|x[m]| / 448) and run on fp8 tensor cores with the
    same weights: per-channel the same w = q - 8; per-group s_g is applied to each group's
    fp32 partial sum, so the effective weight is s_ch * s_g * (q - 8) without the int8
    path's rounding of s_g * (q - 8) (formats.qqq.fp8_weight). A module setting, not a
    buffer: the state dict is the same for both.

    Autograd: the weights are frozen buffers. When x requires a gradient (int8 only), backward
    gives dx = dy @ dequantize() with a straight-through estimator for the per-token int8
    rounding (ops/autograd.py), so adapters can be trained on top of the layer.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group_size: int = -1, act_dtype: str = "int8", device=None):
        super().__init__()
        check_group_size_w4a8(group_size)
        check_act_dtype(act_dtype)
        self.act_dtype = act_dtype
        _check_bias_flag(bias, "QuantLinearW4A8")
        err = check_shape(in_features, out_features)
        if err:
            raise ValueError(err)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.bits, self.act_bits = 4, 8
        kp = padded_k(in_features)
        self.register_buffer("qweight", torch.zeros((out_features, kp // 8), dtype=torch.int32, device=device))
        self.register_buffer("s_ch", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("s_g", None if group_size == -1 else
                             torch.zeros((out_features, kp // group_size), dtype=torch.float16, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32, device=device) if bias else None)
        self.register_buffer("qweight_layout", torch.tensor(LAYOUT_VERSION_W4A8, dtype=torch.int32, device=device))

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_quantized(cls, qw: QQQWeight, bias: Optional[torch.Tensor] = None, *,
                       act_dtype: str = "int8") -> "QuantLinearW4A8":
        _check_weight_type(qw, QQQWeight, "QuantLinearW4A8", "QuantLinear")
        _check_bias(bias, qw.out_features)
        p = pack_qqq(qw)
        layer = cls(qw.in_features, qw.out_features, bias is not None, group_size=qw.group_size,
                    act_dtype=act_dtype, device=qw.qweight.device)
        layer.qweight.copy_(p.qweight)
        layer.s_ch.copy_(p.s_ch)
        if p.s_g is not None:
            layer.s_g.copy_(p.s_g)
        if bias is not None:
            layer.bias.copy_(bias.detach().float())
        return layer

    @classmethod
    def from_qqq(cls, B: torch.Tensor, s_channel: torch.Tensor, s_group: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor] = None, *, group_size: int = 128,
                 act_dtype: str = "int8") -> "QuantLinearW4A8":
        """Load a QQQ checkpoint layer (B, s_channel, s_group; formats.qqq.from_qqq), exactly."""
        return cls.from_quantized(from_qqq(B, s_channel, s_group, group_size=group_size), bias,
                                  act_dtype=act_dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group_size: int = -1, act_dtype: str = "int8") -> "QuantLinearW4A8":
        """Quantize an nn.Linear with formats.qqq.quantize_qqq (round to nearest)."""
        check_group_size_w4a8(group_size)
        check_act_dtype(act_dtype)
        _check_linear(linear)
        return cls.from_quantized(quantize_qqq(linear.weight, group_size), linear.bias, act_dtype=act_dtype)

    def _apply(self, fn, recurse=True):
        # Keep the format dtypes (float32 s_ch, float16 s_g, float32 bias) through
        # model.half() / model.to(torch.bfloat16): follow the device change only.
        before = {k: b for k, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for k, old in before.items():
            new = self._buffers[k]
            if new is not None and new.dtype != old.dtype:
                self._buffers[k] = old.to(new.device)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if _check_loaded(self, state_dict, prefix, error_msgs):
            return
        _upgrade_qweight_layout(state_dict, prefix, LAYOUT_VERSION_W4A8, natural_to_fragment_order_w4a8,
                                "W4A8 ")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    # -- use --------------------------------------------------------------------------
    def packed(self) -> PackedQQQ:
        return PackedQQQ(self.qweight, self.s_ch, self.s_g, self.in_features, self.group_size)

    def quantized_weight(self) -> QQQWeight:
        return unpack_qqq(self.packed())

    def int8_weight(self) -> torch.Tensor:
        """int8 (N, K): w8, the weight operand of the int8 product."""
        return self.quantized_weight().int8_weight()

    def dequantize(self) -> torch.Tensor:
        """float32 (N, K): the effective weight, s_ch[n] * w8[n, k] (act_dtype "fp8":
        s_ch[n] * fp8_weight[n, k]); layer(x) equals (per-token quantized x) @ dequantize().T
        + bias up to the accumulation and output rounding."""
        qw = self.quantized_weight()
        if self.act_dtype == "fp8":
            return qw.s_ch[:, None] * fp8_weight(qw)
        return qw.dequantize()

    def shard(self, rank: int, world_size: int, dim: int) -> "QuantLinearW4A8":
        """Tensor-parallel shard as a new layer: dim=0 output features (column parallel),
        dim=1 input features (row parallel, bias on rank 0 only); see sailfish.parallel."""
        qw = shard_quantized(self.quantized_weight(), rank, world_size, dim)
        layer = type(self).from_quantized(qw, shard_bias(self.bias, rank, world_size, dim))
        layer.act_dtype = self.act_dtype
        return layer

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dtype not in HALF_DTYPES:
            raise TypeError(f"input dtype {x.dtype} is not supported; allowed: float16, bfloat16")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise _input_shape_error(x, self.in_features)

    def quantize_input(self, x: torch.Tensor):
        """x (..., K) float16/bfloat16 -> (x_q (M, K) int8, or float8_e4m3fn for act_dtype "fp8";
        s_tok float32 (M,)), M = x.numel() // K."""
        self._check_input(x)
        x2 = x.reshape(-1, self.in_features)
        if self.act_dtype == "fp8":
            return torch.ops.sailfish.quantize_per_token_fp8(x2)
        return torch.ops.sailfish.quantize_per_token(x2)

    def forward_quantized(self, x_q: torch.Tensor, x_scales: torch.Tensor,
                          out_dtype: torch.dtype) -> torch.Tensor:
        """The GEMM alone: x_q int8 (float8_e4m3fn for act_dtype "fp8") (M, K), x_scales
        float32 (M,) -> (M, N) in out_dtype."""
        want = torch.float8_e4m3fn if self.act_dtype == "fp8" else torch.int8
        if x_q.dtype != want:
            raise TypeError(f"x_q dtype {x_q.dtype} does not match this layer (act_dtype="
                            f"{self.act_dtype!r} takes {want}); use layer.quantize_input(x)")
        buf = self._buffers  # (lean as forward: a fused model calls this once per norm, eagerly)
        op = w4a8_gemm_impl if direct_call_ok(x_q) else torch.ops.sailfish.w4a8_gemm
        return op(x_q, x_scales, buf["qweight"], buf["s_ch"], buf["s_g"], buf["bias"], self.in_features,
                  self.group_size, out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        # quantize_per_token + w4a8_gemm in one op (ops/w4a8.py); with a gradient to compute,
        # the variant with a straight-through backward (the int8 x_q between the two cannot
        # carry one; ops/autograd.py). Lean as QuantLinear.forward (see there), and called
        # directly under the same conditions.
        buf, k = self._buffers, self.in_features
        flat = x.dim() == 2
        x2 = x if flat else x.reshape(-1, k)
        fp8 = self.act_dtype == "fp8"
        if x.requires_grad and torch.is_grad_enabled():
            if fp8:
                raise NotImplementedError("QuantLinearW4A8(act_dtype='fp8') has no backward yet; run it "
                                          "under torch.no_grad() or use act_dtype='int8' for training")
            op = w4a8_linear
        elif direct_call_ok(x):
            op = w4a8_linear_fp8_impl if fp8 else w4a8_linear_impl
        elif fp8:  # (no fused fp8 op: the two ops, as quantize_input + forward_quantized)
            x_q, x_scales = torch.ops.sailfish.quantize_per_token_fp8(x2)
            y = torch.ops.sailfish.w4a8_gemm(x_q, x_scales, buf["qweight"], buf["s_ch"], buf["s_g"], buf["bias"],
                                             k, self.group_size, x.dtype)
            return y if flat else y.reshape(*x.shape[:-1], self.out_features)
        else:
            op = w4a8_linear_nograd
        y = op(x2, buf["qweight"], buf["s_ch"], buf["s_g"], buf["bias"], k, self.group_size)
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, bits=4, act_bits=8, group_size={self.group_size}"
                + (", act_dtype=fp8" if self.act_dtype == "fp8" else ""))
