"""W4A16 launcher, configs and ops:

    sailfish::w4a16_gemm(x, qweight, scales, zeros, perm, sorted_g_idx, bias,
                         in_features, group_size) -> y
    sailfish::w4a16_gemm_nograd(...)  the same without an autograd formula

Host cost per steady-state call on CUDA: one dict lookup for the problem's plan (config
and bound kernels, runtime/launch.py) plus the allocations and the direct kernel launches; the
first call of a problem goes through the tuner and Triton's JIT and builds the plan.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache, partial
from typing import Optional

import torch

from ..formats.int4 import K_CHUNK, K_PAD, PackedW4, unpack
from ..runtime.device import (check_devices, device_of, has_bf16x2, has_mma_asm, pdl, sm_count,
                              use_triton)
from ..runtime.dispatch import define_op
from ..runtime.flags import FLAGS, batch_invariant
from ..runtime.launch import Launch
from ..runtime.plan import Plan, keep, run_built, run_steady
from ..tuning import (KERNELS, Config, Tuner, check_blocks, check_fit, check_kernel, gemv_heuristic, m_bucket,
                      mma_heuristic, problem_key, scratch_runner, split_k_for)
from .common import (GLUON_STEP, acc_fence, as_dependent, capturing, eager_scratch, fixup_fits, gluon_device,
                     gluon_overlap_split_ok, gluon_split_ok, invariant_config, sync_buffer)


# ----------------------------------------------------------------------------------
# W4A16 configs
# ----------------------------------------------------------------------------------
def _tensor_core_gemv(M: int, group_size: int, general_gidx: bool) -> bool:
    """Whether a 'gemv' config for this problem runs the tensor-core GEMV (the format side of
    gemv_on_tensor_cores; x's alignment is checked at launch)."""
    return FLAGS.gemv_mma and M <= 8 and (group_size == -1 or group_size % K_CHUNK == 0) and not general_gidx


def w4a16_heuristic(*, device, M, N, Kp, group_size, general_gidx, has_zeros=False) -> Config:
    sms = sm_count(device.index or 0) if device.type == "cuda" else 132
    if (2 <= M <= 16 and N * Kp >= (1 << 25) and gluon_format(group_size, general_gidx, Kp)
            and device.type == "cuda" and gluon_device(device.index or 0)):
        # the Gluon kernel (a 'gluon' config runs its twin where it does not apply): BN 64 / 3
        # steps with the smallest split filling the SMs ~3 times was the tuner's best on the large
        # Llama weights at M = 2-16 (BLOCK_M 8 at M <= 8); docs/perf_log.md v21, v24
        tiles = -(-N // 64)
        split = next((s for s in (1, 2, 3, 4, 6, 8) if gluon_split_ok(s, Kp // GLUON_STEP) and tiles * s >= 2.9 * sms),
                     1)
        return Config(_gluon_block_m(M), 64, GLUON_STEP, split, 8, 4, 3, kernel="gluon")
    if _tensor_core_gemv(M, group_size, general_gidx):
        # tensor-core GEMV: 16 rows x 8 chunk slots / 8 warps without prefetch at M = 1, 32 rows
        # x 4 slots with prefetch at M = 2-8, the best tiles on the 8 Llama shapes (H200, issue 9)
        rows, stages = (16, 1) if M == 1 else (32, 2)
        bk = next(b for b in ((1024, 512, 256) if M == 1 else (512, 256)) if Kp % b == 0)  # Kp % 256 == 0
        warps = 8 if bk == 1024 else 4  # (the launcher drops warps beyond the work units)
        tiles = -(-N // rows)
        split = split_k_for(tiles, Kp // bk, sms)
        # M = 1 with a program for every SM already: split K only while every split keeps
        # >= 4 K tiles (fewer lost to the reduce launch on H200)
        while M == 1 and split > 1 and tiles >= sms and (Kp // bk) // split < 4:
            split //= 2
        # (no scale_acc here, though faster (docs/perf_log.md v19): it multiplies by the unrounded
        # s * (q - z), so the heuristic keeps the numerics of QuantLinear.dequantize(); tuned
        # tables may choose it)
        return Config(M, rows, bk, split, 8, warps, stages, kernel="gemv")
    if M == 1:  # CUDA-core GEMV
        return gemv_heuristic(N, Kp, Kp, sms)
    # dequantize + cuBLAS from M = 1024 (at M = 1024 the tables may take the pipe tile, which the
    # heuristic cannot: it sees the packed Kp, and where x's K is not a multiple of 256 the Gluon
    # kernel's twin runs, slower than cuBLAS; docs/perf_log.md v32)
    if M >= 1024 and device.type == "cuda":
        return Config(1, 64, 256, 1, 8, 4, 1, kernel="dequant")
    if (64 < M and device.type == "cuda" and gluon_format(group_size, general_gidx, Kp)
            and gluon_device(device.index or 0)):
        # the chunk-pipelined Gluon tile, one CTA (8 consumer warps and a producer, 224 KiB) per SM,
        # so the split is the smallest of 1 / 2 / 4 whose programs fill at least half of their last
        # wave; ahead of the Triton tile below on shapes without a table entry (docs/perf_log.md v31)
        tiles = -(-M // PIPE_TILE[0]) * -(-N // PIPE_TILE[1])
        split = next((s for s in (1, 2, 4) if gluon_split_ok(s, Kp // GLUON_STEP)
                      and 2 * tiles * s >= -(-tiles * s // sms) * sms), 1)
        bm, bn, warps, stages = PIPE_TILE
        return Config(bm, bn, GLUON_STEP, split, 8, warps, stages, kernel="gluon_pipe")
    if (16 < M <= 32 and N * Kp >= (1 << 25) and device.type == "cuda" and not general_gidx
            and scale_acc_tile(128, group_size)):
        # BM 32 / BN 64 / BK 128 / 4 stages with the scale on the fp32 product, split until the
        # tiles fill the SMs ~3 times: faster than the tile below on every large weight measured
        # (docs/perf_log.md v21). It multiplies by the unrounded s * (q - z), so only for large
        # weights on the GPU: smaller layers and the interpreter keep the rounded weights of
        # QuantLinear.dequantize().
        tiles = -(-N // 64)
        k_tiles = Kp // 128
        fits = [s for s in (1, 2, 3, 4, 6, 8) if s <= k_tiles]
        split = next((s for s in fits if tiles * s >= 2.9 * sms), fits[-1])
        return Config(32, 64, 128, split, 8, 4, 4, scale_acc=True)
    # fragment-order tiles (a probe on H200, untuned): BM 16 / BN 128 / BK 256 / 3 stages was the
    # best probe tile at M <= 16, BK 128 / 4 stages at M = 64
    cfg = mma_heuristic(M, N, Kp, sms, (16, 128, 256, 4, 3), (32, 128, 128, 4, 4), (128, 128, 128, 8, 3))
    # 33 <= M <= 64 on >= 2**25 weights (GPU): the same tile with the scale on the fp32 product
    # (docs/perf_log.md v21)
    sa = (32 < M <= 64 and N * Kp >= (1 << 25) and device.type == "cuda" and not general_gidx
          and scale_acc_tile(cfg.BLOCK_K, group_size))
    return replace(cfg, scale_acc=sa)


def _gluon_candidates(*, device, M, N, Kp, group_size, general_gidx, has_zeros):
    """The Hopper Gluon kernels' tiles (kernels/w4a16_gluon.py) for M >= 2, where they can
    run (with or without zero points); at M = 2-8 its BLOCK_M 8 tiles (wgmma N = 8) compete with
    the tensor-core GEMV (at M = 1 they lost to it everywhere). BLOCK_N 64 with 3 or 4 stages at
    M <= 32 (more stages cost occupancy, BLOCK_N 128 spills or shares x), BLOCK_M 64 / BLOCK_N
    128 over 8 warps at M = 33-64; the splits 3 and 6 are tried too, since the split-K that
    fills the SMs ~3-4 times decides the rest (docs/perf_log.md v18, v24).
    """
    if not (2 <= M and gluon_format(group_size, general_gidx, Kp) and gluon_device(device.index or 0)):
        return
    sms = sm_count(device.index or 0)
    if M > 64:  # the chunk-pipelined kernel's tile (PIPE_TILE)
        yield from _gluon_tiles("gluon_pipe", [PIPE_TILE], M=M, N=N, Kp=Kp, sms=sms)
    elif M > 32:  # its BLOCK_M 64 form (ahead of the table for bf16 asymmetric; docs/perf_log.md v32)
        yield from _gluon_tiles("gluon_pipe", [(64,) + PIPE_TILE[1:]], M=M, N=N, Kp=Kp, sms=sms)
    if M > 128:  # ... alone
        return
    bm = _gluon_block_m(M)
    if M <= 64:
        tiles_ = [(bm, 64, 4, 3), (bm, 64, 4, 4)] if M <= 32 else [(64, 128, 8, 3)]
        yield from _gluon_tiles("gluon", tiles_, M=M, N=N, Kp=Kp, sms=sms)
    # the overlap kernels: best on about half the Llama shapes at M = 9-128 (docs/perf_log.md v26)
    if M > 8:
        for kernel in OVERLAP_KERNELS:
            yield from _gluon_tiles(kernel, _overlap_tiles(M), M=M, N=N, Kp=Kp, sms=sms)


def _overlap_tiles(M: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the overlap kernels: one 64-row slice
    per warpgroup, BLOCK_M 64 over two (_check_gluon_config)."""
    bm = _gluon_block_m(M)
    return [(64, 128, 8, 3), (64, 128, 8, 4)] if bm == 64 else [(bm, 64, 4, 3), (bm, 64, 4, 4), (bm, 128, 8, 3)]


# gluon_pipe's tile (BLOCK_M, BLOCK_N, num_warps, num_stages): 128 columns over two consumer warpgroups
# (and a TMA producer warp), x rings of 3 / 4 chunks (224 KiB, one CTA per SM). The tuner's only Gluon
# tile at M > 128 and, beside the overlap kernels, at M = 65-128 (where it covers the batch in one N
# tile instead of two BLOCK_M 64 tiles); the heuristic's at 64 < M < 1024 (docs/perf_log.md v31, v32)
PIPE_TILE = (128, 128, 8, 3)


def _gluon_block_m(M: int) -> int:
    """The Gluon kernels' BLOCK_M (wgmma's N) for a batch of M rows: the smallest of 8-64 that holds it."""
    return 8 if M <= 8 else 16 if M <= 16 else 32 if M <= 32 else 64


def _gluon_tiles(kernel: str, tiles_, *, M, N, Kp, sms):
    """Configs of a Gluon kernel for (BLOCK_M, BLOCK_N, num_warps, num_stages) tiles: no split, and
    every split in 2-8 that the kernel takes (_gluon_split_ok) and that keeps the programs within 8
    per SM."""
    split_ok = _gluon_split_ok(kernel)
    for bm, bn, warps, stages in tiles_:
        tiles = -(-M // bm) * -(-N // bn)
        for split in (1, 2, 3, 4, 6, 8):
            if split_ok(split, Kp // GLUON_STEP) and (split == 1 or tiles * split <= 8 * sms):
                yield Config(bm, bn, GLUON_STEP, split, 8, warps, stages, kernel=kernel)


def w4a16_candidates(*, device, M, N, Kp, group_size, general_gidx, has_zeros=False):
    sms = sm_count(device.index or 0)
    yield from _gluon_candidates(device=device, M=M, N=N, Kp=Kp, group_size=group_size, general_gidx=general_gidx,
                                 has_zeros=has_zeros)
    if _tensor_core_gemv(M, group_size, general_gidx):
        # the tensor-core GEMV (gemv_on_tensor_cores): BLOCK_N 16 runs one 16-row mma block
        # per asm element, >= 32 two (x loaded once for both); num_stages 1 / 2: without /
        # with the one-tile word prefetch. The tiles that were best on some Llama shape on
        # an H200 (issue 9; BLOCK_K 2048: docs/perf_log.md v34). Warps beyond the program's
        # (chunk, row block) work units are dropped by the launcher (kernels/w4a16.gemv_warps).
        space = [(M, 16, 1024, 8, 1), (M, 16, 1024, 8, 2), (M, 16, 2048, 8, 1), (M, 16, 2048, 8, 2),
                 (M, 16, 512, 4, 1), (M, 32, 512, 4, 1),
                 (M, 32, 512, 4, 2), (M, 64, 512, 4, 1), (M, 64, 512, 4, 2), (M, 128, 256, 4, 1),
                 (M, 128, 256, 4, 2)]
    elif M == 1:  # CUDA-core GEMV (group 32 / 64, a general g_idx)
        # (BK 1024: the one gain of a 43-tile sweep on H200, 4096x4096)
        space = [(1, 16, 512, 4, 4), (1, 32, 256, 4, 4), (1, 16, 256, 4, 6), (1, 32, 512, 4, 3),
                 (1, 64, 256, 4, 4), (1, 16, 512, 2, 4), (1, 16, 1024, 4, 4), (1, 16, 1024, 8, 4)]
    elif M <= 8:  # multi-row GEMV; registers: BLOCK_M * BLOCK_N * BLOCK_K / threads fp32
        space = [(M, 16, 256, 4, 4), (M, 16, 128, 4, 6), (M, 32, 128, 4, 4), (M, 8 * (16 // M), 256, 4, 4)]
    else:
        space = []
    # the tensor-core GEMV's tiles with and without the scale on the fp32 chunk products
    sa = (False, True) if _tensor_core_gemv(M, group_size, general_gidx) else (False,)
    for bm, bn, bk, warps, stages in space:
        if Kp % bk == 0 and bn >= 8:
            for split in sorted({1, split_k_for(-(-N // bn), Kp // bk, sms)}):
                for s in sa:
                    yield Config(bm, bn, bk, split, 8, warps, stages, kernel="gemv", scale_acc=s)
    if M >= 256:
        yield Config(1, 64, 256, 1, 8, 4, 1, kernel="dequant")
    if M == 1:
        return
    # BLOCK_K is 128 or 256 (whole 128-channel chunks of the fragment-order layout)
    if M <= 16:
        space = [(16, 128, 256, 4, 3), (16, 128, 128, 4, 4), (16, 64, 256, 4, 4), (16, 64, 128, 4, 6),
                 (16, 256, 128, 8, 4)]
    elif M <= 64:
        bm = 32 if M <= 32 else 64
        space = [(bm, 128, 128, 4, 4), (bm, 128, 256, 4, 3), (bm, 64, 128, 4, 4), (bm, 256, 128, 8, 4),
                 (bm, 256, 128, 8, 3), (bm, 128, 128, 8, 4)]
    else:
        space = [(64, 128, 128, 4, 4), (128, 128, 128, 8, 3), (128, 256, 128, 8, 3),
                 (256, 128, 128, 8, 3), (128, 128, 256, 8, 2)]
    seen = set()
    for bm, bn, bk, warps, stages in space:
        tiles = -(-M // bm) * -(-N // bn)
        s0 = split_k_for(tiles, Kp // bk, sms)
        # and split 3, which beat every power of two on 8192x10240 at M = 64-256 (docs/perf_log.md v18)
        for split in sorted({1, s0, min(2 * s0, Kp // bk), min(3, Kp // bk)}):
            cfg = Config(bm, bn, bk, split, 8, warps, stages)
            # M <= 64: each tile with the scale on the fp32 product too, where it applies
            # (at M = 128 its per-tile FFMAs cost more than the multiplies it saves)
            sa = M <= 64 and not general_gidx and scale_acc_tile(bk, group_size)
            for c in (cfg, replace(cfg, scale_acc=True)) if sa else (cfg,):
                if c not in seen and Kp % bk == 0:
                    seen.add(c)
                    yield c


def experimental_candidates(*, device, M, N, Kp, group_size, general_gidx, has_zeros=False):
    """Tiles that pass every test (interpreter and H100) but did not win where measured, kept for
    the offline tuner on other GPUs and Triton versions (docs/perf_log.md v26): the tensor-core
    GEMV with its words through a cp.async ring (num_stages 3, 4; H100 M = 1-2: 6-12% slower than
    the table on all 8 Llama shapes) and the overlap kernels' tiles outside M = 9-128. Only the
    offline tuner offers them (`python -m sailfish.bench.tune --experimental`), and it checks
    every candidate's output against the reference before timing it; the runtime autotuner does
    not check outputs, so they are not among its candidates."""
    problem = dict(device=device, M=M, N=N, Kp=Kp, group_size=group_size, general_gidx=general_gidx,
                   has_zeros=has_zeros)
    if _tensor_core_gemv(M, group_size, general_gidx):  # the regular GEMV tiles, with a 3- or 4-stage ring
        for cfg in w4a16_candidates(**problem):
            if cfg.kernel == "gemv" and cfg.num_stages == 1:
                yield from (replace(cfg, num_stages=stages) for stages in (3, 4))
    # the overlap kernels' tiles where the regular list has none (M = 9-128 it has, v26): M = 1-8
    # (H100: 1-4% ahead of the table on 5 of 8 shapes at M = 4-8, noise level, v26)
    if M <= 8 and gluon_format(group_size, general_gidx, Kp) and gluon_device(device.index or 0):
        for kernel in OVERLAP_KERNELS:
            yield from _gluon_tiles(kernel, _overlap_tiles(M), M=M, N=N, Kp=Kp, sms=sm_count(device.index or 0))


def w4a16_config(device: torch.device, M: int, N: int, Kp: int, group_size: int, has_zeros: bool,
                 general_gidx: bool, dtype: torch.dtype, invariant: bool = False, make_run=None) -> Config:
    """The config w4a16_launch runs when given none: batch-invariant mode's (invariant_config), else
    the cached one (one dict lookup), else on a problem's first call the tuner's answer (table
    entry, the shape's 'any' entry for another format, autotuning with make_run() where enabled,
    the heuristic), checked. The offline tuner (bench/tune.py) asks it what ships."""
    if invariant:
        config = invariant_config(M, N, Kp)
        check_w4a16_config(config, Kp, M, group_size, general_gidx)
        return config
    mb = m_bucket(M)
    memo = (Kp, N, mb, group_size, has_zeros, general_gidx, dtype)
    config = W4A16_TUNER.lookup(device, memo)
    if config is None:  # first call of this problem on this device
        config = W4A16_TUNER.get(w4a16_key(Kp, N, M, group_size, has_zeros, general_gidx, dtype), device,
                                 None if make_run is None else make_run(),
                                 fallback_key=problem_key("w4a16", Kp, N, M, "any"), memo_key=memo,
                                 M=mb, N=N, Kp=Kp, group_size=group_size, general_gidx=general_gidx,
                                 has_zeros=has_zeros)
        check_w4a16_config(config, Kp, M, group_size, general_gidx, table=True)
    return config


def w4a16_key(kp: int, n: int, m: int, group_size: int, has_zeros: bool, general_gidx: bool,
              dtype: torch.dtype) -> str:
    flags = f"gs={group_size}|zeros={int(has_zeros)}|gidx={int(general_gidx)}|{str(dtype)[6:]}"
    return problem_key("w4a16", kp, n, m, flags)


W4A16_TUNER = Tuner("w4a16", w4a16_heuristic, w4a16_candidates)


def check_w4a16_config(cfg: Config, kp: int, m: int, group_size: int = -1, general_gidx: bool = False,
                  table: bool = False) -> None:
    """ValueError naming the field for a config that cannot run. table=True (a shipped or
    tuned entry, possibly another format's fallback): scale_acc where it does not apply is
    not an error, the kernel runs without it (scale_acc())."""
    check_blocks(cfg)
    if cfg.BLOCK_K % K_CHUNK:
        raise ValueError(f"config BLOCK_K={cfg.BLOCK_K} must be a multiple of {K_CHUNK} "
                         "(whole chunks of the fragment-order weight layout)")
    check_kernel(cfg, W4A16_KERNELS)
    if cfg.kernel in GLUON_KERNELS:
        _check_gluon_config(cfg, kp)
    if cfg.kernel == "gemv" and cfg.BLOCK_M < m:
        raise ValueError(f"config kernel='gemv' needs BLOCK_M >= M, got BLOCK_M={cfg.BLOCK_M}, M={m}")
    check_fit(cfg, kp, kp)
    if cfg.scale_acc and not table and not scale_acc_format(cfg, group_size, general_gidx):
        raise ValueError(f"config scale_acc=True needs kernel='mma' with BLOCK_K <= group_size (or = 2 * group_size "
                         f">= 256) or kernel='gemv' with groups of whole {K_CHUNK}-channel chunks, and no general "
                         f"g_idx; got kernel={cfg.kernel!r}, BLOCK_K={cfg.BLOCK_K}, group_size={group_size}, "
                         f"general g_idx={general_gidx}")


def _check_gluon_config(cfg: Config, kp: int) -> None:
    """The tiles kernels/w4a16_gluon.py compiles: one or two warpgroups, BLOCK_K = one K step
    of two 128-channel chunks, BLOCK_M 8-64 (wgmma's N), BLOCK_N 64 or 128 (64 rows per
    warpgroup and slice; 256 would not fit the registers), a ring of >= 2 steps, every split
    non-empty. 'gluon_overlap' and 'gluon_overlap_regs' (two steps' wgmmas in flight): one 64-row
    slice per warpgroup, BLOCK_M 64 over two warpgroups, a ring of >= 3 steps and an even number
    of K steps in every split (gluon_overlap_split_ok). 'gluon_pipe' (one chunk's wgmmas in flight
    while the next is dequantized, warp-specialized): BLOCK_M 64 or 128, BLOCK_N 128 over two
    consumer warpgroups (num_warps 8; a producer warp comes on top), x rings of >= 3 and >= 4
    chunks."""
    k = cfg.kernel
    if cfg.BLOCK_K != GLUON_STEP:
        raise ValueError(f"config kernel={k!r} needs BLOCK_K={GLUON_STEP}, got {cfg.BLOCK_K}")
    if cfg.BLOCK_M not in ((64, 128) if k == "gluon_pipe" else (8, 16, 32, 64)):
        # 128 columns: the one-step kernel's two scaled products and the overlap kernels' two steps
        # of A operands do not fit beside the accumulator (255 registers, 148-432 bytes of spill,
        # sm_90a, Triton 3.6); 'gluon_pipe' keeps two chunks' A operands and accumulates in place
        allowed = "64 or 128" if k == "gluon_pipe" else "in (8, 16, 32, 64)"
        raise ValueError(f"config kernel={k!r} needs BLOCK_M {allowed}, got {cfg.BLOCK_M}")
    if cfg.BLOCK_N not in (64, 128):
        raise ValueError(f"config kernel={k!r} needs BLOCK_N in (64, 128), got {cfg.BLOCK_N}")
    if cfg.num_warps not in (4, 8) or cfg.BLOCK_N < 16 * cfg.num_warps:
        raise ValueError(f"config kernel={k!r} needs num_warps 4 (one warpgroup) or 8 (two, BLOCK_N >= 128), "
                         f"got num_warps={cfg.num_warps}, BLOCK_N={cfg.BLOCK_N}")
    if k == "gluon_pipe" and (cfg.BLOCK_N, cfg.num_warps) != (128, 8):
        raise ValueError(f"config kernel={k!r} needs BLOCK_N 128 and num_warps 8 (two consumer warpgroups of 64 "
                         f"rows); got BLOCK_N={cfg.BLOCK_N}, num_warps={cfg.num_warps}")
    if k in OVERLAP_KERNELS and (cfg.BLOCK_N != 16 * cfg.num_warps or (cfg.BLOCK_M == 64 and cfg.num_warps == 4)):
        # two steps' A operands per thread: 64 rows per warpgroup (BLOCK_N 64 / 4 warps, 128 / 8), and
        # BLOCK_M 64 over two warpgroups only (one: 255 registers, spilling in the K loop on Triton 3.6)
        raise ValueError(f"config kernel={k!r} needs BLOCK_N = 16 * num_warps and, for BLOCK_M 64, "
                         f"num_warps 8; got BLOCK_M={cfg.BLOCK_M}, BLOCK_N={cfg.BLOCK_N}, num_warps={cfg.num_warps}")
    ring = 3 if k in OVERLAP_KERNELS or k == "gluon_pipe" else 2
    if cfg.num_stages < ring:
        raise ValueError(f"config kernel={k!r} needs num_stages >= {ring} (the cp.async ring), got {cfg.num_stages}")
    from ..kernels.gluon_common import CTA_RESERVED_SHARED, SM_SHARED_BYTES, pipe_shared_bytes
    from ..kernels.w4a16_gluon import shared_bytes
    ring_bytes = (pipe_shared_bytes(cfg.BLOCK_M, cfg.num_stages) if k == "gluon_pipe" else
                  shared_bytes(cfg.BLOCK_M, cfg.BLOCK_N, cfg.num_stages, words=k != "gluon_overlap_regs"))
    if ring_bytes + CTA_RESERVED_SHARED > SM_SHARED_BYTES:
        raise ValueError(f"config kernel={k!r} BLOCK_M={cfg.BLOCK_M} BLOCK_N={cfg.BLOCK_N} num_stages={cfg.num_stages} "
                         f"needs {ring_bytes} bytes of shared memory for its ring; an SM has "
                         f"{SM_SHARED_BYTES - CTA_RESERVED_SHARED} (fewer stages or a smaller tile)")
    if cfg.scale_acc:
        raise ValueError(f"config kernel={k!r} takes no scale_acc (where its scales go is the kernel's choice)")
    steps = kp // GLUON_STEP
    if not _gluon_split_ok(k)(cfg.SPLIT_K, steps):
        what = (f"does not give every split an even number (>= 2) of the {steps} K steps" if k in OVERLAP_KERNELS
                else f"leaves a split of the {steps} K steps empty")
        raise ValueError(f"config kernel={k!r} SPLIT_K={cfg.SPLIT_K} {what} (split k takes steps "
                         "[k * ceil(steps / SPLIT_K), ...))")


# ----------------------------------------------------------------------------------
# W4A16 launcher
# ----------------------------------------------------------------------------------
def w4a16_reference(x, qweight, scales, zeros, perm, sorted_g_idx, bias, in_features, group_size):
    """PyTorch twin of the kernel: the same effective weight, an fp32 matmul."""
    w = unpack(PackedW4(qweight, scales, zeros, perm, sorted_g_idx, in_features, group_size)).dequantize()
    y = x.float() @ w.T.to(x.device)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# The large-M path dequantizes into a transient weight; it is made and multiplied in
# slices of N of at most this many bytes (8192x57344 whole would be 940 MB).
DEQUANT_SLICE_BYTES = 128 << 20


def prefetch_scales(cfg: Config, group_size: int, general_gidx: bool = False, has_zeros: bool = False) -> bool:
    """Load the next K tile's scales one iteration early in the mma kernel (a 2-byte load is
    too narrow for the cp.async pipeline, so one issued in the tile that uses it stalls it).
    - SCALE_ACC with one group per K tile (BLOCK_K <= group size) and no zero points: on
      (the stalls on the scale's load were the largest share in ncu; faster on the BLOCK_K 128
      tiles, neutral elsewhere). Not with two groups per tile nor with zero points (they stay
      synchronous in the dequantization): no gain there. docs/perf_log.md v17.
    - Without SCALE_ACC (the scale enters the dequantization): off. Only possible where
      BLOCK_N >= 32 * num_warps and the group size is not 64 (else Triton 3.6 and 3.9 send
      the dequantized tile through shared memory: `python -m sailfish.bench.ptx --group-size
      64`), and measured slower there (docs/perf_log.md v17).
    SAILFISH_SCALE_PREFETCH=0 turns it off everywhere, =1 on wherever possible (to measure)."""
    mode = FLAGS.scale_prefetch
    if mode == "0":
        return False
    if scale_acc(cfg, group_size, general_gidx):
        one_group = 0 < cfg.BLOCK_K <= group_size
        return one_group and (mode == "1" or not has_zeros)
    return mode == "1" and cfg.BLOCK_N >= 32 * cfg.num_warps and group_size != 64


# The mma kernel loads the per-group scales (and zeros) as int32 pairs of two adjacent groups,
# so Triton pipelines them with cp.async like the weights (a 2-byte load is too narrow for it
# and stalled every K tile: docs/perf_log.md v12). Needs rows of an even number of elements
# that start 4-byte aligned; otherwise the 2-byte load. SAILFISH_PAIRED_SCALES=0 turns it off.


def paired_scales(cfg: Config) -> bool:
    """Whether the mma kernel loads its scales as int32 pairs (PAIRED_SCALES) with this tile.
    Only where BLOCK_N >= 32 * num_warps: with fewer rows than threads Triton (3.6 and 3.9)
    sends the dequantized tile through shared memory again (`python -m sailfish.bench.ptx`),
    as with PREFETCH_S. Only for BLOCK_M >= 32: up to 1.3x faster at M = 64, mixed at M = 2-16
    (docs/perf_log.md v12)."""
    return FLAGS.paired_scales and cfg.BLOCK_N >= 32 * cfg.num_warps and cfg.BLOCK_M >= 32


def scale_acc_tile(block_k: int, group_size: int) -> bool:
    """Whether a K tile of block_k channels can take SCALE_ACC: per channel, one group per tile,
    or two whole groups of >= 128 channels (each half tile is one 128-channel chunk or more of
    the fragment order, kernels/w4a16._half_product)."""
    return group_size == -1 or block_k <= group_size or (block_k == 2 * group_size and group_size >= 128)


def scale_acc_format(cfg: Config, group_size: int, general_gidx: bool) -> bool:
    """Whether cfg's kernel can take SCALE_ACC for this format: the mma kernel with K tiles of
    one group or two (scale_acc_tile), the tensor-core GEMV with groups of whole 128-channel
    chunks (its asm scales each chunk's product); no general g_idx."""
    if general_gidx:
        return False
    if cfg.kernel == "mma":
        return scale_acc_tile(cfg.BLOCK_K, group_size)
    return cfg.kernel == "gemv" and (group_size == -1 or group_size % K_CHUNK == 0)


def scale_acc(cfg: Config, group_size: int, general_gidx: bool) -> bool:
    """Whether the mma kernel or the tensor-core GEMV runs with SCALE_ACC (a config choice,
    Config.scale_acc): the scales multiply the fp32 product once per K tile or chunk (per
    channel: the mma kernel once at the end) instead of every dequantized weight, 4 of the
    13 fp16 asm instructions per word (scale_acc_format; check_w4a16_config refuses the rest).
    Faster at M = 32, slower where BLOCK_K 256 wins and at M = 128 (64 FFMAs per K tile per
    thread), so the tuner decides (docs/perf_log.md v15). (A 'gemv' config whose
    problem falls back to the CUDA-core GEMV, gemv_on_tensor_cores, runs without it.)"""
    return cfg.scale_acc and scale_acc_format(cfg, group_size, general_gidx)


# The 'gemv' configs run on the tensor cores (kernels/w4a16._w4a16_gemv_mma_kernel, issue 9)
# wherever that kernel applies; SAILFISH_GEMV_MMA=0 keeps the CUDA-core GEMV, to compare.


# The 'gluon' configs run the Hopper Gluon kernel (kernels/w4a16_gluon.py) wherever it applies
# (gluon_applies) and its Triton twin (gluon_twin) elsewhere: the CPU interpreter, other GPUs,
# a general g_idx, K % 256 != 0. SAILFISH_GLUON=0 runs the twin everywhere and
# keeps the Gluon tiles out of the tuner's candidates (to compare; ops/common.py).
# 'gluon_overlap': the Gluon kernel that dequantizes each K step while the previous step's
# wgmmas run (kernels/w4a16_gluon.w4a16_gluon_overlap_kernel); 'gluon_overlap_regs': the same with
# the packed words loaded from global memory straight into registers two steps ahead (the ring
# holds x only). Each wins on some shapes and formats: regular candidates at M = 9-128, the
# offline tuner's --experimental elsewhere (docs/perf_log.md v25, v26)
OVERLAP_KERNELS = ("gluon_overlap", "gluon_overlap_regs")
# 'gluon_pipe' (large M): each 128-channel chunk dequantized while the previous chunk's wgmmas run
# (kernels/w4a16_gluon.w4a16_gluon_pipe_kernel); a candidate at M > 64 (docs/perf_log.md v30, v31)
GLUON_KERNELS = ("gluon",) + OVERLAP_KERNELS + ("gluon_pipe",)
W4A16_KERNELS = KERNELS + GLUON_KERNELS  # every Config.kernel the W4A16 launcher takes


def gluon_format(group_size: int, general_gidx: bool, k: int) -> bool:
    """The weight formats and K the Gluon kernel takes: groups of whole 128-channel chunks (or
    per channel), no general g_idx, K a multiple of its 256-channel step."""
    return not general_gidx and (group_size == -1 or group_size % K_CHUNK == 0) and k % GLUON_STEP == 0


def _gluon_split_ok(kernel: str):
    """The split rule of a Gluon kernel: gluon_split_ok or gluon_overlap_split_ok."""
    return gluon_overlap_split_ok if kernel in OVERLAP_KERNELS else gluon_split_ok


def gluon_twin(cfg: Config, group_size: int = 128) -> Config:
    """The Triton config that computes what a Gluon config does: the same tile (BLOCK_M at least
    the mma kernel's 16), split and K step. 'gluon': two 128-channel halves with the scale on each
    fp32 product (SCALE_ACC); the overlap kernels: groups scale the weights (rounded once to x's
    dtype, no SCALE_ACC), per channel the product (SCALE_ACC)."""
    sa = cfg.kernel == "gluon" or group_size == -1
    return replace(cfg, kernel="mma", scale_acc=sa, BLOCK_M=max(16, cfg.BLOCK_M))


def gluon_applies(x: torch.Tensor, qweight: torch.Tensor, group_size: int, general_gidx: bool, use_asm: bool) -> bool:
    """Whether a 'gluon' config runs the Gluon kernel: a Hopper GPU (gluon_device), the asm
    dequantization allowed, a format it takes (gluon_format, with x's K), and x and the words
    16-byte aligned (its cp.async copies 16 bytes per thread)."""
    return (use_asm and x.is_cuda and gluon_format(group_size, general_gidx, x.shape[1])
            and x.data_ptr() % 16 == 0 and qweight.data_ptr() % 16 == 0 and gluon_device(x.device.index))


def gemv_stages(num_stages: int) -> dict:
    """The tensor-core GEMV's K-loop pipelining for a config's num_stages: 1 none, 2 the next
    tile's words loaded one iteration ahead into registers (PREFETCH), >= 3 a cp.async ring of
    that many stages in shared memory (RING; kernels/w4a16._w4a16_gemv_mma_kernel)."""
    return dict(PREFETCH=num_stages == 2, RING=num_stages if num_stages >= 3 else 1)


def gemv_on_tensor_cores(cfg: Config, x: torch.Tensor, gs: int, general_gidx: bool) -> bool:
    """Whether a 'gemv' config runs the tensor-core GEMV: M <= 8 (the 8 columns of an
    m16n8k16 B tile), groups of whole 128-channel chunks (per channel, 128, 256, ...), no
    per-channel group index, x readable as 4-byte channel pairs (even K, aligned rows).
    Elsewhere (group 32 / 64, a general g_idx, odd K) the CUDA-core GEMV runs."""
    # (x is contiguous and its row stride is passed as K: K even makes every row 4-byte aligned)
    return (FLAGS.gemv_mma and cfg.BLOCK_M <= 8 and cfg.BLOCK_N >= 16 and not general_gidx
            and gs % K_CHUNK == 0 and x.shape[1] % 2 == 0 and x.data_ptr() % 4 == 0)


_REDUCE_BLOCK = 1024


def gemv_fixup(cfg: Config, M: int, N: int) -> bool:
    """Whether split-K config cfg adds its slices inside the GEMM: the two GEMVs (kernels/w4a16.py
    _gemv_fixup, bit for bit what the reduce kernel computes), where the tile counters and 32-bit
    slice offsets serve (ops/common.py fixup_fits; M up to twice this call's, a plan serving an M
    bucket). One launch per call instead of two: the reduce launch's host time in eager mode
    (issue 39); in a CUDA graph the PDL-chained reduce measured about even with it (H200,
    docs/perf_log.md v23, "the same in-GEMM split-K for W4A16"). SAILFISH_SPLIT_FIXUP=0: never."""
    return (FLAGS.split_fixup and cfg.kernel == "gemv" and cfg.SPLIT_K > 1
            and fixup_fits(-(-N // cfg.BLOCK_N), 2 * M, N))


def overlap_fixup(cfg: Config, M: int, N: int) -> bool:
    """Whether split-K config cfg of an overlap kernel has the second form that adds its slices
    inside the GEMM (kernels/w4a16_gluon._store FIXUP), for eager calls: one launch a call where
    the reduce takes a second (issue 39 item 5, the host time of eager decode at M = 2-16). Inside
    a CUDA graph capture the plan keeps the PDL-chained reduce, which overlaps the GEMM's tail
    where the last slice's sum is serial (compiled decode, batch 16: 3.813 ms with the reduce,
    3.846 with the sum in the kernel, H100, docs/perf_log.md v50). Where the tile counters and
    32-bit slice offsets serve (M up to twice this call's: a plan serves an M bucket)."""
    return (FLAGS.split_fixup and cfg.kernel in OVERLAP_KERNELS and cfg.SPLIT_K > 1
            and fixup_fits(-(-2 * M // cfg.BLOCK_M) * -(-N // cfg.BLOCK_N), 2 * M, N))


class _GemmPlan(Plan):
    """The fused paths ("gemv", "mma", "gluon") of one W4A16 problem on one GPU: its config and the
    bound kernels (GEMM, split-K reduce; runtime/launch.py). w4a16_launch builds one per call
    on the slow path and keeps it in W4A16_TUNER.plans under its plan key (below) once its
    kernels are bound, so that a steady-state call skips the tuner and Triton's binding.
    fixup (gemv_fixup): the GEMV adds its split-K slices itself, no reduce kernel; each call then
    passes the current stream's tile counters (ops/common.py sync_buffer). eager
    (overlap_fixup): the overlap kernel's form that does the same, bound beside the split-K GEMM
    and its reduce; a call outside a CUDA graph capture launches it, a capture the other two."""

    __slots__ = ("x_desc", "fixup", "sync_at", "overlap", "eager", "in_gemm")

    def __init__(self, cfg: Config, device_index: int, *, gs: int, has_zeros: bool, has_gidx: bool,
                 has_bias: bool, emu: bool, asm: bool, mma_asm: bool, tensor_core_gemv: bool,
                 paired: bool, bf16: bool, K: int, group_size: int, gluon: bool = False, fixup: bool = False,
                 eager_fixup: bool = False):
        from ..kernels.w4a16 import (_splitk_reduce_kernel, _w4a16_gemv_kernel, _w4a16_gemv_mma_kernel,
                                     _w4a16_kernel, gemv_asm, gemv_pairs, gemv_warps)

        if cfg.kernel in GLUON_KERNELS and not gluon:  # (gluon_applies)
            cfg = gluon_twin(cfg, group_size)
        self.config = cfg
        self.x_desc = None  # the pipe kernel's: x -> its TMA descriptor
        self.overlap = cfg.kernel in OVERLAP_KERNELS  # (its kernel takes the tile counters' pointer)
        self.eager = None  # (overlap_fixup's launch)
        self.fixup = fixup and cfg.kernel == "gemv"
        # sync_buffer's arguments: the counters live on the plan's device
        self.sync_at = (torch.device("cpu") if device_index < 0 else torch.device("cuda", device_index), device_index)
        even_k = K % cfg.BLOCK_K == 0
        # PDL (runtime/launch.py): the split-K GEMM lets the reduce launch at once, the reduce waits
        chained = cfg.SPLIT_K > 1 and pdl(device_index) and not self.fixup
        meta = dict(GROUP_SIZE=gs, HAS_ZEROS=has_zeros, HAS_BIAS=has_bias, EVEN_K=even_k, SPLIT_K=cfg.SPLIT_K,
                    EMU_BF16=emu, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, PDL_EARLY=chained,
                    **cfg.launch())
        if cfg.kernel in GLUON_KERNELS:  # (takes no g_idx pointer)
            from ..kernels.w4a16_gluon import (layouts, max_registers, pipe_descriptor, pipe_meta,
                                               w4a16_gluon_kernel, w4a16_gluon_overlap_kernel,
                                               w4a16_gluon_pipe_kernel)

            overlap = self.overlap
            common = dict(GROUP_CHUNKS=gs // K_CHUNK, HAS_ZEROS=has_zeros, HAS_BIAS=has_bias, SPLIT_K=cfg.SPLIT_K,
                          BLOCK_M=cfg.BLOCK_M, STAGES=cfg.num_stages, PDL_EARLY=chained)
            if cfg.kernel == "gluon_pipe":  # warp-specialized, x by TMA (its own launch shape: pipe_meta)
                self.kind = "gluon_pipe"
                self.gemm = Launch(w4a16_gluon_pipe_kernel, dict(common, **pipe_meta(cfg.BLOCK_M)), device_index)
                # x's TMA descriptor, made per call (3.1 us of host time, Triton 3.9, CPU)
                self.x_desc = partial(pipe_descriptor, BLOCK_M=cfg.BLOCK_M)
            else:
                # (the overlap kernels' ~170-250 registers are their in-flight A operands: no cap)
                cap = None if overlap else max_registers(cfg.BLOCK_M, cfg.BLOCK_N, cfg.num_stages, cfg.num_warps,
                                                         has_zeros)
                self.kind = "gluon"
                meta = dict(common, BLOCK_N=cfg.BLOCK_N, num_warps=cfg.num_warps,
                            **({"maxnreg": cap} if cap else {}),
                            **({"WORDS_IN_REGS": cfg.kernel == "gluon_overlap_regs", "PAIRED": paired and gs == K_CHUNK}
                               if overlap else {}),
                            **layouts(cfg.BLOCK_M, cfg.BLOCK_N, cfg.num_warps))
                self.gemm = Launch(w4a16_gluon_overlap_kernel if overlap else w4a16_gluon_kernel, meta, device_index)
                if overlap and eager_fixup:
                    self.eager = Launch(w4a16_gluon_overlap_kernel, dict(meta, PDL_EARLY=False, FIXUP=True),
                                        device_index)
        elif cfg.kernel == "gemv" and tensor_core_gemv:  # (takes no g_idx pointer)
            self.kind = "gemv_mma"
            sa = scale_acc(cfg, group_size, has_gidx)
            text, constraints = (gemv_asm(bf16, has_zeros, even_k, gemv_pairs(cfg.BLOCK_N), sa) if mma_asm
                                 else ("", ""))
            meta.update(USE_ASM=mma_asm, ASM=text, ASM_CONSTRAINTS=constraints, **gemv_stages(cfg.num_stages),
                        SCALE_ACC=sa, FIXUP=self.fixup,
                        num_warps=gemv_warps(cfg.BLOCK_N, cfg.BLOCK_K, cfg.num_warps))
            self.gemm = Launch(_w4a16_gemv_mma_kernel, meta, device_index)
        elif cfg.kernel == "gemv":  # CUDA-core GEMV (takes no GROUP_M / PREFETCH_S / PAIRED_S)
            self.kind = "gemv"
            meta.update(HAS_GIDX=has_gidx, USE_ASM=asm, FIXUP=self.fixup)
            self.gemm = Launch(_w4a16_gemv_kernel, meta, device_index)
        else:
            self.kind = "mma"
            meta.update(HAS_GIDX=has_gidx, USE_ASM=asm, GROUP_M=cfg.GROUP_M,
                        PREFETCH_S=prefetch_scales(cfg, group_size, has_gidx, has_zeros),
                        PAIRED_S=paired and paired_scales(cfg),
                        SCALE_ACC=scale_acc(cfg, group_size, has_gidx), ACC_FENCE=device_index >= 0 and acc_fence())
            self.gemm = Launch(_w4a16_kernel, meta, device_index)
        self.reduce = None
        if cfg.SPLIT_K > 1 and not self.fixup:
            self.reduce = Launch(_splitk_reduce_kernel, dict(SPLIT_K=cfg.SPLIT_K, HAS_BIAS=has_bias, EMU_BF16=emu,
                                                             BLOCK=_REDUCE_BLOCK, num_warps=4,
                                                             **(as_dependent(device_index) if chained else {})),
                                 device_index)
        # split-K summed in the kernel outside captures (the eager launch, or the GEMV's only one)
        self.in_gemm = self.fixup or self.eager is not None

    def __call__(self, out, y, x, qweight, scales, z_arg, sorted_g_idx, bias, M, N, K, sqn, ssn,
                 x_tensor: Optional[torch.Tensor] = None) -> None:
        """out (M, N) = the product; y, x, ..., bias: out's and the operands' pointers, as
        tensors (the first call: Triton specializes on them) or as ints (steady state:
        launch.pointers; x_tensor: x itself, for the pipe kernel's TMA descriptor). x contiguous
        (M, K): its row stride is passed as K (for M = 1 a
        contiguous x may carry any row stride; the kernels never step over it). Pointers
        the kernels do not read (no g_idx, no bias, no workspace) are passed as None:
        Triton makes them constexprs."""
        cfg = self.config
        split = cfg.SPLIT_K
        tiles_n = -(-N // cfg.BLOCK_N)
        kind = self.kind
        sym = out.stride(0)
        gemm, eager = self.gemm, self.eager
        ws = sync = None  # the split-K workspace; the tile counters of a kernel that adds its slices
        if self.in_gemm and not (self.sync_at[1] >= 0 and capturing()):
            # outside a capture: the stream's counters and workspace (tensors for the JIT's first call)
            sc = eager_scratch(*self.sync_at, split * M * N)
            ws, sync = (sc.ws, sc.sync) if (eager or gemm).run is None else (sc.ws_ptr, sc.sync_ptr)
            if eager is not None:  # the overlap kernel adding its slices: one launch
                grid = (-(-M // cfg.BLOCK_M) * tiles_n, split)
                eager(grid, x, qweight, scales, z_arg, bias, y, ws, M, N, K, K, sym, sqn, ssn, sync)
                if gemm.run is None:  # the first call: bind the capture path too (no launch)
                    gemm.prepare(grid, x, qweight, scales, z_arg, bias, y, sc.ws, M, N, K, K, sym, sqn, ssn, None)
                    self.reduce.prepare((-(-(M * N) // _REDUCE_BLOCK), 1), sc.ws, bias, y, M, N, sym)
                return
        elif split > 1:
            ws = out.new_empty((split, M, N), dtype=torch.float32)
            if self.fixup:  # (a GEMV being captured)
                sync = sync_buffer(*self.sync_at)
                sync = sync if gemm.run is None else sync.data_ptr()
        if kind == "gemv_mma":
            gemm((tiles_n, split), x, qweight, scales, z_arg, bias, y, ws, M, N, K, K, sym, sqn, ssn, sync)
        elif kind == "gemv":
            gemm((tiles_n, split), x, qweight, scales, z_arg, sorted_g_idx, bias, y, ws, M, N, K, K, sym, sqn, ssn,
                 sync)
        else:
            grid = (-(-M // cfg.BLOCK_M) * tiles_n, split)
            if kind == "gluon" and self.overlap:  # (no g_idx pointer; the tile counters' pointer: None here)
                gemm(grid, x, qweight, scales, z_arg, bias, y, ws, M, N, K, K, sym, sqn, ssn, None)
                if eager is not None and eager.run is None:  # (a first call inside a capture: no
                    # eager_scratch here, whose first workspace would synchronize a stream)
                    eager.prepare(grid, x, qweight, scales, z_arg, bias, y, ws, M, N, K, K, sym, sqn, ssn,
                                  sync_buffer(*self.sync_at))
            elif kind == "gluon":
                gemm(grid, x, qweight, scales, z_arg, bias, y, ws, M, N, K, K, sym, sqn, ssn)
            elif kind == "gluon_pipe":  # x also as its TMA descriptor
                desc = self.x_desc(x if x_tensor is None else x_tensor)
                gemm(grid, x, desc, qweight, scales, z_arg, bias, y, ws, M, N, K, K, sym, sqn, ssn)
            else:
                gemm(grid, x, qweight, scales, z_arg, sorted_g_idx, bias, y, ws, M, N, K, K, sym, sqn, ssn)
        if self.reduce is not None:
            self.reduce((-(-(M * N) // _REDUCE_BLOCK), 1), ws, bias, y, M, N, sym)

    def bound(self) -> bool:
        return super().bound() and (self.eager is None or self.eager.run is not None)


class _DequantPlan(Plan):
    """The large-M path ("dequant") of one W4A16 problem on one GPU: dequantize into a
    transient weight in slices of whole BLOCK_N tiles, each at most DEQUANT_SLICE_BYTES, and
    multiply each slice with cuBLAS. Kept as a plan like _GemmPlan, so that a steady call
    launches the dequantization kernel directly (runtime/launch.py) instead of through Triton's
    JIT binding (~15-25 us of host time per launch, which a prefill pays for every layer).
    One bound kernel per slice height (the last slice may specialize differently)."""

    __slots__ = ("meta", "device_index", "rows", "launches")
    takes_tensors = True  # (cuBLAS multiplies tensor slices)

    def __init__(self, cfg: Config, device_index: int, flags: dict, K: int):
        self.config, self.kind, self.device_index = cfg, "dequant", device_index
        self.meta = dict(BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, **flags, **cfg.launch())
        self.rows = max(cfg.BLOCK_N, DEQUANT_SLICE_BYTES // (2 * K) // cfg.BLOCK_N * cfg.BLOCK_N)
        self.launches: dict = {}

    def bound(self) -> bool:
        return all(lc.run is not None for lc in self.launches.values())

    def __call__(self, out, y, x, qweight, scales, z_arg, sorted_g_idx, bias, *_) -> None:
        """out (M, N) = x @ W^T (+ bias), all arguments tensors (the first call: Triton
        specializes on them; the slices after it pass their pointers as ints); y is out, and
        what follows bias (the fused plans' sizes and strides) is not needed."""
        from ..kernels.w4a16 import _w4a16_dequant_kernel

        g_arg = qweight if sorted_g_idx is None else sorted_g_idx  # (an unread pointer)

        M, K = x.shape
        N = qweight.shape[0]
        cfg, rows = self.config, self.rows
        w = torch.empty((min(rows, N), K), dtype=x.dtype, device=x.device)
        sq, ss = qweight.stride(0), scales.stride(0)
        for n0 in range(0, N, rows):
            nr = min(rows, N - n0)
            ws = w[:nr]
            launch = self.launches.get(nr)
            if launch is None:
                launch = self.launches[nr] = Launch(_w4a16_dequant_kernel, self.meta, self.device_index)
            grid = (-(-nr // cfg.BLOCK_N), -(-K // cfg.BLOCK_K))
            if launch.run is None:  # (tensors: the JIT's first call)
                launch(grid, qweight[n0:], scales[n0:], z_arg[n0:], g_arg, ws, nr, K, sq, ss, ws.stride(0))
            else:
                launch(grid, qweight.data_ptr() + 4 * sq * n0, scales.data_ptr() + scales.element_size() * ss * n0,
                       z_arg.data_ptr() + z_arg.element_size() * z_arg.stride(0) * n0, g_arg.data_ptr(),
                       ws.data_ptr(), nr, K, sq, ss, ws.stride(0))
            if bias is None:
                torch.mm(x, ws.t(), out=out[:, n0:n0 + nr])
            else:
                torch.addmm(bias[n0:n0 + nr], x, ws.t(), out=out[:, n0:n0 + nr])


def w4a16_launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: Optional[torch.Tensor], perm: Optional[torch.Tensor],
                 sorted_g_idx: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                 in_features: int, group_size: int, config: Optional[Config] = None,
                 use_asm: bool = True) -> torch.Tensor:
    """Run the W4A16 Triton kernel. x (M, K) contiguous fp16/bf16 -> y (M, N), x's dtype.

    use_asm=False forces the pure-Triton dequantization on the GPU too (the path the
    interpreter always runs), so tests can check the two give identical numbers.

    Steady state (CUDA, config=None): one dict lookup finds the problem's plan (config and
    bound kernels, _GemmPlan) under a key that fixes everything the kernels are compiled
    for: device, dtypes, M bucket and M's Triton specialization (1, a multiple of 16, 64-bit),
    the sizes and row strides, the optional operands. Given the op's checks (qweight int32,
    scales in x's dtype), only pointer alignment is left, checked per call."""
    M, K = x.shape
    N, kp8 = qweight.shape
    y = x.new_empty((M, N))
    if M == 0:
        return y
    if perm is not None:
        x = x.index_select(1, perm)
    x = x.contiguous()
    z_arg = scales if zeros is None else zeros  # symmetric: z_ptr must address something (kernels/w4a16.py)
    sqn, ssn = qweight.stride(0), scales.stride(0)
    invariant = batch_invariant()  # (read once: the plan key and the config choice agree)
    key = None
    if config is None and use_asm and x.is_cuda:
        dev = x.get_device()
        key = (dev, x.dtype, (M - 1).bit_length(), M & 15 == 0, N, K, kp8, group_size, sqn, ssn,
               None if zeros is None else zeros.dtype, None if sorted_g_idx is None else sorted_g_idx.dtype,
               None if bias is None else bias.dtype, invariant)
        # (x last: the pipe kernel's TMA descriptor is made from it)
        if run_steady(W4A16_TUNER, key, dev, x, y, (y, x, qweight, scales, z_arg, sorted_g_idx, bias),
                      (M, N, K, sqn, ssn, x)):
            return y
    plans = None if key is None else W4A16_TUNER.plans_for_build()  # before the config lookup
    Kp = kp8 * 8
    gs = 0 if group_size == -1 else group_size
    emu = x.dtype == torch.bfloat16 and not x.is_cuda  # interpreter bf16 twin (kernels/common.py)
    asm = (use_asm and x.is_cuda and sorted_g_idx is None
           and (x.dtype == torch.float16 or has_bf16x2(x.device.index)))
    # scales / zeros as int32 pairs (paired_scales): a function of the plan key (group size,
    # the shared row stride) and of 4-byte alignment (`aligned` checks 16 per steady call)
    pairable = gs > 0 and ssn % 2 == 0 and scales.data_ptr() % 4 == 0 and z_arg.data_ptr() % 4 == 0

    def run(cfg: Config, out: torch.Tensor = y):
        if cfg.kernel == "dequant":
            dplan = _DequantPlan(cfg, x.get_device(), dict(GROUP_SIZE=gs, HAS_ZEROS=zeros is not None,
                                                           HAS_GIDX=sorted_g_idx is not None, EMU_BF16=emu,
                                                           USE_ASM=asm), K)
            dplan(out, out, x, qweight, scales, z_arg, sorted_g_idx, bias)
            return dplan
        return run_built(
            lambda: _GemmPlan(cfg, x.get_device(), gs=gs, has_zeros=zeros is not None,
                              has_gidx=sorted_g_idx is not None, has_bias=bias is not None, emu=emu, asm=asm,
                              mma_asm=use_asm and has_mma_asm(x),
                              tensor_core_gemv=gemv_on_tensor_cores(cfg, x, gs, sorted_g_idx is not None),
                              paired=pairable, bf16=x.dtype == torch.bfloat16, K=K, group_size=group_size,
                              fixup=gemv_fixup(cfg, M, N), eager_fixup=overlap_fixup(cfg, M, N),
                              gluon=cfg.kernel in GLUON_KERNELS and gluon_applies(x, qweight, group_size,
                                                                                sorted_g_idx is not None, use_asm)),
            lambda plan: plan(out, out, x, qweight, scales, z_arg, sorted_g_idx, bias, M, N, K, sqn, ssn),
            ("gluon", "gluon_pipe"), "W4A16")

    with device_of(x):
        if config is None:
            config = w4a16_config(x.device, M, N, Kp, group_size, zeros is not None, sorted_g_idx is not None,
                                  x.dtype, invariant, lambda: scratch_runner(run, y))
        else:
            check_w4a16_config(config, Kp, M, group_size, sorted_g_idx is not None)
        plan = run(config)
    keep(plans, key, plan, x, qweight, scales, zeros, sorted_g_idx, bias)
    return y


# ----------------------------------------------------------------------------------
# torch.library op
# ----------------------------------------------------------------------------------
def w4a16_gemm_impl(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: Optional[torch.Tensor], perm: Optional[torch.Tensor],
                    sorted_g_idx: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    in_features: int, group_size: int) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a 4-bit weight in the formats.int4.PackedW4 layout.

    x: (M, K) float16/bfloat16, K = in_features; qweight: int32 (N, Kp/8);
    scales / zeros: (N, Gp) in x's dtype; perm: int32 (K,) or None;
    sorted_g_idx: int32 (Kp,) or None; bias: (N,) or None. Returns (M, N) in x's dtype.
    """
    _validate(x, qweight, scales, zeros, bias, in_features)
    if x.is_cuda or use_triton(x):
        return w4a16_launch(x, qweight, scales, zeros, perm, sorted_g_idx, bias, in_features, group_size)
    return w4a16_reference(x, qweight, scales, zeros, perm, sorted_g_idx, bias, in_features, group_size)


def w4a16_layer_impl(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: Optional[torch.Tensor], perm: Optional[torch.Tensor],
                     sorted_g_idx: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                     in_features: int, group_size: int) -> torch.Tensor:
    """w4a16_gemm_impl for QuantLinear.forward's direct call (runtime/dispatch.direct_call_ok: a
    CUDA x), which has checked x (its dtype is the layer's scales' dtype, float16 or bfloat16;
    (M, in_features)) and whose other operands are the layer's buffers, checked when it was built;
    left to check here: that they are on x's device and qweight is int32. _validate's repeat of
    the rest cost 2.5-4.5 us of host time a call on the H100 host (docs/perf_log.md v51)."""
    _check_one_device(x, qweight, scales, zeros, bias)
    if qweight.dtype is not torch.int32:
        raise TypeError(f"qweight dtype {qweight.dtype} is not supported; allowed: torch.int32")
    return w4a16_launch(x, qweight, scales, zeros, perm, sorted_g_idx, bias, in_features, group_size)


def _w4a16_fake(x, qweight, scales, zeros, perm, sorted_g_idx, bias, in_features, group_size):
    check_devices(True, x=x, qweight=qweight, scales=scales, zeros=zeros, bias=bias)
    return x.new_empty((x.shape[0], qweight.shape[0]))


_W4A16_SCHEMA = ("(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? perm, Tensor? sorted_g_idx, "
                 "Tensor? bias, SymInt in_features, SymInt group_size) -> Tensor")
# sailfish::w4a16_gemm: the public op, with the input-gradient formula (ops/autograd.py).
# sailfish::w4a16_gemm_nograd: the same op without one, for callers that need no gradient
# (QuantLinear.forward when x does not require grad): it skips the ~7 us autograd layer.
# Differentiating through it gives no gradient (PyTorch warns at backward).
w4a16_gemm = define_op("w4a16_gemm", _W4A16_SCHEMA, w4a16_gemm_impl, _w4a16_fake)
w4a16_gemm_nograd = define_op("w4a16_gemm_nograd", _W4A16_SCHEMA, w4a16_gemm_impl, _w4a16_fake)


def _validate(x, qweight, scales, zeros, bias, in_features) -> None:
    dtype = x.dtype
    if dtype is not torch.float16 and dtype is not torch.bfloat16:
        raise TypeError(f"x dtype {dtype} is not supported; allowed: float16, bfloat16")
    if dtype is not scales.dtype:
        raise TypeError(f"x dtype {dtype} does not match the layer dtype {scales.dtype}")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must have shape (M, {in_features}), got {tuple(x.shape)}")
    if qweight.dtype is not torch.int32 or qweight.dim() != 2 or (qweight.shape[1] * 8) % K_PAD:
        raise ValueError(f"qweight must be int32 (N, Kp/8) with Kp a multiple of {K_PAD}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != qweight.shape[0]):
        raise ValueError(f"bias must have shape ({qweight.shape[0]},), got {tuple(bias.shape)}")
    _check_one_device(x, qweight, scales, zeros, bias)


def _check_one_device(x, qweight, scales, zeros, bias) -> None:
    """check_devices, called only when the cheap get_device() comparison fails or gives -1
    (ints: comparing torch.device objects costs ~0.3 us each)."""
    dev = x.get_device()
    if (dev < 0 or qweight.get_device() != dev or scales.get_device() != dev
            or (zeros is not None and zeros.get_device() != dev) or (bias is not None and bias.get_device() != dev)):
        check_devices(x=x, qweight=qweight, scales=scales, zeros=zeros, bias=bias)
