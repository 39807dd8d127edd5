"""The MoE router after its F.linear, in one launch (issue 41):

    sailfish::router_topk(logits, top_k, renormalize, fp32_weights=False) -> (weights, ids)

logits (T, E) float16 / bfloat16 / float32 (E <= ROUTER_MAX_EXPERTS, unit-stride rows) ->
weights (T, top_k) in logits' dtype (fp32_weights: float32), ids (T, top_k) int64 (what
torch.topk gives and transformers' experts modules take), in descending order. The reference
below is the contract: transformers 5's TopKRouter formula (Qwen3-MoE, Qwen2-MoE:
softmax(logits, dtype=float32), torch.topk, `/= sum` if norm_topk_prob, `.to(logits.dtype)`;
Mixtral: the same with the renormalisation always on and the weights left in float32, i.e.
renormalize=True, fp32_weights=True).

What the kernel (kernels/router.py) gives, and the tests check (tests/test_router.py):
- ids: the reference's wherever the reference's top_k + 1 largest probabilities of a row are
  distinct. On exact ties (equal logits) the lowest index comes first; torch.topk leaves the
  order of equal values unspecified, so the SET (and the weights) match, the order among the
  tied ones may not. The kernel ranks the logits themselves, so logits that differ by a few
  fp32 ulps but round to one probability are ordered by logit (torch: by its own tie rule).
- weights: the same fp32 operations as torch (max, d = x - max, exp(d), a sum, IEEE divisions),
  except the order of the sums and the backend's exp. Against the weights computed exactly from
  the same fp32 d, each fp32 weight is within 2a + S + 1 fp32 ulps (relative; renormalized:
  2a + k + 2, the row's sum cancelling), a = 4 ulps for exp (+ 1.5 max |d| on the GPU, whose exp
  is ex2(d * log2e)), S = BLOCK_E / 8 + log2(BLOCK_E) for the tree-shaped sum of the row (E = 128:
  32 ulps plain, 18 renormalized at k = 8 on the CPU interpreter; measured: at most ~5). torch
  adds its own such error, so kernel and reference differ by both. Then the cast to the weights'
  dtype, one rounding.
- NaN / Inf: as torch's softmax, a row with a NaN or +Inf logit, or all -Inf, has every weight
  NaN; its ids are still top_k distinct columns, NaN ranked first (as torch.topk ranks NaN).

Where it runs: CUDA tensors and, with TRITON_INTERPRET=1, CPU tensors run the kernel; other CPU
tensors the reference. One launch per call; on CUDA the bound kernel is kept per (device,
dtype, E, top_k, flags, row stride) and a steady call is a dict lookup, two allocations and the
direct launch (runtime/launch.py Launch, runtime/plan.py run_steady / keep), as ops/rowwise.py.
Under torch.compile the op traces through its fake implementation (sailfish.fuse's router keeps
the op there: replacing inductor's softmax + sort + gather is the point).

The whole router, its F.linear included, in one launch (sailfish.fuse.SailfishTopKRouter):

    sailfish::router_linear_topk(x, weight, top_k, renormalize, fp32_weights=False) -> (logits, weights, ids)

x (T, H) float16 / bfloat16 / float32, weight (E, H) of x's dtype (E <= ROUTER_MAX_EXPERTS),
both with unit-stride rows -> logits (T, E) in x's dtype, then router_topk's (weights, ids) OF
THOSE LOGITS (router_linear_topk_reference: F.linear, then router_topk_reference).
- logits: each the fp32 sum of the H products (exact in fp32 for fp16 / bf16 operands) rounded
  once to x's dtype, as F.linear's (cuBLAS and the CPU both sum in fp32); the order of the sum
  differs, so against the exact value each is within gamma_{H-1} * sum_h |x_h w_h| (gamma_n =
  n u / (1 - n u), u = 2^-24: any order of H - 1 fp32 additions) before that rounding.
- weights, ids: what router_topk gives for the rounded logits the op returns (the same
  @triton.jit code ranks them: kernels/router.py _topk_rows).
Why: at decode (Qwen3-30B-A3B: 128 x 2048 bf16, 512 KB) the router's GEMM is a separate
launch-bound cuBLAS kernel of ~5 us next to router_topk's ~4.4 us (H100, docs/perf_log.md v44).
The kernel spreads the logits over ~LINEAR_PROGRAMS programs and the last to finish ranks them
(kernels/router.py router_linear_topk_kernel). T > LINEAR_MAX_T (prefill): F.linear (cuBLAS's
tensor cores) and then router_topk's launch, the same contract.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Tuple

import torch
import torch.nn.functional as F

from ..formats.int4 import check_flag
from ..runtime.device import check_devices, device_of, use_triton
from ..runtime.dispatch import define_op
from ..runtime.launch import Launch
from ..runtime.plan import keep, run_steady
from ..tuning import next_pow2
from .common import SYNC_CAP, sync_buffer

ROUTER_MAX_EXPERTS = 1024  # the row stays in registers (DeepSeek-V3: 256, Qwen3-Next: 512 experts)
LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@lru_cache(maxsize=None)
def _kernel(linear: bool = False):
    """kernels.router's kernel (linear: the one with the F.linear), imported on first use (after
    TRITON_INTERPRET is settled)."""
    from ..kernels import router
    return router.router_linear_topk_kernel if linear else router.router_topk_kernel


class _RouterPlans:
    """The bound launches by key, as ops/rowwise.py's _RowPlans (no config: never stale)."""
    plans: dict = {}


def router_topk_reference(logits: torch.Tensor, top_k: int, renormalize: bool,
                          fp32_weights: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """transformers' TopKRouter after its F.linear: softmax in float32, torch.topk, the weights
    over their sum if renormalize, cast to logits' dtype unless fp32_weights."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    values, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        values /= values.sum(dim=-1, keepdim=True)
    return (values if fp32_weights else values.to(logits.dtype)), ids


def _check_rows(name: str, t, max_cols: int = 0) -> None:
    """t: a 2-D tensor of a dtype in LOGIT_DTYPES with unit-stride rows; max_cols: the logits'
    (T, E), 1 <= E <= max_cols."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} dtype {t.dtype} is not supported; allowed: float16, bfloat16, float32")
    if max_cols and (t.dim() != 2 or not 1 <= t.shape[1] <= max_cols):
        raise ValueError(f"{name} must have shape (T, E) with 1 <= E <= {max_cols}, got {tuple(t.shape)}")
    if t.dim() != 2:
        raise ValueError(f"{name} must have shape (T, H), got {tuple(t.shape)}")
    if t.shape[1] > 1 and t.shape[0] > 0 and t.stride(1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides "
                         f"{tuple(t.stride())}; call .contiguous() first")


def _check_topk(top_k, E: int, renormalize, fp32_weights) -> None:
    if type(top_k) is not int or not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k!r} is not supported; allowed: an int in [1, {E}] (E, the logits' last dim)")
    check_flag("renormalize", renormalize)
    check_flag("fp32_weights", fp32_weights)


def _check(logits, top_k, renormalize, fp32_weights, fake: bool = False) -> int:
    """Returns E."""
    _check_rows("logits", logits, ROUTER_MAX_EXPERTS)
    E = logits.shape[1]
    _check_topk(top_k, E, renormalize, fp32_weights)
    if fake or not (logits.is_cuda or logits.device.type == "cpu"):
        check_devices(fake, logits=logits)
    return E


def _check_linear(x, weight, top_k, renormalize, fp32_weights, fake: bool = False) -> None:
    _check_rows("x", x)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must be x's dtype {x.dtype}")
    H = x.shape[1]
    if weight.dim() != 2 or weight.shape[1] != H or not 1 <= weight.shape[0] <= ROUTER_MAX_EXPERTS:
        raise ValueError(f"weight must have shape (E, H) with 1 <= E <= {ROUTER_MAX_EXPERTS} and H = {H} (x's last "
                         f"dim), got {tuple(weight.shape)}")
    _check_rows("weight", weight)
    _check_topk(top_k, weight.shape[0], renormalize, fp32_weights)
    if fake or x.device != weight.device or not (x.is_cuda or x.device.type == "cpu"):
        check_devices(fake, x=x, weight=weight)


@lru_cache(maxsize=None)
def _tile(E: int, top_k: int) -> dict:
    """The kernel's constexprs for rows of E experts: BLOCK_E (the row), BLOCK_K, ROWS per
    program (several short rows, up to 256 values a program), num_warps (one warp up to 512
    values: the k rounds' reductions stay warp shuffles)."""
    block_e = next_pow2(E)
    rows = max(1, min(8, 256 // block_e))
    return dict(BLOCK_E=block_e, BLOCK_K=next_pow2(top_k), ROWS=rows,
                num_warps=1 if rows * block_e <= 512 else 2)


def router_topk_launch(logits: torch.Tensor, top_k: int, renormalize: bool,
                       fp32_weights: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The kernel on checked operands: (weights (T, top_k), ids (T, top_k) int64)."""
    T, E = logits.shape
    weights = logits.new_empty((T, top_k), dtype=torch.float32 if fp32_weights else logits.dtype)
    ids = logits.new_empty((T, top_k), dtype=torch.int64)
    if T == 0:
        return weights, ids
    stride = logits.stride(0) if T > 1 else E  # (one row: the kernel never steps, any value does)
    meta = _tile(E, top_k)
    grid = (-(-T // meta["ROWS"]), 1)
    operands = (logits, weights, ids)
    key = None
    if logits.is_cuda:
        dev = logits.get_device()
        key = (dev, logits.dtype, E, top_k, renormalize, fp32_weights, stride)
        if run_steady(_RouterPlans, key, dev, logits, grid, operands, (T, E, stride)):
            return weights, ids
    emu = weights.dtype is torch.bfloat16 and not logits.is_cuda
    launch = Launch(_kernel(), dict(meta, K=top_k, RENORM=renormalize, EMU_BF16=emu), logits.get_device())
    with device_of(logits):
        launch(grid, *operands, T, E, stride)
    keep(None if key is None else _RouterPlans.plans, key, launch, *operands)
    return weights, ids


def router_topk_impl(logits: torch.Tensor, top_k: int, renormalize: bool,
                     fp32_weights: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """softmax + top-k (+ renormalisation) of logits (T, E): (weights (T, top_k), ids (T, top_k)
    int64), router_topk_reference's ids and, within the module doc's bound, its weights."""
    _check(logits, top_k, renormalize, fp32_weights)
    if use_triton(logits):
        return router_topk_launch(logits, top_k, renormalize, fp32_weights)
    return router_topk_reference(logits, top_k, renormalize, fp32_weights)


def _router_topk_fake(logits, top_k, renormalize, fp32_weights=False):
    _check(logits, top_k, renormalize, fp32_weights, fake=True)
    T = logits.shape[0]
    return (logits.new_empty((T, top_k), dtype=torch.float32 if fp32_weights else logits.dtype),
            logits.new_empty((T, top_k), dtype=torch.int64))


router_topk = define_op("router_topk", "(Tensor logits, int top_k, bool renormalize, bool fp32_weights=False) "
                        "-> (Tensor, Tensor)", router_topk_impl, _router_topk_fake)


# ----------------------------------------------------------------------------------
# The router with its F.linear: sailfish::router_linear_topk
# ----------------------------------------------------------------------------------
# tokens up to which the kernel computes the logits itself (decode; beyond: cuBLAS's GEMM, then
# router_topk). H100 (benchmarks/probes/router_probe.py, docs/perf_log.md v45), whole router per call,
# this kernel / F.linear + router_topk: Qwen3-30B-A3B T = 1 5.1 / 9.2 us, T = 4 8.1 / 8.0, T = 16 25 / 8.1;
# Mixtral T = 1 3.4 / 7.8, T = 4 4.7 / 7.5, T = 16 12.3 / 7.6 (its logits on CUDA cores lose from T = 16)
LINEAR_MAX_T = 4
LINEAR_PROGRAMS = 128  # programs the logits are spread over at decode (~ an H100's 132 SMs)
LINEAR_TILE = 4096  # values of one K step's product tile (BLOCK_T x SLICE_E x BLOCK_H): 32 a thread at 4 warps


class _RouterLinearPlans:
    plans: dict = {}


def router_linear_topk_reference(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                                 fp32_weights: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' TopKRouter: (logits = F.linear(x, weight), *router_topk_reference(logits, ...))."""
    logits = F.linear(x, weight)
    return (logits, *router_topk_reference(logits, top_k, renormalize, fp32_weights))


@lru_cache(maxsize=None)
def _linear_tile(T: int, E: int, H: int, top_k: int) -> dict:
    """The fused kernel's constexprs: BLOCK_T tokens a program (16 at most: the product tile stays
    in registers), SLICE_E experts a program so that ~LINEAR_PROGRAMS programs share the weight's
    rows (one row each for Qwen3-MoE's 128 experts at T <= 16; fewer where the K step would fall
    below 64 channels), BLOCK_H channels a K step (the
    product tile LINEAR_TILE values; STAGES: the K loop pipelined where it has several steps); the
    top-k's row tiling is router_topk's (_tile), no more rows than the token block. First
    guesses, to be measured (benchmarks/probes/router_probe.py)."""
    block_t = min(16, next_pow2(T))
    blocks = -(-T // block_t)
    slice_e = max(1, min(next_pow2(E), next_pow2(-(-E * blocks // LINEAR_PROGRAMS)), LINEAR_TILE // (block_t * 64)))
    block_h = min(next_pow2(H), LINEAR_TILE // (block_t * slice_e))  # (64 at least: K steps of 128 bytes)
    top = _tile(E, top_k)
    return dict(BLOCK_E=top["BLOCK_E"], BLOCK_K=top["BLOCK_K"], ROWS=min(top["ROWS"], block_t), SLICE_E=slice_e,
                BLOCK_T=block_t, BLOCK_H=block_h, STAGES=1 if block_h >= H else 3, num_warps=4)


def router_linear_topk_launch(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                              fp32_weights: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused kernel on checked operands (T <= LINEAR_MAX_T, or any T under the interpreter's
    tests): (logits (T, E), weights (T, top_k), ids (T, top_k) int64)."""
    T, H = x.shape
    E = weight.shape[0]
    logits = x.new_empty((T, E))
    weights = x.new_empty((T, top_k), dtype=torch.float32 if fp32_weights else x.dtype)
    ids = x.new_empty((T, top_k), dtype=torch.int64)
    if T == 0:
        return logits, weights, ids
    meta = _linear_tile(T, E, H, top_k)
    grid = (-(-E // meta["SLICE_E"]), -(-T // meta["BLOCK_T"]))
    if grid[1] > SYNC_CAP:
        raise ValueError(f"x has {T} tokens: {grid[1]} token blocks, more than the {SYNC_CAP} counters")
    cnt = sync_buffer(x.device, x.get_device())
    stride_x = x.stride(0) if T > 1 else H  # (one row: the kernel never steps, any value does)
    stride_w = weight.stride(0) if E > 1 else H
    operands = (x, weight, logits, weights, ids, cnt)
    ints = (T, E, H, stride_x, stride_w)
    key = None
    if x.is_cuda:
        dev = x.get_device()
        # (T in the key: the tiles follow it; the kernel does not specialize on it)
        key = (dev, x.dtype, T, E, H, top_k, renormalize, fp32_weights, stride_x, stride_w)
        if run_steady(_RouterLinearPlans, key, dev, x, grid, operands, ints):
            return logits, weights, ids
    emu = not x.is_cuda and x.dtype is torch.bfloat16
    launch = Launch(_kernel(True), dict(meta, K=top_k, RENORM=renormalize, EMU_BF16=emu and not fp32_weights,
                                        EMU_LOGITS=emu), x.get_device())
    with device_of(x):
        launch(grid, *operands, *ints)
    keep(None if key is None else _RouterLinearPlans.plans, key, launch, *operands)
    return logits, weights, ids


def router_linear_topk_impl(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                            fp32_weights: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole router: (logits (T, E), weights (T, top_k), ids (T, top_k) int64), see the module
    doc. T > LINEAR_MAX_T: F.linear, then router_topk's kernel (two launches; prefill)."""
    _check_linear(x, weight, top_k, renormalize, fp32_weights)
    if not use_triton(x):
        return router_linear_topk_reference(x, weight, top_k, renormalize, fp32_weights)
    if x.shape[0] > LINEAR_MAX_T:
        logits = F.linear(x, weight)
        return (logits, *router_topk_launch(logits, top_k, renormalize, fp32_weights))
    return router_linear_topk_launch(x, weight, top_k, renormalize, fp32_weights)


def _router_linear_topk_fake(x, weight, top_k, renormalize, fp32_weights=False):
    _check_linear(x, weight, top_k, renormalize, fp32_weights, fake=True)
    T = x.shape[0]
    return (x.new_empty((T, weight.shape[0])),
            x.new_empty((T, top_k), dtype=torch.float32 if fp32_weights else x.dtype),
            x.new_empty((T, top_k), dtype=torch.int64))


router_linear_topk = define_op("router_linear_topk", "(Tensor x, Tensor weight, int top_k, bool renormalize, "
                               "bool fp32_weights=False) -> (Tensor, Tensor, Tensor)", router_linear_topk_impl,
                               _router_linear_topk_fake)
