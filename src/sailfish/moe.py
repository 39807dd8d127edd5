"""QuantExperts: 4-bit drop-in for the experts modules of transformers 5 MoE models.

transformers 5 (checked on 5.24) holds a MoE block's experts in one module (MixtralExperts,
Qwen2MoeExperts, Qwen3MoeExperts, DeepseekV2Experts, DeepseekV3Experts, ...) with two 3-D
parameters, `gate_up_proj` (E, 2I, H; gate rows before up rows) and `down_proj` (E, H, I),
called as experts(hidden_states (M, H), top_k_index (M, k), top_k_weights (M, k)) and
computing sum_k w_k * down_e(act(gate_e(x)) * up_e(x)). The router (softmax, top-k,
renormalisation, norm_topk_prob, grouped top-k) runs before it in the MoE block and keeps its
16-bit weight (sailfish.fuse's SailfishTopKRouter runs the known softmax + top-k formulas in one
launch, sailfish::router_topk, the rest is left as it is); shared experts are ordinary MLPs of
nn.Linear layers, which
quantize_model turns into QuantLinears like any other. QuantExperts replaces the experts
module only, so every architecture's routing semantics stay transformers' own.

Supported: silu-gated experts without biases, in transformers' (E, 2I, H) orientation
(a module with has_bias, is_transposed, no gate, another activation or its own _apply_gate is
refused with a ValueError naming what).

Shared experts (num_shared = S > 0; DeepSeek-V2 / V3). A DeepSeek MoE block adds a shared MLP,
down(silu(gate(x)) * up(x)) of width S * I, to the routed experts' sum for every token. That MLP
is exactly S experts of the routed width I (expert j: gate and up rows [jI, (j+1)I), down input
channels [jI, (j+1)I); the same sum, split), so sailfish.fuse.fold_shared_experts moves it into
the block's QuantExperts: its stacked buffers hold the E routed experts, then the S shared ones,
and sailfish::moe_w4a16(num_shared=S) runs them with weight 1 after every token's top-k, one
block instead of the experts plus three more GEMM launches. The weights exist once, in the
stack; the shared MLP module is gone from the block. The state_dict stays the unfolded model's:
the experts' own keys hold the E routed experts (views of the stack's first E), and the shared
MLP's projections are written, as the plain QuantLinears they were, under the sibling's keys
(`<block>.shared_experts.gate_proj.qweight`, ...; unpacked from the stack and packed again, exactly,
on every state_dict() call, as fuse.FusedQuantLinear writes its projections), and read back into
the stack by load_state_dict (the folded block hands them over; a QuantExperts loaded on its own
reads `shared_experts.*` itself). sailfish.fuse.unfused_layers gives them as those layers too, so
save_quantized writes the unfolded model's checkpoint. Shared experts take no act-order (their
down projection is cut on group boundaries: I a multiple of the group size, or per-channel).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from .formats.experts import PackedExperts, check_perms, pack_into, padded_k_experts, quantize_experts
from .formats.int4 import (GROUP_SIZES, HALF_DTYPES, QuantizedWeight, check_flag, check_half_dtype,
                           check_int_choice, unpack)
from .formats.shard import concat_quantized, slice_quantized
from .nn import QuantLinear, parent_prefix

# DeepSeek-V2 / V3's names: the block's shared MLP (the experts module's sibling) and its
# projections, under which a QuantExperts holding shared experts keeps their state_dict keys
SHARED_MLP = "shared_experts"
SHARED_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def experts_reason(module: nn.Module) -> Optional[str]:
    """None if `module` is a transformers experts module QuantExperts can replace, else why not.
    (A module without 3-D gate_up_proj / down_proj parameters is no experts module at all:
    is_experts_module.)"""
    if getattr(module, "has_bias", False) or any(n.endswith("_bias") for n, _ in module.named_parameters()):
        return "experts with biases are not supported"
    if getattr(module, "is_transposed", False):
        return "transposed expert weights (is_transposed=True) are not supported"
    if not getattr(module, "has_gate", True):
        return "non-gated experts (has_gate=False) are not supported"
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and apply_gate.__name__ != "_default_apply_gate":
        return f"a custom gate ({type(module).__name__}._apply_gate) is not supported"
    act = getattr(module, "act_fn", None)
    if not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        return f"activation {type(act).__name__} is not supported; allowed: silu"
    e, two_i, h = module.gate_up_proj.shape
    if two_i % 2 or tuple(module.down_proj.shape) != (e, h, two_i // 2):
        return (f"gate_up_proj {tuple(module.gate_up_proj.shape)} and down_proj {tuple(module.down_proj.shape)} "
                "are not (E, 2I, H) and (E, H, I)")
    return None


def is_experts_module(module: nn.Module) -> bool:
    """A transformers 5 experts module: 3-D `gate_up_proj` and `down_proj` parameters."""
    p, q = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(p, torch.Tensor) and isinstance(q, torch.Tensor) and p.dim() == 3 and q.dim() == 3


class QuantExperts(nn.Module):
    """E 4-bit experts (W4A16, formats/experts.PackedExperts) run by one grouped kernel per GEMM
    (sailfish::moe_w4a16). forward(hidden_states (M, H), top_k_index (M, k), top_k_weights
    (M, k)) -> (M, H) in the layer dtype, as transformers' experts modules; hidden_states may
    have leading dims (..., H) with index / weights (..., k).

    Buffers: w13_* (gate_up, (E, 2I, H)) and w2_* (down, (E, H, I)) qweight / scales / zeros in
    the stacked layout; act_order=True (GPTQ desc_act checkpoints: their per-expert g_idx) adds
    w13_perm int32 (E, H) and w2_perm (E, I), each expert's permutation of its input channels
    (formats/experts.py), loaded only if every row is a permutation.

    num_shared S > 0 (no act-order): the buffers hold E + S experts, the routed ones then the
    S shared experts every token takes at weight 1 (DeepSeek's shared MLP of width S * I; the
    module docstring says how its state_dict keeps the unfolded model's keys). num_experts is E,
    the routed experts."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, *, group_size: int = 128,
                 sym: bool = True, act_order: bool = False, dtype: torch.dtype = torch.float16, device=None,
                 num_shared: int = 0):
        super().__init__()
        for name, v in (("num_experts", num_experts), ("hidden_dim", hidden_dim),
                        ("intermediate_dim", intermediate_dim)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if type(num_shared) is not int or num_shared < 0:
            raise ValueError(f"num_shared={num_shared!r} must be an int >= 0 (the shared experts after the routed ones)")
        check_int_choice("group_size", group_size, GROUP_SIZES)
        check_flag("sym", sym)
        check_flag("act_order", act_order)
        if act_order and num_shared:
            raise ValueError(f"num_shared={num_shared} needs act_order=False: shared experts take no act-order")
        check_half_dtype(dtype)
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.group_size, self.num_shared = group_size, num_shared
        total = num_experts + num_shared
        for name, n, k in (("w13", 2 * intermediate_dim, hidden_dim), ("w2", hidden_dim, intermediate_dim)):
            kp = padded_k_experts(k)
            gp = 1 if group_size == -1 else -(-kp // group_size)
            self.register_buffer(f"{name}_qweight", torch.zeros((total, n, kp // 8), dtype=torch.int32, device=device))
            self.register_buffer(f"{name}_scales", torch.zeros((total, n, gp), dtype=dtype, device=device))
            self.register_buffer(f"{name}_zeros", None if sym else torch.zeros((total, n, gp), dtype=dtype,
                                                                               device=device))
            perm = torch.arange(k, dtype=torch.int32, device=device).repeat(num_experts, 1) if act_order else None
            self.register_buffer(f"{name}_perm", perm)

    @classmethod
    def from_packed(cls, w13: PackedExperts, w2: PackedExperts) -> "QuantExperts":
        """From stacked gate_up (E, 2I, H) and down (E, H, I) experts of one format."""
        E, two_i, H = w13.num_experts, w13.out_features, w13.in_features
        if (w2.num_experts, w2.out_features, w2.in_features) != (E, H, two_i // 2) or two_i % 2:
            raise ValueError(f"w13 (E, 2I, H) = {(E, two_i, H)} and w2 (E, H, I) = "
                             f"{(w2.num_experts, w2.out_features, w2.in_features)} do not fit together")
        if (w13.group_size, w13.dtype, w13.sym) != (w2.group_size, w2.dtype, w2.sym):
            raise ValueError(f"w13 and w2 must share group_size, dtype and sym, got {(w13.group_size, w13.dtype, w13.sym)} "
                             f"and {(w2.group_size, w2.dtype, w2.sym)}")
        act_order = w13.perm is not None or w2.perm is not None
        layer = cls(E, H, two_i // 2, group_size=w13.group_size, sym=w13.sym, act_order=act_order, dtype=w13.dtype,
                    device=w13.qweight.device)
        for name, p in (("w13", w13), ("w2", w2)):
            if p.perm is not None:
                check_perms(f"{name}.perm", p.perm, E, p.in_features)
            for part in ("qweight", "scales", "zeros", "perm"):  # (a perm of None: the identity)
                t = getattr(p, part)
                if t is not None:
                    getattr(layer, f"{name}_{part}").copy_(t)
        return layer

    @classmethod
    def from_experts(cls, module: nn.Module, *, group_size: int = 128, sym: bool = True,
                     dtype: Optional[torch.dtype] = None) -> "QuantExperts":
        """Round-to-nearest quantization of a transformers experts module (each expert's gate_up
        and down weight as formats.int4.quantize would a Linear's). dtype: the layer dtype,
        default the module's if float16/bfloat16, else float16."""
        if not is_experts_module(module):
            raise TypeError(f"module must be a transformers experts module (3-D gate_up_proj and down_proj), "
                            f"got {type(module).__name__}")
        reason = experts_reason(module)
        if reason:
            raise ValueError(f"{type(module).__name__}: {reason}")
        if dtype is None:
            dtype = module.gate_up_proj.dtype if module.gate_up_proj.dtype in HALF_DTYPES else torch.float16
        with torch.no_grad():
            w13 = quantize_experts(module.gate_up_proj.detach(), group_size, sym, dtype)
            w2 = quantize_experts(module.down_proj.detach(), group_size, sym, dtype)
        return cls.from_packed(w13, w2)

    @property
    def dtype(self) -> torch.dtype:
        return self.w13_scales.dtype

    @property
    def act_order(self) -> bool:
        return self.w13_perm is not None

    @property
    def sym(self) -> bool:
        return self.w13_zeros is None

    # -- shared experts: the shared MLP's projections <-> the last num_shared experts -----------
    def with_shared(self, gate: QuantizedWeight, up: QuantizedWeight, down: QuantizedWeight) -> "QuantExperts":
        """A new QuantExperts holding this one's routed experts and, after them, the shared MLP
        down(silu(gate(x)) * up(x)) of width W (gate / up (W, H), down (H, W)) as S = W / I shared
        experts; ValueError naming what does not fit (W not a multiple of I, a group cut by an
        expert boundary, another group size, dtype or symmetry, act-order)."""
        i = self.intermediate_dim
        if self.num_shared or self.act_order:
            raise ValueError(f"with_shared takes routed experts without act-order, got num_shared={self.num_shared}, "
                             f"act_order={self.act_order}")
        if gate.out_features % i or not gate.out_features:
            raise ValueError(f"gate_proj has {gate.out_features} output features, not a multiple of the experts' "
                             f"intermediate size {i}")
        layer = type(self)(self.num_experts, self.hidden_dim, i, group_size=self.group_size, sym=self.sym,
                           dtype=self.dtype, device=self.w13_qweight.device, num_shared=gate.out_features // i)
        with torch.no_grad():
            for name, b in self._buffers.items():
                if b is not None:
                    layer._buffers[name][:self.num_experts].copy_(b)
            layer._pack_shared((gate, up, down))
        return layer

    def _pack_shared(self, weights) -> None:
        """The shared MLP's (gate, up, down) QuantizedWeights into the last num_shared experts."""
        E, S, H, i = self.num_experts, self.num_shared, self.hidden_dim, self.intermediate_dim
        for name, qw, shape in zip(SHARED_PROJECTIONS, weights, ((S * i, H), (S * i, H), (H, S * i))):
            if not isinstance(qw, QuantizedWeight):
                raise TypeError(f"{name} must be a QuantizedWeight, got {type(qw).__name__}")
            got = (qw.out_features, qw.in_features, qw.group_size, qw.dtype, qw.sym, qw.g_idx is None)
            want = (*shape, self.group_size, self.dtype, self.sym, True)
            if got != want:
                raise ValueError(f"{name} has (out_features, in_features, group_size, dtype, sym, no act-order) "
                                 f"{got}; {S} shared experts of these experts need {want}")
        gate, up, down = weights
        w13, w2 = self.packed()
        for j in range(S):
            lo, hi = j * i, (j + 1) * i
            pack_into(w13, E + j, [(0, slice_quantized(gate, 0, lo, hi)), (i, slice_quantized(up, 0, lo, hi))])
            pack_into(w2, E + j, [(0, slice_quantized(down, 1, lo, hi))])

    def shared_weights(self) -> Tuple[QuantizedWeight, QuantizedWeight, QuantizedWeight]:
        """The shared MLP's (gate, up, down) QuantizedWeights, put back together from the last
        num_shared experts (the exact inverse of with_shared)."""
        if not self.num_shared:
            raise ValueError("this QuantExperts holds no shared experts (num_shared=0)")
        w13, w2 = self.packed()
        i, experts = self.intermediate_dim, range(self.num_experts, self.num_experts + self.num_shared)
        gate_up = [unpack(w13.expert(e)) for e in experts]
        return (concat_quantized([slice_quantized(g, 0, 0, i) for g in gate_up]),
                concat_quantized([slice_quantized(g, 0, i, 2 * i) for g in gate_up]),
                concat_quantized([unpack(w2.expert(e)) for e in experts], dim=1))

    def shared_layers(self):
        """[(projection name, QuantLinear)]: the shared MLP as the plain layers it was (what its
        state_dict keys and a checkpoint hold)."""
        return [(name, QuantLinear.from_quantized(qw)) for name, qw in zip(SHARED_PROJECTIONS, self.shared_weights())]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if not self.num_shared:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, b in self._buffers.items():  # the routed experts, under the unfolded module's keys
            if b is not None:
                destination[prefix + name] = (b if keep_vars else b.detach())[:self.num_experts]
        shared = f"{parent_prefix(prefix)}{SHARED_MLP}."
        for name, layer in self.shared_layers():
            layer._save_to_state_dict(destination, f"{shared}{name}.", keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # the kernel reads x at the perms' indices without bounds checks: refuse any other values
        for name, k in (("w13_perm", self.hidden_dim), ("w2_perm", self.intermediate_dim)):
            t = state_dict.get(prefix + name)
            if isinstance(t, torch.Tensor) and getattr(self, name) is not None:
                try:
                    check_perms(prefix + name, t, self.num_experts, k)
                except ValueError as e:
                    error_msgs.append(str(e))
                    return
        args = (local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if not self.num_shared:
            return super()._load_from_state_dict(state_dict, prefix, *args)
        if not prefix:  # loaded on its own (in a model the folded block hands the shared keys over)
            shared = f"{SHARED_MLP}."
            self._load_shared(state_dict, shared, *args)
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith(shared)}
        # the routed keys hold E experts: load them through views of the stack's first E
        full = dict(self._buffers)
        routed = {k: None if b is None else b[:self.num_experts] for k, b in full.items()}
        self._buffers.update(routed)
        try:
            super()._load_from_state_dict(state_dict, prefix, *args)
        finally:
            loaded = dict(self._buffers)
            self._buffers.update(full)
        with torch.no_grad():
            for k, b in loaded.items():  # (load_state_dict(assign=True) puts its tensors in place of the views)
                if b is not None and b is not routed[k]:
                    full[k][:self.num_experts].copy_(b)

    def _load_shared(self, state_dict, shared: str, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs) -> None:
        """Read the shared MLP's projections (keys `shared` + gate_proj. / up_proj. / down_proj.)
        as the plain layers they are into the last num_shared experts."""
        if strict:
            mine = tuple(f"{shared}{name}." for name in SHARED_PROJECTIONS)
            unexpected_keys.extend(k for k in state_dict if k.startswith(shared) and not k.startswith(mine))
        errors, missing, weights = len(error_msgs), len(missing_keys), []
        w, h = self.num_shared * self.intermediate_dim, self.hidden_dim
        for name, (k, n) in zip(SHARED_PROJECTIONS, ((h, w), (h, w), (w, h))):
            part = QuantLinear(k, n, False, group_size=self.group_size, sym=self.sym, dtype=self.dtype,
                               device=self.w13_qweight.device)
            part._load_from_state_dict(state_dict, f"{shared}{name}.", local_metadata, strict, missing_keys,
                                       unexpected_keys, error_msgs)
            weights.append(part)
        if len(error_msgs) > errors or len(missing_keys) > missing:
            return
        try:
            with torch.no_grad():
                self._pack_shared([part.quantized_weight() for part in weights])
        except (TypeError, ValueError) as e:
            error_msgs.append(f"{shared[:-1]}: cannot be held as {self.num_shared} shared experts: {e}")

    def _apply(self, fn, recurse=True):
        # Follow device moves; a dtype change would re-round the scales (as QuantLinear, refused,
        # with the buffers restored first so the layer is unchanged)
        before = {k: b for k, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        wanted = self._buffers["w13_scales"].dtype  # (every floating buffer is cast alike)
        if wanted != before["w13_scales"].dtype:
            self._buffers.update(before)
            raise TypeError(f"QuantExperts has dtype {self.dtype}; .to()/.half()/.float()/.bfloat16() do not "
                            f"change it (that would re-round its scales) and {wanted} was requested")
        return self

    def packed(self) -> Tuple[PackedExperts, PackedExperts]:
        """(w13, w2) of every expert in the buffers, the shared ones (num_shared) included."""
        return (PackedExperts(self.w13_qweight, self.w13_scales, self.w13_zeros, self.hidden_dim, self.group_size,
                              self.w13_perm),
                PackedExperts(self.w2_qweight, self.w2_scales, self.w2_zeros, self.intermediate_dim, self.group_size,
                              self.w2_perm))

    def dequantize(self, rounded: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
        """float32 (gate_up_proj (E + S, 2I, H), down_proj (E + S, H, I)): the effective weights
        (S = num_shared; rounded=False: s * (q - z) exactly, PackedExperts.dequantize)."""
        w13, w2 = self.packed()
        return w13.dequantize(rounded), w2.dequantize(rounded)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_dim:
            raise ValueError(f"hidden_states must have shape (..., {self.hidden_dim}), got "
                             f"{tuple(hidden_states.shape)}")
        lead = hidden_states.shape[:-1]
        for name, t in (("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
            if t.dim() != len(lead) + 1 or t.shape[:-1] != lead:
                raise ValueError(f"{name} must have shape ({', '.join(map(str, lead))}, top_k) to match "
                                 f"hidden_states {tuple(hidden_states.shape)}, got {tuple(t.shape)}")
        x = hidden_states.reshape(-1, self.hidden_dim)
        k = top_k_index.shape[-1]
        y = torch.ops.sailfish.moe_w4a16(
            x, top_k_index.reshape(x.shape[0], k), top_k_weights.reshape(x.shape[0], k),
            self.w13_qweight, self.w13_scales, self.w13_zeros, self.w2_qweight, self.w2_scales, self.w2_zeros,
            self.group_size, self.w13_perm, self.w2_perm, self.num_shared)
        return y.reshape(*lead, self.hidden_dim)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, bits=4, group_size={self.group_size}, "
                f"sym={self.sym}, act_order={self.act_order}, num_shared={self.num_shared}")
