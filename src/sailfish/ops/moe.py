"""Mixture-of-experts block with 4-bit experts (W4A16): reference, routing prep, configs,
launcher and op.

    sailfish::moe_w4a16(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros,
                        w2_qweight, w2_scales, w2_zeros, group_size, w13_perm=None, w2_perm=None,
                        num_shared=0) -> y

y[m] = sum_k topk_weights[m, k] * down_e(silu(gate_e(x[m])) * up_e(x[m])), e = topk_ids[m, k],
the experts in formats/experts.PackedExperts layout: w13 (E, 2I, H) holds gate rows [0, I)
and up rows [I, 2I) of each expert (transformers' gate_up_proj), w2 (E, H, I) the down
projection. Act-order experts (GPTQ desc_act): w13_perm int32 (E, H) / w2_perm (E, I), each
expert's permutation of its input channels (formats/experts.py: the weight's K channels sorted by
group), so the expert multiplies x[:, perm[e]] (h[:, perm[e]]); None: no act-order.
Expert ids outside [0, E) contribute nothing (transformers passes E for a token
slot that no local expert takes). The routing (softmax, top-k, renormalisation) is the
caller's: the op takes its result.

Shared experts (num_shared = S > 0; DeepSeek-V2 / V3): the weights hold E + S experts, the last S
the shared experts of the routed width I (a shared MLP of width S * I split into S experts along
its intermediate channels: the same sum, exactly), which every token takes with weight 1 after its
top-k (its slots m * (k + S) + k + j); the routed ids must then lie in [0, E), E = the weights'
experts - S. y = the routed sum + the shared experts' rows, in one fixed order: one block, no
separate shared MLP launches.

Numerics (the reference below is the exact twin; kernels/moe.py): fp32 accumulation,
h = silu(gate) * up in fp32 rounded once to x's dtype, each (token, k) row of the down
product times its routing weight in fp32 (rounded once to x's dtype when K is not split),
the top-k rows of a token added in the fixed order k = 0, 1, ... in fp32, rounded once.
Deterministic run to run: every sum in a fixed order; the one atomic (the decode path's
counters, kernel "moe_fused") only picks which program does a sum, never changes a value.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Tuple

import torch

from ..formats.experts import PackedExperts, check_perms, padded_k_experts
from ..formats.int4 import GROUP_SIZES, K_CHUNK, check_int_choice, unpack
from ..runtime.device import check_devices, device_of, has_bf16x2, pdl, sms_for, use_triton
from ..runtime.dispatch import define_op
from ..runtime.flags import FLAGS
from ..runtime.launch import Launch
from ..runtime.plan import Plan, keep, run_built, run_steady
from ..tuning import Config, Tuner, check_blocks, check_fit, check_kernel, next_pow2, problem_key
# acc_fence: the Triton-version rule of the dense path; the split-K counters: one buffer per stream, shared
from .common import GLUON_STEP, SYNC_CAP, acc_fence, as_dependent, gluon_device, sync_buffer

MAX_TOPK = 32  # the top-k sum is unrolled (kernels/moe._topk_sum_kernel)
# the routing kernels hold a (slots x experts) one-hot tile in registers (Router); the largest
# MoE models published have 512 routed experts (Qwen3-Next), DeepSeek-V3 256, Kimi-K2 384
MAX_EXPERTS = 1024
_REDUCE_BLOCK = 1024
# Decode's launch chain (docs/perf_log.md v42): config kernel "moe_fused" adds gate_up's split-K
# slices and does the top-k sum inside the two GEMM launches (kernels/moe.py FUSED): routing + 2
# launches instead of routing + 4. The top-k sum is done per N tile by one program that reads
# every token's rows: the heuristic takes it up to this many tokens (H100, v42: at M = 1-4 it
# gains up to 15% on Qwen3-30B-A3B, at M = 16 it lost 2-4% on all three benchmark shapes).
FUSED_MAX_M = 4
# ... and an unsplit down GEMM does its top-k sum inside only up to this K: Mixtral's (K = 14336) lost
# 15 us at M = 4 with it in two H100 runs (v42: 185 -> 200 us; v45: 186 -> 201), the 768-1408 wide
# experts of Qwen3-30B-A3B and DeepSeek-V2-Lite gained 2 us
FUSED_MAX_K = 8192
KINDS = ("moe", "moe_fused", "moe_gemv", "moe_gluon")
# Large M on Hopper: config kernel "moe_gluon" (kernels/moe_gluon.py), the dense pipe kernel's
# warp-specialized K loop over the routing's blocks, x by TMA in routing order. Both GEMMs of a
# block take it together (gate_up writes h in the order the down GEMM's TMA reads it; pair_gluon).
# Its tile: BLOCK_N 64 gate_up columns (128 weight rows) / 128 down columns over two consumer
# warpgroups, BLOCK_K one 256-channel step, no split; the x rings take BLOCK_M 128 at 3 stages
# (224 KiB, one CTA per SM), BLOCK_M 64 at 4
GLUON_STAGES = {64: 4, 128: 3}
GLUON_LARGE_EXPERT = 1 << 25  # H x I from which BLOCK_M 64 takes "moe_gluon" (moe_heuristic, moe_config)
# Decode with about one slot per routed expert: config kernel "moe_gemv" (BLOCK_M 1), one
# tensor-core GEMV per slot (kernels/moe._moe_gemv_kernel), no routing. Each slot reads its
# expert's tiles, so an expert routed twice is read twice: from L2 when the expert is small, from
# HBM when it is large. Taken at most at these slots per expert (H100, docs/perf_log.md v45:
# Qwen3-30B-A3B / DeepSeek-V2-Lite (2.4 / 4.3 MiB experts) won up to 0.75 slots per expert and
# broke even at 1.0-1.5; Mixtral (84 MiB experts) won at 0.25 and lost at 0.5).
GEMV_SLOTS_PER_EXPERT = 0.75
GEMV_SLOTS_PER_LARGE_EXPERT = 0.25
GEMV_SMALL_EXPERT = 16 << 20  # bytes of an expert's 4-bit weights below which a second read is an L2 hit
# ... and where a (slots x experts) one-hot tile of at most this many entries (powers of two,
# >= 16 each) holds the routing, both GEMMs' programs route themselves (kernels/moe._route_block:
# 32 int32 a thread at 4 warps, before the K loop): routing + 2 launches become 2. Qwen3-30B-A3B
# (128 experts) up to M = 4, DeepSeek-V2-Lite (64) up to M = 8, Mixtral (8) up to M = 16.
ROUTE_TILE = 4096


# ----------------------------------------------------------------------------------
# Reference (pure PyTorch): the op's math, and its CPU path without the interpreter
# ----------------------------------------------------------------------------------
def slot_experts(topk_ids: torch.Tensor, num_experts: int, num_shared: int = 0) -> torch.Tensor:
    """int64 (M * (k + S),): the expert of every slot m * (k + S) + j, the routed ids (-1 outside
    [0, num_experts)) then the shared experts num_experts + j (kernels/moe._slot_expert's twin)."""
    ids = topk_ids.long()
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, -1)
    if num_shared:
        shared = torch.arange(num_experts, num_experts + num_shared, device=ids.device)
        ids = torch.cat([ids, shared.expand(ids.shape[0], num_shared)], 1)
    return ids.reshape(-1)


def slot_weights(topk_weights: torch.Tensor, num_shared: int = 0) -> torch.Tensor:
    """float32 (M * (k + S),): the slots' routing weights, 1 for the shared experts' (_slot_weight's twin)."""
    tw = topk_weights.float()
    if num_shared:
        tw = torch.cat([tw, tw.new_ones((tw.shape[0], num_shared))], 1)
    return tw.reshape(-1)


def moe_w4a16_reference(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                        w2_zeros, group_size, w13_perm=None, w2_perm=None, num_shared=0):
    M, H = x.shape
    E, I = w13_qweight.shape[0], w13_qweight.shape[1] // 2
    topk = topk_ids.shape[1] + num_shared  # slots per token
    # (act-order: unpack puts each expert's channels back in x's order)
    w13 = PackedExperts(w13_qweight, w13_scales, w13_zeros, H, group_size, w13_perm)
    w2 = PackedExperts(w2_qweight, w2_scales, w2_zeros, I, group_size, w2_perm)
    ids = slot_experts(topk_ids, E - num_shared, num_shared)
    tw = slot_weights(topk_weights, num_shared)
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


def align_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                  num_shared: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slots int32 (max_blocks * block_m,), block_expert int32 (max_blocks,)).

    Slot t = m * topk + k of topk_ids (M, topk) (num_shared S: m * (topk + S) + k, the shared
    experts num_experts + j after the top-k: slot_experts; num_experts counts the routed ones).
    sorted_slots lists every expert's slots in increasing order, expert 0 first, each expert's run
    padded to a whole block with T (the slot count);
    block_expert[b] is the expert of block b, -1 for the blocks past the last used one. Ids
    outside [0, E) are left out. Deterministic (a stable sort, unique scatter targets) and free of
    host synchronisation, with sizes that depend only on (M, topk, E, block_m): CUDA graphs and
    torch.compile take it as it is."""
    dev = topk_ids.device
    ids = slot_experts(topk_ids.reshape(topk_ids.shape[0], -1), num_experts, num_shared)
    num_experts += num_shared
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
    which is its reference. topk, num_shared: align_routing's shared experts (topk only matters
    where num_shared > 0)."""

    def __init__(self, num_experts: int, block_m: int, device_index: int, topk: int = 1, num_shared: int = 0):
        from ..kernels.moe import _route_count_kernel, _route_place_kernel

        self.E, self.block_m, self.topk, self.shared = num_experts, block_m, topk, num_shared
        ep = max(16, next_pow2(num_experts + num_shared))
        self.block_t = max(16, min(128, 8192 // ep))  # the (slots x experts) one-hot tile: <= 8192 entries
        slots = dict(TOPK=topk, SHARED=num_shared) if num_shared else {}
        self.count = Launch(_route_count_kernel, dict(E_POW2=ep, BLOCK_T=self.block_t, **slots, num_warps=4),
                            device_index)
        self.place = Launch(_route_place_kernel, dict(BLOCK_M=block_m, E_POW2=ep, BLOCK_T=self.block_t, **slots,
                                                      num_warps=4), device_index)
        self.place_one = Launch(_route_place_kernel, dict(BLOCK_M=block_m, E_POW2=ep, BLOCK_T=self.block_t,
                                                          ONE_CHUNK=True, **slots, num_warps=4), device_index)
        self.e_pow2 = ep

    def bound(self) -> bool:
        """Whether the launches of the plan's slot count are bound (one chunk: place_one; else
        count and place)."""
        return self.place_one.run is not None or (self.count.run is not None and self.place.run is not None)

    def __call__(self, topk_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        ids = topk_ids.reshape(-1)
        T, E, bm = ids.numel() // self.topk * (self.topk + self.shared), self.E, self.block_m
        chunks = -(-T // self.block_t)
        nb = max_blocks(T, E + self.shared, bm)
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
# Configs: the gate_up and down GEMMs are two tuner problems of one block, each with BLOCK_M
# fixed by the routing (block_m: one routing serves both GEMMs, so their BLOCK_M agree)
# ----------------------------------------------------------------------------------
def moe_block_m(M: int, topk: int, num_experts: int) -> int:
    """BLOCK_M of both GEMMs (one routing serves both), from the average slots per routed expert.
    Decode (<= 16 slots per expert): 16, the smallest tl.dot tile, GEMV-like; prefill 32-128
    (H100 sweep, docs/perf_log.md v39: DeepSeek-V2-Lite M = 1024, 96 slots per expert, 380 us
    at 128 against 436 at 64)."""
    T = M * topk
    per = T / min(num_experts, T)
    return 16 if per <= 16 else 32 if per <= 48 else 64 if per < 96 else 128


def moe_gemv_format(group_size: int, H: int, I: int, perms: Tuple[bool, bool]) -> bool:
    """Whether the experts' format takes kernel "moe_gemv" (the dense tensor-core GEMV's:
    ops/w4a16.gemv_on_tensor_cores): groups of whole 128-channel chunks or per channel, no
    act-order permutation, x and h readable as 4-byte channel pairs (H and I even)."""
    return (group_size == -1 or group_size % K_CHUNK == 0) and not any(perms) and H % 2 == 0 and I % 2 == 0


def moe_gemv_applies(M: int, topk: int, E: int, H: int, I: int, gemv_format: bool) -> bool:
    """The "moe_gemv" path (BLOCK_M 1, no routing) for this many tokens: a format it takes and at
    most GEMV_SLOTS_PER_EXPERT slots per expert (GEMV_SLOTS_PER_LARGE_EXPERT where an expert's
    3 H I / 2 bytes pass GEMV_SMALL_EXPERT): few experts get two slots, or their second read is
    an L2 hit."""
    small = 3 * H * I // 2 <= GEMV_SMALL_EXPERT
    return gemv_format and M * topk <= (GEMV_SLOTS_PER_EXPERT if small else GEMV_SLOTS_PER_LARGE_EXPERT) * E


def _blocks(M: int, topk: int, E: int, bm: int) -> int:
    """The blocks a uniform routing fills."""
    T = M * topk
    return max(min(E, T), -(-T // bm))


def _decode_split(tiles: int, Kp: int, bk: int, want: int) -> int:
    """Split K until `want` programs (or Kp // bk splits, or 16)."""
    split = 1
    while tiles * split < want and split * 2 <= Kp // bk and split < 16:
        split *= 2
    return split


def moe_heuristic(*, device, M, topk, E, N, Kp, gated, block_m, gluon=False) -> Config:
    """The tile of one GEMM of the block (N output columns, Kp padded K; gated: gate_up, whose
    program holds a gate and an up tile of BLOCK_N columns each; block_m: the routing's
    BLOCK_M, moe_block_m's). From the H100 sweep of the three benchmark models at M = 1, 16,
    256, 1024 (benchmarks/probes/moe_config_sweep.py, docs/perf_log.md v39); other GPUs take
    the same rules."""
    sms = sms_for(device)
    bm = block_m
    if bm == 1:  # one GEMV per slot ("moe_gemv"): BLOCK_N 16, BLOCK_K the largest that leaves >= 3 K tiles
        # (gate_up at most 512). H100 sweep (moe_decode_probe.py --sweep, docs/perf_log.md v45): at M = 1
        # Qwen3-30B-A3B gate_up 16/512, down 16/256; DeepSeek-V2-Lite 16/512, 16/128; Mixtral down 16/1024
        # best or within 2%
        cap = 512 if gated else 1024
        bk = max([bk for bk in (256, 512, 1024) if bk <= cap and Kp % bk == 0 and Kp // bk >= 3], default=K_CHUNK)
        return _gemv_config(sms, M * topk, N, Kp, gated, 16, bk)
    # experts as large as Mixtral's: N x K >= 32M weights a GEMM (the same for both GEMMs of a block)
    large = N * Kp >= GLUON_LARGE_EXPERT
    # the Hopper Gluon GEMMs ("moe_gluon"; gluon: the format and GPU take them, gluon_moe_format) at
    # BLOCK_M 128, and at 64 for large experts. H100, same machine (docs/perf_log.md v47): Mixtral
    # M = 512-4096 1.13-1.38x the Triton tiles (M = 4096 6060 -> 5160 us), M = 256 (BLOCK_M 64) even
    # (skewed 1.09x); Qwen3-30B-A3B M = 2048 / 4096 1.09x / 1.03x, but at BLOCK_M 64 (M = 1024, K 768
    # for down: 3 K steps) 0.83x
    if gluon and (bm == 128 or (bm == 64 and large)):
        return gluon_config(bm, gated)
    blocks = _blocks(M, topk, E, bm)
    bk256 = 256 if Kp % 256 == 0 else K_CHUNK
    stages, scale = 3, False
    # large experts: at BLOCK_M 64 the gate_up and at BLOCK_M 128 the down GEMM take BLOCK_K 128 with
    # the group scale on the product (scale_acc) and a 4-deep ring (H100 sweep, moe_config_sweep.py
    # scale, docs/perf_log.md v46: Mixtral M = 256 856 -> 795 us, M = 1024 1835 -> 1788 us; the other
    # GEMM lost with it)
    if bm == 16:  # decode
        if gated:  # 128 columns of each; 64 (and BLOCK_K 128) where even that leaves most SMs idle
            bn, bk = (128, bk256) if blocks * -(-N // 128) >= sms // 2 else (64, K_CHUNK)
        else:  # 256 columns where they still give every SM a tile
            bn, bk = (256, K_CHUNK) if blocks * -(-N // 256) >= sms else (128, bk256)
        warps = 4
    elif bm == 32:
        bn, bk, warps = (64, K_CHUNK, 4) if gated else (256, K_CHUNK, 4)
    elif bm == 64:  # (sm_90 compile, Triton 3.9: BM 64 / BN 128 over 4 warps took 255 registers)
        # down: BLOCK_K 256 over a long K (Mixtral's 14336 at M = 256: 979 -> 839 us, H100 autotune,
        # docs/perf_log.md v46); 128 elsewhere (the v39 sweep's choice, measured on shorter K)
        bn, bk, warps = (128, bk256, 8) if gated else (256, bk256 if Kp >= 8192 else K_CHUNK, 8)
        if gated and large:
            bk, stages, scale = K_CHUNK, 4, True
    else:
        bn, bk, warps = (128, K_CHUNK, 8) if gated else ((128, 256, 8) if Kp % 256 == 0 else (256, K_CHUNK, 8))
        if not gated and large:
            bn, bk, stages, scale = 128, K_CHUNK, 4, True
    split = 1
    tiles = blocks * -(-N // bn)
    if bm == 16 and tiles < sms:  # split K until every SM has a program (twice, for the gate_up)
        split = _decode_split(tiles, Kp, bk, 2 * sms if gated else sms)
    return Config(bm, bn, bk, split, 8, warps, stages, kernel=moe_kind(M, gated, bm, split, Kp), scale_acc=scale)


def _gemv_config(sms: int, T: int, N: int, Kp: int, gated: bool, bn: int, bk: int, stages: int = 1) -> Config:
    """A "moe_gemv" config: BLOCK_N bn rows (gated: bn // 2 columns of gate and up), BLOCK_K bk,
    K split until the T slots' programs fill the SMs twice; SCALE_ACC (the dense M = 1 GEMV's
    choice on every H100 table entry). Warps: the dense GEMV's rule (kernels/w4a16.gemv_warps), at most 8."""
    from ..kernels.w4a16 import gemv_warps

    tiles = T * -(-N // (bn // 2 if gated else bn))
    split = _decode_split(tiles, Kp, bk, 2 * sms)
    return Config(1, bn, bk, split, 8, gemv_warps(bn, bk, 8), stages, kernel="moe_gemv", scale_acc=True)


def gluon_config(block_m: int, gated: bool) -> Config:
    """The "moe_gluon" tile of one GEMM (KINDS' comment)."""
    return Config(block_m, 64 if gated else 128, GLUON_STEP, 1, 8, 8, GLUON_STAGES[block_m], kernel="moe_gluon")


def gluon_moe_format(group_size: int, H: int, I: int, kp13: int, kp2: int, perms: Tuple[bool, bool],
                     device: torch.device) -> bool:
    """Whether "moe_gluon" runs its Gluon kernel for these experts on this device: a Hopper GPU
    with Gluon (ops/common.gluon_device), groups of whole 128-channel chunks or per channel, no
    act-order, both GEMMs' padded K whole 128-channel chunks (an odd number of them: the last
    256-channel step half, kernels/moe_gluon.py HALF_LAST), and rows of x and h that TMA can
    address (16-byte strides: H and I multiples of 8). Elsewhere its Triton twin runs (gluon_twin)."""
    return (device.type == "cuda" and (group_size == -1 or group_size % K_CHUNK == 0) and not any(perms)
            and kp13 % K_CHUNK == 0 and kp2 % K_CHUNK == 0 and H % 8 == 0 and I % 8 == 0
            and gluon_device(device.index or 0))


def gluon_twin(cfg: Config, group_size: int) -> Config:
    """The Triton config that computes what a "moe_gluon" config does: its tile with BLOCK_K 128,
    the group scale on the weights (rounded once to x's dtype), per channel on the product."""
    return replace(cfg, kernel="moe", BLOCK_K=K_CHUNK, num_stages=3, scale_acc=group_size == -1)


def pair_gluon(cfg13: Config, cfg2: Config, group_size: int, gluon: bool) -> Tuple[Config, Config]:
    """The configs a plan runs: "moe_gluon" only where the Gluon kernel applies (gluon:
    gluon_moe_format) and both GEMMs ask for it (gate_up writes h in the routing order that only
    the Gluon down GEMM reads); otherwise each "moe_gluon" config runs its Triton twin."""
    if gluon and cfg13.kernel == cfg2.kernel == "moe_gluon":
        return cfg13, cfg2
    return tuple(gluon_twin(c, group_size) if c.kernel == "moe_gluon" else c for c in (cfg13, cfg2))


def scale_acc_fits(group_size: int, block_k: int) -> bool:
    """Whether the grouped kernel's SCALE_ACC (kernels/moe._dot_tile: the group scale on the fp32
    product) can take this format and K tile: one group per K tile, or per channel. A config's
    scale_acc elsewhere runs the per-weight scaling (the same values up to rounding)."""
    return group_size == -1 or group_size % block_k == 0


def moe_kind(M: int, gated: bool, block_m: int, split: int, Kp: int) -> str:
    """The decode path ("moe_fused") at BLOCK_M 16 and M <= FUSED_MAX_M where it saves a launch:
    gate_up only when split (else there is no reduce to fold), down when split or its K (Kp) is
    at most FUSED_MAX_K (the top-k sum)."""
    fused = block_m == 16 and M <= FUSED_MAX_M and (split > 1 or (not gated and Kp <= FUSED_MAX_K))
    return "moe_fused" if fused else "moe"


def moe_candidates(*, device, M, topk, E, N, Kp, gated, block_m, gluon=False):
    """The heuristic's config (and, where it is "moe_fused", its tile as "moe": the separate
    reduce launches), then the tiles of moe_config_sweep.py at the routing's BLOCK_M: BLOCK_N
    32-128 (gate_up) / 64-256 (down), BLOCK_K 128 / 256 (128 also with scale_acc and 4 stages),
    unsplit and, at BLOCK_M 16, the split giving 2 programs per SM and half that; each of the
    heuristic's kind rule (moe_kind)."""
    sms = sms_for(device)
    first = moe_heuristic(device=device, M=M, topk=topk, E=E, N=N, Kp=Kp, gated=gated, block_m=block_m,
                          gluon=gluon)
    yield first
    if gluon and block_m in GLUON_STAGES and first.kernel != "moe_gluon":
        yield gluon_config(block_m, gated)
    if block_m == 1:  # "moe_gemv": BLOCK_N 16-64, BLOCK_K 128-1024, words prefetched or not
        for bn in (16, 32, 64):
            for bk in (K_CHUNK, 256, 512, 1024):
                for stages in (1, 2):
                    if Kp % bk:
                        continue
                    cfg = _gemv_config(sms, M * topk, N, Kp, gated, bn, bk, stages)
                    if cfg != first:
                        yield cfg
        return
    if first.kernel != "moe":
        yield replace(first, kernel="moe")
    blocks = _blocks(M, topk, E, block_m)
    for bn in (32, 64, 128) if gated else (64, 128, 256):
        for bk in (K_CHUNK, 256):
            if Kp % bk:
                continue
            splits = {1}
            if block_m == 16:
                sp = _decode_split(blocks * -(-N // bn), Kp, bk, 2 * sms)
                splits |= {sp, max(1, sp // 2)}
            for split in sorted(splits):
                cfg = Config(block_m, bn, bk, split, 8, 4 if block_m <= 32 else 8, 3,
                             kernel=moe_kind(M, gated, block_m, split, Kp))
                # (and at BLOCK_K 128 with the group scale on the product, 4 stages: moe_heuristic's large experts)
                for c in (cfg, replace(cfg, num_stages=4, scale_acc=True)) if bk == K_CHUNK else (cfg,):
                    if c != first:
                        yield c


def check_moe_config(cfg: Config, *, M: int, topk: int, E: int, N: int, Kp: int, block_m: int, gated: bool,
                     **_) -> None:
    """ValueError naming the field of a config one GEMM (gated: gate_up, N = I; else down, N = H)
    of the block of M tokens cannot run: the shared checks (tuning.check_blocks / check_kernel /
    check_fit), whole 128-channel K chunks, BLOCK_M the routing's (block_m: both GEMMs share one
    routing), and "moe_fused"'s counters (one per gate_up tile, per down N tile) within SYNC_CAP."""
    what = "gate_up" if gated else "down"
    check_blocks(cfg)
    check_kernel(cfg, KINDS)
    if cfg.kernel == "moe_fused":
        tiles = (max_blocks(M * topk, E, block_m) if gated else 1) * -(-N // cfg.BLOCK_N)
        if tiles > SYNC_CAP:
            raise ValueError(f"{what} config kernel='moe_fused' with BLOCK_N={cfg.BLOCK_N} needs {tiles} tile "
                             f"counters for M={M}, more than the {SYNC_CAP} there are; use kernel='moe'")
    if cfg.kernel == "moe_gluon":
        want = gluon_config(cfg.BLOCK_M if cfg.BLOCK_M in GLUON_STAGES else 128, gated)
        if cfg.BLOCK_M not in GLUON_STAGES or (cfg.BLOCK_N, cfg.BLOCK_K, cfg.SPLIT_K, cfg.num_warps) != (
                want.BLOCK_N, want.BLOCK_K, want.SPLIT_K, want.num_warps):
            raise ValueError(f"{what} config kernel='moe_gluon' takes BLOCK_M in {tuple(GLUON_STAGES)}, "
                             f"BLOCK_N={want.BLOCK_N}, BLOCK_K={want.BLOCK_K}, SPLIT_K=1, num_warps=8; got {cfg}")
        from ..kernels.gluon_common import CTA_RESERVED_SHARED, SM_SHARED_BYTES, pipe_shared_bytes

        if cfg.num_stages < 3 or pipe_shared_bytes(cfg.BLOCK_M, cfg.num_stages) + CTA_RESERVED_SHARED > \
                SM_SHARED_BYTES:
            raise ValueError(f"{what} config kernel='moe_gluon' num_stages={cfg.num_stages}: the x rings of "
                             f"BLOCK_M={cfg.BLOCK_M} take 3 to {GLUON_STAGES[cfg.BLOCK_M]} (shared memory)")
    if cfg.kernel == "moe_gemv":
        tiles = (M * topk if gated and cfg.SPLIT_K > 1 else 1) * -(-N // (cfg.BLOCK_N // 2 if gated else cfg.BLOCK_N))
        if tiles > SYNC_CAP:
            raise ValueError(f"{what} config kernel='moe_gemv' with BLOCK_N={cfg.BLOCK_N} needs {tiles} tile "
                             f"counters for M={M}, more than the {SYNC_CAP} there are")
        if cfg.BLOCK_M != 1 or block_m != 1:
            raise ValueError(f"{what} config kernel='moe_gemv' needs BLOCK_M=1 in both GEMMs' configs (one "
                             f"slot a program), got BLOCK_M={cfg.BLOCK_M} and the other's {block_m}")
    elif cfg.BLOCK_M < 16:
        raise ValueError(f"{what} config BLOCK_M={cfg.BLOCK_M} must be >= 16 (the smallest tl.dot tile)")
    if cfg.BLOCK_M != block_m:
        raise ValueError(f"{what} config BLOCK_M={cfg.BLOCK_M} must be the routing's BLOCK_M={block_m}: "
                         "gate_up and down BLOCK_M must agree (one routing serves both GEMMs)")
    if cfg.BLOCK_K % K_CHUNK:
        raise ValueError(f"{what} config BLOCK_K={cfg.BLOCK_K} must be a multiple of {K_CHUNK}")
    # ("moe_gluon" where K is not whole 256-channel steps: its twin's 128-channel K tiles)
    check_fit(gluon_twin(cfg, -1) if cfg.kernel == "moe_gluon" and Kp % cfg.BLOCK_K else cfg, Kp, Kp)


MOE_TUNER = Tuner("moe_w4a16", moe_heuristic, moe_candidates, check_moe_config)


def moe_key(M: int, topk: int, E: int, N: int, Kp: int, gated: bool, block_m: int) -> str:
    return problem_key("moe_w4a16", Kp, N, M, f"{'gate_up' if gated else 'down'}|E={E}|topk={topk}|bm={block_m}")


def moe_config(device: torch.device, M: int, topk: int, E: int, I: int, H: int, kp13: int, kp2: int,
               make_run=None, gemv_format: bool = False, gluon: bool = False) -> Tuple[Config, Config]:
    """The (gate_up, down) configs moe_w4a16_launch runs when given none: per GEMM the cached
    one, else on a problem's first call the tuner's answer (table entry, autotuning with
    make_run(gated) where enabled, the heuristic), checked. M is exact (BLOCK_M follows it:
    1, kernel "moe_gemv", where moe_gemv_applies with gemv_format, moe_gemv_format's answer).
    gluon: gluon_moe_format's answer (the heuristic takes "moe_gluon" at BLOCK_M 64 / 128; large
    experts take BLOCK_M 64 where moe_block_m says 32)."""
    bm = 1 if moe_gemv_applies(M, topk, E, H, I, gemv_format) else moe_block_m(M, topk, E)
    if gluon and bm == 32 and H * I >= GLUON_LARGE_EXPERT:
        # large experts at 17-48 slots an expert: the BLOCK_M 64 Gluon tiles. H100, Mixtral M = 128
        # (32 slots an expert), same process (docs/perf_log.md v47): 609 -> 495 us uniform, 594 -> 595
        # skewed routing
        bm = 64
    out = []
    for gated, N, Kp in ((True, I, kp13), (False, H, kp2)):
        memo = (M, topk, E, N, Kp, gated, bm, gluon)
        cfg = MOE_TUNER.lookup(device, memo)
        if cfg is None:  # first call of this problem on this device
            cfg = MOE_TUNER.get(moe_key(M, topk, E, N, Kp, gated, bm), device,
                                None if make_run is None else make_run(gated, out), memo_key=memo,
                                M=M, topk=topk, E=E, N=N, Kp=Kp, gated=gated, block_m=bm, gluon=gluon)
        out.append(cfg)
    return out[0], out[1]


def route_tile(T: int, E: int) -> dict:
    """The one-hot routing tile's sides (kernels/moe._route_block): slots and experts, powers of two
    >= 16 (the routing kernels' E_POW2, Router)."""
    return dict(T_POW2=max(16, next_pow2(T)), E_POW2=max(16, next_pow2(E)))


def route_inline(M: int, topk: int, E: int, cfg2: Config) -> bool:
    """Whether the decode path's GEMMs route themselves (ROUTE_TILE): the down GEMM is "moe_fused"
    (the decode path) and the routing's one-hot tile is small."""
    tile = route_tile(M * topk, E)
    return _fused(cfg2) and tile["T_POW2"] * tile["E_POW2"] <= ROUTE_TILE


def _fused(cfg: Config) -> bool:
    """Whether cfg's GEMM does its reduce inside its launch (gate_up: only a split one has one)."""
    return cfg.kernel == "moe_fused"


# ----------------------------------------------------------------------------------
# Launcher: a plan per problem (configs and bound launches; runtime/plan.py), built once
# ----------------------------------------------------------------------------------
class MoEPlan(Plan):
    """The configs (gate_up: `config`, down: `cfg2`) and bound kernel launches of one MoE
    problem (the plan key of moe_w4a16_launch): router, gate_up GEMM, the split gate_up's
    gated reduce, down GEMM, top-k sum (the reduce and the sum None where the config's kernel
    "moe_fused" does them inside the GEMM; the router None where the GEMMs route themselves:
    route_inline). Its calls take the tensors (allocations, strides)."""

    __slots__ = ("cfg2", "M", "topk", "E", "I", "H", "router", "gated_reduce", "down", "topk_sum", "sync_at",
                 "nb", "shared", "kp")
    takes_tensors = True

    def __init__(self, cfg13: Config, cfg2: Config, device: torch.device, dtype: torch.dtype, M: int, topk: int,
                 E: int, I: int, H: int, group_size: int, z13: bool, z2: bool, p13: bool = False,
                 p2: bool = False, shared: int = 0, gluon: bool = False):
        from ..kernels.moe import _gated_reduce_kernel, _moe_w4a16_kernel, _topk_sum_kernel

        cfg13, cfg2 = pair_gluon(cfg13, cfg2, group_size, gluon)
        self.config, self.cfg2, self.kind = cfg13, cfg2, cfg13.kernel if cfg13.kernel == "moe_gluon" else "moe"
        # (E: the routed experts; shared: the shared experts stacked after them, taken by every token)
        self.M, self.topk, self.E, self.I, self.H, self.shared = M, topk, E, I, H, shared
        slots = dict(SHARED=shared) if shared else {}  # (without: the kernels compile as before)
        emu = dtype == torch.bfloat16 and device.type != "cuda"  # interpreter bf16 (kernels/common.py)
        asm = device.type == "cuda" and (dtype == torch.float16 or has_bf16x2(device.index or 0))
        gs = 0 if group_size == -1 else group_size
        dev = device.index if device.type == "cuda" else -1

        self.sync_at = (device, dev)  # sync_buffer's arguments: the counters live on the plan's device
        self.nb = 0
        if cfg13.kernel == "moe_gemv":  # one GEMV per slot: no routing, no reduce launches
            from ..kernels.moe import _moe_gemv_kernel
            from ..kernels.w4a16 import gemv_asm, gemv_pairs, gemv_warps
            from .w4a16 import gemv_stages

            self.router = self.gated_reduce = self.topk_sum = self.reduce = None
            chained = pdl(dev)

            def gemv(cfg: Config, gated: bool, zeros: bool, K: int) -> Launch:
                even_k = K % cfg.BLOCK_K == 0
                text, cons = gemv_asm(dtype == torch.bfloat16, zeros, even_k, gemv_pairs(cfg.BLOCK_N),
                                      cfg.scale_acc) if asm else ("", "")
                link = {} if not chained else dict(PDL_EARLY=True) if gated else as_dependent(dev)
                return Launch(_moe_gemv_kernel, dict(
                    TOPK=topk, **slots, GATED=gated, GROUP_SIZE=gs, HAS_ZEROS=zeros, EVEN_K=even_k, SPLIT_K=cfg.SPLIT_K,
                    EMU_BF16=emu, USE_ASM=asm, ASM=text, ASM_CONSTRAINTS=cons, BLOCK_N=cfg.BLOCK_N,
                    BLOCK_K=cfg.BLOCK_K, SCALE_ACC=cfg.scale_acc, **gemv_stages(cfg.num_stages), **link,
                    num_warps=gemv_warps(cfg.BLOCK_N, cfg.BLOCK_K, cfg.num_warps), num_stages=1), dev)

            self.gemm, self.down = gemv(cfg13, True, z13, H), gemv(cfg2, False, z2, I)
            return
        if self.kind == "moe_gluon":  # routing, x gathered, the two Gluon GEMMs, the top-k sum
            from ..kernels.moe_gluon import moe_w4a16_gluon_kernel
            from ..kernels.w4a16_gluon import pipe_meta  # (the dense pipe kernel's layouts and launch)

            def gluon_gemm(cfg: Config, gated: bool, zeros: bool, kp: int) -> Launch:
                # (an odd number of 128-channel chunks: the last K step has one; else compiled as before)
                half = dict(HALF_LAST=True) if kp % GLUON_STEP else {}
                return Launch(moe_w4a16_gluon_kernel, dict(
                    GATED=gated, GROUP_CHUNKS=gs // K_CHUNK, HAS_ZEROS=zeros, GROUP_B=cfg.GROUP_M,
                    BLOCK_M=cfg.BLOCK_M, STAGES=cfg.num_stages, **half, **pipe_meta(cfg.BLOCK_M)), dev)

            self.router = Router(E, cfg13.BLOCK_M, dev, topk, shared)
            self.nb = max_blocks(M * (topk + shared), E + shared, cfg13.BLOCK_M)
            self.kp = (padded_k_experts(H), padded_k_experts(I))  # the GEMMs' K (their weights' padded rows)
            self.gemm, self.down = gluon_gemm(cfg13, True, z13, self.kp[0]), gluon_gemm(cfg2, False, z2, self.kp[1])
            self.reduce = self.gated_reduce = None
            self.topk_sum = Launch(_topk_sum_kernel, dict(TOPK=topk, **slots, SPLIT_K=1, WEIGHTED=True, EMU_BF16=emu,
                                                          BLOCK=_REDUCE_BLOCK, num_warps=4), dev)
            return
        route = route_inline(M, topk + shared, E + shared, cfg2)
        # (the routing tile's constexprs only where it is used: one compile serves every M otherwise)
        routing = dict(ROUTE=True, **route_tile(M * (topk + shared), E + shared)) if route else {}
        # the decode path's down GEMM a programmatic dependent of gate_up (sm_90+, SAILFISH_PDL)
        chained = _fused(cfg2) and pdl(dev)

        def gemm(cfg: Config, gated: bool, zeros: bool, K: int, perm: bool) -> Launch:
            link = {} if not chained else dict(PDL_EARLY=True) if gated else as_dependent(dev)
            # (act-order only where there is a perm, SCALE_ACC where the config asks for it and the
            # format allows it (scale_acc_fits): the other kernels compile as before)
            link.update(dict(HAS_PERM=True) if perm else {})
            link.update(dict(SCALE_ACC=True) if cfg.scale_acc and scale_acc_fits(group_size, cfg.BLOCK_K) else {})
            return Launch(_moe_w4a16_kernel, dict(
                TOPK=topk, **slots, GATED=gated, GROUP_SIZE=gs, HAS_ZEROS=zeros, EVEN_K=K % cfg.BLOCK_K == 0,
                SPLIT_K=cfg.SPLIT_K, EMU_BF16=emu, USE_ASM=asm, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, ACC_FENCE=asm and acc_fence(),
                FUSED=_fused(cfg), **routing, **link, **cfg.launch()), dev)

        self.router = None if route else Router(E, cfg13.BLOCK_M, dev, topk, shared)
        self.nb = max_blocks(M * (topk + shared), E + shared, cfg13.BLOCK_M)
        self.gemm = gemm(cfg13, True, z13, H, p13)  # gate_up
        self.down = gemm(cfg2, False, z2, I, p2)
        self.reduce = None  # (Plan's split-K reduce: the MoE plan's are gated_reduce and topk_sum)
        self.gated_reduce = None if cfg13.SPLIT_K == 1 or _fused(cfg13) else Launch(
            _gated_reduce_kernel, dict(SPLIT_K=cfg13.SPLIT_K, EMU_BF16=emu, BLOCK=_REDUCE_BLOCK, num_warps=4), dev)
        self.topk_sum = None if _fused(cfg2) else Launch(
            _topk_sum_kernel, dict(TOPK=topk, **slots, SPLIT_K=cfg2.SPLIT_K, WEIGHTED=cfg2.SPLIT_K == 1, EMU_BF16=emu,
                                   BLOCK=_REDUCE_BLOCK, num_warps=4), dev)

    def bound(self) -> bool:
        return ((self.router is None or self.router.bound()) and self.gemm.run is not None
                and self.down.run is not None
                and all(k is None or k.run is not None for k in (self.gated_reduce, self.topk_sum)))

    def __call__(self, y, x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                 w2_zeros, w13_perm=None, w2_perm=None) -> None:
        """y (M, H) = the block; operands contiguous (topk_ids too)."""
        M, topk, I, H = self.M, self.topk, self.I, self.H
        T = M * (topk + self.shared)  # slots
        c13, c2 = self.config, self.cfg2
        if c13.kernel == "moe_gemv":
            self._gemv_call(y, x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                            w2_zeros)
            return
        if self.kind == "moe_gluon":
            self._gluon_call(y, x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                             w2_zeros)
            return
        nb = self.nb
        sorted_slots = block_expert = None  # (route_inline: the GEMMs' programs route themselves)
        if self.router is not None:
            sorted_slots, block_expert = self.router(topk_ids)
        tw = topk_weights.reshape(-1).float().contiguous()
        h = x.new_empty((T, I))
        f32 = torch.float32
        sync = sync_buffer(*self.sync_at) if _fused(c13) or _fused(c2) else None
        ws = None if c13.SPLIT_K == 1 else x.new_empty((c13.SPLIT_K, T, 2 * I), dtype=f32)
        z13 = w13_scales if w13_zeros is None else w13_zeros  # symmetric: an unread pointer
        self.gemm((nb * -(-I // c13.BLOCK_N), c13.SPLIT_K), x, w13_qweight, w13_scales, z13, sorted_slots,
                  block_expert, None, h if ws is None or self.gated_reduce is None else None, ws,
                  topk_ids if self.router is None else None, None,
                  sync if _fused(c13) else None, w13_perm, T, I, H, self.E, nb, H, I,
                  w13_qweight.stride(0), w13_qweight.stride(1), w13_scales.stride(0), w13_scales.stride(1))
        if self.gated_reduce is not None:
            self.gated_reduce((-(-T * I // _REDUCE_BLOCK), 1), ws, h, T, I)
        split = c2.SPLIT_K
        rows = x.new_empty((T, H)) if split == 1 else x.new_empty((split, T, H), dtype=f32)
        z2 = w2_scales if w2_zeros is None else w2_zeros
        sum_inside = self.topk_sum is None
        self.down((nb * -(-H // c2.BLOCK_N), split), h, w2_qweight, w2_scales, z2, sorted_slots, block_expert,
                  tw, rows if split == 1 else None, None if split == 1 else rows,
                  topk_ids if sum_inside or self.router is None else None,
                  y if sum_inside else None, sync if sum_inside else None, w2_perm, T, H, I, self.E, nb, I, H,
                  w2_qweight.stride(0), w2_qweight.stride(1), w2_scales.stride(0), w2_scales.stride(1))
        if not sum_inside:
            self.topk_sum((-(-M * H // _REDUCE_BLOCK), 1), rows, topk_ids, None if split == 1 else tw, y, M, H,
                          self.E)


    def _gemv_call(self, y, x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                   w2_zeros) -> None:
        """The "moe_gemv" block: gate_up then down, one GEMV per slot each (kernels/moe._moe_gemv_kernel),
        their split-K sums and the top-k sum inside the two launches."""
        M, topk, I, H, E = self.M, self.topk, self.I, self.H, self.E
        T = M * (topk + self.shared)  # slots
        c13, c2 = self.config, self.cfg2
        ids = topk_ids.reshape(-1)
        tw = topk_weights.reshape(-1).float().contiguous()
        h = x.new_empty((T, I))
        f32 = torch.float32
        sync = sync_buffer(*self.sync_at)
        ws13 = None if c13.SPLIT_K == 1 else x.new_empty((c13.SPLIT_K, T, 2 * I), dtype=f32)
        z13 = w13_scales if w13_zeros is None else w13_zeros  # symmetric: an unread pointer
        self.gemm((T, -(-I // (c13.BLOCK_N // 2)), c13.SPLIT_K), x, w13_qweight, w13_scales, z13, ids, None, h, ws13,
                  None, sync if c13.SPLIT_K > 1 else None, T, I, H, E, H, w13_qweight.stride(0),
                  w13_qweight.stride(1), w13_scales.stride(0), w13_scales.stride(1))
        split = c2.SPLIT_K
        rows = x.new_empty((T, H)) if split == 1 else None
        ws2 = None if split == 1 else x.new_empty((split, T, H), dtype=f32)
        z2 = w2_scales if w2_zeros is None else w2_zeros
        self.down((T, -(-H // c2.BLOCK_N), split), h, w2_qweight, w2_scales, z2, ids, tw, rows, ws2, y, sync, T, H, I,
                  E, I, w2_qweight.stride(0), w2_qweight.stride(1), w2_scales.stride(0), w2_scales.stride(1))

    def _gluon_call(self, y, x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                    w2_zeros) -> None:
        """The "moe_gluon" block (kernels/moe_gluon.py): routing; x's rows gathered into routing order
        (padding places: token 0); gate_up -> h in routing order; down -> the weighted slot rows; the
        top-k sum."""
        from ..kernels.w4a16_gluon import pipe_descriptor

        M, topk, I, H, E, S = self.M, self.topk, self.I, self.H, self.E, self.shared
        T, nb = M * (topk + S), self.nb
        c13, c2 = self.config, self.cfg2
        bm = c13.BLOCK_M
        sorted_slots, block_expert = self.router(topk_ids)
        tokens = torch.where(sorted_slots < T, sorted_slots // (topk + S), 0)
        xs = x.index_select(0, tokens)
        h = x.new_empty((nb * bm, I))
        tw = slot_weights(topk_weights, S).contiguous()
        z13 = w13_scales if w13_zeros is None else w13_zeros  # symmetric: an unread pointer
        kp13, kp2 = self.kp
        self.gemm((nb * -(-I // c13.BLOCK_N), 1), pipe_descriptor(xs, bm), w13_qweight, w13_scales, z13,
                  block_expert, sorted_slots, tw, h, T, I, kp13, nb, I, w13_qweight.stride(0), w13_qweight.stride(1),
                  w13_scales.stride(0), w13_scales.stride(1))
        rows = x.new_empty((T, H))
        z2 = w2_scales if w2_zeros is None else w2_zeros
        self.down((nb * -(-H // c2.BLOCK_N), 1), pipe_descriptor(h, bm), w2_qweight, w2_scales, z2,
                  block_expert, sorted_slots, tw, rows, T, H, kp2, nb, H, w2_qweight.stride(0),
                  w2_qweight.stride(1), w2_scales.stride(0), w2_scales.stride(1))
        self.topk_sum((-(-M * H // _REDUCE_BLOCK), 1), rows, topk_ids, None, y, M, H, E)


def moe_w4a16_launch(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                     w2_zeros, group_size, w13_perm=None, w2_perm=None, num_shared: int = 0,
                     configs: Optional[Tuple[Config, Config]] = None) -> torch.Tensor:
    """Run the MoE block's kernels (validated operands). configs: (gate_up, down) to force
    (tests), checked; their BLOCK_M must agree (one routing serves both GEMMs). The configs see
    the block as top-(k + S) routing over E + S experts (num_shared S: the shared experts' slots).

    Steady state (CUDA, configs=None): the problem's plan (MoEPlan) from one dict lookup under
    a key that fixes everything the kernels are compiled for (the operands are contiguous, so
    their strides follow from the shapes); only pointer alignment is checked per call."""
    M, H = x.shape
    y = x.new_empty((M, H))
    if M == 0:
        return y
    x, topk_ids = x.contiguous(), topk_ids.contiguous()
    topk, (E, two_i, kw13) = topk_ids.shape[1], w13_qweight.shape
    I, S = two_i // 2, num_shared
    E -= S  # routed
    operands = (x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales, w2_zeros,
                w13_perm, w2_perm)
    perms = (w13_perm is not None, w2_perm is not None)
    key = None
    if configs is None and x.is_cuda:
        dev = x.get_device()
        key = (dev, x.dtype, M, topk, E, I, H, group_size, w13_zeros is not None, w2_zeros is not None,
               topk_ids.dtype, perms, S)
        if run_steady(MOE_TUNER, key, dev, x, y, operands, ()):
            return y
    plans = None if key is None else MOE_TUNER.plans_for_build()  # before the config lookup
    kp13, kp2 = kw13 * 8, w2_qweight.shape[2] * 8

    gluon = gluon_moe_format(group_size, H, I, kp13, kp2, perms, x.device)

    def build(cfg13: Config, cfg2: Config) -> MoEPlan:
        return MoEPlan(cfg13, cfg2, x.device, x.dtype, M, topk, E, I, H, group_size, w13_zeros is not None,
                       w2_zeros is not None, *perms, shared=S, gluon=gluon and FLAGS.gluon)

    def make_run(gated: bool, chosen: list):
        """The tuner's run(cfg) for one GEMM: the whole block, the other GEMM at the chosen
        gate_up config (down) or the heuristic (gate_up)."""
        def run(cfg: Config) -> None:
            other = chosen[0] if not gated else moe_heuristic(
                device=x.device, M=M, topk=topk + S, E=E + S, N=H, Kp=kp2, gated=False, block_m=cfg.BLOCK_M)
            (build(cfg, other) if gated else build(other, cfg))(x.new_empty((M, H)), *operands)
        return run

    gemv_format = moe_gemv_format(group_size, H, I, perms)
    with device_of(x):
        if configs is None:
            configs = moe_config(x.device, M, topk + S, E + S, I, H, kp13, kp2, make_run, gemv_format, gluon)
        else:
            bm = configs[0].BLOCK_M
            for cfg, gated, N, Kp in ((configs[0], True, I, kp13), (configs[1], False, H, kp2)):
                check_moe_config(cfg, M=M, topk=topk + S, E=E + S, N=N, Kp=Kp, block_m=bm, gated=gated)
            if configs[0].kernel == "moe_gemv" and not gemv_format:
                raise ValueError(f"config kernel='moe_gemv' does not take group_size={group_size}, hidden={H}, "
                                 f"I={I}, act-order={any(perms)}: it needs groups of whole {K_CHUNK}-channel "
                                 "chunks or per channel, even hidden and I, no act-order")
        if configs[0].kernel == "moe_gemv" and x.data_ptr() % 4:  # (the GEMV reads 4-byte channel pairs)
            x = x.clone()
            operands = (x,) + operands[1:]
        plan = run_built(lambda: build(*configs), lambda p: p(y, *operands), ("moe_gluon",), "MoE W4A16")
    keep(plans, key, plan, *operands)
    return y


# ----------------------------------------------------------------------------------
# torch.library op
# ----------------------------------------------------------------------------------
def validate(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales, w2_zeros,
             group_size, w13_perm=None, w2_perm=None, num_shared=0, fake: bool = False) -> None:
    """TypeError / ValueError naming the argument, its value and what is allowed. The perms'
    values (each row a permutation) are checked where that needs no device sync: on the CPU;
    QuantExperts checks them when it is built or loaded."""
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
    if type(num_shared) is not int or not 0 <= num_shared < E:
        raise ValueError(f"num_shared={num_shared!r} must be an int in [0, E={E}) (w13_qweight.shape[0]: the "
                         "routed experts, then the shared ones)")
    routed = E - num_shared
    if not 1 <= topk <= min(routed, MAX_TOPK - num_shared):
        raise ValueError(f"top_k={topk} (topk_ids.shape[1]) must lie in [1, min(routed experts={routed}, "
                         f"{MAX_TOPK} - num_shared={num_shared})]")
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
    for name, perm, k in (("w13_perm", w13_perm, H), ("w2_perm", w2_perm, I)):
        if perm is not None:
            check_perms(name, perm, E, k, values=not fake and perm.device.type == "cpu")
    check_devices(fake, x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13_qweight=w13_qweight,
                  w13_scales=w13_scales, w13_zeros=w13_zeros, w2_qweight=w2_qweight, w2_scales=w2_scales,
                  w2_zeros=w2_zeros, w13_perm=w13_perm, w2_perm=w2_perm)


def moe_w4a16_impl(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                   w2_zeros, group_size, w13_perm=None, w2_perm=None, num_shared=0):
    args = (x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales, w2_zeros,
            group_size, w13_perm, w2_perm, num_shared)
    validate(*args)
    if use_triton(x):
        return moe_w4a16_launch(*args)
    return moe_w4a16_reference(*args)


def _moe_w4a16_fake(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales,
                    w2_zeros, group_size, w13_perm=None, w2_perm=None, num_shared=0):
    validate(x, topk_ids, topk_weights, w13_qweight, w13_scales, w13_zeros, w2_qweight, w2_scales, w2_zeros,
             group_size, w13_perm, w2_perm, num_shared, fake=True)
    return x.new_empty(x.shape)


moe_w4a16 = define_op(
    "moe_w4a16",
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_qweight, Tensor w13_scales, Tensor? w13_zeros, "
    "Tensor w2_qweight, Tensor w2_scales, Tensor? w2_zeros, SymInt group_size, Tensor? w13_perm=None, "
    "Tensor? w2_perm=None, int num_shared=0) -> Tensor",
    moe_w4a16_impl, _moe_w4a16_fake)
