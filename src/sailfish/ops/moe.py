"""Mixture-of-experts block with 4-bit experts (W4A16): reference, routing prep, configs,
launcher and op.

    sailfish::moe_w4a16(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros,
                        w2_qweight, w2_scales, w2_zeros, group_size) -> y

y[m] = sum_k topk_weights[m, k] * down_e(silu(gate_e(x[m])) * up_e(x[m])), e = topk_ids[m, k],
the experts in formats/experts.PackedExperts layout: w13 (E, 2I, H) holds gate rows [0, I)
and up rows [I, 2I) of each expert (transformers' gate_up_proj), w2 (E, H, I) the down
projection. Expert ids outside [0, E) contribute nothing (transformers passes E for a token
slot that no local expert takes). The routing (softmax, top-k, renormalisation) is the
caller's: the op takes its result.

Numerics (the reference below is the exact twin; kernels/moe.py): fp32 accumulation,
h = silu(gate) * up in fp32 rounded once to x's dtype, each (token, k) row of the down
product times its routing weight in fp32 (rounded once to x's dtype when K is not split),
the top-k rows of a token added in the fixed order k = 0, 1, ... in fp32, rounded once.
Deterministic run to run: no atomics anywhere.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..formats.experts import PackedExperts, padded_k_experts
from ..formats.int4 import GROUP_SIZES, K_CHUNK, check_int_choice, unpack
from ..runtime.device import check_devices, device_of, has_bf16x2, sms_for, use_triton
from ..runtime.dispatch import define_op
from ..runtime.launch import Launch, aligned
from ..tuning import Config, next_pow2, split_k_for
from .common import acc_fence  # (the Triton-version rule of the dense path)

MAX_TOPK = 32  # the top-k sum is unrolled (kernels/moe._topk_sum_kernel)
# the routing kernels hold a (slots x experts) one-hot tile in registers (Router); the largest
# MoE models published have 512 routed experts (Qwen3-Next), DeepSeek-V3 256, Kimi-K2 384
MAX_EXPERTS = 1024
_REDUCE_BLOCK = 1024


# ----------------------------------------------------------------------------------
# Reference (pure PyTorch): the op's math, and its CPU path without the interpreter
# ----------------------------------------------------------------------------------
def moe_w4a16_reference(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                        w2_zeros, group_size):
    M, H = x.shape
    topk = topk_ids.shape[1]
    E, I = w13_qweight.shape[0], w13_qweight.shape[1] // 2
    w13 = PackedExperts(w13_qweight, w13_scales, w13_zeros, H, group_size)
    w2 = PackedExperts(w2_qweight, w2_scales, w2_zeros, I, group_size)
    ids = topk_ids.reshape(-1).long()
    tw = topk_weights.reshape(-1).float()
    rows = torch.zeros((M * topk, H), dtype=torch.float32, device=x.device)
    for e in range(E):
        slots = (ids == e).nonzero()[:, 0]
        if not len(slots):
            continue
        gu = x[slots // topk].float() @ unpack(w13.expert(e)).dequantize().T
        h = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(x.dtype).float()
        rows[slots] = ((h @ unpack(w2.expert(e)).dequantize().T) * tw[slots, None]).to(x.dtype).float()
    rows = rows.view(M, topk, H)
    y = rows[:, 0]
    for k in range(1, topk):  # the kernel's fixed order
        y = y + rows[:, k]
    return y.to(x.dtype)


# ----------------------------------------------------------------------------------
# Routing prep: slots sorted by expert, padded to whole blocks (torch ops, fixed sizes)
# ----------------------------------------------------------------------------------
def max_blocks(slots: int, num_experts: int, block_m: int) -> int:
    """Blocks of block_m slots the routing of `slots` (token, k) pairs can need at most: every
    expert's run ends in at most one partial block, and at most min(E, slots) experts get one."""
    return -(-slots // block_m) + min(num_experts, slots)


def align_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slots int32 (max_blocks * block_m,), block_expert int32 (max_blocks,)).

    Slot t = m * topk + k of topk_ids (M, topk). sorted_slots lists every expert's slots in
    increasing order, expert 0 first, each expert's run padded to a whole block with T = M * topk;
    block_expert[b] is the expert of block b, -1 for the blocks past the last used one. Ids
    outside [0, E) are left out. Deterministic (a stable sort, unique scatter targets) and free of
    host synchronisation, with sizes that depend only on (M, topk, E, block_m): CUDA graphs and
    torch.compile take it as it is."""
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).long()
    T = ids.numel()
    nb = max_blocks(T, num_experts, block_m)
    sorted_ids, order = torch.sort(ids, stable=True)
    bounds = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=dev))  # run starts
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    valid = (sorted_ids >= 0) & (sorted_ids < num_experts)
    e = sorted_ids.clamp(0, num_experts - 1)
    dest = ends[e] - padded[e] + torch.arange(T, device=dev) - bounds[e]
    dest = torch.where(valid, dest, nb * block_m + torch.arange(T, device=dev))  # left out: past the end
    sorted_slots = torch.full((nb * block_m + T,), T, dtype=torch.int32, device=dev)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(nb, device=dev) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_slots[:nb * block_m], block_expert


class Router:
    """align_routing in two Triton launches (kernels/moe._route_count_kernel, _route_place_kernel;
    one when the slots fit one chunk): the same outputs, bit for bit, as the PyTorch twin above,
    which is its reference."""

    def __init__(self, num_experts: int, block_m: int, device_index: int):
        from ..kernels.moe import _route_count_kernel, _route_place_kernel

        self.E, self.block_m = num_experts, block_m
        ep = max(16, next_pow2(num_experts))
        self.block_t = max(16, min(128, 8192 // ep))  # the (slots x experts) one-hot tile: <= 8192 entries
        self.count = Launch(_route_count_kernel, dict(E_POW2=ep, BLOCK_T=self.block_t, num_warps=4), device_index)
        self.place = Launch(_route_place_kernel, dict(BLOCK_M=block_m, E_POW2=ep, BLOCK_T=self.block_t,
                                                      num_warps=4), device_index)
        self.place_one = Launch(_route_place_kernel, dict(BLOCK_M=block_m, E_POW2=ep, BLOCK_T=self.block_t,
                                                          ONE_CHUNK=True, num_warps=4), device_index)
        self.e_pow2 = ep

    def __call__(self, topk_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        ids = topk_ids.reshape(-1)
        T, E, bm = ids.numel(), self.E, self.block_m
        chunks = -(-T // self.block_t)
        nb = max_blocks(T, E, bm)
        dev = ids.device
        sorted_slots = torch.empty(nb * bm, dtype=torch.int32, device=dev)
        block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
        if chunks == 1:  # decode: one launch
            self.place_one((1, 1), ids, None, sorted_slots, block_expert, T, E, nb)
        else:
            hist = torch.empty((chunks, self.e_pow2), dtype=torch.int32, device=dev)
            self.count((chunks, 1), ids, hist, sorted_slots, T, E, nb * bm)
            self.place((chunks, 1), ids, hist, sorted_slots, block_expert, T, E, nb)
        return sorted_slots, block_expert


# ----------------------------------------------------------------------------------
# Configs (one function per M bucket; NOT MEASURED: first guesses from the dense kernel's
# tiles, for the lead to tune on an H100)
# ----------------------------------------------------------------------------------
def moe_block_m(M: int, topk: int, num_experts: int) -> int:
    """BLOCK_M of both GEMMs (one routing serves both), from the average slots per routed expert.
    Decode (<= 16 slots per expert): 16, the smallest tl.dot tile, GEMV-like; prefill 32-128
    (H100 sweep, docs/perf_log.md v39: DeepSeek-V2-Lite M = 1024, 96 slots per expert, 380 us
    at 128 against 436 at 64)."""
    T = M * topk
    per = T / min(num_experts, T)
    return 16 if per <= 16 else 32 if per <= 48 else 64 if per < 96 else 128


def moe_config(M: int, topk: int, num_experts: int, N: int, Kp: int, gated: bool, sms: int) -> Config:
    """The tile of one GEMM of the block (N output columns, Kp padded K; gated: gate_up, whose
    program holds a gate and an up tile of BLOCK_N columns each). From the H100 sweep of the
    three benchmark models at M = 1, 16, 256, 1024 (benchmarks/probes/moe_config_sweep.py,
    docs/perf_log.md v39); other GPUs take the same rules."""
    bm = moe_block_m(M, topk, num_experts)
    T = M * topk
    blocks = max(min(num_experts, T), -(-T // bm))  # the blocks a uniform routing fills
    bk256 = 256 if Kp % 256 == 0 else K_CHUNK
    if bm == 16:  # decode
        if gated:  # 128 columns of each; 64 (and BLOCK_K 128) where even that leaves most SMs idle
            bn, bk = (128, bk256) if blocks * -(-N // 128) >= sms // 2 else (64, K_CHUNK)
        else:  # 256 columns where they still give every SM a tile
            bn, bk = (256, K_CHUNK) if blocks * -(-N // 256) >= sms else (128, bk256)
        warps = 4
    elif bm == 32:
        bn, bk, warps = (64, K_CHUNK, 4) if gated else (256, K_CHUNK, 4)
    elif bm == 64:  # (sm_90 compile, Triton 3.9: BM 64 / BN 128 over 4 warps took 255 registers)
        bn, bk, warps = (128, bk256, 8) if gated else (256, K_CHUNK, 8)
    else:
        bn, bk, warps = (128, K_CHUNK, 8) if gated else ((128, 256, 8) if Kp % 256 == 0 else (256, K_CHUNK, 8))
    split = 1
    tiles = blocks * -(-N // bn)
    if bm == 16 and tiles < sms:  # split K until every SM has a program (twice, for the gate_up)
        want = 2 * sms if gated else sms
        while tiles * split < want and split * 2 <= Kp // bk and split < 16:
            split *= 2
    return Config(bm, bn, bk, split, 8, warps, 3, kernel="moe")


# ----------------------------------------------------------------------------------
# Launcher: a plan per problem (configs and bound launches), built once
# ----------------------------------------------------------------------------------
def problem_key(x, topk_ids, w13_qweight, w13_zeros, w2_zeros, group_size) -> tuple:
    """Everything the plan's kernels are specialised for (the operands are contiguous, so
    their strides follow from the shapes): device, dtype, M, top-k, E, I, H, format, id dtype."""
    return (x.device, x.dtype, x.shape[0], topk_ids.shape[1], w13_qweight.shape[0], w13_qweight.shape[1] // 2,
            x.shape[1], group_size, w13_zeros is not None, w2_zeros is not None, topk_ids.dtype)


class MoEPlan:
    """The configs and bound kernel launches of one MoE problem (problem_key)."""

    def __init__(self, key: tuple, cfg13: Config, cfg2: Config):
        from ..kernels.moe import _gated_reduce_kernel, _moe_w4a16_kernel, _topk_sum_kernel

        device, dtype, M, topk, E, I, H, group_size, z13, z2, _ = key
        self.cfg13, self.cfg2, self.M, self.topk, self.E, self.I, self.H = cfg13, cfg2, M, topk, E, I, H
        emu = dtype == torch.bfloat16 and device.type != "cuda"  # interpreter bf16 (kernels/common.py)
        asm = device.type == "cuda" and (dtype == torch.float16 or has_bf16x2(device.index or 0))
        gs = 0 if group_size == -1 else group_size
        dev = device.index if device.type == "cuda" else -1

        def gemm(cfg: Config, gated: bool, zeros: bool, K: int) -> Launch:
            return Launch(_moe_w4a16_kernel, dict(
                TOPK=topk, GATED=gated, GROUP_SIZE=gs, HAS_ZEROS=zeros, EVEN_K=K % cfg.BLOCK_K == 0,
                SPLIT_K=cfg.SPLIT_K, EMU_BF16=emu, USE_ASM=asm, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, ACC_FENCE=asm and acc_fence(), **cfg.launch()), dev)

        self.router = Router(E, cfg13.BLOCK_M, dev)
        self.gate_up = gemm(cfg13, True, z13, H)
        self.down = gemm(cfg2, False, z2, I)
        self.gated_reduce = None if cfg13.SPLIT_K == 1 else Launch(
            _gated_reduce_kernel, dict(SPLIT_K=cfg13.SPLIT_K, EMU_BF16=emu, BLOCK=_REDUCE_BLOCK, num_warps=4), dev)
        self.topk_sum = Launch(_topk_sum_kernel, dict(TOPK=topk, SPLIT_K=cfg2.SPLIT_K, WEIGHTED=cfg2.SPLIT_K == 1,
                                                      EMU_BF16=emu, BLOCK=_REDUCE_BLOCK, num_warps=4), dev)

    def __call__(self, x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                 w2_zeros) -> torch.Tensor:
        M, topk, I, H = self.M, self.topk, self.I, self.H
        T = M * topk
        c13, c2 = self.cfg13, self.cfg2
        sorted_slots, block_expert = self.router(topk_ids)
        nb = block_expert.shape[0]
        tw = topk_weights.reshape(-1).float().contiguous()
        h = x.new_empty((T, I))
        f32 = torch.float32
        ws = None if c13.SPLIT_K == 1 else x.new_empty((c13.SPLIT_K, T, 2 * I), dtype=f32)
        z13 = w13_scales if w13_zeros is None else w13_zeros  # symmetric: an unread pointer
        self.gate_up((nb * -(-I // c13.BLOCK_N), c13.SPLIT_K), x, w13_qweight, w13_scales, z13, sorted_slots,
                     block_expert, None, None if ws is not None else h, ws, T, I, H, nb, H, I,
                     w13_qweight.stride(0), w13_qweight.stride(1), w13_scales.stride(0), w13_scales.stride(1))
        if ws is not None:
            self.gated_reduce((-(-T * I // _REDUCE_BLOCK), 1), ws, h, T, I)
        split = c2.SPLIT_K
        rows = x.new_empty((T, H)) if split == 1 else x.new_empty((split, T, H), dtype=f32)
        z2 = w2_scales if w2_zeros is None else w2_zeros
        self.down((nb * -(-H // c2.BLOCK_N), split), h, w2_qweight, w2_scales, z2, sorted_slots, block_expert,
                  tw, rows if split == 1 else None, None if split == 1 else rows, T, H, I, nb, I, H,
                  w2_qweight.stride(0), w2_qweight.stride(1), w2_scales.stride(0), w2_scales.stride(1))
        y = x.new_empty((M, H))
        self.topk_sum((-(-M * H // _REDUCE_BLOCK), 1), rows, topk_ids, None if split == 1 else tw, y, M, H, self.E)
        return y


_PLANS: dict = {}


def moe_w4a16_launch(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                     w2_zeros, group_size, configs: Optional[Tuple[Config, Config]] = None) -> torch.Tensor:
    """Run the MoE block's kernels (validated operands). configs: (gate_up, down) to force
    (tests); their BLOCK_M must agree (one routing serves both GEMMs)."""
    if x.shape[0] == 0:
        return x.new_empty(x.shape)
    x = x.contiguous()
    key = problem_key(x, topk_ids, w13_qweight, w13_zeros, w2_zeros, group_size)
    # a cached plan's bound launches assume what Triton specialised the first call for: the
    # pointers 16-byte aligned (ops/launch.py); anything else takes a fresh plan (the JIT path)
    topk_ids = topk_ids.contiguous()
    cacheable = configs is None and aligned(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight,
                                            w2_scales, w2_zeros)
    plan = _PLANS.get(key) if cacheable else None
    if plan is None:
        if configs is None:
            _, _, M, topk, E, I, H = key[:7]
            sms = sms_for(x.device)
            configs = (moe_config(M, topk, E, I, w13_qweight.shape[2] * 8, True, sms),
                       moe_config(M, topk, E, H, w2_qweight.shape[2] * 8, False, sms))
        check_configs(*configs, w13_qweight.shape[2] * 8, w2_qweight.shape[2] * 8)
        plan = MoEPlan(key, *configs)
        if cacheable:
            _PLANS[key] = plan
    with device_of(x):
        return plan(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales, w2_zeros)


def check_configs(cfg13: Config, cfg2: Config, kp13: int, kp2: int) -> None:
    """ValueError naming the field of a (gate_up, down) config pair the kernels cannot run."""
    if cfg13.BLOCK_M != cfg2.BLOCK_M:
        raise ValueError(f"configs: gate_up BLOCK_M={cfg13.BLOCK_M} and down BLOCK_M={cfg2.BLOCK_M} must agree "
                         "(one routing serves both GEMMs)")
    for what, cfg, kp in (("gate_up", cfg13, kp13), ("down", cfg2, kp2)):
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            v = getattr(cfg, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{what} config {name}={v} must be a power of two >= 16")
        if cfg.BLOCK_K % K_CHUNK or kp % cfg.BLOCK_K:
            raise ValueError(f"{what} config BLOCK_K={cfg.BLOCK_K} must be a multiple of {K_CHUNK} that divides "
                             f"the padded K={kp}")
        if not 1 <= cfg.SPLIT_K <= kp // cfg.BLOCK_K:
            raise ValueError(f"{what} config SPLIT_K={cfg.SPLIT_K} must lie in [1, {kp // cfg.BLOCK_K}]")


# ----------------------------------------------------------------------------------
# torch.library op
# ----------------------------------------------------------------------------------
def validate(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales, w2_zeros,
             group_size, fake: bool = False) -> None:
    """TypeError / ValueError naming the argument, its value and what is allowed."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"x dtype {x.dtype} is not supported; allowed: float16, bfloat16")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens, hidden), got shape {tuple(x.shape)}")
    M, H = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != M or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer (M={M}, top_k) tensor, got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    topk = topk_ids.shape[1]
    if topk_weights.shape != topk_ids.shape or not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_weights must be a floating-point tensor of topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    check_int_choice("group_size", group_size, GROUP_SIZES)
    if w13_qweight.dtype != torch.int32 or w13_qweight.dim() != 3:
        raise ValueError(f"w13_qweight must be int32 (E, 2I, Kp/8), got {w13_qweight.dtype} {tuple(w13_qweight.shape)}")
    E, two_i, kw13 = w13_qweight.shape
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"the expert count E={E} (w13_qweight.shape[0]) must lie in [1, {MAX_EXPERTS}]")
    if not 1 <= topk <= min(E, MAX_TOPK):
        raise ValueError(f"top_k={topk} (topk_ids.shape[1]) must lie in [1, min(E={E}, {MAX_TOPK})]")
    if two_i < 2 or two_i % 2:
        raise ValueError(f"w13_qweight.shape[1]={two_i} must be 2 * I (gate rows, then up rows), I >= 1")
    if kw13 * 8 != padded_k_experts(H):
        raise ValueError(f"w13_qweight.shape[2]={kw13} does not fit hidden={H} (x.shape[1]): allowed "
                         f"{padded_k_experts(H) // 8}, K padded to a multiple of {K_CHUNK}, 8 channels a word")
    I = two_i // 2
    if tuple(w2_qweight.shape) != (E, H, padded_k_experts(I) // 8) or w2_qweight.dtype != torch.int32:
        raise ValueError(f"w2_qweight must be int32 (E={E}, hidden={H}, {padded_k_experts(I) // 8}) for "
                         f"I={I}, got {w2_qweight.dtype} {tuple(w2_qweight.shape)}")
    for name, q, s, z, k in (("w13", w13_qweight, w13_scales, w13_zeros, H), ("w2", w2_qweight, w2_scales, w2_zeros, I)):
        gp = 1 if group_size == -1 else -(-padded_k_experts(k) // group_size)
        want = (q.shape[0], q.shape[1], gp)
        if tuple(s.shape) != want or s.dtype != x.dtype:
            raise ValueError(f"{name}_scales must be {x.dtype} {want} (group_size={group_size}), got "
                             f"{s.dtype} {tuple(s.shape)}")
        if z is not None and (tuple(z.shape) != want or z.dtype != x.dtype):
            raise ValueError(f"{name}_zeros must be {x.dtype} {want} or None, got {z.dtype} {tuple(z.shape)}")
        for part, t in (("qweight", q), ("scales", s), ("zeros", z)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name}_{part} must be contiguous")
    check_devices(fake, x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13_qweight=w13_qweight,
                  w13_scales=w13_scales, w13_zeros=w13_zeros, w2_qweight=w2_qweight, w2_scales=w2_scales,
                  w2_zeros=w2_zeros)


def moe_w4a16_impl(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                   w2_zeros, group_size):
    args = (x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales, w2_zeros,
            group_size)
    validate(*args)
    if use_triton(x):
        return moe_w4a16_launch(*args)
    return moe_w4a16_reference(*args)


def _moe_w4a16_fake(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                    w2_zeros, group_size):
    validate(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales, w2_zeros,
             group_size, fake=True)
    return x.new_empty(x.shape)


moe_w4a16 = define_op(
    "moe_w4a16",
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_qweight, Tensor w13_scales, Tensor? w13_zeros, "
    "Tensor w2_qweight, Tensor w2_scales, Tensor? w2_zeros, SymInt group_size) -> Tensor",
    moe_w4a16_impl, _moe_w4a16_fake)
