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

ROUTER_MAX_EXPERTS = 1024  # the row stays in registers (DeepSeek-V3: 256, Qwen3-Next: 512 experts)
LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@lru_cache(maxsize=None)
def _kernel():
    """kernels.router's kernel, imported on first use (after TRITON_INTERPRET is settled)."""
    from ..kernels.router import router_topk_kernel
    return router_topk_kernel


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


def _check(logits, top_k, renormalize, fp32_weights, fake: bool = False) -> int:
    """Returns E."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"logits dtype {logits.dtype} is not supported; allowed: float16, bfloat16, float32")
    if logits.dim() != 2 or not 1 <= logits.shape[1] <= ROUTER_MAX_EXPERTS:
        raise ValueError(f"logits must have shape (T, E) with 1 <= E <= {ROUTER_MAX_EXPERTS}, "
                         f"got {tuple(logits.shape)}")
    E = logits.shape[1]
    if E > 1 and logits.shape[0] > 0 and logits.stride(1) != 1:
        raise ValueError(f"logits must have a contiguous last dimension (stride 1), got strides "
                         f"{tuple(logits.stride())}; call .contiguous() first")
    if type(top_k) is not int or not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k!r} is not supported; allowed: an int in [1, {E}] (E, the logits' last dim)")
    check_flag("renormalize", renormalize)
    check_flag("fp32_weights", fp32_weights)
    if fake or not (logits.is_cuda or logits.device.type == "cpu"):
        check_devices(fake, logits=logits)
    return E


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
