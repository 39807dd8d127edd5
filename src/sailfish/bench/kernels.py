"""Kernel registry for `python -m sailfish.bench`.

One benchmark row family is one `KernelSpec`: a kernel name (the JSON "kernel" field), a
configuration (the JSON "dtype" and "group_size" fields) and a builder. Several specs may
share a kernel name (sailfish-w4a16 has three configurations); `--kernels` selects by
name (all its configurations) or by spec id ("sailfish-w4a16/bf16/g128/asym").

group_size convention in rows: the quantization group along K; -1 = one group per
output channel (per-channel scales); 0 = not group-quantized (cuBLAS fp16/bf16, and the
W8A8 int8/fp8 rows, whose scales are per tensor or absent).

Builder contract
----------------
    builder(K: int, N: int, ctx: BuildContext) -> Built

is called once per (spec, shape) and owns the weights for every M of that shape:

* it makes one random weight (never zeros) and R distinct copies of it, with
  R = ctx.copies(bytes of one copy) (R * bytes >= 3 x L2 and R >= 2 on CUDA; 1 when no
  timing is done), so the timed graph streams each copy from HBM, not L2;
* `Built.case(M) -> Case` prepares one M: a random activation x and
    - `calls`: R zero-argument callables, calls[i]() runs the kernel once on copy i;
    - `check()`: relative Frobenius error ||y - ref|| / ||ref|| of calls[0]() against
      the kernel's *own* reference math (fp32), computed on the same inputs;
    - `tol`: the largest error accepted (the runner never times a kernel above it);
    - `min_bytes`: the fewest bytes the operation must move at this M (GB/s, roofline);
* raise `Skip(reason)` from the builder or from case() when a configuration is not
  supported (the rows are skipped with that reason; any other exception skips too);
* `Built.release()` (optional) frees what references alone would not.

Adding a kernel (e.g. sailfish-w4a8 or sailfish-w4a8-gemm):

    def build_sailfish_w4a8(K, N, ctx, *, group_size, dtype): ...  # returns Built
    register(KernelSpec("sailfish-w4a8", "fp16", 128, functools.partial(
        build_sailfish_w4a8, group_size=128, dtype=torch.float16),
        sym=True, ours=True, cpu=True, short="sf-w4a8 g128"))

`ours=True` makes a failed check a failed run (non-zero exit); `cpu=True` runs it in CPU
correctness mode (Triton interpreter). `available()` returns None or why the kernel
cannot run in this process (rows skipped with that reason, or silently absent from the
default selection when `optional=True`).
"""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from .timing import w4a16_min_bytes


class Skip(Exception):
    """This configuration is not supported here; the message says why."""


# ----------------------------------------------------------------------------------
# minimum bytes models (what the operation must read + write at the least)
# ----------------------------------------------------------------------------------
def half_min_bytes(m: int, k: int, n: int) -> int:
    """fp16/bf16 GEMM: weight, x and y, 2 bytes each."""
    return 2 * n * k + 2 * m * k + 2 * m * n


def int8_min_bytes(m: int, k: int, n: int) -> int:
    """W8A8 int8 GEMM with a 16-bit output: N*K + M*K + 2*M*N.

    torch._int_mm has no scales and writes int32 (4*M*N bytes); the model is that of the
    W8A8 layer it stands for (int8 in, fp16 out), so its roofline is comparable to the rest.
    """
    return n * k + m * k + 2 * m * n


def fp8_min_bytes(m: int, k: int, n: int) -> int:
    """W8A8 fp8 (e4m3) GEMM, bf16 output, two fp32 per-tensor scales."""
    return n * k + m * k + 2 * m * n + 8


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref||_F / ||ref||_F in fp32; inf when not finite or when ref is all zero."""
    y = y.float()
    ref = ref.float()
    den = ref.norm().item()
    num = (y - ref).norm().item()
    if not (math.isfinite(num) and math.isfinite(den)) or den == 0.0:
        return float("inf")
    return num / den


def tensor_bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


# ----------------------------------------------------------------------------------
# registry types
# ----------------------------------------------------------------------------------
@dataclass
class BuildContext:
    device: torch.device
    copies: Callable[[int], int]          # bytes of one weight copy -> R
    seed: int = 0


@dataclass
class Case:
    calls: List[Callable[[], Any]]
    check: Callable[[], float]
    tol: float
    min_bytes: int


@dataclass
class Built:
    case: Callable[[int], Case]
    copies: int
    weight_bytes: int                     # bytes of one copy
    release: Callable[[], None] = lambda: None
    note: str = ""                        # e.g. which packing convention was detected


@dataclass
class KernelSpec:
    kernel: str                           # JSON "kernel"
    dtype: str                            # JSON "dtype": fp16 | bf16 | int8 | fp8
    group_size: int                       # JSON "group_size" (see module doc)
    builder: Callable[[int, int, BuildContext], Built]
    sym: bool = True
    ours: bool = False                    # a Sailfish kernel: a failed check fails the run
    cpu: bool = False                     # runs in CPU correctness mode (Triton interpreter)
    optional: bool = False                # absent from the default set when unavailable
    available: Callable[[], Optional[str]] = lambda: None
    short: str = ""                       # column label in the summary table
    baseline: bool = False                # the cuBLAS fp16 row speedups are measured against

    @property
    def id(self) -> str:
        gs = "chan" if self.group_size == -1 else (f"g{self.group_size}" if self.group_size else "")
        parts = [self.kernel, self.dtype] + ([gs] if gs else [])
        if self.group_size and not self.sym:
            parts.append("asym")
        return "/".join(parts)

    @property
    def label(self) -> str:
        return self.short or self.id


REGISTRY: Dict[str, KernelSpec] = {}      # spec id -> spec, in registration (= run) order


def register(spec: KernelSpec) -> KernelSpec:
    if spec.id in REGISTRY:
        raise ValueError(f"kernel spec {spec.id} is already registered")
    REGISTRY[spec.id] = spec
    return spec


def kernel_names() -> List[str]:
    return list(dict.fromkeys(s.kernel for s in REGISTRY.values()))


def select(names: Optional[List[str]]) -> List[KernelSpec]:
    """Specs for --kernels (names or spec ids); None = every registered spec."""
    if names is None:
        return list(REGISTRY.values())
    out: List[KernelSpec] = []
    for name in names:
        hits = [s for s in REGISTRY.values() if name in (s.kernel, s.id)]
        if not hits:
            raise ValueError(f"unknown kernel {name!r}; known: {', '.join(kernel_names())} "
                             f"(or a spec id: {', '.join(REGISTRY)})")
        out += [s for s in hits if s not in out]
    return out


# ----------------------------------------------------------------------------------
# builders
# ----------------------------------------------------------------------------------
def _gen(ctx: BuildContext, salt: int = 0) -> torch.Generator:
    g = torch.Generator(device=ctx.device)
    g.manual_seed(ctx.seed * 1000003 + salt)
    return g


def build_sailfish_w4a16(k: int, n: int, ctx: BuildContext, *, group_size: int, sym: bool,
                         dtype: torch.dtype) -> Built:
    """QuantLinear (RTN-quantized random nn.Linear); reference x.float() @ dequantize().T."""
    from ..nn import QuantLinear, check_shape

    err = check_shape(k, n)
    if err:
        raise Skip(err)
    torch.manual_seed(ctx.seed + k * 7 + n)
    lin = torch.nn.Linear(k, n, bias=False, dtype=dtype, device=ctx.device)  # kaiming-uniform
    base = QuantLinear.from_linear(lin, group_size=group_size, sym=sym)
    del lin
    nbytes = tensor_bytes(*base.buffers())
    r = ctx.copies(nbytes)
    layers = [base] + [copy.deepcopy(base) for _ in range(r - 1)]
    w_ref = base.dequantize()                 # fp32 (N, K): exactly what the kernel multiplies by
    tol = 3e-3 if dtype == torch.float16 else 5e-3
    gen = _gen(ctx, 1)

    def case(m: int) -> Case:
        x = torch.randn(m, k, dtype=dtype, device=ctx.device, generator=gen)
        return Case(calls=[functools.partial(layer, x) for layer in layers],
                    check=lambda: rel_err(layers[0](x), x.float() @ w_ref.T),
                    tol=tol, min_bytes=w4a16_min_bytes(m, k, n, group_size, zeros=not sym))

    return Built(case, r, nbytes)


def build_cublas_half(k: int, n: int, ctx: BuildContext, *, dtype: torch.dtype) -> Built:
    """F.linear with a dense fp16/bf16 weight; reference fp32 x @ w.T."""
    gen = _gen(ctx, 2)
    w0 = torch.randn(n, k, dtype=dtype, device=ctx.device, generator=gen).mul_(k ** -0.5)
    r = ctx.copies(tensor_bytes(w0))
    ws = [w0] + [w0.clone() for _ in range(r - 1)]
    w_ref = w0.float()
    tol = 3e-3 if dtype == torch.float16 else 5e-3

    def case(m: int) -> Case:
        x = torch.randn(m, k, dtype=dtype, device=ctx.device, generator=gen)
        lin = torch.nn.functional.linear
        return Case(calls=[functools.partial(lin, x, w) for w in ws],
                    check=lambda: rel_err(lin(x, ws[0]), x.float() @ w_ref.T),
                    tol=tol, min_bytes=half_min_bytes(m, k, n))

    return Built(case, r, tensor_bytes(w0))


def build_cublas_int8(k: int, n: int, ctx: BuildContext) -> Built:
    """torch._int_mm: int8 x (M, K) times int8 w.t() (column-major (K, N)) -> int32."""
    if not hasattr(torch, "_int_mm"):
        raise Skip("torch._int_mm is not available in this torch")
    gen = _gen(ctx, 3)
    w0 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=ctx.device, generator=gen)
    r = ctx.copies(tensor_bytes(w0))
    ws = [w0] + [w0.clone() for _ in range(r - 1)]
    w_ref = w0.float()

    def case(m: int) -> Case:
        x = torch.randint(-128, 128, (m, k), dtype=torch.int8, device=ctx.device, generator=gen)
        try:
            torch._int_mm(x, ws[0].t())
        except Exception as e:  # noqa: BLE001 - e.g. "self.size(0) needs to be greater than 16"
            raise Skip(f"torch._int_mm refuses M={m}: {_short(e)}") from None
        return Case(calls=[functools.partial(torch._int_mm, x, w.t()) for w in ws],
                    check=lambda: rel_err(torch._int_mm(x, ws[0].t()), x.float() @ w_ref.T),
                    tol=1e-4, min_bytes=int8_min_bytes(m, k, n))

    return Built(case, r, tensor_bytes(w0))


def w4a8_min_bytes(m: int, k: int, n: int, group_size: int, quantize: bool) -> int:
    """W4A8: 4-bit weights + fp32 channel scales (+ fp16 group scales), fp16 output; the
    activations are read as fp16 when the row includes their quantization, else as int8
    plus one fp32 scale per token."""
    groups = 0 if group_size == -1 else -(-k // group_size)
    act = 2 * m * k if quantize else m * k + 4 * m
    return n * k // 2 + 4 * n + 2 * n * groups + act + 2 * m * n


def build_sailfish_w4a8(k: int, n: int, ctx: BuildContext, *, group_size: int, dtype: torch.dtype,
                        quantize: bool) -> Built:
    """QuantLinearW4A8 (QQQ weights, per-token int8 activations). quantize=True times the
    whole layer (activation quantization included), False only the GEMM on pre-quantized
    x. Reference: (s_tok * x_q) @ dequantize().T in fp32, on the kernel's own x_q."""
    from ..nn import QuantLinear, check_shape

    err = check_shape(k, n)
    if err:
        raise Skip(err)
    torch.manual_seed(ctx.seed + k * 11 + n)
    lin = torch.nn.Linear(k, n, bias=False, dtype=dtype, device=ctx.device)
    base = QuantLinear.from_linear(lin, act_bits=8, group_size=group_size)
    del lin
    nbytes = tensor_bytes(*base.buffers())
    r = ctx.copies(nbytes)
    layers = [base] + [copy.deepcopy(base) for _ in range(r - 1)]
    w_ref = base.dequantize()
    tol = 3e-3 if dtype == torch.float16 else 5e-3
    gen = _gen(ctx, 5)

    def case(m: int) -> Case:
        x = torch.randn(m, k, dtype=dtype, device=ctx.device, generator=gen)
        x_q, x_s = base.quantize_input(x)
        ref = (x_s[:, None] * x_q.float()) @ w_ref.T
        if quantize:
            calls = [functools.partial(layer, x) for layer in layers]
        else:
            calls = [functools.partial(layer.forward_quantized, x_q, x_s, dtype) for layer in layers]
        return Case(calls=calls, check=lambda: rel_err(calls[0](), ref), tol=tol,
                    min_bytes=w4a8_min_bytes(m, k, n, group_size, quantize))

    return Built(case, r, nbytes)


def _scaled_mm(a, b, sa, sb):
    out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    return out[0] if isinstance(out, tuple) else out  # torch <= 2.4 returned (out, amax)


def build_cublas_fp8(k: int, n: int, ctx: BuildContext) -> Built:
    """torch._scaled_mm: e4m3 x (M, K) row-major times e4m3 w.t() (column-major), fp32
    per-tensor scales, bf16 out; reference (x8 @ w8.T) * sa * sb in fp32."""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        raise Skip("torch._scaled_mm / float8_e4m3fn are not available in this torch")
    gen = _gen(ctx, 4)
    w0 = torch.randn(n, k, device=ctx.device, generator=gen).to(torch.float8_e4m3fn)
    r = ctx.copies(tensor_bytes(w0))
    ws = [w0] + [w0.clone() for _ in range(r - 1)]
    w_ref = w0.float()
    sa = torch.tensor(0.5 / math.sqrt(k), dtype=torch.float32, device=ctx.device)
    sb = torch.tensor(0.25, dtype=torch.float32, device=ctx.device)

    def case(m: int) -> Case:
        x = torch.randn(m, k, device=ctx.device, generator=gen).to(torch.float8_e4m3fn)
        try:
            _scaled_mm(x, ws[0].t(), sa, sb)
        except Exception as e:  # noqa: BLE001 - e.g. M not a multiple of 16 on some versions
            raise Skip(f"torch._scaled_mm refuses M={m}: {_short(e)}") from None
        return Case(calls=[functools.partial(_scaled_mm, x, w.t(), sa, sb) for w in ws],
                    check=lambda: rel_err(_scaled_mm(x, ws[0].t(), sa, sb),
                                          (x.float() @ w_ref.T) * (sa * sb)),
                    tol=1e-2, min_bytes=fp8_min_bytes(m, k, n))

    return Built(case, r, tensor_bytes(w0))


def _tinygemm_packings(q: torch.Tensor, inner_k_tiles: int):
    """Candidate packed weights, newest torch convention first (checked against the
    reference before use): uint8 (N, K/2) high nibble = even k (torch >= 2.5 on CUDA);
    the same with the nibbles swapped; int32 (N, K) codes (torch <= 2.4)."""
    conv = torch._convert_weight_to_int4pack
    qi = q.to(torch.int32)
    yield "uint8 (N,K/2) hi=even k", lambda: conv(((qi[:, ::2] << 4) | qi[:, 1::2]).to(torch.uint8).contiguous(), inner_k_tiles)
    yield "uint8 (N,K/2) lo=even k", lambda: conv(((qi[:, 1::2] << 4) | qi[:, ::2]).to(torch.uint8).contiguous(), inner_k_tiles)
    yield "int32 (N,K)", lambda: conv(qi.contiguous(), inner_k_tiles)


def build_tinygemm(k: int, n: int, ctx: BuildContext, *, group_size: int = 128,
                   inner_k_tiles: int = 8) -> Built:
    """torch._weight_int4pack_mm (bf16): W[n, k] = (q - 8) * s[g, n] + z[g, n];
    qScaleAndZeros (K/g, N, 2) bf16. Reference: x.float() @ W.T with W in fp32."""
    if ctx.device.type != "cuda":
        raise Skip("tinygemm runs on CUDA only")
    if not (hasattr(torch, "_weight_int4pack_mm") and hasattr(torch, "_convert_weight_to_int4pack")):
        raise Skip("torch._weight_int4pack_mm / _convert_weight_to_int4pack are not available")
    if k % group_size or k % (inner_k_tiles * 16) or n % 8:
        raise Skip(f"tinygemm needs K % {group_size} == 0, K % {inner_k_tiles * 16} == 0, N % 8 == 0")
    gen = _gen(ctx, 5)
    dev = ctx.device
    groups = k // group_size
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=dev, generator=gen)
    s = (torch.rand(groups, n, device=dev, generator=gen) * 0.02 + 0.01).to(torch.bfloat16)
    z = (torch.randn(groups, n, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    sz = torch.stack([s, z], dim=-1).contiguous()                     # (K/g, N, 2)
    gidx = torch.arange(k, device=dev) // group_size
    w_ref = (q.float() - 8) * s.float()[gidx].T + z.float()[gidx].T   # (N, K) fp32
    probe = torch.randn(8, k, dtype=torch.bfloat16, device=dev, generator=gen)
    ref_probe = probe.float() @ w_ref.T
    packed, fmt, errors = None, "", []
    for name, make in _tinygemm_packings(q, inner_k_tiles):
        try:
            cand = make()
            e = rel_err(torch._weight_int4pack_mm(probe, cand, group_size, sz), ref_probe)
        except Exception as ex:  # noqa: BLE001
            errors.append(f"{name}: {_short(ex)}")
            continue
        if e < 1e-2:
            packed, fmt = cand, name
            break
        errors.append(f"{name}: err={e:.2e}")
    del q, probe, ref_probe
    if packed is None:
        raise Skip("no int4pack convention matched the reference: " + "; ".join(errors))
    nbytes = tensor_bytes(packed, sz)
    r = ctx.copies(nbytes)
    weights = [(packed, sz)] + [(packed.clone(), sz.clone()) for _ in range(r - 1)]
    mm = torch._weight_int4pack_mm

    def case(m: int) -> Case:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev, generator=gen)
        return Case(calls=[functools.partial(mm, x, w, group_size, c) for w, c in weights],
                    check=lambda: rel_err(mm(x, weights[0][0], group_size, weights[0][1]), x.float() @ w_ref.T),
                    tol=1e-2, min_bytes=w4a16_min_bytes(m, k, n, group_size, zeros=True))

    return Built(case, r, nbytes, note=f"packing: {fmt}")


def marlin_available() -> Optional[str]:
    """None when a built `marlin_cuda` extension (IST-DASLab/marlin, built from its public
    source; never shipped with Sailfish) is importable, from sys.path or from the folder
    named by MARLIN_BUILD_DIR; else why not."""
    import os
    import sys

    d = os.environ.get("MARLIN_BUILD_DIR")
    if d and d not in sys.path:
        sys.path.insert(0, d)
    try:
        import marlin_cuda  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"marlin_cuda is not importable ({_short(e)}); build it and set MARLIN_BUILD_DIR"
    return None


MARLIN_MAX_PAR = 16  # Marlin's default: at most 16 x 4 x 16 = 1024 rows per launch slice


def build_marlin(k: int, n: int, ctx: BuildContext, *, group_size: int = 128) -> Built:
    """Marlin W4A16 (fp16, symmetric, g128), for the same-run comparison of issue 8.

    Marlin's packed layout is its own (an offline permutation for its mma.sync fragments); the
    bench does not re-implement its packer. The weight is random packed words with random
    scales (Marlin's speed does not depend on the values), and the check compares Marlin's
    output with x @ W_eff in fp32, where W_eff is the weight Marlin itself decodes, read back
    by multiplying the K x K identity (each row of the identity selects one row of W^T, and
    the fp16 output holds that dequantized weight exactly). That catches wrong results at
    the timed M (split/reduction bugs, races), not a wrong packing, which Marlin owns.
    Tolerance 1e-2, as for the other peers: Marlin adds its K slices in fp16 through global
    memory, measured 2.8e-4 (8192x10240) to 6.5e-3 (28672x8192) on an H200."""
    if ctx.device.type != "cuda":
        raise Skip("Marlin runs on CUDA only")
    if marlin_available():
        raise Skip(marlin_available())
    import marlin_cuda

    if group_size != 128 or k % 128 or n % 256:
        raise Skip("Marlin here: group_size 128, K % 128 == 0, N % 256 == 0")
    gen = _gen(ctx, 7)
    dev = ctx.device
    words = torch.randint(-2**31, 2**31 - 1, (k // 16, n * 16 // 8), dtype=torch.int32, device=dev, generator=gen)
    s = ((torch.rand(k // group_size, n, device=dev, generator=gen) + 0.5) * 0.01).half()
    ws = torch.zeros(n // 128 * MARLIN_MAX_PAR, dtype=torch.int32, device=dev)

    def mul(x, b, sc, out):
        marlin_cuda.mul(x, b, out, sc, ws, -1, -1, -1, MARLIN_MAX_PAR)
        return out

    eye = torch.eye(k, dtype=torch.float16, device=dev)
    w_eff_t = mul(eye, words, s, torch.empty(k, n, dtype=torch.float16, device=dev)).float()  # (K, N)
    del eye
    nbytes = tensor_bytes(words, s)
    r = ctx.copies(nbytes)
    weights = [(words, s)] + [(words.clone(), s.clone()) for _ in range(r - 1)]

    def case(m: int) -> Case:
        x = torch.randn(m, k, dtype=torch.float16, device=dev, generator=gen)
        outs = [torch.empty(m, n, dtype=torch.float16, device=dev) for _ in weights]
        return Case(calls=[functools.partial(mul, x, b, sc, o) for (b, sc), o in zip(weights, outs)],
                    check=lambda: rel_err(mul(x, words, s, outs[0]), x.float() @ w_eff_t),
                    tol=1e-2, min_bytes=w4a16_min_bytes(m, k, n, group_size))

    return Built(case, r, nbytes, note="random packed weight; reference: the weight Marlin decodes")


def gemlite_available() -> Optional[str]:
    try:
        import gemlite  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"gemlite is not importable ({_short(e)})"
    return None


def build_gemlite(k: int, n: int, ctx: BuildContext, *, group_size: int = 128) -> Built:
    """GemLite A16W4, fp16, asymmetric (HQQ format): W = (q - z) * s, s/z (N, K/g) fp16.
    Best-effort use of its public API (GemLiteLinear(...).pack(W_q, scales, zeros, bias))."""
    if ctx.device.type != "cuda":
        raise Skip("gemlite runs on CUDA only")
    import gemlite
    from gemlite.core import DType, GemLiteLinear

    _gemlite_load_configs(gemlite)
    gen = _gen(ctx, 6)
    dev = ctx.device
    groups = k // group_size
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=dev, generator=gen)
    s = (torch.rand(n, groups, device=dev, generator=gen) * 0.02 + 0.01).half()
    z = (torch.rand(n, groups, device=dev, generator=gen) * 15).half()
    gidx = torch.arange(k, device=dev) // group_size
    w_ref = (q.float() - z.float()[:, gidx]) * s.float()[:, gidx]

    def make():
        lin = GemLiteLinear(4, group_size=group_size, in_features=k, out_features=n,
                            input_dtype=DType.FP16, output_dtype=DType.FP16)
        lin.pack(q, s, z, None)
        return lin

    base = make()
    nbytes = tensor_bytes(*base.parameters(), *base.buffers()) or (n * k // 2 + 4 * n * groups)
    r = ctx.copies(nbytes)
    layers = [base]
    for _ in range(r - 1):
        try:
            layers.append(copy.deepcopy(base))
        except Exception:  # noqa: BLE001 - fall back to packing again
            layers.append(make())

    def case(m: int) -> Case:
        x = torch.randn(m, k, dtype=torch.float16, device=dev, generator=gen)
        return Case(calls=[functools.partial(layer, x) for layer in layers],
                    check=lambda: rel_err(layers[0](x), x.float() @ w_ref.T),
                    tol=1e-2, min_bytes=w4a16_min_bytes(m, k, n, group_size, zeros=True))

    return Built(case, r, nbytes, note=f"gemlite {getattr(gemlite, '__version__', '?')}")


def _gemlite_load_configs(gemlite) -> None:
    """GemLite picks its shipped config by device-name tag; an H200 has none, so use the
    H100 one there."""
    import os
    try:
        name = torch.cuda.get_device_properties(0).name.lower()
        root = os.path.join(os.path.dirname(gemlite.__file__), "configs")
        tags = [f[:-5] for f in os.listdir(root) if f.endswith(".json")]
        if not any(t in name.replace(" ", "_") for t in tags) and "h200" in name and "h100" in tags:
            gemlite.load_config(os.path.join(root, "h100.json"))
    except Exception:  # noqa: BLE001 - configs are an optimisation only
        pass


def _short(e: BaseException, n: int = 160) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:n]}"


# ----------------------------------------------------------------------------------
# the registry (run order within a shape; the cuBLAS fp16 baseline always runs first)
# ----------------------------------------------------------------------------------
register(KernelSpec("cublas-fp16", "fp16", 0, functools.partial(build_cublas_half, dtype=torch.float16),
                    short="cublas fp16", baseline=True))
register(KernelSpec("sailfish-w4a16", "fp16", 128,
                    functools.partial(build_sailfish_w4a16, group_size=128, sym=True, dtype=torch.float16),
                    sym=True, ours=True, cpu=True, short="sf g128 fp16"))
register(KernelSpec("sailfish-w4a16", "bf16", 128,
                    functools.partial(build_sailfish_w4a16, group_size=128, sym=False, dtype=torch.bfloat16),
                    sym=False, ours=True, cpu=True, short="sf g128 bf16 asym"))
register(KernelSpec("sailfish-w4a16", "fp16", -1,
                    functools.partial(build_sailfish_w4a16, group_size=-1, sym=True, dtype=torch.float16),
                    sym=True, ours=True, cpu=True, short="sf chan fp16"))
register(KernelSpec("cublas-bf16", "bf16", 0, functools.partial(build_cublas_half, dtype=torch.bfloat16),
                    short="cublas bf16"))
register(KernelSpec("tinygemm", "bf16", 128, build_tinygemm, sym=False, short="tinygemm"))
register(KernelSpec("marlin", "fp16", 128, build_marlin, sym=True, optional=True,
                    available=marlin_available, short="marlin"))
register(KernelSpec("gemlite", "fp16", 128, build_gemlite, sym=False, optional=True,
                    available=gemlite_available, short="gemlite"))
for _gs, _short_gs in ((128, "g128"), (-1, "chan")):
    register(KernelSpec("sailfish-w4a8", "fp16", _gs, functools.partial(
        build_sailfish_w4a8, group_size=_gs, dtype=torch.float16, quantize=True),
        sym=True, ours=True, cpu=True, short=f"sf w4a8 {_short_gs}"))
    register(KernelSpec("sailfish-w4a8-gemm", "fp16", _gs, functools.partial(
        build_sailfish_w4a8, group_size=_gs, dtype=torch.float16, quantize=False),
        sym=True, ours=True, cpu=True, short=f"sf w4a8-gemm {_short_gs}"))
register(KernelSpec("cublas-int8", "int8", 0, build_cublas_int8, short="int8 cublas"))
register(KernelSpec("cublas-fp8", "fp8", 0, build_cublas_fp8, short="fp8 cublas"))

BASELINE_ID = "cublas-fp16/fp16"
