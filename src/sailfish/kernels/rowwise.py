"""Row-wise kernels around the GEMMs: RMSNorm and SiLU-and-multiply, each alone or with the
W4A8 per-token int8 (or fp8) quantization of its output fused in (launchers, references and ops:
ops/rowwise.py).

Why: in a CUDA-graph decode step transformers' LlamaRMSNorm is ~8 tiny kernels and
`act_fn(gate) * up` two, each a few microseconds at batch 1; W4A8 then quantizes the result in
another launch. Here each is one launch, and the quantized forms hand the W4A8 GEMM its input.

Design (why):
- The numbers are eager PyTorch's, rounding for rounding: every value torch rounds to the
  activation dtype is rounded here too (`rounded`), computed in fp32 from fp32 operands. A
  product of two fp16 / bf16 values is exact in fp32, so `weight * h` and `a * up` rounded once
  are torch's half-precision multiplies bit for bit. What may differ: the order of the sum of
  squares (so the mean), and rsqrt / exp, which are the backend's (the interpreter's: numpy's
  1 / sqrt, as torch's CPU rsqrt; the GPU's approximate instructions, as torch's CUDA rsqrtf
  is). The mean's division is IEEE (div_rn), as torch's CPU `sum / K`.
- The fused quantizations quantize the kernel's own rounded output with the per-token
  quantizer's code (kernels/w4a8.py token_scale / quantize_scaled), so they give exactly
  quantize_per_token(rms_norm(x)) and quantize_per_token(silu_mul(gu)) (int8, or FP8: the
  float8 e4m3 quantize_per_token_fp8), NaN / Inf rows included (scale NaN, codes 0).
- One kernel for both (RMS constexpr). One program per ROWS rows (ROWS > 1 only for short rows,
  e.g. Qwen3's 128-wide q/k norms over many heads), the row in registers up to ops/rowwise.py
  ROW_ONE_PASS_MAX channels, chunks of BLOCK_K beyond (the sum / max pass, then the output
  pass, which recomputes each value with the same instructions, so the same bits).
- A few long rows with the quantization (W4A8's silu_mul_quant at decode batch sizes): each row
  over programs, the row's last program quantizing it (silu_mul_quant_split_kernel; its
  docstring says why and how it stays bit for bit the one-program kernel's).
- The launch goes through runtime/launch.py's Launch and runtime/plan.py's run_steady / keep
  (a steady call: one dict lookup and the direct launch), without a Tuner: the tile follows
  from the row width alone, so there is no config to choose.
- M is not specialized (do_not_specialize): the launcher keeps one bound kernel per
  (device, dtype, width, row layout) whatever the number of rows (runtime/launch.py); the
  usual one-level layout passes inner = 1, which Triton specializes away.
- bf16 under the interpreter: computed in fp32 and rounded with integer ops (EMU_BF16,
  kernels/common.py), loaded with w4a8.to_f32.
"""
import triton
import triton.language as tl

from .common import SYNC_TILES, cast_out, last_slice, pdl_wait, round_bf16_emu
from .w4a8 import abs_or_inf, quantize_scaled, to_f32, token_scale


@triton.jit
def rounded(v, DTYPE: tl.constexpr, EMU_BF16: tl.constexpr):
    """fp32 v -> fp32 holding v rounded to DTYPE (nearest even): torch's rounding of an op's
    fp32 result to a half-precision output."""
    if EMU_BF16:
        r = round_bf16_emu(v)
    else:
        r = v.to(DTYPE).to(tl.float32)
    return r


@triton.jit
def _load_tile(row_ptrs, cols, n, row_ok):
    """The (ROWS, BLOCK_K) tile at row_ptrs + cols as fp32 (0 outside the rows / columns),
    and its mask."""
    mask = row_ok[:, None] & (cols < n)
    return to_f32(tl.load(row_ptrs + cols, mask=mask, other=0.0)), mask


@triton.jit
def _rms_out(x, r, w, DTYPE: tl.constexpr, EMU_BF16: tl.constexpr):
    """LlamaRMSNorm's output from x, the row's rsqrt(mean(x^2) + eps) and the weight:
    weight * (x * r).to(dtype), each product rounded to the dtype."""
    return rounded(w * rounded(x * r, DTYPE, EMU_BF16), DTYPE, EMU_BF16)


@triton.jit
def _silu_mul_out(g, u, DTYPE: tl.constexpr, EMU_BF16: tl.constexpr):
    """F.silu(gate) * up as eager torch rounds it: silu = g / (1 + exp(-g)) in fp32, rounded,
    then the product, rounded."""
    a = rounded(tl.math.div_rn(g, 1.0 + tl.exp(-g)), DTYPE, EMU_BF16)
    return rounded(a * u, DTYPE, EMU_BF16)


@triton.jit
def _store_scales(amax, s_ptr, rows, row_ok, QMAX: tl.constexpr):
    """Per-row max |y| (abs_or_inf's) -> store the scales, return (bad, c, inv) per element."""
    bad, c, inv, scale = token_scale(amax, QMAX)
    tl.store(s_ptr + rows, scale, mask=row_ok)
    return bad[:, None], c[:, None], inv[:, None]


@triton.jit
def _inv_rms(ss, n, eps):
    """rsqrt(mean + eps) per row from the sum of squares ss (the mean an IEEE division)."""
    return tl.math.rsqrt(tl.math.div_rn(ss, tl.zeros_like(ss) + n) + eps)[:, None]


@triton.jit
def _chunk(a_rows, w_ptr, cols, k0, n, row_ok, r, RMS: tl.constexpr, DTYPE: tl.constexpr,
           EMU_BF16: tl.constexpr):
    """Output columns k0 + cols of each row, and their mask. RMS: the norm of a's row (x) with
    its r (_inv_rms) and the weight; else silu(a's first n columns) * its next n."""
    a, mask = _load_tile(a_rows + k0, cols, n - k0, row_ok)
    if RMS:
        y = _rms_out(a, r, to_f32(tl.load(w_ptr + k0 + cols, mask=k0 + cols < n, other=0.0)), DTYPE, EMU_BF16)
    else:
        u, _ = _load_tile(a_rows + n + k0, cols, n - k0, row_ok)
        y = _silu_mul_out(a, u, DTYPE, EMU_BF16)
    return y, mask


@triton.jit(do_not_specialize=["M"])
def rowwise_kernel(a_ptr, w_ptr, out_ptr, s_ptr, M, n, stride_am, inner, stride_ai, eps,
                   RMS: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, ONE_PASS: tl.constexpr,
                   QUANT: tl.constexpr, FP8: tl.constexpr, EMU_BF16: tl.constexpr, PDL: tl.constexpr = False):
    """a (M, *), row r at (r // inner) * stride_am + (r % inner) * stride_ai (inner = 1: rows
    stride_am apart; two levels: e.g. a (B, S, H, D) view of a fused q/k/v output, B * S
    outer rows stride_am apart, H inner ones stride_ai apart) -> out (M, n) contiguous in a's
    dtype: RMS, the RMSNorm of
    a (M, n) with weight w (n,) and eps; else silu(gate) * up with a = [gate | up] (M, 2n) (w and
    eps unused). QUANT: out the int8 codes (FP8: float8 e4m3) and s_ptr the float32 (M,) scales of
    quantize_per_token(out) (FP8: quantize_per_token_fp8) instead."""
    pdl_wait(PDL)  # (PDL: launched as a programmatic dependent of the kernel before it)
    DTYPE: tl.constexpr = a_ptr.dtype.element_ty
    QMAX: tl.constexpr = 448.0 if FP8 else 127.0
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    rows = rows.to(tl.int64)
    a_rows = a_ptr + ((rows // inner) * stride_am + (rows % inner) * stride_ai)[:, None]
    out_rows = out_ptr + rows[:, None] * n
    cols = tl.arange(0, BLOCK_K)[None, :]
    if ONE_PASS:  # the row stays in registers
        if RMS:
            x, mask = _load_tile(a_rows, cols, n, row_ok)
            r = _inv_rms(tl.sum(x * x, axis=1), n, eps)
            y = _rms_out(x, r, to_f32(tl.load(w_ptr + cols, mask=cols < n, other=0.0)), DTYPE, EMU_BF16)
        else:
            y, mask = _chunk(a_rows, w_ptr, cols, 0, n, row_ok, eps, RMS, DTYPE, EMU_BF16)
        if QUANT:
            bad, c, inv = _store_scales(tl.max(abs_or_inf(y), axis=1), s_ptr, rows, row_ok, QMAX)
            tl.store(out_rows + cols, quantize_scaled(y, bad, c, inv, FP8), mask=mask)
        else:
            tl.store(out_rows + cols, cast_out(y, DTYPE, EMU_BF16), mask=mask)
    else:  # (ROWS = 1) chunks: the sum of squares, the max for QUANT, then the output
        r = eps  # (unused without RMS)
        if RMS:
            acc = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, n, BLOCK_K):
                xk, _ = _load_tile(a_rows + k0, cols, n - k0, row_ok)
                acc += xk * xk
            r = _inv_rms(tl.sum(acc, axis=1), n, eps)
        if QUANT:
            amax = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, n, BLOCK_K):
                yk, _ = _chunk(a_rows, w_ptr, cols, k0, n, row_ok, r, RMS, DTYPE, EMU_BF16)
                amax = tl.maximum(amax, abs_or_inf(yk))
            bad, c, inv = _store_scales(tl.max(amax, axis=1), s_ptr, rows, row_ok, QMAX)
        for k0 in range(0, n, BLOCK_K):
            yk, mask = _chunk(a_rows, w_ptr, cols, k0, n, row_ok, r, RMS, DTYPE, EMU_BF16)
            if QUANT:
                tl.store(out_rows + k0 + cols, quantize_scaled(yk, bad, c, inv, FP8), mask=mask)
            else:
                tl.store(out_rows + k0 + cols, cast_out(yk, DTYPE, EMU_BF16), mask=mask)


@triton.jit(do_not_specialize=["M"])
def silu_mul_quant_split_kernel(a_ptr, h_ptr, pam_ptr, out_ptr, s_ptr, sync_ptr, M, n, stride_am,
                                BLOCK_K: tl.constexpr, PARTS: tl.constexpr, BLOCK_Q: tl.constexpr,
                                FP8: tl.constexpr, EMU_BF16: tl.constexpr, PDL: tl.constexpr = False):
    """rowwise_kernel's silu(gate) * up + quantization (QUANT, not RMS) for a few long rows, each
    split over programs: grid (M, cdiv(n, BLOCK_K)). Why: one program a row leaves all but M SMs
    idle, and a 14336-channel row's exp and IEEE divisions on one SM took 6.2 us at M = 16 (H100;
    this kernel 5.0 us, docs/perf_log.md v50). Program (row, part) computes its BLOCK_K outputs,
    stores them rounded to a's dtype in h (M, n) (the rounded values: exact) and their max |y|
    (abs_or_inf) in pam (M, PARTS), and counts itself in on the row's counter (sync_ptr from SYNC_TILES on, zero
    between launches; kernels/common.last_slice); the row's last program takes the row's maximum,
    stores the scale and quantizes the row from h, BLOCK_Q channels at a time (the whole row at
    once up to ops/rowwise.ROW_ONE_PASS_MAX, so the loads are in flight together), and puts the
    counter back to zero. The codes and scale are rowwise_kernel's bit for bit: the same rounded
    outputs, maximum (max is exact in any order) and token_scale / quantize_scaled."""
    pdl_wait(PDL)  # (PDL: launched as a programmatic dependent of the kernel before it)
    DTYPE: tl.constexpr = a_ptr.dtype.element_ty
    QMAX: tl.constexpr = 448.0 if FP8 else 127.0
    row = tl.program_id(0)
    part = tl.program_id(1)
    rows = row + tl.arange(0, 1)
    row_ok = rows < M
    rows = rows.to(tl.int64)
    a_rows = a_ptr + (rows * stride_am)[:, None]
    h_rows = h_ptr + (rows * n)[:, None]
    k0 = part * BLOCK_K
    cols = tl.arange(0, BLOCK_K)[None, :]
    y, mask = _chunk(a_rows, a_ptr, cols, k0, n, row_ok, 0.0, False, DTYPE, EMU_BF16)
    tl.store(h_rows + k0 + cols, cast_out(y, DTYPE, EMU_BF16), mask=mask)
    tl.store(pam_ptr + rows * PARTS + part, tl.max(abs_or_inf(y), axis=1))
    cnt = sync_ptr + SYNC_TILES + row
    if last_slice(cnt, tl.num_programs(1)):
        p = tl.arange(0, PARTS)[None, :]
        amax = tl.max(tl.load(pam_ptr + rows[:, None] * PARTS + p, mask=p < tl.num_programs(1), other=0.0,
                              cache_modifier=".cg"), axis=1)
        bad, c, inv = _store_scales(amax, s_ptr, rows, row_ok, QMAX)
        q = tl.arange(0, BLOCK_Q)[None, :]
        for k in range(0, n, BLOCK_Q):
            qmask = row_ok[:, None] & (k + q < n)
            hk = to_f32(tl.load(h_rows + k + q, mask=qmask, other=0.0, cache_modifier=".cg"))
            tl.store(out_ptr + (rows * n)[:, None] + k + q, quantize_scaled(hk, bad, c, inv, FP8), mask=qmask)
        tl.atomic_xchg(cnt, 0, sem="relaxed")


@triton.jit(do_not_specialize=["M"])
def add_rms_norm_quant_kernel(a_ptr, b_ptr, w_ptr, sum_ptr, out_ptr, s_ptr, M, n, eps, BLOCK_K: tl.constexpr,
                              ROWS: tl.constexpr, FP8: tl.constexpr, EMU_BF16: tl.constexpr,
                              PDL: tl.constexpr = False):
    """A decoder layer's residual add and the next W4A8 input's norm + quantization in one launch:
    sum = a + b (contiguous (M, n), rounded to a's dtype as torch's half-precision add rounds its
    fp32 result), stored in sum_ptr, and rowwise_kernel's RMS + QUANT of it (one pass: n <= BLOCK_K,
    the same tile, so the same sum of squares, codes and scales bit for bit). Why: under
    torch.compile the add is inductor's own launch before the opaque norm op (~1.8 us a launch at
    decode sizes on an H100); inductor.fold_residual_adds rewrites the graph to call this."""
    pdl_wait(PDL)  # (PDL: launched as a programmatic dependent of the kernel before it)
    DTYPE: tl.constexpr = a_ptr.dtype.element_ty
    QMAX: tl.constexpr = 448.0 if FP8 else 127.0
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    rows = rows.to(tl.int64)
    offs = (rows * n)[:, None]
    cols = tl.arange(0, BLOCK_K)[None, :]
    xa, mask = _load_tile(a_ptr + offs, cols, n, row_ok)
    xb, _ = _load_tile(b_ptr + offs, cols, n, row_ok)
    x = rounded(xa + xb, DTYPE, EMU_BF16)
    tl.store(sum_ptr + offs + cols, cast_out(x, DTYPE, EMU_BF16), mask=mask)
    r = _inv_rms(tl.sum(x * x, axis=1), n, eps)
    y = _rms_out(x, r, to_f32(tl.load(w_ptr + cols, mask=cols < n, other=0.0)), DTYPE, EMU_BF16)
    bad, c, inv = _store_scales(tl.max(abs_or_inf(y), axis=1), s_ptr, rows, row_ok, QMAX)
    tl.store(out_ptr + offs + cols, quantize_scaled(y, bad, c, inv, FP8), mask=mask)
