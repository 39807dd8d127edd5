"""Test helpers: tolerances, random 4-bit weights, act-order group indices, per-element
error bounds, compile checks in a child process."""
import os
import subprocess
import sys
from typing import Optional

import pytest
import torch

import sailfish

from sailfish.formats.int4 import QuantizedWeight, num_groups

# Relative Frobenius error ||y - ref|| / ||ref|| allowed between a kernel's output and
# the fp32 reference x.float() @ W_eff.T (+ bias), W_eff = layer.dequantize(). The
# kernels multiply by exactly W_eff, so the only differences are fp32 accumulation
# order (< 1e-4 relative) and the final rounding of y to the output dtype.
TOL = {
    # fp16 output rounding is at most u = 2**-11 ~ 4.9e-4 relative per element.
    torch.float16: 2e-3,
    # bf16 keeps 8 significant bits: round-to-nearest output rounding alone is up to
    # u = 2**-8 ~ 3.9e-3 relative per element (a correctly rounded result measured
    # 2.57e-3); fp32 accumulation-order differences add < 1e-4. Kernel bugs (a wrong
    # nibble, scale or group) give errors of 1e-2 and up.
    torch.bfloat16: 4e-3,
}

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.detach().float(), ref.detach().float()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def desc_act_g_idx(k: int, group_size: int, device=None) -> torch.Tensor:
    """GPTQ desc_act: columns are quantized in the order of a permutation `perm`, and
    the i-th column processed joins group i // group_size: g_idx[k] = perm_inv[k] // gs."""
    perm = torch.randperm(k, device=device)
    perm_inv = torch.empty_like(perm)
    perm_inv[perm] = torch.arange(k, device=device)
    return (perm_inv // group_size).to(torch.int32)


def general_g_idx(k: int, group_size: int, device=None) -> torch.Tensor:
    """A non-uniform g_idx: random group sizes, every group present."""
    g = num_groups(k, group_size)
    idx = torch.randint(0, g, (k,), device=device)
    idx[torch.randperm(k, device=device)[:g]] = torch.arange(g, device=device)
    return idx.to(torch.int32)


def make_g_idx(mode: str, k: int, group_size: int, device=None) -> Optional[torch.Tensor]:
    return {"none": lambda: None,
            "descact": lambda: desc_act_g_idx(k, group_size, device),
            "gidx": lambda: general_g_idx(k, group_size, device)}[mode]()


def random_quantized(k: int, n: int, group_size: int, sym: bool, dtype: torch.dtype,
                     g_idx: Optional[torch.Tensor] = None, device=None) -> QuantizedWeight:
    """Random codes, scales (both signs) and zero points in their full ranges."""
    g = num_groups(k, group_size)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
    scales = (torch.rand(g, n, device=device) * 0.02 + 0.002)
    scales = (scales * torch.where(torch.rand(g, n, device=device) < 0.1, -1.0, 1.0)).to(dtype)
    zeros = None if sym else torch.randint(0, 17, (g, n), dtype=torch.uint8, device=device)
    return QuantizedWeight(q, scales, zeros, g_idx, group_size)


def random_checkpoint_weight(k: int, n: int, group_size: int, sym: bool, dtype: torch.dtype,
                             g_idx: Optional[torch.Tensor] = None, device=None, min_zero: int = 1) -> QuantizedWeight:
    """random_quantized as checkpoints hold it: scales > 0, zero points in [min_zero, 15]
    (one nibble; GPTQ v1 needs min_zero=1)."""
    qw = random_quantized(k, n, group_size, sym, dtype, g_idx, device)
    qw.scales = qw.scales.abs()
    if qw.zeros is not None:
        qw.zeros = qw.zeros.clamp(min_zero, 15)
    return qw


# ----------------------------------------------------------------------------------
# Per-element error bound for a GEMM output y ~ x @ w.T (+ bias)
# ----------------------------------------------------------------------------------
# Unit roundoff u of each output dtype: a correctly rounded value is within u * |v| of v
# (half an ulp; p significant bits give u = 2**-p).
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}
# Half the smallest subnormal step of each output dtype: the absolute rounding error
# near zero, where the relative bound u * |v| no longer holds.
_HALF_TINY = {torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134, torch.float32: 2.0 ** -150}
U32 = 2.0 ** -24
# Sequential fp32 additions into one output's accumulator: the tensor-core paths add one
# k = 16 MMA (16 exact products) per step, K / 16 steps; the GEMV path adds one tree-summed
# K tile per step (fewer, plus log2(BLOCK_K) <= 10 tree levels); split-K adds at most a
# few dozen partial sums. ACC_STEPS_EXTRA covers the tree levels and the split-K reduce.
ACC_STEPS_EXTRA = 64


def accumulation_constant(k: int) -> float:
    """c_acc: the fp32 accumulation error of one output is at most c_acc * sum_k |x_k w_k|.

    Each of n = ceil(K / 16) + ACC_STEPS_EXTRA sequential fp32 additions changes the result
    by at most one ulp of a partial sum (round to nearest gives half an ulp; tensor cores
    truncate when they align the 16 products, up to one ulp), and every partial sum is at
    most sum_k |x_k w_k| in magnitude: c_acc = 2 * n * 2**-24 (one ulp <= 2u relative).
    A worst-case bound, so a correct kernel never exceeds it. Its resolution: for random
    data sum_k |x_k w_k| ~ sqrt(K) |ref|, so the term allows about 2e-3 |ref| at K = 4096
    (it rejects one row 1% off, and fp16 accumulation across K tiles of 128, which a
    correct fp32 kernel cannot produce) but about 3e-2 |ref| at K = 28672, where only
    the output-rounding term stays tight for outputs that are large against the products.
    """
    return 2 * (-(-k // 16) + ACC_STEPS_EXTRA) * U32


def elementwise_bound(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                      out_dtype: torch.dtype):
    """(ref, bound): the float64 product ref = x @ w.T (+ bias) over the last dim of x, and
    the largest |y - ref| a correct fp32-accumulating kernel with output dtype out_dtype
    can give per element:

        bound = (u_out + u32) * |ref| + (1 + u_out) * c_acc(K) * sum_k |x_k| |w_k| + tiny

    u_out |ref|: rounding the result once to the output dtype; u32 |ref|: the fp32 bias
    addition; c_acc (accumulation_constant): the fp32 accumulation, grown by the output
    rounding (1 + u_out); tiny: half a subnormal step of the output dtype.
    x (..., K) and w (N, K) must be the exact operands (w = layer.dequantize()).
    """
    k = x.shape[-1]
    xd, wd = x.detach().double().reshape(-1, k), w.detach().double().to(x.device)
    ref = xd @ wd.T
    if bias is not None:
        ref = ref + bias.detach().double()
    mag = xd.abs() @ wd.abs().T
    u = UNIT_ROUNDOFF[out_dtype]
    bound = (u + U32) * ref.abs() + (1 + u) * accumulation_constant(k) * mag + _HALF_TINY[out_dtype]
    shape = (*x.shape[:-1], w.shape[0])
    return ref.reshape(shape), bound.reshape(shape)


def check_per_element(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                      bias: Optional[torch.Tensor] = None) -> Optional[str]:
    """None if every element of y is within elementwise_bound of x @ w.T (+ bias), else a
    message naming how many are not and the worst one."""
    ref, bound = elementwise_bound(x, w, bias, y.dtype)
    err = (y.detach().double().to(ref.device) - ref).abs()
    bad = ~(err <= bound)  # NaN counts as bad
    if not bad.any():
        return None
    ratio = torch.where(bad, err / bound, torch.zeros_like(err)).nan_to_num(float("inf"))
    i = int(ratio.flatten().argmax())
    idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), ratio.shape))
    return (f"{int(bad.sum())} of {y.numel()} elements exceed the per-element bound; worst at "
            f"{idx}: y={y[idx].item()!r}, ref={ref[idx].item()!r}, |err|={err[idx].item():.3g} "
            f"> bound={bound[idx].item():.3g} ({ratio[idx].item():.3g}x)")


def assert_close_per_element(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                             bias: Optional[torch.Tensor] = None) -> None:
    """Assert each element of a kernel output y (dtype: its output dtype) is x @ w.T
    (+ bias) up to elementwise_bound."""
    msg = check_per_element(y, x, w, bias)
    assert msg is None, msg


def run_compile_child(code: str, tmp_path) -> None:
    """Run `code` in a fresh Python without TRITON_INTERPRET (this process's kernels are
    interpreted), compiling into tmp_path; it must exit 0 and print "checked"."""
    pytest.importorskip("triton.backends.nvidia")
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    src_dir = os.path.dirname(os.path.dirname(sailfish.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src_dir, env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "checked" in r.stdout, (r.stdout + r.stderr)[-3000:]


class StandInKernel:
    """A stand-in for a Gluon kernel (tests of the compile-failure fallback): launching it raises
    `error` (a CompilationError: a Triton whose Gluon the kernel does not compile with)."""

    params = None

    def __init__(self, error: Exception):
        self.error = error

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise self.error
        return launch


def incompatible_gluon() -> Exception:
    from triton.compiler.errors import CompilationError

    return CompilationError(None, None, "stand-in for an incompatible Gluon")


# the Gluon compile checks' K-loop verdict (prepended to their child scripts: tests/test_w4a16_gluon.py,
# tests/test_w4a8.py, tests/test_moe.py): ptxas serialization or spill, a wgmma register hazard, local memory in the loop
LOOP_PROBLEMS = r"""
from sailfish.tools.ptx import wgmma_register_hazard as _hazard


def loop_problems(rep, text, body):
    why = []
    if "serialized" in rep or re.search(r"\b[1-9][0-9]* bytes spill", rep):
        why.append(rep[-400:])
    if _hazard(text):
        why.append("wgmma register hazard")
    if any(t.startswith(("LDL", "STL")) for t in body):
        why.append("local memory in the K loop")
    return why

"""

# loop_problems and pipe_problems, for the pipe kernels' compile children
PIPE_PROBLEMS = LOOP_PROBLEMS + r"""

def pipe_problems(k, ring):
    '''The warp-specialized pipe kernels' checks on compiled kernel k (x rings of `ring` bytes):
    loop_problems, the K loop's A operand in registers with no shared-memory store or ldmatrix,
    waits 1 (a chunk in flight) and 0 only, the rings' shared memory plus Triton's < 1 KiB, 12
    warps with TMA and setmaxnreg. Returns (why, the SASS K loop).'''
    from sailfish.tools.ptx import k_loop_stats, ptxas_report, sass, wgmma_loop

    ptx = k.asm["ptx"]
    st = k_loop_stats(ptx)
    text = sass(k.asm["cubin"])
    body = wgmma_loop(text) or []
    why = loop_problems(ptxas_report(ptx), text, body)
    if st is None or st.st_shared or st.ldmatrix or not st.wgmma_a_in_registers:
        why.append(f"K loop {st}")
    waits = sorted(set(re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx)))
    if waits != ["0", "1"]:  # one chunk's wgmmas left in flight while the next is dequantized
        why.append(f"waits {waits}")
    if not ring <= k.metadata.shared < ring + 1024:
        why.append(f"shared memory {k.metadata.shared}, rings {ring}")
    if ".reqntid 384" not in ptx or "cp.async.bulk.tensor" not in ptx or "setmaxnreg" not in ptx:
        why.append("not the warp-specialized TMA kernel")
    return why, body
"""


def assert_compiles_to_eager_logits(model, ids, backend: str = "eager") -> None:
    """torch.compile(model, fullgraph=True) (a graph break raises) gives the eager model's logits
    on ids (no gradient); dynamo's caches are reset before and after."""
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            got = torch.compile(model, fullgraph=True, backend=backend)(ids).logits
            assert torch.equal(got, model(ids).logits)
    finally:
        torch._dynamo.reset()
