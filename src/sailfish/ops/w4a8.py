"""W4A8 (QQQ) launchers, configs and ops:

    sailfish::quantize_per_token(x) -> (x_q, x_scales)
    sailfish::quantize_per_token_fp8(x) -> (x_q float8_e4m3fn, x_scales)
    sailfish::w4a8_gemm(x_q, x_scales, qweight, s_ch, s_g, bias, in_features, group_size,
                        out_dtype) -> y
    sailfish::w4a8_linear_nograd(x, qweight, s_ch, s_g, bias, in_features, group_size) -> y
        (the two in one op; sailfish::w4a8_linear, ops/autograd.py, is it with a backward)

Formats: formats/qqq.py. Kernels: kernels/w4a8.py.

Paths (tuning.Config.kernel), chosen per (K, N, bucketed M, group size, out dtype, activation
dtype) by W4A8_TUNER: "mma" (tensor-core tiles with the weight in registers; the heuristic's
choice at every M but the next path's: BLOCK_M 16 / 32 / 64 / 128 by M bucket, split-K when there
are fewer than 2 tiles per SM), "gluon_pipe" (int8, the warp-specialized Hopper kernel of
kernels/w4a8_gluon.py, its "mma" twin elsewhere; the heuristic's at M = 65-512, g128 up to 2048,
where K is a multiple of 256), "gluon_overlap" (int8, its one-warpgroup form for M = 2-32, a
candidate there and the H100 table's at M = 5-16 on q/k/v, o and down, 17-32 on o and down),
"gemv" (M = 1, CUDA cores; a tuning candidate), "dequant" (int8 weight + torch._int_mm; a tuning
candidate for M >= 256). The shipped tables hold entries for fp16
output, per channel and g128, on the 8 Llama-3 shapes (docs/perf_log.md v16, v22, v23, v33): H200
at M = 1-4096, H100 at M = 1, 2, 8, 16, 32, 64 and 128-4096; the other M buckets run the heuristic.
fp8 activations (x_q float8_e4m3fn) run "mma" only, under their own table keys.
`w4a8_launch(..., raw_acc=True)` returns the int32 accumulator.

Every launch runs with the tensors' GPU current (ops.device_of when it is not). Host cost
per steady-state call on CUDA: one dict lookup for the problem's plan (config and bound
kernels, runtime/launch.py) plus the allocations and the direct kernel launches; the first
call of a problem goes through the tuner and Triton's JIT and builds the plan.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Optional, Tuple

import torch

from ..formats.int4 import HALF_DTYPES, K_PAD
from ..formats.qqq import (GROUP_SIZES_W4A8, PackedQQQ, check_act_dtype, fp8_weight, group_scales_fit_int8,
                           quantize_activations, unpack_qqq)
from ..runtime.device import capability, check_devices, device_of, pdl, sms_for, use_triton
from ..runtime.dispatch import define_op
from ..runtime.flags import FLAGS, batch_invariant
from ..runtime.launch import Launch
from ..runtime.plan import Plan, keep, run_built, run_steady
from ..tuning import (KERNELS, Config, Tuner, check_config, gemv_candidates, m_bucket, mma_candidates,
                      mma_heuristic, next_pow2, problem_key, scratch_runner, split_k_for)
from .common import (GLUON_STEP, as_dependent, capturing, eager_scratch, fixup_fits, gluon_device,
                     gluon_overlap_split_ok, gluon_split_ok, invariant_config, sync_buffer)

ACT_DTYPES = HALF_DTYPES + (torch.float32,)
# Rows up to this many channels are quantized from registers in one pass (at most 64 fp32
# values per thread: 4 warps up to 2048 channels, 8 up to 8192, 16 above); longer rows take
# a max pass and a quantize pass. The second pass over a row cost the M = 1 GEMM chain
# about 2 us at K = 14336 / 28672 (H200; docs/perf_log.md v16).
QUANT_ONE_PASS_MAX = 32768

_KERNELS = None  # kernels.w4a8, imported on first use (after TRITON_INTERPRET is settled)


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        from ..kernels import w4a8 as k
        _KERNELS = k
    return _KERNELS


_RANGE_ATTR = "_sailfish_s_g_in_range"


def group_scales_in_range(s_g: Optional[torch.Tensor]) -> bool:
    """formats.qqq.group_scales_fit_int8 (the int8 weight rne(s_g * (q - 8)) needs no clamp, so
    the kernels may drop it: kernels/w4a8.py _ASM_GROUP_NOCLAMP). The answer is kept on the
    tensor with its version counter, so an in-place change (load_state_dict, copy_) is seen;
    computing it reads the scales back (one sync per weight, on its first call). While a CUDA
    graph is being captured, and for inference tensors (no version counter), an unknown answer
    is False: the clamping kernel, always right."""
    if s_g is None:
        return False
    try:
        version = s_g._version
    except RuntimeError:  # inference tensor: no version counter to validate a cached answer
        return False
    cached = getattr(s_g, _RANGE_ATTR, None)
    if cached is not None and cached[0] == version:
        return cached[1]
    if s_g.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    ok = group_scales_fit_int8(s_g)
    setattr(s_g, _RANGE_ATTR, (version, ok))
    return ok


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------
# Activation quantization
# ----------------------------------------------------------------------------------
def quantize_per_token_launch(x: torch.Tensor, block_k: Optional[int] = None, act_dtype: str = "int8"
                              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run the per-token quantization kernel. x (M, K) fp16/bf16/fp32 ->
    (x_q (M, K) contiguous, int8 or, act_dtype="fp8", float8_e4m3fn; scales float32 (M,)).
    block_k: tile over K (a power of two); default: the whole row if K <= QUANT_ONE_PASS_MAX,
    else 4096 (two passes). On CUDA the bound kernel is kept per (device, dtype, act_dtype,
    K, row stride, block_k) in W4A8_TUNER.plans (runtime/launch.py)."""
    fp8 = act_dtype == "fp8"
    if fp8:
        check_fp8_device(x)
    elif act_dtype != "int8":
        check_act_dtype(act_dtype)  # raises, naming the allowed values
    M, K = x.shape
    x_q = x.new_empty((M, K), dtype=torch.float8_e4m3fn if fp8 else torch.int8)
    scales = x.new_empty((M,), dtype=torch.float32)
    if M == 0:
        return x_q, scales
    if x.stride(1) != 1:
        x = x.contiguous()
    # one row: the kernel never steps over the row stride, so any value does; K keeps the key fixed
    sxm = K if M == 1 else x.stride(0)
    key = None
    if x.is_cuda:
        dev = x.get_device()
        key = ("quantize", dev, x.dtype, fp8, K, sxm, block_k)
        if run_steady(W4A8_TUNER, key, dev, x, (M, 1), (x, x_q, scales), (K, sxm, K)):  # (the plan: a Launch)
            return x_q, scales
    plans = None if key is None else W4A8_TUNER.plans_for_build()
    bk = block_k
    if bk is None:
        bk = max(16, next_pow2(K)) if K <= QUANT_ONE_PASS_MAX else 4096
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"block_k={bk} must be a power of two >= 16")
    launch = Launch(_kernels()._quantize_per_token_kernel,
                    dict(BLOCK_K=bk, ONE_PASS=K <= bk, FP8=fp8,
                         num_warps=4 if bk <= 2048 else 8 if bk <= 8192 else 16, **as_dependent(x.get_device())),
                    x.get_device())
    with device_of(x):
        launch((M, 1), x, x_q, scales, K, sxm, K)
    keep(plans, key, launch, x)
    return x_q, scales


def check_fp8_device(t: torch.Tensor) -> None:
    """fp8 (e4m3) activations need sm_89+ (Ada, Hopper): e4m3 tensor cores and conversions."""
    if t.is_cuda:
        cap = capability(t.get_device())
        if cap < (8, 9):
            raise RuntimeError(f"fp8 (e4m3) activations need a GPU of compute capability >= 8.9, "
                               f"{t.device} has {cap[0]}.{cap[1]}; use act_dtype='int8'")


def quantize_per_token_impl(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic int8 quantization (formats.qqq.quantize_activations).

    x: (M, K) float16/bfloat16 (float32 accepted). Returns x_q int8 (M, K) in [-127, 127]
    and scales float32 (M,) with scales = max|x[m]| / 127 and
    x_q = clamp(round_half_even(x * (127 / max|x[m]|)), -127, 127); zero rows: 0 and 0.
    """
    _check_activations(x, ACT_DTYPES)
    if x.is_cuda or use_triton(x):
        return quantize_per_token_launch(x)
    return quantize_activations(x)


def _check_activations(x: torch.Tensor, dtypes: Tuple[torch.dtype, ...]) -> None:
    if x.dtype not in dtypes:
        raise TypeError(f"x dtype {x.dtype} is not supported; allowed: {', '.join(str(d)[6:] for d in dtypes)}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if not x.is_cuda and x.device.type != "cpu":
        check_devices(x=x)


def _quantize_fake(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32)


# No derivative (int8 rounding): ops/autograd.py registers a backward that says so;
# QuantLinearW4A8 trains through sailfish::w4a8_linear (straight-through) instead.
quantize_per_token = define_op("quantize_per_token", "(Tensor x) -> (Tensor, Tensor)",
                               quantize_per_token_impl, _quantize_fake)


def quantize_per_token_fp8_impl(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic float8 (e4m3) quantization (formats.qqq.quantize_activations with
    act_dtype="fp8"): x_q float8_e4m3fn (M, K) = x * (448 / max|x[m]|) rounded to nearest
    even, scales float32 (M,) = max|x[m]| / 448; zero rows: 0 and 0; NaN/Inf rows: 0 and NaN."""
    _check_activations(x, ACT_DTYPES)
    if x.is_cuda or use_triton(x):
        return quantize_per_token_launch(x, act_dtype="fp8")
    return quantize_activations(x, "fp8")


def _quantize_fp8_fake(x):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty((x.shape[0],), dtype=torch.float32)


quantize_per_token_fp8 = define_op("quantize_per_token_fp8", "(Tensor x) -> (Tensor, Tensor)",
                                   quantize_per_token_fp8_impl, _quantize_fp8_fake)


# ----------------------------------------------------------------------------------
# GEMM configs
# ----------------------------------------------------------------------------------
# 'gluon_pipe' (int8 activations, large M): the warp-specialized Hopper kernel; 'gluon_overlap'
# (int8, M <= 32): its one-warpgroup form that unpacks a K step while the previous step's wgmmas run
# (kernels/w4a8_gluon.py), where they apply (w4a8_gluon_applies); their Triton twin (w4a8_gluon_twin)
# elsewhere: the CPU interpreter, other GPUs, K not a multiple of the 256-channel step
W4A8_GLUON = ("gluon_pipe", "gluon_overlap")
W4A8_KERNELS = KERNELS + W4A8_GLUON
# its tile (BLOCK_M, BLOCK_N, num_warps, num_stages): 128 weight rows over two consumer warpgroups
# (and a TMA producer warp), x_q rings of 3 / 4 chunks of (BLOCK_M, 128) int8 (112 KiB at BLOCK_M 128)
W4A8_PIPE_TILES = ((128, 128, 8, 3), (128, 128, 8, 4))
# the overlap kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages): 64 weight rows over one warpgroup,
# x_q rings of 3 / 4 steps; candidates at M = 2-32. H100 at M = 16, in one process against the
# previous table's Triton tiles: faster on q/k/v, o and down (10.7 / 8.9 / 19.3 us against 11.5 /
# 10.0 / 20.4 with the reduce kernel; the split-K slices added in the kernel since), slower on gate/up
# (32.4 against 28.2); the table's at M = 5-16 on those three. At M = 32 (BLOCK_M 32): o 9.7 against
# 12.0, down 20.4 against 25.5 (taken), q/k/v 11.9 against 11.4, gate/up 34.1 against 30.1 (v50)
W4A8_OVERLAP_TILES = ((16, 64, 4, 3), (16, 64, 4, 4), (32, 64, 4, 3), (32, 64, 4, 4))


def w4a8_gluon_device(device_index: int) -> bool:
    """gluon_device (an sm_90 GPU, a Triton whose Gluon compiles the kernels, SAILFISH_GLUON)
    with kernels/w4a8_gluon importable."""
    return gluon_device(device_index, "w4a8_gluon")  # (which imports kernels/w4a16_gluon)


def w4a8_gluon_applies(x_q: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether a Gluon config (W4A8_GLUON) runs the Gluon kernel: int8 x_q on a Hopper GPU, K a
    multiple of 256 (its K step), x_q's rows and the words 16-byte aligned (TMA or cp.async, 16-byte
    loads)."""
    return (x_q.is_cuda and x_q.dtype is torch.int8 and x_q.shape[1] % GLUON_STEP == 0
            and x_q.data_ptr() % 16 == 0 and x_q.stride(0) % 16 == 0 and qweight.data_ptr() % 16 == 0
            and w4a8_gluon_device(x_q.device.index))


def w4a8_gluon_twin(cfg: Config) -> Config:
    """The Triton config computing what a Gluon config does (int32 sums: the same bits): the same
    tile and split; 'gluon_pipe' with K tiles of 128 channels (the Triton kernel's M = 1024 tile,
    _W4A8_TILES), 'gluon_overlap' with its 256-channel step (the M <= 16 tile)."""
    return replace(cfg, kernel="mma", BLOCK_K=128 if cfg.kernel == "gluon_pipe" else cfg.BLOCK_K)


def _gluon_pipe_candidates(*, device, M, N, Kp, group_size, act_dtype):
    """'gluon_pipe' configs at M > 64 on a Hopper GPU: W4A8_PIPE_TILES, unsplit and with every
    split up to 4 that leaves no split empty and keeps the programs within 4 per SM."""
    if act_dtype != "int8" or M <= 64 or Kp % GLUON_STEP or device.type != "cuda":
        return
    if not w4a8_gluon_device(device.index or 0):
        return
    sms = sms_for(device)
    for bm, bn, warps, stages in W4A8_PIPE_TILES:
        tiles = -(-M // bm) * -(-N // bn)
        for split in (1, 2, 3, 4):
            if gluon_split_ok(split, Kp // GLUON_STEP) and (split == 1 or tiles * split <= 4 * sms):
                yield Config(bm, bn, GLUON_STEP, split, 8, warps, stages, kernel="gluon_pipe")


def _gluon_overlap_candidates(*, device, M, N, Kp, act_dtype):
    """'gluon_overlap' configs at M = 2-32 on a Hopper GPU: W4A8_OVERLAP_TILES of the smallest BLOCK_M
    that holds M, unsplit and with every split up to 8 that gives each split an even number of K
    steps and keeps the programs within 4 per SM."""
    if act_dtype != "int8" or not 2 <= M <= 32 or Kp % GLUON_STEP or device.type != "cuda":
        return
    if not w4a8_gluon_device(device.index or 0):
        return
    sms = sms_for(device)
    bm = 16 if M <= 16 else 32
    for _, bn, warps, stages in (t for t in W4A8_OVERLAP_TILES if t[0] == bm):
        tiles = -(-N // bn)
        for split in (1, 2, 3, 4, 6, 8):
            if gluon_overlap_split_ok(split, Kp // GLUON_STEP) and (split == 1 or tiles * split <= 4 * sms):
                yield Config(bm, bn, GLUON_STEP, split, 8, warps, stages, kernel="gluon_overlap")


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) at M <= 16, M <= 64 (BLOCK_M 32 / 64), M > 64,
# from the fragment-order kernel on H200 (8192x57344 / 4096x4096, quantization included):
# M = 1-16 (16, 64, 256) per-channel 86.5 / 73.4 us (gemv 101.3 at M = 1), g128 within 1-5%
# of the best tile; M = 64 (64, 64, 256) 92.8 / 147.3 us, a middle ground between the large
# shape's best (64, 128, 256: 82.6 / 136.0) and the small shape's (12.4 us table tile vs 18.9);
# M = 1024 the fused kernel per-channel (128, 128, 128) 748 us = 1.73x cuBLAS fp16 (int8 cuBLAS
# 1.14x); g128 there prefers (256, 128, 128) (1155 us vs 1555; the dequant path 1310), left
# to the tuner: the M > 64 split-K rule is shared with W4A16 (tests/test_tuning.py).
_W4A8_TILES = ((16, 64, 256, 4, 4), (32, 64, 256, 4, 4), (128, 128, 128, 8, 3))


def w4a8_heuristic(*, device, M, N, K, Kp, group_size, act_dtype="int8") -> Config:
    sms = sms_for(device)
    small, mid, large = _W4A8_TILES
    if act_dtype == "fp8":  # per-group fp8 takes K tiles within one group
        small, mid = (16, 128, 128, 4, 4), (32, 128, 128, 4, 4)
    # M = 1 too: the tensor-core tile beat the CUDA-core GEMV on 8192x57344 (86.5 vs 101.3 us
    # per-channel, 136.1 vs 144.4 g128) and lost by 0.6 us on 4096x4096
    cfg = mma_heuristic(M, N, K, sms, small, mid, large)
    # the Gluon kernel where the H200 tuner chose it on most Llama-3 shapes (docs/perf_log.md v33):
    # M = 65-512 both formats (per channel 1.0-1.6x the Triton tile, g128 1.1-1.8x), g128 up to
    # M = 2048; its twin (w4a8_gluon_twin) is the large tile above, so elsewhere nothing changes
    if (act_dtype == "int8" and 64 < M <= (512 if group_size == -1 else 2048) and K % GLUON_STEP == 0
            and device.type == "cuda" and w4a8_gluon_device(device.index or 0)):
        bm, bn, warps, stages = W4A8_PIPE_TILES[0]
        steps = Kp // GLUON_STEP
        split = split_k_for(-(-M // bm) * -(-N // bn), steps, sms // 4)
        while not gluon_split_ok(split, steps):
            split -= 1
        cfg = Config(bm, bn, GLUON_STEP, split, 8, warps, stages, kernel="gluon_pipe")
    return cfg


def w4a8_candidates(*, device, M, N, K, Kp, group_size, act_dtype="int8"):
    sms = sms_for(device)
    if act_dtype == "fp8":  # the tensor-core kernel only, K tiles within one group
        bk = 128 if group_size != -1 else 256
        space = [(16, 64, bk, 4, 4), (16, 128, 128, 4, 4)] if M <= 16 else \
            [(64 if M > 32 else 32, 128, 128, 4, 4), (64 if M > 32 else 32, 64, bk, 4, 4)] if M <= 64 else \
            [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 64, 8, 4)]
        yield from mma_candidates(space, M, N, K, Kp, sms)
        return
    if M == 1:
        yield from gemv_candidates([(1, 16, 512, 4, 4), (1, 32, 256, 4, 4), (1, 16, 256, 4, 6),
                                    (1, 32, 512, 4, 3), (1, 64, 256, 4, 4), (1, 16, 512, 2, 4)],
                                   N, K, Kp, sms)
        space = [(16, 64, 256, 4, 4), (16, 128, 128, 4, 4)]  # the tensor-core tiles too
    elif M <= 16:
        space = [(16, 64, 256, 4, 4), (16, 128, 128, 4, 4), (16, 128, 256, 4, 3),
                 (16, 256, 128, 8, 3), (16, 64, 128, 4, 6)]
    elif M <= 64:
        bm = 32 if M <= 32 else 64
        space = [(bm, 64, 128, 4, 4), (bm, 128, 128, 4, 4), (bm, 128, 256, 4, 3),
                 (bm, 256, 128, 8, 3)]
    else:
        space = [(64, 128, 128, 4, 4), (128, 128, 128, 8, 3), (128, 256, 128, 8, 3),
                 (256, 128, 128, 8, 3), (128, 128, 64, 8, 4)]
    if M >= 256 and K % 8 == 0 and N % 8 == 0 and K >= 16 and N >= 16:
        yield Config(1, 64, 256, 1, 8, 4, 1, kernel="dequant")  # int8 weight + torch._int_mm
    yield from _gluon_pipe_candidates(device=device, M=M, N=N, Kp=Kp, group_size=group_size, act_dtype=act_dtype)
    yield from _gluon_overlap_candidates(device=device, M=M, N=N, Kp=Kp, act_dtype=act_dtype)
    yield from mma_candidates(space, M, N, K, Kp, sms)


def w4a8_config(device: torch.device, M: int, N: int, K: int, Kp: int, group_size: int, out_dtype: torch.dtype,
                act: str = "int8", invariant: bool = False, make_run=None) -> Config:
    """The config w4a8_launch runs when given none: batch-invariant mode's for fp8 (invariant_config;
    fp8's float32 sums depend on the K tiling and split, int8's int32 sums are exact in any order,
    so int8 is batch-invariant with every config), else the cached one (one dict lookup), else on
    a problem's first call the tuner's answer (checked by W4A8_TUNER). The offline tuner
    (bench/tune.py) asks it what ships."""
    if invariant:
        config = invariant_config(M, N, Kp)
        check_w4a8_config(config, M, N, K, Kp, group_size, act)
        return config
    mb = m_bucket(M)
    memo = (K, N, mb, group_size, out_dtype, act)
    config = W4A8_TUNER.lookup(device, memo)
    if config is None:  # first call of this problem on this device
        # no entry for this group size / output dtype: the same shape's g128 fp16 config (every
        # int8 config runs every format; fp8 has no fallback: its kernel set differs). Per-channel
        # on heuristics alone chose the fused tiles at large M, 0.63-0.71x cuBLAS fp16 on H200
        # 8192x57344 vs 1.04-1.22x for g128.
        config = W4A8_TUNER.get(w4a8_key(K, N, M, group_size, out_dtype, act), device,
                                None if make_run is None else make_run(),
                                fallback_key=None if act == "fp8" else problem_key("w4a8", K, N, M, "any"),
                                memo_key=memo, M=mb, N=N, K=K, Kp=Kp, group_size=group_size, act_dtype=act)
    return config


def w4a8_key(k: int, n: int, m: int, group_size: int, out_dtype: torch.dtype, act_dtype: str = "int8") -> str:
    fp8 = "|fp8" if act_dtype == "fp8" else ""
    return problem_key("w4a8", k, n, m, f"gs={group_size}|{str(out_dtype)[6:]}{fp8}")


def check_w4a8_config(cfg: Config, M: int, N: int, K: int, Kp: int, group_size: int = -1,
                  act_dtype: str = "int8") -> None:
    """W4A8's own rules, then tuning.check_config's. M may be the M bucket: the rules hold
    for every M of a bucket alike (gemv: bucket 1; dequant: buckets >= 32). fp8 activations
    run the tensor-core kernel only, per-group with K tiles inside one group."""
    if cfg.scale_acc:
        raise ValueError("config scale_acc=True is a W4A16 option; W4A8 applies its scales in the epilogue")
    if act_dtype == "fp8" and cfg.kernel != "mma":
        raise ValueError(f"config kernel={cfg.kernel!r}: fp8 activations run kernel='mma' only")
    if act_dtype == "fp8" and group_size != -1 and cfg.BLOCK_K > group_size:
        raise ValueError(f"config BLOCK_K={cfg.BLOCK_K} must be <= group_size={group_size} with fp8 activations")
    if cfg.kernel == "gemv" and M != 1:
        raise ValueError(f"config kernel='gemv' needs M=1, got M={M}")
    if cfg.kernel == "dequant" and (M <= 16 or K % 8 or N % 8 or K < 16 or N < 16):
        raise ValueError("config kernel='dequant' (torch._int_mm) needs M > 16 and K, N multiples "
                         f"of 8, >= 16; got M={M}, K={K}, N={N}")
    if cfg.kernel == "dequant" and cfg.SPLIT_K != 1:
        raise ValueError(f"config SPLIT_K={cfg.SPLIT_K} must be 1 for 'dequant'")
    if cfg.BLOCK_K < 32:
        raise ValueError(f"config BLOCK_K={cfg.BLOCK_K} must be >= 32 (the int8 MMA's K)")
    if cfg.kernel == "gluon_pipe":
        _check_pipe_config(cfg, Kp)
        check_config(w4a8_gluon_twin(cfg), Kp, K)
    elif cfg.kernel == "gluon_overlap":
        _check_overlap_config(cfg, Kp)
        check_config(w4a8_gluon_twin(cfg), Kp, K)
    else:
        check_config(cfg, Kp, K)


def _check_pipe_config(cfg: Config, Kp: int) -> None:
    """The tiles kernels/w4a8_gluon.py compiles (int8 activations: check_w4a8_config): BLOCK_K = one K step of two
    128-channel chunks, BLOCK_M 64 or 128 (wgmma's N; the int32 accumulator of 64 x 128 per
    consumer thread group), BLOCK_N 128 over two consumer warpgroups (num_warps 8), x_q rings of
    >= 3 and >= 4 chunks that fit an SM's shared memory, every split non-empty."""
    from ..kernels.gluon_common import CTA_RESERVED_SHARED, SM_SHARED_BYTES, pipe_shared_bytes

    k = "config kernel='gluon_pipe'"
    if cfg.BLOCK_K != GLUON_STEP:
        raise ValueError(f"{k} needs BLOCK_K={GLUON_STEP}, got {cfg.BLOCK_K}")
    if cfg.BLOCK_M not in (64, 128):
        raise ValueError(f"{k} needs BLOCK_M 64 or 128, got {cfg.BLOCK_M}")
    if (cfg.BLOCK_N, cfg.num_warps) != (128, 8):
        raise ValueError(f"{k} needs BLOCK_N 128 and num_warps 8 (two consumer warpgroups of 64 rows); "
                         f"got BLOCK_N={cfg.BLOCK_N}, num_warps={cfg.num_warps}")
    ring = pipe_shared_bytes(cfg.BLOCK_M, cfg.num_stages, elem_bytes=1)
    if cfg.num_stages < 3 or ring + CTA_RESERVED_SHARED > SM_SHARED_BYTES:
        raise ValueError(f"{k} needs num_stages >= 3 with its rings ({ring} bytes at num_stages="
                         f"{cfg.num_stages}) within an SM's {SM_SHARED_BYTES - CTA_RESERVED_SHARED} bytes")
    steps = Kp // GLUON_STEP
    if Kp % GLUON_STEP or not gluon_split_ok(cfg.SPLIT_K, steps):
        raise ValueError(f"{k} SPLIT_K={cfg.SPLIT_K} leaves a split of the {steps} K steps empty (split k "
                         "takes steps [k * ceil(steps / SPLIT_K), ...))")


def _check_overlap_config(cfg: Config, Kp: int) -> None:
    """The tiles kernels/w4a8_gluon.w4a8_gluon_overlap_kernel compiles (int8 activations):
    BLOCK_K = one K step, BLOCK_M 16 or 32 (wgmma's N), 64 weight rows over one warpgroup
    (BLOCK_N 64, num_warps 4), a ring of >= 3 steps, every split an even number of K steps >= 2."""
    k = "config kernel='gluon_overlap'"
    if cfg.BLOCK_K != GLUON_STEP:
        raise ValueError(f"{k} needs BLOCK_K={GLUON_STEP}, got {cfg.BLOCK_K}")
    if cfg.BLOCK_M not in (16, 32):
        raise ValueError(f"{k} needs BLOCK_M 16 or 32, got {cfg.BLOCK_M}")
    if (cfg.BLOCK_N, cfg.num_warps) != (64, 4):
        raise ValueError(f"{k} needs BLOCK_N 64 and num_warps 4 (one warpgroup of 64 rows); "
                         f"got BLOCK_N={cfg.BLOCK_N}, num_warps={cfg.num_warps}")
    if not 3 <= cfg.num_stages <= 8:
        raise ValueError(f"{k} needs num_stages in 3..8 (its x_q ring), got {cfg.num_stages}")
    steps = Kp // GLUON_STEP
    if Kp % GLUON_STEP or not gluon_overlap_split_ok(cfg.SPLIT_K, steps):
        raise ValueError(f"{k} SPLIT_K={cfg.SPLIT_K} must give each split an even number (>= 2) of the {steps} "
                         "K steps (split k takes steps [k * ceil(steps / SPLIT_K), ...))")


W4A8_TUNER = Tuner("w4a8", w4a8_heuristic, w4a8_candidates,
                   check=lambda cfg, *, M, N, K, Kp, group_size=-1, act_dtype="int8", **_:
                   check_w4a8_config(cfg, M, N, K, Kp, group_size, act_dtype))


# ----------------------------------------------------------------------------------
# GEMM launcher
# ----------------------------------------------------------------------------------
def w4a8_reference(x_q, x_scales, qweight, s_ch, s_g, bias, in_features, group_size, out_dtype,
                   raw_acc: bool = False) -> torch.Tensor:
    """PyTorch twin of the kernel: the product in float64 (exact for int8: |acc| <= 127 * 127
    * K < 2**53), float32 epilogue. fp8 x_q: the weight is formats.qqq.fp8_weight."""
    qw = unpack_qqq(PackedQQQ(qweight, s_ch, s_g, in_features, group_size))
    fp8 = x_q.dtype == torch.float8_e4m3fn
    w = fp8_weight(qw) if fp8 else qw.int8_weight()
    acc = x_q.double() @ w.double().T.to(x_q.device)
    if raw_acc:
        return acc.float() if fp8 else acc.to(torch.int32)
    y = (acc.float() * s_ch.float()[None, :]) * x_scales.float()[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


# Split-K inside the GEMM (kernels/w4a8.py _add_slices: the last slice of each tile adds the
# slices and stores the output) instead of a reduce kernel after it, for the tiles where that
# measured faster: H200, whole layer call, same configs, 4 shapes x per channel / g128 x M = 1-64
# (docs/perf_log.md v23): BLOCK_N 64 with BLOCK_M <= 32, and the GEMV, 1.00-1.15x (one launch
# less); BLOCK_N >= 128 or BLOCK_M 64 0.81-1.09x, mostly slower (their last slice reads more). The
# 'gluon_overlap' tiles (BLOCK_N 64) take it too: with the reduce kernel its three split-K launches a
# layer cost 6.8 us (H100, M = 16, docs/perf_log.md v50).
def fixup_tile(cfg: Config) -> bool:
    """Whether split-K config cfg adds its slices inside the GEMM (above; SAILFISH_SPLIT_FIXUP=0:
    never)."""
    return FLAGS.split_fixup and cfg.SPLIT_K > 1 and (cfg.kernel == "gemv" or (cfg.BLOCK_M <= 32 and cfg.BLOCK_N <= 64))


class _W4A8Plan(Plan):
    """The fused paths ("gemv", "mma") of one W4A8 problem on one GPU: its config and the
    bound kernels (GEMM, split-K reduce; runtime/launch.py), kept in W4A8_TUNER.plans as
    ops/w4a16.py keeps W4A16's (_GemmPlan there). fixup: the split-K slices are added inside
    the GEMM (fixup_tile), no reduce kernel; each call then passes the stream's sync_buffer."""

    __slots__ = ("gemv", "ws_dtype", "fixup", "sync_at", "x_desc")

    def __init__(self, cfg: Config, device_index: int, *, gs: int, has_bias: bool, raw: bool, emu: bool,
                 asm: bool, fp8: bool, K: int, clamp: bool = True, fixup: bool = False, gluon: bool = False):
        kern = _kernels()
        if cfg.kernel in W4A8_GLUON and not gluon:  # (w4a8_gluon_applies)
            cfg = w4a8_gluon_twin(cfg)
        # (the pipe kernel's split-K: the reduce kernel)
        self.config, self.gemv, self.kind = cfg, cfg.kernel == "gemv", cfg.kernel
        self.fixup = fixup and cfg.kernel != "gluon_pipe"
        self.x_desc = None  # the Gluon kernel's: x_q -> its TMA descriptor
        # sync_buffer's arguments: the counters live on the plan's device
        self.sync_at = (torch.device("cpu") if device_index < 0 else torch.device("cuda", device_index), device_index)
        self.ws_dtype = torch.float32 if fp8 else torch.int32  # split-K partial sums
        release = pdl(device_index)  # (the row kernel after the GEMM may launch early: ops/common.as_dependent)
        meta = dict(GROUP_SIZE=gs, HAS_BIAS=has_bias, EVEN_K=K % cfg.BLOCK_K == 0, SPLIT_K=cfg.SPLIT_K,
                    RAW=raw, EMU_BF16=emu, USE_ASM=asm, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                    CLAMP=clamp, FIXUP=self.fixup, PDL_EARLY=release, **cfg.launch())
        if cfg.kernel == "gluon_pipe":
            from ..kernels.w4a8_gluon import pipe_descriptor, pipe_meta, w4a8_gluon_pipe_kernel

            # (no PDL: W4A8's reduce is not a programmatic dependent, _reduce_launch)
            self.gemm = Launch(w4a8_gluon_pipe_kernel, dict(
                GROUPED=gs > 0, CLAMP=clamp, HAS_BIAS=has_bias, SPLIT_K=cfg.SPLIT_K, RAW=raw, BLOCK_M=cfg.BLOCK_M,
                STAGES=cfg.num_stages, PDL_EARLY=False, **pipe_meta(cfg.BLOCK_M)), device_index)
            self.x_desc = partial(pipe_descriptor, BLOCK_M=cfg.BLOCK_M)  # (per call: ~3 us of host time)
        elif cfg.kernel == "gluon_overlap":
            from ..kernels.w4a8_gluon import overlap_meta, w4a8_gluon_overlap_kernel

            self.gemm = Launch(w4a8_gluon_overlap_kernel, dict(
                GROUPED=gs > 0, CLAMP=clamp, HAS_BIAS=has_bias, SPLIT_K=cfg.SPLIT_K, RAW=raw, FIXUP=self.fixup,
                BLOCK_M=cfg.BLOCK_M, STAGES=cfg.num_stages, PDL_EARLY=release,
                **overlap_meta(cfg.BLOCK_M)), device_index)
        elif self.gemv:
            self.gemm = Launch(kern._w4a8_gemv_kernel, meta, device_index)
        else:
            meta.update(BLOCK_M=cfg.BLOCK_M, GROUP_M=cfg.GROUP_M)
            self.gemm = Launch(kern._w4a8_kernel, meta, device_index)
        self.reduce = None if cfg.SPLIT_K == 1 or self.fixup else \
            _reduce_launch(cfg.SPLIT_K, has_bias, raw, emu, device_index)

    def __call__(self, out, y, x_q, x_scales, qweight, s_ch, s_g, bias, M, N, K, sxm, sqn, sgn,
                 x_tensor: Optional[torch.Tensor] = None) -> None:
        """out (M, N) = the product; y, x_q, ..., bias: out's and the operands' pointers, as
        tensors or ints (see ops/w4a16.py _GemmPlan; x_tensor: x_q itself, for the Gluon
        kernel's TMA descriptor); sxm: x_q's row stride; sqn: qweight's row stride in bytes
        (the Triton kernels read its int32 words as bytes). s_g / bias may be None (Triton
        makes them constexprs)."""
        cfg = self.config
        split = cfg.SPLIT_K
        # split-K: int32 (fp8: float32) partial sums in a (split, M, N) workspace, added in a
        # fixed order (int32: exactly) by the reduce kernel or, fixup, the tile's last slice with
        # the stream's tile counters; outside a capture the stream's workspace and counters
        # (ops/common.eager_scratch; tensors for the JIT's first call)
        ws = sync = None
        if self.fixup and not (self.sync_at[1] >= 0 and capturing()):
            sc = eager_scratch(*self.sync_at, split * M * N)
            ws, sync = (sc.ws.view(self.ws_dtype), sc.sync) if self.gemm.run is None else (sc.ws_ptr, sc.sync_ptr)
        elif split > 1:
            ws = out.new_empty((split, M, N), dtype=self.ws_dtype)
            if self.fixup:
                sync = sync_buffer(*self.sync_at)
                sync = sync if self.gemm.run is None else sync.data_ptr()
        target = ws if self.reduce is not None else y
        tiles_n = _cdiv(N, cfg.BLOCK_N)
        if self.kind == "gluon_pipe":  # x_q as its TMA descriptor; the words' row stride in words
            self.gemm((_cdiv(M, cfg.BLOCK_M) * tiles_n, split), self.x_desc(x_q if x_tensor is None else x_tensor),
                      x_scales, qweight, s_ch, s_g, bias, target, M, N, K, out.stride(0), sqn // 4, sgn)
        elif self.kind == "gluon_overlap":  # the words' row stride in words
            self.gemm((_cdiv(M, cfg.BLOCK_M) * tiles_n, split), x_q, x_scales, qweight, s_ch, s_g, bias, target,
                      ws if self.fixup else None, sync, M, N, K, sxm, out.stride(0), sqn // 4, sgn)
        elif self.gemv:
            self.gemm((tiles_n, split), x_q, x_scales, qweight, s_ch, s_g, bias, target, N, K, sqn, sgn, sync, ws)
        else:
            self.gemm((_cdiv(M, cfg.BLOCK_M) * tiles_n, split), x_q, x_scales, qweight, s_ch, s_g, bias,
                      target, M, N, K, sxm, N if target is ws else out.stride(0), sqn, sgn, sync, ws)
        if self.reduce is not None:
            self.reduce((_cdiv(M, 16), _cdiv(N, 128)), ws, x_scales, s_ch, bias, y, M, N, out.stride(0))


def _reduce_launch(split: int, has_bias: bool, raw: bool, emu: bool, device_index: int) -> Launch:
    """int32 ws (split, M, N) -> out: the exact sum, then the epilogue (raw: the sum);
    grid (cdiv(M, 16), cdiv(N, 128)). Not a programmatic dependent (runtime/device.py pdl): with
    it, W4A8's chains measured 0.91-1.05x (H200, docs/perf_log.md v16)."""
    return Launch(_kernels()._w4a8_splitk_reduce_kernel,
                  dict(SPLIT_K=split, HAS_BIAS=has_bias, RAW=raw, EMU_BF16=emu, BLOCK_M=16, BLOCK_N=128,
                       num_warps=4), device_index)


def _launch(cfg: Config, out: torch.Tensor, x_q, x_scales, qweight, s_ch, s_g, bias,
            gs: int, raw: bool, emu: bool, clamp: bool = True) -> Optional[_W4A8Plan]:
    """One GEMM with cfg into out (M, N). Operands contiguous; s_g / bias may be None
    (the fused kernels then get None, the dequant path s_ch, never read). The kernels read
    qweight as its bytes (formats.qqq.PackedQQQ); on the GPU they unpack with inline asm, in
    the interpreter with its pure-Triton twin. clamp=False: every |s_g| < 127.5 / 8
    (group_scales_in_range), the per-group unpack without its clamp. Returns the plan that ran
    (None for "dequant", whose per-call cost does not matter at the M it serves)."""
    kern = _kernels()
    M, K = x_q.shape
    N = qweight.shape[0]
    sqn = 4 * qweight.stride(0)  # the kernels read the int32 words as their bytes
    asm = x_q.is_cuda
    s_g_arg = s_ch if s_g is None else s_g
    sg_stride = 0 if s_g is None else s_g.stride(0)
    bias_arg = s_ch if bias is None else bias
    dev = x_q.get_device()
    if cfg.kernel == "dequant":
        w8 = torch.empty((N, K), dtype=torch.int8, device=x_q.device)
        kern._w4a8_dequant_kernel[(_cdiv(N, cfg.BLOCK_N), _cdiv(K, cfg.BLOCK_K))](
            qweight, s_g_arg, w8, N, K, sqn, sg_stride, w8.stride(0),
            GROUP_SIZE=gs, USE_ASM=asm, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, CLAMP=clamp,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        _reduce_launch(1, bias is not None, raw, emu, dev)(
            (_cdiv(M, 16), _cdiv(N, 128)), torch._int_mm(x_q, w8.t()), x_scales, s_ch, bias_arg, out, M, N,
            out.stride(0))
        return None
    # split-K inside the GEMM while the tile counters fit and a slice's offsets fit in 32 bits (M
    # up to twice this call's: a plan serves an M bucket)
    tiles = (1 if cfg.kernel == "gemv" else _cdiv(2 * M, cfg.BLOCK_M)) * _cdiv(N, cfg.BLOCK_N)

    def build() -> _W4A8Plan:
        return _W4A8Plan(cfg, dev, gs=gs, has_bias=bias is not None, raw=raw, emu=emu, asm=asm,
                         fp8=x_q.dtype is torch.float8_e4m3fn, K=K, clamp=clamp,
                         fixup=fixup_tile(cfg) and fixup_fits(tiles, 2 * M, N),
                         gluon=cfg.kernel in W4A8_GLUON and w4a8_gluon_applies(x_q, qweight))

    sxm = K if M == 1 else x_q.stride(0)
    return run_built(build, lambda plan: plan(out, out, x_q, x_scales, qweight, s_ch, s_g, bias, M, N, K, sxm, sqn,
                                              sg_stride), W4A8_GLUON, "W4A8")


def w4a8_launch(x_q: torch.Tensor, x_scales: torch.Tensor, qweight: torch.Tensor,
                s_ch: torch.Tensor, s_g: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                in_features: int, group_size: int, out_dtype: torch.dtype,
                config: Optional[Config] = None, raw_acc: bool = False) -> torch.Tensor:
    """Run the W4A8 Triton kernel. x_q int8 (or float8_e4m3fn) (M, K), x_scales float32 (M,)
    -> y (M, N) in out_dtype; raw_acc=True returns the accumulator sum_k x_q[m, k] * w[n, k]
    instead (no s_tok, s_ch, bias): int32 and exact for int8 (w = w8), float32 for fp8
    (w = formats.qqq.fp8_weight), for tests.

    Steady state (CUDA, config=None): the problem's plan (_W4A8Plan) from one dict lookup,
    keyed as W4A16's (ops/w4a16.py w4a16_launch); given the op's checks (int8 x_q, int32
    qweight, float32 scales, float16 s_g) only pointer alignment is checked per call."""
    M, K = x_q.shape
    N, kp8 = qweight.shape
    fp8 = x_q.dtype is torch.float8_e4m3fn
    if fp8:
        check_fp8_device(x_q)
    y = x_q.new_empty((M, N), dtype=(torch.float32 if fp8 else torch.int32) if raw_acc else out_dtype)
    if M == 0:
        return y
    if x_q.stride(1) != 1:
        x_q = x_q.contiguous()
    sxm = K if M == 1 else x_q.stride(0)  # (one row: any stride does, see quantize_per_token_launch)
    # per-group int8: the unpack's clamp only when some scale needs it (group_scales_in_range;
    # asked of the caller's tensor, which keeps the answer)
    clamp = fp8 or s_g is None or not group_scales_in_range(s_g)
    # the kernel indexes these with unit inner stride
    x_scales, qweight, s_ch = x_scales.contiguous(), qweight.contiguous(), s_ch.contiguous()
    s_g = None if s_g is None else s_g.contiguous()
    bias = None if bias is None else bias.contiguous()
    # batch-invariant mode pins fp8's config (ops.set_batch_invariant; int8 is invariant with any)
    invariant = fp8 and batch_invariant()
    key = None
    if config is None and x_q.is_cuda:
        dev = x_q.get_device()
        sqn, sgn = 4 * qweight.stride(0), 0 if s_g is None else s_g.stride(0)  # (sqn in bytes)
        key = (dev, out_dtype, fp8, raw_acc, (M - 1).bit_length(), M & 15 == 0, N, K, kp8, group_size, sxm, sqn, sgn,
               None if bias is None else bias.dtype, clamp, invariant)
        # (x_q last: the Gluon kernel's TMA descriptor is made from it)
        if run_steady(W4A8_TUNER, key, dev, x_q, y, (y, x_q, x_scales, qweight, s_ch, s_g, bias),
                      (M, N, K, sxm, sqn, sgn, x_q)):
            return y
    plans = None if key is None else W4A8_TUNER.plans_for_build()  # before the config lookup
    Kp = kp8 * 8
    gs = 0 if group_size == -1 else group_size
    act = "fp8" if fp8 else "int8"
    emu = out_dtype == torch.bfloat16 and not x_q.is_cuda  # interpreter bf16 twin (kernels/common.py)
    args = (x_q, x_scales, qweight, s_ch, s_g, bias, gs, raw_acc, emu, clamp)
    with device_of(x_q):
        if config is None:
            config = w4a8_config(x_q.device, M, N, K, Kp, group_size, out_dtype, act, invariant,
                                 lambda: scratch_runner(lambda cfg, out: _launch(cfg, out, *args), y))
        else:
            check_w4a8_config(config, M, N, K, Kp, group_size, act)
        plan = _launch(config, y, *args)
    keep(plans, key, plan, x_q, x_scales, qweight, s_ch, s_g, bias)
    return y


# ----------------------------------------------------------------------------------
# torch.library op
# ----------------------------------------------------------------------------------
def w4a8_gemm_impl(x_q: torch.Tensor, x_scales: torch.Tensor, qweight: torch.Tensor,
                   s_ch: torch.Tensor, s_g: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   in_features: int, group_size: int, out_dtype: torch.dtype) -> torch.Tensor:
    """y = s_tok[m] * s_ch[n] * (x_q @ w8^T)[m, n] (+ bias[n]) for a W4A8 weight in the
    formats.qqq.PackedQQQ layout.

    x_q: int8 (M, K), K = in_features; x_scales: float32 (M,) (from quantize_per_token).
    Or x_q float8_e4m3fn (from quantize_per_token_fp8): y = s_tok[m] * s_ch[n] *
    (x_q @ w^T)[m, n] with w = formats.qqq.fp8_weight (q - 8, times s_g for group_size=128);
    qweight: int32 (N, Kp/8); s_ch: float32 (N,); s_g: float16 (N, Kp/128) when
    group_size=128, None when group_size=-1; bias: (N,) float or None;
    out_dtype: torch.float16 or torch.bfloat16. Returns (M, N) in out_dtype.
    """
    _validate(x_q, x_scales, qweight, s_ch, s_g, bias, in_features, group_size, out_dtype)
    if x_q.is_cuda or use_triton(x_q):
        return w4a8_launch(x_q, x_scales, qweight, s_ch, s_g, bias, in_features, group_size, out_dtype)
    return w4a8_reference(x_q, x_scales, qweight, s_ch, s_g, bias, in_features, group_size, out_dtype)


def _w4a8_gemm_fake(x_q, x_scales, qweight, s_ch, s_g, bias, in_features, group_size, out_dtype):
    check_devices(True, x_q=x_q, x_scales=x_scales, qweight=qweight, s_ch=s_ch, s_g=s_g, bias=bias)
    return x_q.new_empty((x_q.shape[0], qweight.shape[0]), dtype=out_dtype)


# No derivative with respect to the int8 x_q; see quantize_per_token above.
w4a8_gemm = define_op(
    "w4a8_gemm", "(Tensor x_q, Tensor x_scales, Tensor qweight, Tensor s_ch, Tensor? s_g, Tensor? bias, "
    "SymInt in_features, SymInt group_size, ScalarType out_dtype) -> Tensor", w4a8_gemm_impl, _w4a8_gemm_fake)


def w4a8_linear_impl(x: torch.Tensor, qweight: torch.Tensor, s_ch: torch.Tensor,
                     s_g: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                     in_features: int, group_size: int, act_dtype: str = "int8") -> torch.Tensor:
    """x (M, K) float16/bfloat16 -> y (M, N) in x's dtype: quantize_per_token + w4a8_gemm in
    one op (the same numbers as calling the two), one dispatch for QuantLinearW4A8.
    act_dtype "fp8": quantize_per_token_fp8 + w4a8_gemm (w4a8_linear_fp8_impl)."""
    _check_activations(x, HALF_DTYPES)
    if x.shape[1] != in_features:
        raise ValueError(f"x must have shape (M, {in_features}), got {tuple(x.shape)}")
    _validate_weight(qweight, s_ch, s_g, bias, in_features, group_size, x)
    if x.is_cuda or use_triton(x):
        x_q, x_scales = quantize_per_token_launch(x, act_dtype=act_dtype)
        return w4a8_launch(x_q, x_scales, qweight, s_ch, s_g, bias, in_features, group_size, x.dtype)
    x_q, x_scales = quantize_activations(x, act_dtype)
    return w4a8_reference(x_q, x_scales, qweight, s_ch, s_g, bias, in_features, group_size, x.dtype)


def w4a8_linear_fp8_impl(x, qweight, s_ch, s_g, bias, in_features: int, group_size: int) -> torch.Tensor:
    """w4a8_linear_impl with float8 (e4m3) activations: a plain function, no op (what
    QuantLinearW4A8.forward calls directly in plain eager; elsewhere it runs the two ops)."""
    return w4a8_linear_impl(x, qweight, s_ch, s_g, bias, in_features, group_size, act_dtype="fp8")


def _w4a8_linear_fake(x, qweight, s_ch, s_g, bias, in_features, group_size):
    check_devices(True, x=x, qweight=qweight, s_ch=s_ch, s_g=s_g, bias=bias)
    return x.new_empty((x.shape[0], qweight.shape[0]))


W4A8_LINEAR_SCHEMA = ("(Tensor x, Tensor qweight, Tensor s_ch, Tensor? s_g, Tensor? bias, SymInt in_features, "
                      "SymInt group_size) -> Tensor")
# sailfish::w4a8_linear (ops/autograd.py) is this op with a straight-through backward; the
# no-grad twin is what QuantLinearW4A8.forward runs when x needs no gradient (it skips the
# ~7 us autograd layer; differentiating through it gives no gradient, PyTorch warns).
w4a8_linear_nograd = define_op("w4a8_linear_nograd", W4A8_LINEAR_SCHEMA, w4a8_linear_impl, _w4a8_linear_fake)


def _validate(x_q, x_scales, qweight, s_ch, s_g, bias, in_features, group_size, out_dtype) -> None:
    if out_dtype is not torch.float16 and out_dtype is not torch.bfloat16:
        raise TypeError(f"out_dtype {out_dtype} is not supported; allowed: float16, bfloat16")
    if x_q.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise TypeError(f"x_q must be int8 (from quantize_per_token) or float8_e4m3fn (from "
                        f"quantize_per_token_fp8), got {x_q.dtype}")
    if x_q.dim() != 2 or x_q.shape[1] != in_features or in_features <= 0:
        raise ValueError(f"x_q must have shape (M, {in_features}), got {tuple(x_q.shape)}")
    if x_scales.dtype is not torch.float32 or x_scales.dim() != 1 or x_scales.shape[0] != x_q.shape[0]:
        raise ValueError(f"x_scales must be float32 of shape ({x_q.shape[0]},), got "
                         f"{x_scales.dtype} {tuple(x_scales.shape)}")
    _validate_weight(qweight, s_ch, s_g, bias, in_features, group_size, x_q, x_scales)


def _validate_weight(qweight, s_ch, s_g, bias, in_features, group_size, device, x_scales=None) -> None:
    # device: the activation tensor whose device the weights must share
    """The weight operands' checks (cheap ones: they run on every call)."""
    if group_size != -1 and group_size != 128:
        raise ValueError(f"group_size={group_size!r} is not supported for W4A8; allowed: {GROUP_SIZES_W4A8}")
    if (qweight.dtype is not torch.int32 or qweight.dim() != 2 or (qweight.shape[1] * 8) % K_PAD
            or qweight.shape[1] * 8 < in_features):
        raise ValueError(f"qweight must be int32 (N, Kp/8) with Kp >= in_features a multiple of {K_PAD}")
    n, kp = qweight.shape[0], qweight.shape[1] * 8
    if s_ch.dtype is not torch.float32 or s_ch.dim() != 1 or s_ch.shape[0] != n:
        raise ValueError(f"s_ch must be float32 of shape ({n},), got {s_ch.dtype} {tuple(s_ch.shape)}")
    if group_size == -1:
        if s_g is not None:
            raise ValueError("s_g must be None for per-channel weights (group_size=-1)")
    elif (s_g is None or s_g.dtype is not torch.float16 or s_g.dim() != 2 or s_g.shape[0] != n
          or s_g.shape[1] != kp // group_size):
        got = None if s_g is None else f"{s_g.dtype} {tuple(s_g.shape)}"
        raise ValueError(f"s_g must be float16 of shape ({n}, {kp // group_size}), got {got}")
    if bias is not None and (not bias.is_floating_point() or bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"bias must be a float tensor of shape ({n},), got {bias.dtype} {tuple(bias.shape)}")
    dev = device.get_device()  # ints: comparing torch.device objects costs ~0.3 us each
    if (dev < 0 or qweight.get_device() != dev or s_ch.get_device() != dev
            or (s_g is not None and s_g.get_device() != dev) or (bias is not None and bias.get_device() != dev)
            or (x_scales is not None and x_scales.get_device() != dev)):
        check_devices(x=device, x_scales=x_scales, qweight=qweight, s_ch=s_ch, s_g=s_g, bias=bias)
