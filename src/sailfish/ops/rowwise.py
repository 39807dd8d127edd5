"""Row-wise ops around the GEMMs (issue 39): transformers' RMSNorm and SiLU-and-multiply in one
launch each, and the same with W4A8's per-token int8 quantization of the result fused in, so
that a W4A8 GEMM takes the norm's (or the MLP activation's) output without a quantize launch.

    sailfish::rms_norm(x, weight, eps) -> y                      x (..., K) -> y (..., K)
    sailfish::rms_norm_quant(x, weight, eps) -> (x_q, scales)    int8 (M, K), float32 (M,)
    sailfish::silu_mul(gu) -> h                                  gu (..., 2I) -> h (..., I)
    sailfish::silu_mul_quant(gu) -> (h_q, scales)                int8 (M, I), float32 (M,)
    sailfish::rms_norm_quant_fp8, sailfish::silu_mul_quant_fp8   the same with float8_e4m3fn codes
                                                                 (quantize_per_token_fp8's; sm_89+)
    sailfish::add_rms_norm_quant(x, residual, weight, eps)       (x + residual, *rms_norm_quant of it)
      (and _fp8)                                                 (the form a compiled graph's residual
                                                                 add folds into: sailfish/inductor.py)

M is the product of the leading dims, which may have any layout (_row_layout: read in place where
one or two strides reach every row, e.g. Qwen3's q/k norms on (B, S, H, D) views of a fused
q/k/v output; copied otherwise); the outputs are contiguous. The references below are the contract (plain torch:
LlamaRMSNorm's and eager `F.silu(gate) * up`'s roundings; the `_quant` forms are exactly
formats.qqq.quantize_activations, i.e. sailfish::quantize_per_token, of those outputs). The
kernels (kernels/rowwise.py) give the references' bits except for the order of the sum of
squares and the backend's rsqrt / exp (tests/test_rowwise.py bounds the difference: one
rounding of the output dtype on the normalized value, then torch's own products), and their
`_quant` forms give quantize_per_token of the kernel's own output bit for bit.

Under torch.compile a model may call `rms_norm_torch`, `silu_mul_torch` and
`quantize_per_token_torch` instead, so that inductor fuses them itself: they are the references
(plain torch, no Python loops or data-dependent branches).

Where they run: CUDA tensors and, with TRITON_INTERPRET=1, CPU tensors run the kernels; other
CPU tensors the references (runtime/device.py). Launches: one Triton launch per call; on CUDA
the bound kernel is kept per (op, device, dtype, width, row layout) and a steady call is that
dict lookup, the output allocation and the direct launch (runtime/launch.py Launch,
runtime/plan.py run_steady / keep). No Tuner: a row op's tile follows from its width alone
(_tile), so there is no config to choose or forget, and the plans live in _RowPlans.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..formats.int4 import HALF_DTYPES
from ..formats.qqq import check_act_dtype, quantize_activations
from ..runtime.device import check_devices, device_of, use_triton
from ..runtime.dispatch import define_op
from ..runtime.launch import Launch
from ..runtime.plan import keep, run_steady
from ..tuning import next_pow2
from .common import SYNC_CAP, as_dependent, sync_buffer
from .w4a8 import check_fp8_device

# Rows up to this many channels are kept in registers (16 warps: 32 fp32 values per thread and
# operand); wider rows loop over chunks of ROW_CHUNK (a second pass, a third for the _quant
# forms). Llama-3-8B's widths (4096, and 14336 for silu_mul) take one pass.
ROW_ONE_PASS_MAX = 16384
ROW_CHUNK = 4096
# silu_mul_quant of up to SPLIT_ROWS_MAX rows of at least 2 * SPLIT_BLOCK outputs: each row over
# programs of SPLIT_BLOCK outputs (kernels/rowwise.silu_mul_quant_split_kernel). H100, M = 16, 14336
# channels: 6.2 us with one program a row, 4.96 / 5.19 / 5.64 us split in parts of 2048 / 1024 / 4096
# (docs/perf_log.md v50).
SPLIT_ROWS_MAX = 32
SPLIT_BLOCK = 2048
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # the _quant forms' codes by act_dtype


@lru_cache(maxsize=None)
def _kernel(split: bool = False, add: bool = False):
    """kernels.rowwise's kernel (split: the split-row silu_mul_quant's; add: the residual add with
    the norm and quantization), imported on first use (after TRITON_INTERPRET is settled)."""
    from ..kernels.rowwise import add_rms_norm_quant_kernel, rowwise_kernel, silu_mul_quant_split_kernel
    return add_rms_norm_quant_kernel if add else silu_mul_quant_split_kernel if split else rowwise_kernel


class _RowPlans:
    """What run_steady reads of a Tuner: `plans`, the bound launches by key. They never go
    stale (no config, no SAILFISH_* switch decides them), so tuning.clear_caches leaves them."""
    plans: dict = {}


# ----------------------------------------------------------------------------------
# References (the contract) and the plain-torch forms for torch.compile
# ----------------------------------------------------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, rounding for rounding: h = x * rsqrt(mean(x^2) + eps)
    in fp32, rounded to x's dtype, then weight * h in that dtype."""
    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * h


def silu_mul_reference(gu: torch.Tensor) -> torch.Tensor:
    """transformers' `act_fn(gate) * up` with gate, up = the halves of gu's last dim: silu in
    fp32 rounded to gu's dtype, then the product rounded."""
    i = gu.shape[-1] // 2
    return F.silu(gu[..., :i]) * gu[..., i:]


def rms_norm_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                             act_dtype: str = "int8") -> Tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token's reference (act_dtype "fp8": quantize_per_token_fp8's) of
    rms_norm_reference's output, as (M, K)."""
    return quantize_activations(rms_norm_reference(x, weight, eps).reshape(-1, x.shape[-1]), act_dtype)


def add_rms_norm_quant_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                 act_dtype: str = "int8") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + residual, *rms_norm_quant_reference of it): a decoder layer's residual add, then the
    norm and quantization of the next W4A8 input."""
    h = x + residual
    return (h, *rms_norm_quant_reference(h, weight, eps, act_dtype))


def silu_mul_quant_reference(gu: torch.Tensor, act_dtype: str = "int8") -> Tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token's reference (act_dtype "fp8": quantize_per_token_fp8's) of
    silu_mul_reference's output, as (M, I)."""
    return quantize_activations(silu_mul_reference(gu).reshape(-1, gu.shape[-1] // 2), act_dtype)


# For torch.compile (inductor fuses these with their neighbours). Compiled, they are not these
# bits: inductor may elide the intermediate fp16/bf16 roundings (unless
# torch._inductor.config.emulate_precision_casts) and its Triton divisions are not IEEE.
rms_norm_torch = rms_norm_reference
silu_mul_torch = silu_mul_reference
quantize_per_token_torch = quantize_activations  # (x (M, K), act_dtype="int8") -> (x_q (M, K), float32 (M,))


# ----------------------------------------------------------------------------------
# Checks (shared by the ops and their fake implementations)
# ----------------------------------------------------------------------------------
def _check_rows(name: str, x: torch.Tensor) -> int:
    """x (..., n) fp16/bf16 with a unit-stride last dim; returns n."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HALF_DTYPES:
        raise TypeError(f"{name} dtype {x.dtype} is not supported; allowed: float16, bfloat16")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have shape (..., n) with n > 0, got {tuple(x.shape)}")
    n = x.shape[-1]
    if n > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides "
                         f"{tuple(x.stride())}; call .contiguous() first")
    return n


def _check_rms(x, weight, eps, fake: bool = False) -> int:
    k = _check_rows("x", x)
    if not isinstance(weight, torch.Tensor) or weight.dtype != x.dtype:
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise TypeError(f"weight must be a tensor of x's dtype {x.dtype}, got {got}")
    if weight.dim() != 1 or weight.shape[0] != k:
        raise ValueError(f"weight must have shape ({k},) (x's last dim), got {tuple(weight.shape)}")
    if not isinstance(eps, (float, int)) or not (0.0 <= eps < math.inf):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    if fake:
        check_devices(True, x=x, weight=weight)
    elif x.get_device() != weight.get_device() or x.get_device() < 0:  # (-1: the CPU and meta alike)
        check_devices(x=x, weight=weight)
    return k


def _check_add(x, residual, weight, eps, fake: bool = False) -> int:
    """_check_rms, and residual a tensor of x's shape, dtype and device."""
    k = _check_rms(x, weight, eps, fake)
    if not isinstance(residual, torch.Tensor) or residual.dtype != x.dtype or residual.shape != x.shape:
        got = (f"{residual.dtype} {tuple(residual.shape)}" if isinstance(residual, torch.Tensor)
               else type(residual).__name__)
        raise ValueError(f"residual must be a tensor of x's dtype and shape ({x.dtype} {tuple(x.shape)}), got {got}")
    if fake:
        check_devices(True, x=x, residual=residual)
    elif residual.get_device() != x.get_device():
        check_devices(x=x, residual=residual)
    return k


def _check_gu(gu, fake: bool = False) -> int:
    n = _check_rows("gu", gu)
    if n % 2:
        raise ValueError(f"gu's last dim must be even (gate and up halves, 2 * intermediate_size), got {n}")
    if fake:
        check_devices(True, gu=gu)
    elif not (gu.is_cuda or gu.device.type == "cpu"):
        check_devices(gu=gu)
    return n // 2


# ----------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _tile(n: int, block_k: Optional[int]) -> dict:
    """The kernels' constexprs for rows of n channels: BLOCK_K (default the whole row up to
    ROW_ONE_PASS_MAX, else ROW_CHUNK; a power of two >= 16), ROWS per program (several rows of
    short widths, up to 2048 values a program), ONE_PASS, num_warps (by values per program)."""
    bk = block_k if block_k is not None else max(16, next_pow2(n)) if n <= ROW_ONE_PASS_MAX else ROW_CHUNK
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"block_k={bk} must be a power of two >= 16")
    rows = max(1, min(16, 2048 // bk)) if n <= bk else 1  # (the chunked loops take one row)
    size = rows * bk
    return dict(BLOCK_K=bk, ROWS=rows, ONE_PASS=n <= bk,
                num_warps=4 if size <= 2048 else 8 if size <= 8192 else 16)


def _row_layout(x: torch.Tensor) -> Optional[Tuple[int, int, int]]:
    """How the kernel walks the rows of x (..., n) without a copy: (row stride, inner, inner
    stride), row r at (r // inner) * row stride + (r % inner) * inner stride. Leading dims that
    merge into one: inner = 1; else if all but the last merge (a (B, S, H, D) view of a slice of
    a fused q/k/v output, as Qwen3's q/k norms see it): two levels; else None (copy)."""
    n = x.shape[-1]
    if x.is_contiguous():
        return n, 1, 1
    dims = [(size, st) for size, st in zip(x.shape[:-1], x.stride()[:-1]) if size != 1]

    def merged(ds):  # the stride of ds merged into one dim, or None
        ok = all(st0 == st1 * s1 for (_, st0), (s1, st1) in zip(ds, ds[1:]))
        return (ds[-1][1] if ds else n) if ok else None

    outer = merged(dims)
    if outer is not None:
        return outer, 1, 1
    outer = merged(dims[:-1])
    return None if outer is None else (outer, *dims[-1])


def _run_kept(x: torch.Tensor, key: tuple, grid: tuple, operands: tuple, tail: tuple, make) -> None:
    """Launch a row kernel on operands + tail: through the plan kept under (key, x's device) when
    there is one (CUDA; runtime/plan.py run_steady), else through Triton's JIT with the (kernel,
    constexprs) make() returns (built only then: a steady call is the lookup and the launch),
    keeping the bound launch for the next call."""
    full = None
    if x.is_cuda:
        dev = x.get_device()
        full = (*key, dev)
        if run_steady(_RowPlans, full, dev, x, grid, operands, tail):
            return
    kernel, meta = make()
    launch = Launch(kernel, dict(meta, **as_dependent(x.get_device())), x.get_device())
    with device_of(x):
        launch(grid, *operands, *tail)
    keep(None if full is None else _RowPlans.plans, full, launch, *operands)


def _launch_rows(rms: bool, x: torch.Tensor, M: int, operands: tuple, n: int, eps: float, quant: Optional[str],
                 block_k: Optional[int]) -> None:
    """rowwise_kernel over the M > 0 rows of x (..., width) for n outputs each: operands (w, out,
    scales) after x, then M, n, x's row layout (_row_layout; a contiguous copy where it has none),
    eps; through the kept plan when there is one (CUDA)."""
    layout = _row_layout(x)
    if layout is None:
        x = x.contiguous()
        layout = (x.shape[-1], 1, 1)
    sxm, inner, sxi = layout
    if M == 1:  # one row: the kernel never steps over the strides, so any value does
        sxm, sxi = x.shape[-1], 1
    elif inner == 1:
        sxi = 1  # (unused: the same key and specialization whatever it was)
    meta = _tile(n, block_k)
    grid = (-(-M // meta["ROWS"]), 1)
    _run_kept(x, (rms, quant, x.dtype, n, sxm, inner, sxi, block_k), grid, (x, *operands), (M, n, sxm, inner, sxi, eps),
              lambda: (_kernel(), dict(meta, RMS=rms, QUANT=quant is not None, FP8=quant == "fp8",
                                       EMU_BF16=x.dtype is torch.bfloat16 and not x.is_cuda)))


def _outputs(x: torch.Tensor, M: int, n: int, shape, quant: Optional[str]):
    """(out, scales) for M rows of n outputs: codes (M, n) and float32 (M,) for the _quant
    forms, else x's dtype in `shape` and out itself as the (unused) scales operand."""
    if quant is not None:
        if quant == "fp8":
            check_fp8_device(x)
        return x.new_empty((M, n), dtype=CODE_DTYPES[quant]), x.new_empty((M,), dtype=torch.float32)
    out = x.new_empty(shape)
    return out, out


def rms_norm_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, quant: Optional[str] = None,
                    block_k: Optional[int] = None):
    """The RMSNorm kernel on checked operands: y (x's shape), or with quant "int8" / "fp8"
    (x_q (M, K) int8 / float8_e4m3fn, scales float32 (M,)). block_k: the chunk width (default:
    _tile's), for tests."""
    k = x.shape[-1]
    M = x.numel() // k
    out, scales = _outputs(x, M, k, x.shape, quant)
    if M:
        if k > 1 and weight.stride(0) != 1:
            weight = weight.contiguous()
        _launch_rows(True, x, M, (weight, out, scales), k, float(eps), quant, block_k)
    return out if quant is None else (out, scales)


def add_rms_norm_quant_launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              quant: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels/rowwise.add_rms_norm_quant_kernel on checked operands of a one-pass width (k <=
    ROW_ONE_PASS_MAX): (x + residual in x's shape, codes (M, K), scales float32 (M,)); x and
    residual read as contiguous rows (copied where they are not)."""
    k = x.shape[-1]
    M = x.numel() // k
    out, scales = _outputs(x, M, k, None, quant)
    h = x.new_empty(x.shape)
    if not M:
        return h, out, scales
    x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
    meta = _tile(k, None)
    grid = (-(-M // meta["ROWS"]), 1)
    _run_kept(x, ("add", quant, x.dtype, k), grid, (x, residual, weight, h, out, scales), (M, k, eps),
              lambda: (_kernel(add=True), dict(BLOCK_K=meta["BLOCK_K"], ROWS=meta["ROWS"], num_warps=meta["num_warps"],
                                               FP8=quant == "fp8",
                                               EMU_BF16=x.dtype is torch.bfloat16 and not x.is_cuda)))
    return h, out, scales


def _split(M: int, i: int, quant: Optional[str], block_k: Optional[int], split: Optional[bool]) -> bool:
    """Whether silu_mul_launch splits each row over programs: asked (split), or by default a
    quantizing call of at most SPLIT_ROWS_MAX rows with two SPLIT_BLOCK parts a row or more."""
    if split is not None:
        if split and quant is None:
            raise ValueError("split=True is the quantizing form's (quant 'int8' or 'fp8'), got quant=None")
        return split
    return quant is not None and block_k is None and 0 < M <= SPLIT_ROWS_MAX and i >= 2 * SPLIT_BLOCK


def _launch_split(gu: torch.Tensor, M: int, i: int, out: torch.Tensor, scales: torch.Tensor, quant: str,
                  block_k: Optional[int]) -> None:
    """silu_mul_quant_split_kernel over the M rows of gu (contiguous rows: a copy otherwise) in
    parts of block_k (default SPLIT_BLOCK) outputs, through the kept plan when there is one (CUDA);
    h (M, I) in gu's dtype and the parts' maxima are this call's workspace, the row counters the
    stream's (ops/common.sync_buffer)."""
    layout = _row_layout(gu)
    if layout is None or layout[1] != 1:
        gu = gu.contiguous()
        layout = (gu.shape[-1], 1, 1)
    sam = layout[0] if M > 1 else 2 * i
    bk = block_k if block_k is not None else SPLIT_BLOCK
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"block_k={bk} must be a power of two >= 16")
    if M > SYNC_CAP:
        raise ValueError(f"the split form takes at most {SYNC_CAP} rows (one counter each), got {M}")
    parts = -(-i // bk)
    width = next_pow2(parts)  # (the parts' maxima of a row, padded to a power of two)
    h = gu.new_empty((M, i))
    pam = gu.new_empty((M, width), dtype=torch.float32)
    sync = sync_buffer(gu.device, gu.get_device())
    grid = (M, parts)
    def make():
        block_q = min(max(16, next_pow2(i)), ROW_ONE_PASS_MAX)  # the last program's pass over the row
        return _kernel(split=True), dict(BLOCK_K=bk, PARTS=width, BLOCK_Q=block_q, FP8=quant == "fp8",
                                         EMU_BF16=gu.dtype is torch.bfloat16 and not gu.is_cuda,
                                         num_warps=max(_tile(bk, None)["num_warps"], _tile(block_q, None)["num_warps"]))

    _run_kept(gu, ("split", quant, gu.dtype, i, sam, bk), grid, (gu, h, pam, out, scales, sync), (M, i, sam), make)


def silu_mul_launch(gu: torch.Tensor, quant: Optional[str] = None, block_k: Optional[int] = None,
                    split: Optional[bool] = None):
    """The SiLU-and-multiply kernel on a checked gu: h (..., I), or with quant as
    rms_norm_launch's (h_q (M, I), scales float32 (M,)). block_k: as rms_norm_launch's (the
    split form's part width). split: each row over programs (the quantizing form only; default:
    _split's rule)."""
    i = gu.shape[-1] // 2
    M = gu.numel() // (2 * i)
    out, scales = _outputs(gu, M, i, (*gu.shape[:-1], i), quant)
    if M and _split(M, i, quant, block_k, split):
        _launch_split(gu, M, i, out, scales, quant, block_k)
    elif M:
        _launch_rows(False, gu, M, (gu, out, scales), i, 0.0, quant, block_k)  # (w, eps: unused)
    return out if quant is None else (out, scales)


# ----------------------------------------------------------------------------------
# torch.library ops (no derivative registered: inference ops)
# ----------------------------------------------------------------------------------
def rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: x (..., K) float16/bfloat16, weight (K,) of x's dtype, eps >= 0 -> y like x
    (contiguous), rms_norm_reference's numbers."""
    _check_rms(x, weight, eps)
    if use_triton(x):
        return rms_norm_launch(x, weight, eps)
    return rms_norm_reference(x, weight, eps).contiguous()


def rms_norm_quant_impl(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        act_dtype: str = "int8") -> Tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token(rms_norm(x, weight, eps)) in one launch: (x_q int8 (M, K), scales
    float32 (M,)), M the product of x's leading dims; act_dtype "fp8": quantize_per_token_fp8's
    float8_e4m3fn codes (sm_89+ on CUDA)."""
    _check_rms(x, weight, eps)
    check_act_dtype(act_dtype)
    if use_triton(x):
        return rms_norm_launch(x, weight, eps, quant=act_dtype)
    return rms_norm_quant_reference(x, weight, eps, act_dtype)


def rms_norm_quant_fp8_impl(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_quant_impl(x, weight, eps, "fp8")


def add_rms_norm_quant_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            act_dtype: str = "int8") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + residual, *rms_norm_quant(x + residual, weight, eps)) with the sum in x's shape: one
    launch where the row fits one pass (ROW_ONE_PASS_MAX), else the add and rms_norm_quant."""
    k = _check_add(x, residual, weight, eps)
    check_act_dtype(act_dtype)
    if use_triton(x) and k <= ROW_ONE_PASS_MAX:
        return add_rms_norm_quant_launch(x, residual, weight, float(eps), act_dtype)
    h = x + residual
    return (h, *rms_norm_quant_impl(h, weight, eps, act_dtype))


def add_rms_norm_quant_fp8_impl(x, residual, weight, eps):
    return add_rms_norm_quant_impl(x, residual, weight, eps, "fp8")


def silu_mul_impl(gu: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gu (..., 2I) float16/bfloat16 = [gate | up] -> h (..., I) (contiguous),
    silu_mul_reference's numbers."""
    _check_gu(gu)
    if use_triton(gu):
        return silu_mul_launch(gu)
    return silu_mul_reference(gu).contiguous()


def silu_mul_quant_impl(gu: torch.Tensor, act_dtype: str = "int8") -> Tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token(silu_mul(gu)) in one launch: (h_q int8 (M, I), scales float32 (M,));
    act_dtype "fp8": as rms_norm_quant_impl's."""
    _check_gu(gu)
    check_act_dtype(act_dtype)
    if use_triton(gu):
        return silu_mul_launch(gu, quant=act_dtype)
    return silu_mul_quant_reference(gu, act_dtype)


def silu_mul_quant_fp8_impl(gu: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return silu_mul_quant_impl(gu, "fp8")


def _quant_fake(x: torch.Tensor, n: int, act_dtype: str = "int8"):
    m = x.numel() // x.shape[-1]
    return x.new_empty((m, n), dtype=CODE_DTYPES[act_dtype]), x.new_empty((m,), dtype=torch.float32)


def _rms_norm_fake(x, weight, eps):
    _check_rms(x, weight, eps, fake=True)
    return x.new_empty(x.shape)


def _rms_norm_quant_fake(x, weight, eps, act_dtype="int8"):
    return _quant_fake(x, _check_rms(x, weight, eps, fake=True), act_dtype)


def _add_rms_norm_quant_fake(x, residual, weight, eps, act_dtype="int8"):
    return (x.new_empty(x.shape), *_quant_fake(x, _check_add(x, residual, weight, eps, fake=True), act_dtype))


def _silu_mul_fake(gu):
    return gu.new_empty((*gu.shape[:-1], _check_gu(gu, fake=True)))


def _silu_mul_quant_fake(gu, act_dtype="int8"):
    return _quant_fake(gu, _check_gu(gu, fake=True), act_dtype)


_RMS = "(Tensor x, Tensor weight, float eps)"
rms_norm = define_op("rms_norm", _RMS + " -> Tensor", rms_norm_impl, _rms_norm_fake)
rms_norm_quant = define_op("rms_norm_quant", _RMS + " -> (Tensor, Tensor)", rms_norm_quant_impl,
                           _rms_norm_quant_fake)
rms_norm_quant_fp8 = define_op("rms_norm_quant_fp8", _RMS + " -> (Tensor, Tensor)", rms_norm_quant_fp8_impl,
                               lambda x, weight, eps: _rms_norm_quant_fake(x, weight, eps, "fp8"))
_ADD = "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor, Tensor)"
add_rms_norm_quant = define_op("add_rms_norm_quant", _ADD, add_rms_norm_quant_impl, _add_rms_norm_quant_fake)
add_rms_norm_quant_fp8 = define_op("add_rms_norm_quant_fp8", _ADD, add_rms_norm_quant_fp8_impl,
                                   lambda x, residual, weight, eps: _add_rms_norm_quant_fake(x, residual, weight, eps,
                                                                                             "fp8"))
silu_mul = define_op("silu_mul", "(Tensor gu) -> Tensor", silu_mul_impl, _silu_mul_fake)
silu_mul_quant = define_op("silu_mul_quant", "(Tensor gu) -> (Tensor, Tensor)", silu_mul_quant_impl,
                           _silu_mul_quant_fake)
silu_mul_quant_fp8 = define_op("silu_mul_quant_fp8", "(Tensor gu) -> (Tensor, Tensor)", silu_mul_quant_fp8_impl,
                               lambda gu: _silu_mul_quant_fake(gu, "fp8"))
