"""W4A8 (QQQ): per-token int8 activation quantization, the int8 x int4 GEMM and the layer.

References: the activation quantizer and the int8 weight are compared exactly with
formats/qqq.py; the int32 accumulator exactly with the integer product; the layer with
y_ref = s_tok[m] * (x_q @ w8^T)[m, n] * s_ch[n] + bias[n] in float64, where only the
output rounding differs (tests/helpers.TOL). On CPU the kernels run in Triton's
interpreter (tests/conftest.py), on CUDA on the GPU.
"""
import os
import subprocess
import sys
import warnings

import pytest
import torch

import sailfish

from helpers import DTYPE_NAMES, PIPE_PROBLEMS, TOL, StandInKernel, incompatible_gluon, rel_err, run_compile_child
from sailfish.runtime.flags import FLAGS
from sailfish import Config, QuantLinear, QuantLinearW4A8, quantize_model
from sailfish.formats.nibbles import pack_nibbles
from sailfish.formats.qqq import (QQQWeight, codes_to_int8, natural_to_fragment_order_w4a8,
                                  num_groups_w4a8, pack_codes, pack_qqq, quantize_activations,
                                  quantize_qqq, unpack_codes, unpack_qqq)
from sailfish.ops import use_triton
from sailfish.ops.w4a8 import group_scales_in_range, quantize_per_token_launch, w4a8_launch, w4a8_reference

F16, BF16 = torch.float16, torch.bfloat16
# Frobenius bounds against the float64 reference. Every output element is that reference
# rounded once to the output dtype (plus float32 epilogue error ~1e-7), so its relative
# error is at most the unit roundoff u: fp16 2**-11 (helpers.TOL's 2e-3 has room); bf16
# has 8 significant bits, u = 2**-8 ~ 3.9e-3 (helpers.TOL's 4e-3 is this bound rounded up;
# a correctly rounded result measured 2.57e-3 at M=1, N=200, past the 2.5e-3 TOL once had).
# assert_rounded() below checks the tight per-element version of the same statement.
TOL_W4A8 = {F16: TOL[F16], BF16: 2.0 ** -8}


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch):
    """On CUDA, take the shipped table or the heuristic instead of benchmarking ~10 configs
    per new shape (minutes of compilation); the explicit-config tests cover every path."""
    monkeypatch.setenv("SAILFISH_AUTOTUNE", "0")


def random_qqq(k, n, group_size, device, s_g_max=127 / 8):
    """Random codes over [0, 15], channel scales of both signs, group scales over (0, s_g_max]."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
    s_ch = (torch.rand(n, device=device) * 0.01 + 1e-3) * torch.where(
        torch.rand(n, device=device) < 0.1, -1.0, 1.0)
    s_g = None
    if group_size != -1:
        g = num_groups_w4a8(k, group_size)
        s_g = (torch.rand(g, n, device=device) * s_g_max).clamp_min(0.01).half()
    return QQQWeight(q, s_ch, s_g, group_size)


def random_layer(k, n, gs, bias, device, **kw):
    b = torch.randn(n, device=device) if bias else None
    return QuantLinearW4A8.from_quantized(random_qqq(k, n, gs, device, **kw), b)


def layer_reference(layer, x):
    """float64 y_ref from the per-token int8 x (formats reference) and the layer's w8."""
    x_q, s_tok = quantize_activations(x.reshape(-1, layer.in_features))
    acc = x_q.double() @ layer.int8_weight().double().T
    y = s_tok.double()[:, None] * acc * layer.s_ch.double()[None, :]
    if layer.bias is not None:
        y = y + layer.bias.double()
    return y.reshape(*x.shape[:-1], layer.out_features)


def assert_rounded(y, ref, bias=None):
    """Each y element is the float64 reference rounded to y's dtype: within half an ulp,
    plus float32 slack for the epilogue (relative to the terms, which the bias may cancel)."""
    p, emin = {F16: (11, -14), BF16: (8, -126)}[y.dtype]
    ref = ref.double()
    _, e = torch.frexp(ref)  # |ref| in [2**(e-1), 2**e)
    ulp = torch.ldexp(torch.ones_like(ref), (e - p).clamp_min(emin - p + 1))
    terms = ref.abs() + (0 if bias is None else 2 * bias.double().abs())
    bad = (y.double() - ref).abs() > 0.5 * ulp + 1e-6 * terms
    assert not bad.any(), f"{int(bad.sum())} elements off by more than half an ulp"


def test_kernels_are_used(device):
    assert use_triton(torch.empty(1, device=device))


# ----------------------------------------------------------------------------------
# activation quantization
# ----------------------------------------------------------------------------------
def special_rows(k, dtype, device):
    """Rows with everything that can go wrong: random, zero, tiny, huge, a single value."""
    rows = [torch.randn(k), torch.zeros(k), torch.randn(k) * 1e-6, torch.randn(k) * 1e-7,
            torch.randn(k) * 1e4, torch.zeros(k)]
    rows[-1][k // 2] = -3.0  # one non-zero value: quantizes to -127
    if dtype == F16:
        rows.append(torch.randn(k) * 2.0**-20)  # fp16 subnormals only
        rows.append(torch.full((k,), 65504.0) * torch.sign(torch.randn(k)))
    else:
        rows.append(torch.randn(k) * 1e-38)      # bf16 subnormals (amax < 2**-60 path)
        rows.append(torch.randn(k) * 2.0**-130)
        rows.append(torch.randn(k) * 3e37)  # near the top of the range (max 3.4e38)
    # near-ties: x / amax = (j + 1/2) / 127, so x * (127 / amax) lands next to j + 1/2
    # (the rounding of 127 / amax decides the side; kernel and reference must agree)
    a = 3.734375
    j = torch.arange(k) % 254 - 127
    rows.append(a * (j + 0.5) / 127)
    rows[-1][0] = a
    return torch.stack(rows).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("k,block_k", [(16, None), (400, None), (400, 64), (4096, 1024)],
                         ids=["K16", "K400", "K400-twopass", "K4096-twopass"])
def test_quantize_per_token_exact(k, block_k, dtype, device):
    x = torch.cat([special_rows(k, dtype, device), torch.randn(7, k, device=device).to(dtype)])
    x_q, s = quantize_per_token_launch(x, block_k=block_k)
    r_q, r_s = quantize_activations(x)
    assert x_q.dtype == torch.int8 and s.dtype == torch.float32
    assert torch.equal(x_q, r_q) and torch.equal(s, r_s)
    # the reference is the spec: |x - s * x_q| <= s / 2 and the largest element hits 127
    # (s exact in float64: for bf16-subnormal rows the stored float32 s is subnormal too)
    xf = x.double()
    assert torch.isfinite(s).all() and int(x_q.abs().max()) <= 127
    s64 = xf.abs().amax(dim=1) / 127
    err = (xf - s64[:, None] * x_q.double()).abs().amax(dim=1)
    assert (err <= s64 * (0.5 + 1e-5)).all()
    nz = xf.abs().amax(dim=1) > 0
    assert (x_q[nz].abs().amax(dim=1) == 127).all() and (x_q[~nz] == 0).all() and (s[~nz] == 0).all()


def test_quantize_rounds_half_to_even(device):
    # scale 1 (max 127): the quotients are the values themselves, .5 ties go to even
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -3.5]], device=device).half()
    expected = torch.tensor([[127, 0, 2, 2, -2, 0, 126, -4]], dtype=torch.int8, device=device)
    x_q, s = torch.ops.sailfish.quantize_per_token(x)
    assert torch.equal(x_q, expected) and float(s) == 1.0
    assert torch.equal(quantize_activations(x)[0], expected)


def test_quantize_per_token_op(device):
    x = torch.randn(3, 5, 48, device=device).to(BF16)
    layer = random_layer(48, 16, -1, False, device)
    x_q, s = layer.quantize_input(x)
    assert x_q.shape == (15, 48) and s.shape == (15,)
    with pytest.raises(TypeError, match="dtype"):
        torch.ops.sailfish.quantize_per_token(torch.ones(2, 16, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="2-D"):
        torch.ops.sailfish.quantize_per_token(torch.ones(16, device=device).half())


def nonfinite_rows(k, dtype, device, m=6):
    """m random rows; row 1 holds one NaN, row 2 one +Inf, row 4 one -Inf and a NaN."""
    x = torch.randn(m, k, device=device).to(dtype)
    x[1, k // 3] = float("nan")
    x[2, k - 1] = float("inf")
    x[4, 0], x[4, k // 2] = float("-inf"), float("nan")
    return x, torch.tensor([False, True, True, False, True, False], device=device)[:m]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("block_k", [None, 64], ids=["onepass", "twopass"])
def test_quantize_nonfinite_rows(block_k, dtype, device):
    """A NaN or Inf in a token: scale NaN and x_q 0 (so its outputs are NaN), in the kernel
    and the reference alike; the other rows are quantized as if alone."""
    k = 272
    x, bad = nonfinite_rows(k, dtype, device)
    x_q, s = quantize_per_token_launch(x, block_k=block_k)
    r_q, r_s = quantize_activations(x)
    assert torch.equal(x_q, r_q) and torch.equal(s.isnan(), r_s.isnan())
    assert torch.equal(s[~bad], r_s[~bad])
    assert s[bad].isnan().all() and (x_q[bad] == 0).all()
    g_q, g_s = quantize_activations(x[~bad])
    assert torch.equal(x_q[~bad], g_q) and torch.equal(s[~bad], g_s)


@pytest.mark.parametrize("m,cfg", [
    (1, None),  # the layer's own path (M = 1: GEMV)
    (6, None),
    (6, Config(16, 64, 128, 2)),
    (6, Config(32, 64, 64, 4)),
    (20, Config(1, 64, 128, kernel="dequant")),
], ids=["layer-M1", "layer-M6", "mma-split2", "mma-split4", "dequant"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
def test_nonfinite_rows_give_nan_outputs(m, cfg, dtype, device):
    """F.linear turns a NaN / Inf input row into a non-finite output row; W4A8 must not
    return finite numbers for it (tl.max dropped NaN before): the row's outputs are NaN,
    every other row is untouched."""
    k, n = 272, 136
    layer = random_layer(k, n, 128, True, device)
    if m == 1:
        x, bad = torch.randn(1, k, device=device).to(dtype), torch.tensor([True], device=device)
        x[0, 5] = float("nan")
    else:
        x, bad = nonfinite_rows(k, dtype, device, 6)
        if m > 6:
            x = torch.cat([x, torch.randn(m - 6, k, device=device).to(dtype)])
            bad = torch.cat([bad, torch.zeros(m - 6, dtype=torch.bool, device=device)])
    if cfg is None:
        y = layer(x)
    else:
        x_q, x_s = layer.quantize_input(x)
        y = w4a8_launch(x_q, x_s, layer.qweight, layer.s_ch, layer.s_g, layer.bias, k, 128, dtype, config=cfg)
    assert y[bad].isnan().all()
    assert torch.isfinite(y[~bad]).all()
    assert_rounded(y[~bad], layer_reference(layer, x[~bad]), layer.bias)
    x_q, x_s = quantize_activations(x)  # the PyTorch fallback agrees
    y_fb = w4a8_reference(x_q, x_s, layer.qweight, layer.s_ch, layer.s_g, layer.bias, k, 128, dtype)
    assert y_fb[bad].isnan().all() and torch.equal(y_fb[~bad].isnan(), torch.zeros_like(y_fb[~bad], dtype=torch.bool))


# ----------------------------------------------------------------------------------
# weight format
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("gs", [-1, 128], ids=["chan", "g128"])
def test_quantizer(gs, device):
    k, n = 400, 64
    w = torch.randn(n, k, device=device)
    w[3] = 0  # an all-zero row
    qw = quantize_qqq(w, gs)
    assert qw.qweight.dtype == torch.uint8 and int(qw.qweight.max()) <= 15
    assert (qw.qweight[3] == 8).all() and torch.isfinite(qw.s_ch).all()
    if gs == 128:
        assert qw.s_g.shape == (4, n) and qw.s_g.dtype == torch.float16
        # every code maps into int8 without clamping: 8 * s_g <= 127
        assert float(qw.s_g.float().abs().max()) * 8 <= 127
        p = (qw.qweight.float() - 8) * qw.s_g.float()[torch.arange(k, device=device) // 128].T
        assert torch.equal(p.round().to(torch.int8), qw.int8_weight())
    else:
        assert torch.equal(qw.int8_weight(), (qw.qweight.int() - 8).to(torch.int8))
    err = rel_err(qw.dequantize(), w)
    assert err < 0.15, err  # 4-bit RTN on a Gaussian weight: ~0.11-0.12


def test_group_scales_help_uneven_columns(device):
    w = torch.randn(32, 512, device=device)
    w[:, :128] *= 20  # one loud group of input channels
    chan, grp = quantize_qqq(w, -1), quantize_qqq(w, 128)
    quiet = slice(128, None)
    assert rel_err(grp.dequantize()[:, quiet], w[:, quiet]) < 0.5 * rel_err(chan.dequantize()[:, quiet], w[:, quiet])


@pytest.mark.parametrize("gs", [-1, 128], ids=["chan", "g128"])
def test_pack_roundtrip(gs, device):
    qw = random_qqq(208, 24, gs, device)
    p = pack_qqq(qw)
    assert p.qweight.shape == (24, 256 // 8) and p.qweight.dtype == torch.int32
    back = unpack_qqq(p)
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.s_ch, qw.s_ch)
    if gs == 128:
        assert p.s_g.shape == (24, 2) and torch.equal(back.s_g, qw.s_g)
    # padding channels hold code 8, i.e. w8 = 0
    assert (unpack_codes(p.qweight, 256)[:, 208:] == 8).all()


def test_fragment_order_layout(device):
    """PackedQQQ's fragment order, element by element from its docstring's formula: channel
    k = 128c + 32s + 16h + 4t + e is nibble h of byte 64c + 16t + 4s + e (bytes little-endian
    in the int32 words), against a loop over the channels (independent of the vectorised pack)."""
    n, kp = 3, 256
    q = torch.randint(0, 16, (n, kp), dtype=torch.uint8, device=device)
    words = pack_codes(q, kp).cpu()
    byts = words.view(torch.uint8).long()  # (n, kp // 2), little-endian
    for k in range(kp):
        c, r = divmod(k, 128)
        s, r = divmod(r, 32)
        h, r = divmod(r, 16)
        t, e = divmod(r, 4)
        b = byts[:, 64 * c + 16 * t + 4 * s + e]
        assert torch.equal((b >> (4 * h)) & 0xF, q[:, k].long().cpu()), k
    assert torch.equal(unpack_codes(words, kp), q.cpu())
    # version 1 (natural order, Sailfish <= 0.2) converts to the same words
    v1 = pack_nibbles(q.reshape(n, kp // 8, 8).int())
    assert torch.equal(natural_to_fragment_order_w4a8(v1).cpu(), words)


def test_int8_conversion_clamps_and_rounds_half_even(device):
    q = torch.tensor([[0, 1, 7, 9, 15, 8]], dtype=torch.uint8, device=device)
    s_g = torch.tensor([[20.0]], device=device).half()  # > 127 / 8: -8 * 20 clamps
    assert codes_to_int8(q, s_g, 128).tolist() == [[-127, -127, -20, 20, 127, 0]]
    s_g = torch.tensor([[2.5]], device=device).half()   # 2.5 * odd = .5 ties
    assert codes_to_int8(q, s_g, 128).tolist() == [[-20, -18, -2, 2, 18, 0]]


def test_group_scales_in_range(device):
    """The kernels drop the unpack's clamp only when no scale can need it: |s_g| < 127.5 / 8
    (at 127.5 / 8 the code 0 gives rne(-127.5) = -128, which must clamp)."""
    ok = torch.full((3, 5), 15.875, device=device).half()  # quantize_qqq's largest is 119 / 7.5
    assert group_scales_in_range(ok) and group_scales_in_range(-ok)
    for bad in (127.5 / 8, 20.0, float("nan"), float("inf")):
        s = ok.clone()
        s[2, 4] = bad
        assert not group_scales_in_range(s), bad
    assert not group_scales_in_range(None)
    # the answer is kept with the tensor's version: an in-place change is seen
    s = ok.clone()
    assert group_scales_in_range(s)
    s[0, 0] = -16.0
    assert not group_scales_in_range(s)
    s.fill_(1.0)
    assert group_scales_in_range(s)
    with torch.inference_mode():  # no version counter: not known, so the clamping kernel
        assert not group_scales_in_range(ok.clone())


@pytest.mark.parametrize("m", [1, 5])
def test_scales_changed_in_place_take_the_clamp(m, device):
    """A layer whose scales leave the no-clamp range in place (after calls that ran the
    kernel without the clamp and cached its plan) gets the clamped int8 weights."""
    k, n = 400, 136
    layer = random_layer(k, n, 128, False, device)
    x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=device)
    x_s = torch.ones(m, device=device)

    def acc():
        y = w4a8_launch(x_q, x_s, layer.qweight, layer.s_ch, layer.s_g, None, k, 128, F16, raw_acc=True)
        w8 = layer.int8_weight()
        return y, (x_q.double() @ w8.double().T).long()

    for _ in range(2):  # the second call takes the cached plan (CUDA)
        y, ref = acc()
        assert torch.equal(y.long(), ref)
    with torch.no_grad():
        layer.s_g[:, :3] = 24.0  # -8 * 24 and -7 * 24 clamp to -127
    y, ref = acc()
    assert ref.abs().max() > 0 and torch.equal(y.long(), ref)


# ----------------------------------------------------------------------------------
# GEMM: the int32 accumulator, exactly
# ----------------------------------------------------------------------------------
RAW_CASES = [  # M, K, N, gs, config (None: the heuristic), s_g_max
    (1, 400, 200, 128, None, 127 / 8),
    (3, 272, 136, -1, None, None),
    (17, 512, 64, 128, None, 20.0),                       # s_g past 127/8: clamping
    (100, 400, 136, -1, None, None),                      # large-M path
    (100, 272, 200, 128, None, 127 / 8),
    (5, 400, 136, 128, Config(16, 64, 64, 1), 127 / 8),   # BLOCK_K < group
    (5, 400, 136, 128, Config(16, 64, 256, 2), 127 / 8),  # BLOCK_K spans 2 groups, split-K
    (33, 272, 200, -1, Config(32, 128, 64, 3), None),     # split-K 3 of 5 K tiles
    (64, 512, 64, 128, Config(64, 64, 128, 4), 127 / 8),  # split-K, even K
    (1, 400, 136, -1, None, None),                                  # M=1: the GEMV path
    (1, 272, 200, 128, Config(1, 16, 512, 1, kernel="gemv"), 20.0),
    (1, 400, 64, 128, Config(1, 32, 128, 3, kernel="gemv"), 127 / 8),
    (1, 512, 136, -1, Config(16, 64, 128, 2), None),               # M=1 on the tensor-core tiles
    (17, 400, 136, 128, Config(1, 64, 256, kernel="dequant"), 127 / 8),  # int8 weight + _int_mm
    (40, 272, 64, -1, Config(1, 32, 64, kernel="dequant"), None),
    # the Hopper Gluon kernel (its Triton twin elsewhere): rows past M and N, split-K, clamping
    (70, 512, 200, -1, Config(64, 128, 256, 1, 8, 8, 3, kernel="gluon_pipe"), None),
    (130, 768, 136, 128, Config(128, 128, 256, 3, 8, 8, 4, kernel="gluon_pipe"), 20.0),
    (20, 1024, 256, 128, Config(128, 128, 256, 2, 8, 8, 3, kernel="gluon_pipe"), 127 / 8),
    (33, 400, 136, -1, Config(64, 128, 256, 1, 8, 8, 3, kernel="gluon_pipe"), None),  # K % 256: the twin
]


def raw_id(case):
    m, k, n, gs, cfg, _ = case
    s = f"M{m}-K{k}-N{n}-g{gs}"
    return s + (f"-{cfg.kernel}-bm{cfg.BLOCK_M}bn{cfg.BLOCK_N}bk{cfg.BLOCK_K}s{cfg.SPLIT_K}" if cfg else "")


@pytest.mark.parametrize("case", RAW_CASES, ids=raw_id)
def test_int32_accumulator_exact(case, device):
    m, k, n, gs, cfg, s_g_max = case
    qw = random_qqq(k, n, gs, device, s_g_max=s_g_max or 127 / 8)
    p = pack_qqq(qw)
    x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=device)
    x_s = torch.rand(m, device=device)
    acc = w4a8_launch(x_q, x_s, p.qweight, p.s_ch, p.s_g, None, k, gs, F16, config=cfg, raw_acc=True)
    ref = (x_q.double() @ qw.int8_weight().double().T).long()  # exact below 2**53
    assert acc.dtype == torch.int32 and torch.equal(acc.long(), ref)


@pytest.mark.parametrize("gs", [-1, 128], ids=["chan", "g128"])
def test_identity_activations(gs, device):
    """x_q = I gives back the int8 weight bit for bit (unpacking, nibble order, scales)."""
    k, n = 272, 136
    qw = random_qqq(k, n, gs, device)
    p = pack_qqq(qw)
    eye = torch.eye(k, dtype=torch.int8, device=device)
    acc = w4a8_launch(eye, torch.ones(k, device=device), p.qweight, p.s_ch, p.s_g, None, k, gs, F16,
                      raw_acc=True)
    assert torch.equal(acc, qw.int8_weight().T.int())


def test_split_k_deterministic(device):
    """Split-K partial sums are int32, added exactly: the same bits for any split."""
    k, n, m = 512, 136, 3
    layer = random_layer(k, n, 128, True, device)
    x = torch.randn(m, k, device=device).half()
    x_q, x_s = layer.quantize_input(x)
    args = (x_q, x_s, layer.qweight, layer.s_ch, layer.s_g, layer.bias, k, 128, F16)
    raws = [w4a8_launch(*args, config=Config(16, 64, 128, s), raw_acc=True) for s in (1, 2, 4, 4)]
    assert all(torch.equal(r, raws[0]) for r in raws[1:])
    ys = [w4a8_launch(*args, config=Config(16, 64, 128, s)) for s in (1, 4, 4)]
    assert torch.equal(ys[1], ys[2])
    for y in ys:
        assert_rounded(y, layer_reference(layer, x), layer.bias)


@pytest.mark.parametrize("act", ["int8", "fp8"])
@pytest.mark.parametrize("m,cfg", [
    (5, Config(16, 64, 64, 3)),
    (33, Config(32, 32, 128, 2)),
    (1, Config(1, 32, 64, 3, kernel="gemv")),
], ids=["mma-split3", "mma-2mtiles", "gemv-split3"])
def test_split_k_inside_the_gemm(m, cfg, act, device, monkeypatch):
    """Split-K slices added by the last slice of each tile (kernels/w4a8.py _add_slices): the same
    bits as the reduce kernel, for the output and the raw accumulator, and every tile counter
    back at zero after the launch (the next launch on the stream relies on it)."""
    if act == "fp8" and cfg.kernel == "gemv":
        pytest.skip("fp8 activations run the tensor-core tiles only")
    if act == "fp8" and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89+")
    import sailfish.ops.w4a8 as ops8
    k, n = 400, 136
    layer = random_layer(k, n, 128, True, device)
    x = torch.randn(m, k, device=device).half()
    x[m // 2, 7] = 500.0
    x_q, x_s = (ops8.quantize_per_token_launch(x, act_dtype=act) if act == "fp8" else layer.quantize_input(x))
    args = (x_q, x_s, layer.qweight, layer.s_ch, layer.s_g, layer.bias, k, 128, F16)
    assert ops8.fixup_tile(cfg)
    out = {}
    for fixup in (False, True):
        monkeypatch.setattr(FLAGS, "split_fixup", fixup)
        ops8.W4A8_TUNER.plans.clear()
        out[fixup] = (w4a8_launch(*args, config=cfg), w4a8_launch(*args, config=cfg, raw_acc=True))
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
    if act == "int8":
        assert_rounded(out[True][0], layer_reference(layer, x), layer.bias)
    dev = x.get_device()
    assert not ops8.sync_buffer(x.device, dev).any(), "tile counters left non-zero"
    assert ops8.sync_buffer(x.device, dev) is ops8.sync_buffer(x.device, dev)


@pytest.mark.parametrize("m,cfg", [
    (1, Config(1, 16, 256, 1, kernel="gemv")),
    (1, Config(1, 32, 128, 2, kernel="gemv")),
    (20, Config(1, 64, 128, kernel="dequant")),
    (20, Config(32, 64, 64, 2)),
], ids=["gemv", "gemv-split2", "dequant", "mma-split2"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
def test_paths_epilogue(m, cfg, dtype, device):
    """Every path's epilogue (scales, bias, output rounding), against the reference."""
    k, n = 272, 136
    layer = random_layer(k, n, 128, True, device)
    x = torch.randn(m, k, device=device).to(dtype)
    x_q, x_s = layer.quantize_input(x)
    y = w4a8_launch(x_q, x_s, layer.qweight, layer.s_ch, layer.s_g, layer.bias, k, 128, dtype, config=cfg)
    assert y.dtype == dtype
    assert_rounded(y, layer_reference(layer, x), layer.bias)


@pytest.mark.parametrize("gs", [-1, 128], ids=["chan", "g128"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
def test_gluon_pipe_outputs(gs, dtype, device):
    """'gluon_pipe' (the Gluon kernel on Hopper, its twin elsewhere): every output element against
    the reference, with a bias, rows past M and N, a NaN token (its outputs NaN) and split-K; the
    Gluon kernel is the one that ran where it applies."""
    import sailfish.ops.w4a8 as ops8

    m, k, n = 72, 512, 200
    layer = random_layer(k, n, gs, True, device)
    x = torch.randn(m, k, device=device).to(dtype)
    x[5, 3] = float("nan")
    x_q, x_s = layer.quantize_input(x)
    ref = layer_reference(layer, x)
    for split in (1, 2):
        cfg = Config(64, 128, 256, split, 8, 8, 3, kernel="gluon_pipe")
        y = w4a8_launch(x_q, x_s, layer.qweight, layer.s_ch, layer.s_g, layer.bias, k, gs, dtype, config=cfg)
        assert y[5].isnan().all() and not y[torch.arange(m) != 5].isnan().any()
        keep = torch.arange(m, device=y.device) != 5
        assert_rounded(y[keep], ref[keep], layer.bias)
    hopper = device == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    assert ops8.w4a8_gluon_applies(x_q, layer.qweight) == (hopper and ops8.w4a8_gluon_device(x_q.device.index))


@pytest.mark.parametrize("m,k,gs,bias,dtype,cfg", [
    (16, 512, 128, True, F16, Config(16, 64, 256, 1, 8, 4, 3, kernel="gluon_overlap")),
    (5, 1024, -1, False, BF16, Config(16, 64, 256, 2, 8, 4, 4, kernel="gluon_overlap")),
    (12, 2048, 128, False, F16, Config(16, 64, 256, 4, 8, 4, 3, kernel="gluon_overlap")),
    (30, 1536, 128, True, BF16, Config(32, 64, 256, 3, 8, 4, 4, kernel="gluon_overlap")),
    (2, 512, -1, True, F16, Config(16, 64, 256, 1, 8, 4, 4, kernel="gluon_overlap")),
], ids=["g128-bias", "chan-split2", "g128-split4", "bm32-split3", "m2"])
def test_gluon_overlap_outputs(m, k, gs, bias, dtype, cfg, device):
    """'gluon_overlap' (the one-warpgroup Gluon kernel on Hopper, its twin elsewhere): every output
    element against the reference, rows past M and N (N = 200: a partial 64-row tile), a NaN token
    (its outputs NaN), split-K, bias; the int32 sums equal the reference's exactly (raw_acc); the
    plan that ran is the Gluon kernel where it applies."""
    import sailfish.ops.w4a8 as ops8

    n = 200
    layer = random_layer(k, n, gs, bias, device)
    x = torch.randn(m, k, device=device).to(dtype)
    x[m // 2, 3] = float("nan")
    x_q, x_s = layer.quantize_input(x)
    ref = layer_reference(layer, x)
    args = (x_q, x_s, layer.qweight, layer.s_ch, layer.s_g, layer.bias, k, gs, dtype)
    y = w4a8_launch(*args, config=cfg)
    bad = torch.arange(m, device=y.device) == m // 2
    assert y[bad].isnan().all() and not y[~bad].isnan().any()
    assert_rounded(y[~bad], ref[~bad], layer.bias)
    acc = w4a8_launch(*args, config=cfg, raw_acc=True)
    assert torch.equal(acc, w4a8_reference(*args, raw_acc=True))
    gluon = ops8.w4a8_gluon_applies(x_q, layer.qweight)

    def plan_of(fixup):
        return ops8._W4A8Plan(cfg, x_q.get_device(), gs=max(gs, 0), has_bias=bias, raw=False,
                              emu=dtype is BF16 and not x_q.is_cuda, asm=x_q.is_cuda, fp8=False, K=k, fixup=fixup,
                              gluon=gluon)

    plan = plan_of(cfg.SPLIT_K > 1)
    assert plan.kind == ("gluon_overlap" if gluon else "mma")
    assert plan.fixup == (cfg.SPLIT_K > 1)  # (the slices added in the kernel: BLOCK_N 64)
    if cfg.SPLIT_K > 1:  # ... and by the reduce kernel: the same bits
        plan = plan_of(False)
        out = torch.empty_like(y)
        sqn, sgn = 4 * layer.qweight.stride(0), 0 if layer.s_g is None else layer.s_g.stride(0)
        plan(out, out, x_q, x_s, layer.qweight, layer.s_ch, layer.s_g, layer.bias, m, n, k, x_q.stride(0), sqn, sgn)
        assert out[bad].isnan().all() and torch.equal(out[~bad], y[~bad])


@pytest.mark.parametrize("m,cfg,match", [
    (3, Config(1, 16, 256, kernel="gemv"), "gemv' needs M=1"),
    (3, Config(8, 64, 64), "BLOCK_M >= 16"),
    (16, Config(1, 64, 64, kernel="dequant"), "needs M > 16"),
    (17, Config(1, 64, 64, 2, kernel="dequant"), "1 for 'dequant'"),
    (3, Config(16, 64, 16), "BLOCK_K=16 must be >= 32"),
    (3, Config(16, 64, 512), "divide the padded K=256"),
    (3, Config(16, 64, 64, kernel="tiles"), "kernel='tiles'"),
    (3, Config(128, 128, 128, 1, 8, 8, 3, kernel="gluon_pipe"), "needs BLOCK_K=256"),
    (3, Config(32, 128, 256, 1, 8, 8, 3, kernel="gluon_pipe"), "BLOCK_M 64 or 128"),
    (3, Config(128, 64, 256, 1, 8, 4, 3, kernel="gluon_pipe"), "BLOCK_N 128 and num_warps 8"),
    (3, Config(128, 128, 256, 1, 8, 8, 2, kernel="gluon_pipe"), "num_stages >= 3"),
    (3, Config(128, 128, 256, 1, 8, 8, 7, kernel="gluon_pipe"), "within an SM"),
    (3, Config(128, 128, 256, 2, 8, 8, 3, kernel="gluon_pipe"), "SPLIT_K=2 leaves a split"),
    (3, Config(16, 64, 128, 1, 8, 4, 3, kernel="gluon_overlap"), "needs BLOCK_K=256"),
    (3, Config(64, 64, 256, 1, 8, 4, 3, kernel="gluon_overlap"), "BLOCK_M 16 or 32"),
    (3, Config(16, 128, 256, 1, 8, 8, 3, kernel="gluon_overlap"), "BLOCK_N 64 and num_warps 4"),
    (3, Config(16, 64, 256, 1, 8, 4, 2, kernel="gluon_overlap"), "num_stages in 3..8"),
    (3, Config(16, 64, 256, 1, 8, 4, 3, kernel="gluon_overlap"), "even number"),
], ids=["gemv-M3", "mma-bm8", "dequant-M16", "dequant-split", "bk16", "bk512", "name", "pipe-bk", "pipe-bm",
        "pipe-bn", "pipe-ring", "pipe-smem", "pipe-split", "overlap-bk", "overlap-bm", "overlap-bn", "overlap-ring",
        "overlap-steps"])
def test_bad_config(m, cfg, match, device):
    layer = random_layer(208, 64, -1, False, device)
    x_q = torch.zeros(m, 208, dtype=torch.int8, device=device)
    with pytest.raises(ValueError, match=match):
        w4a8_launch(x_q, torch.ones(m, device=device), layer.qweight, layer.s_ch, None, None,
                    208, -1, F16, config=cfg)


@pytest.mark.parametrize("kernel,m,cfg", [
    ("w4a8_gluon_pipe_kernel", 72, Config(64, 128, 256, 1, 8, 8, 3, kernel="gluon_pipe")),
    ("w4a8_gluon_overlap_kernel", 12, Config(16, 64, 256, 1, 8, 4, 3, kernel="gluon_overlap")),
], ids=["pipe", "overlap"])
def test_gluon_compile_failure_falls_back_to_the_twin(kernel, m, cfg, monkeypatch, device):
    """A Triton whose Gluon does not compile a W4A8 Gluon kernel: a warning naming it, the twin's
    result, and no Gluon config (either family) tried again; other errors are raised."""
    import sailfish.kernels.w4a8_gluon as gk
    import sailfish.ops.w4a16 as ops16
    import sailfish.ops.w4a8 as ops8

    # the Gluon path as on a Hopper GPU, the TMA descriptor a stand-in (the stand-in kernels never read it)
    monkeypatch.setattr(gk, "pipe_descriptor", lambda x_q, BLOCK_M: x_q)
    monkeypatch.setattr(ops8, "w4a8_gluon_applies", lambda *a: FLAGS.gluon)
    k, n = 512, 136
    layer = random_layer(k, n, 128, True, device)
    x_q, x_s = layer.quantize_input(torch.randn(m, k, device=device).to(F16))

    def run(c):
        return w4a8_launch(x_q, x_s, layer.qweight, layer.s_ch, layer.s_g, layer.bias, k, 128, F16, config=c)

    monkeypatch.setattr(gk, kernel, StandInKernel(RuntimeError("a launch error")))
    monkeypatch.setattr(FLAGS, "gluon", True)
    with pytest.raises(RuntimeError, match="a launch error"):
        run(cfg)
    monkeypatch.setattr(gk, kernel, StandInKernel(incompatible_gluon()))
    with pytest.warns(RuntimeWarning, match="Gluon W4A8 kernel does not compile"):
        y = run(cfg)
    assert not FLAGS.gluon
    assert torch.equal(y, run(ops8.w4a8_gluon_twin(cfg)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second attempt, no second warning
        assert torch.equal(run(cfg), y)


def test_gluon_pipe_rejects_fp8(device):
    """'gluon_pipe' runs int8 activations only."""
    import sailfish.ops.w4a8 as ops8

    with pytest.raises(ValueError, match="fp8 activations run kernel='mma' only"):
        ops8.check_w4a8_config(Config(128, 128, 256, 1, 8, 8, 3, kernel="gluon_pipe"), 128, 64, 512, 512, -1, "fp8")


# ----------------------------------------------------------------------------------
# layer against the per-token int8 reference
# ----------------------------------------------------------------------------------
#   M    K    N   gs   dtype bias
LAYER_CASES = [
    (1, 400, 136, 128, F16, True),
    (1, 272, 200, -1, BF16, False),
    (3, 400, 200, -1, F16, False),
    (3, 208, 64, 128, BF16, True),
    (17, 272, 136, 128, BF16, False),
    (17, 400, 64, -1, F16, True),
    (100, 400, 200, 128, F16, False),
    (100, 272, 136, -1, BF16, True),
]


def layer_id(case):
    m, k, n, gs, dtype, bias = case
    return f"M{m}-K{k}-N{n}-g{gs}-{DTYPE_NAMES[dtype]}" + ("-bias" if bias else "")


@pytest.mark.parametrize("case", LAYER_CASES, ids=layer_id)
def test_layer_matches_reference(case, device):
    m, k, n, gs, dtype, bias = case
    layer = random_layer(k, n, gs, bias, device)
    x = torch.randn(m, k, device=device).to(dtype)
    x[0, : k // 2] *= 50  # uneven magnitudes inside a row
    y = layer(x)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = layer_reference(layer, x)
    assert rel_err(y, ref) <= TOL_W4A8[dtype]
    assert_rounded(y, ref, layer.bias)
    # the same numbers through the effective float weight (dequantize())
    x_q, s_tok = quantize_activations(x)
    ref2 = (s_tok.double()[:, None] * x_q.double()) @ layer.dequantize().double().T
    if bias:
        ref2 = ref2 + layer.bias.double()
    assert rel_err(y, ref2) <= TOL_W4A8[dtype]
    # and through the op's PyTorch fallback (what a CPU without TRITON_INTERPRET runs)
    y_fb = w4a8_reference(x_q, s_tok, layer.qweight, layer.s_ch, layer.s_g, layer.bias, k, gs, dtype)
    assert_rounded(y_fb, ref, layer.bias)


@pytest.mark.parametrize("gs", [-1, 128], ids=["chan", "g128"])
def test_from_linear_end_to_end(gs, device):
    lin = torch.nn.Linear(256, 136, bias=True, device=device).half()
    layer = QuantLinear.from_linear(lin, act_bits=8, group_size=gs)
    assert isinstance(layer, QuantLinearW4A8) and layer.group_size == gs
    x = torch.randn(2, 9, 256, device=device).half()
    y = layer(x)
    assert y.shape == (2, 9, 136) and y.dtype == F16
    assert rel_err(y, layer_reference(layer, x)) <= TOL_W4A8[F16]
    assert_rounded(y, layer_reference(layer, x), layer.bias)
    # against the float layer: 4-bit weights and 8-bit activations, loose
    with torch.no_grad():
        assert rel_err(y, lin(x)) < 0.2


def test_zero_and_tiny_rows_through_layer(device):
    layer = random_layer(272, 64, 128, False, device)
    x = torch.randn(4, 272, device=device).half()
    x[1] = 0
    x[2] *= 1e-6  # fp16 subnormals
    y = layer(x)
    assert torch.isfinite(y).all() and (y[1] == 0).all()
    assert_rounded(y, layer_reference(layer, x))  # row 2: fp16 subnormal outputs, exactly rounded
    assert y[2].abs().max() > 0


def test_empty_batch(device):
    layer = random_layer(64, 16, -1, True, device)
    assert layer(torch.empty(0, 64, device=device).half()).shape == (0, 16)


# ----------------------------------------------------------------------------------
# module API
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("gs", [-1, 128], ids=["chan", "g128"])
def test_state_dict_roundtrip(gs, device):
    layer = random_layer(208, 24, gs, True, device)
    sd = layer.state_dict()
    assert set(sd) == ({"qweight", "s_ch", "bias", "qweight_layout"} | ({"s_g"} if gs == 128 else set()))
    assert int(sd["qweight_layout"]) == 2
    fresh = QuantLinearW4A8(208, 24, True, group_size=gs, device=device)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.dequantize(), layer.dequantize())
    x = torch.randn(3, 208, device=device).half()
    assert torch.equal(fresh(x), layer(x))


@pytest.mark.parametrize("gs", [-1, 128], ids=["chan", "g128"])
def test_state_dict_layout_1_is_repacked(gs, device):
    """A state dict of Sailfish <= 0.2 (natural nibble order, no qweight_layout) loads into
    the fragment order: same codes, same outputs."""
    layer = random_layer(208, 24, gs, True, device)
    old = {k: v for k, v in layer.state_dict().items() if k != "qweight_layout"}
    codes = layer.quantized_weight().qweight
    old["qweight"] = pack_nibbles(torch.nn.functional.pad(codes.int(), (0, 48), value=8).reshape(24, 32, 8))
    fresh = QuantLinearW4A8(208, 24, True, group_size=gs, device=device)
    fresh.load_state_dict(old)
    assert torch.equal(fresh.qweight, layer.qweight) and int(fresh.qweight_layout) == 2
    x = torch.randn(3, 208, device=device).half()
    assert torch.equal(fresh(x), layer(x))
    bad = dict(old, qweight_layout=torch.tensor(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="qweight_layout=3"):
        fresh.load_state_dict(bad)


def test_dtype_conversion_keeps_format(device):
    layer = random_layer(64, 16, 128, True, device)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.half()
    layer.to(torch.bfloat16)
    for k, v in layer.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k


def test_extra_repr():
    layer = QuantLinearW4A8(64, 16, group_size=128)
    assert repr(layer) == ("QuantLinearW4A8(in_features=64, out_features=16, bias=True, bits=4, "
                           "act_bits=8, group_size=128)")


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(in_features=100, out_features=64), ValueError, "in_features=100 must be a positive multiple of 16"),
    (dict(in_features=64, out_features=20), ValueError, "out_features=20 must be a positive multiple of 8"),
    (dict(in_features=64, out_features=64, group_size=64), ValueError, r"group_size=64 .* W4A8; allowed: \(-1, 128\)"),
])
def test_constructor_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        QuantLinearW4A8(**kwargs)


def test_from_linear_errors():
    lin = torch.nn.Linear(64, 32).half()
    with pytest.raises(ValueError, match="act_bits=4 is not supported"):
        QuantLinear.from_linear(lin, act_bits=4)
    with pytest.raises(ValueError, match="group_size=32"):
        QuantLinear.from_linear(lin, act_bits=8, group_size=32)
    with pytest.raises(ValueError, match="symmetric"):
        QuantLinear.from_linear(lin, act_bits=8, sym=False)
    with pytest.raises(ValueError, match="dtype does not apply"):
        QuantLinear.from_linear(lin, act_bits=8, dtype=F16)
    with pytest.raises(ValueError, match="multiple of 16"):
        QuantLinear.from_linear(torch.nn.Linear(72, 32), act_bits=8)
    with pytest.raises(TypeError, match="nn.Linear"):
        QuantLinearW4A8.from_linear(torch.nn.Conv1d(4, 4, 1))
    assert isinstance(QuantLinear.from_linear(lin), QuantLinear)  # act_bits=16 default


def test_forward_errors(device):
    layer = random_layer(64, 16, -1, False, device)
    with pytest.raises(TypeError, match="float32 is not supported"):
        layer(torch.randn(2, 64, device=device))
    with pytest.raises(ValueError, match="last dim 48 != in_features=64"):
        layer(torch.randn(2, 48, device=device).half())


def test_op_errors(device):
    layer = random_layer(64, 16, 128, False, device)
    x_q = torch.zeros(2, 64, dtype=torch.int8, device=device)
    s = torch.ones(2, device=device)
    op = torch.ops.sailfish.w4a8_gemm
    with pytest.raises(TypeError, match="out_dtype"):
        op(x_q, s, layer.qweight, layer.s_ch, layer.s_g, None, 64, 128, torch.float32)
    with pytest.raises(TypeError, match="x_q must be int8"):
        op(x_q.half(), s, layer.qweight, layer.s_ch, layer.s_g, None, 64, 128, F16)
    with pytest.raises(ValueError, match="x_scales"):
        op(x_q, s.half(), layer.qweight, layer.s_ch, layer.s_g, None, 64, 128, F16)
    with pytest.raises(ValueError, match="s_g must be float16"):
        op(x_q, s, layer.qweight, layer.s_ch, None, None, 64, 128, F16)
    with pytest.raises(ValueError, match="s_g must be None"):
        op(x_q, s, layer.qweight, layer.s_ch, layer.s_g, None, 64, -1, F16)
    with pytest.raises(ValueError, match="shape \\(M, 64\\)"):
        op(x_q[:, :48], s, layer.qweight, layer.s_ch, layer.s_g, None, 64, 128, F16)
    with pytest.raises(ValueError, match="SPLIT_K"):
        w4a8_launch(x_q, s, layer.qweight, layer.s_ch, layer.s_g, None, 64, 128, F16,
                    config=Config(16, 64, 64, 2))


class TinyMLP(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.up = random_layer(256, 512, 128, True, device)
        self.down = random_layer(512, 256, -1, False, device)

    def forward(self, x):
        # the hidden activations too: each layer is checked on the input it consumed
        u = self.up(x)
        h = torch.nn.functional.silu(u)
        return self.down(h), u, h


@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
def test_torch_compile_fullgraph(dtype, device):
    model = TinyMLP(device)
    backend = "inductor" if device == "cuda" else "aot_eager"
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for m in (3, 17):
        x = torch.randn(2, m, 256, device=device).to(dtype)
        with torch.no_grad():
            y, u, h = compiled(x)
        assert y.shape == (2, m, 256) and y.dtype == dtype
        # against the float64 reference, layer by layer, each on the input it consumed
        assert_rounded(u, layer_reference(model.up, x), model.up.bias)
        assert_rounded(y, layer_reference(model.down, h))


def test_quantize_model(device):
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 40),
                                torch.nn.Linear(40, 12)).half().to(device)
    x = torch.randn(5, 64, device=device).half()
    quantize_model(model, act_bits=8, group_size=-1)
    assert isinstance(model[0], QuantLinearW4A8) and isinstance(model[2], QuantLinearW4A8)
    assert isinstance(model[3], torch.nn.Linear)  # K = 40 is not a multiple of 16
    assert model.sailfish_report["quantized"] == ["0", "2"] and "3" in model.sailfish_report["skipped"]
    assert model(x).shape == (5, 12)
    with pytest.raises(ValueError, match="act_bits=2"):
        quantize_model(torch.nn.Linear(64, 64).half(), act_bits=2)
    with pytest.raises(ValueError, match="group_size=256 .* W4A8"):
        quantize_model(torch.nn.Linear(64, 64).half(), act_bits=8, group_size=256)


_FALLBACK_CHILD = r"""
import sys, torch, sailfish
from sailfish.ops import use_triton
src = torch.load(sys.argv[1])
layer = sailfish.QuantLinearW4A8(**src["args"])
layer.load_state_dict(src["state"])
assert not use_triton(src["x"]), "TRITON_INTERPRET leaked into the child"
y = layer(src["x"])
assert "sailfish.kernels.w4a8" not in sys.modules, "the fallback must not run the kernels"
torch.save(y, sys.argv[2])
"""


def test_cpu_fallback_matches_kernel(device, tmp_path):
    """CPU without TRITON_INTERPRET runs the PyTorch reference: the same numbers."""
    k, n = 272, 136
    layer = random_layer(k, n, 128, True, device)
    x = torch.randn(5, k).to(BF16)
    x[1] = 0
    state = {key: v.cpu() for key, v in layer.state_dict().items()}
    args = dict(in_features=k, out_features=n, bias=True, group_size=128)
    torch.save({"args": args, "state": state, "x": x}, tmp_path / "in.pt")
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    src_dir = os.path.dirname(os.path.dirname(sailfish.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src_dir, env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-c", _FALLBACK_CHILD, str(tmp_path / "in.pt"),
                    str(tmp_path / "out.pt")], env=env, check=True, timeout=300)
    y_fallback = torch.load(tmp_path / "out.pt")
    ref = layer_reference(layer.cpu(), x)
    assert_rounded(y_fallback, ref, layer.bias)
    y_kernel = layer.to(device)(x.to(device)).cpu()
    assert_rounded(y_kernel, ref, layer.bias.cpu())


_COMPILE_CHILD = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from sailfish.tools.ptx import ast_source
from sailfish.kernels import w4a8 as K

ARCH = int(sys.argv[1])
# ops that carry a value unchanged (up to shape or a widening): a product of one of these
# with a kernel argument is a product of the argument itself
PASS = ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "arith.extsi")


def narrow_products(ttir, args):
    # the arith.muli ops whose result is 32-bit and one of whose operands is one of `args`
    # (row lengths, strides, M, N): each one an offset that can pass 2**31
    defs = {}
    for line in ttir.splitlines():
        m = re.match(r"\s*(%[\w.]+) = ([\w.]+) (%[\w.]+)", line)
        if m:
            defs[m.group(1)] = (m.group(2), m.group(3))

    def root(v):
        while v in defs and defs[v][0] in PASS:
            v = defs[v][1]
        return v

    bad = []
    for line in ttir.splitlines():
        m = re.match(r"\s*%[\w.]+ = arith.muli (%[\w.]+), (%[\w.]+) : (\S+)", line)
        if m and not re.search(r"i64>?$", m.group(3)):
            hit = {root(m.group(1)), root(m.group(2))} & {"%" + a for a in args}
            if hit:
                bad.append(line.split(" loc(")[0].strip())
    return bad


def build(fn, sig, consts, warps=4, stages=3, wide=()):
    src = ast_source(fn, sig, consts)
    c = triton.compile(src, target=GPUTarget("cuda", ARCH, 32), options={"num_warps": warps, "num_stages": stages})
    bad = narrow_products(c.asm["ttir"], wide)
    assert not bad, f"{fn.__name__}: 32-bit products of {wide}: {bad}"
    return c.asm["ptx"]


q = {"x_ptr": "*bf16", "xq_ptr": "*i8", "s_ptr": "*fp32", "K": "i32", "stride_xm": "i32", "stride_qm": "i32"}
qw = ("stride_xm", "stride_qm")
ptx = build(K._quantize_per_token_kernel, q, {"BLOCK_K": 8192, "ONE_PASS": True, "FP8": False}, 8, wide=qw)
assert "div.rn.f32" in ptx and "div.full" not in ptx and "fma" not in ptx and ".ftz" not in ptx
build(K._quantize_per_token_kernel, dict(q, x_ptr="*fp16"), {"BLOCK_K": 1024, "ONE_PASS": False, "FP8": False}, wide=qw)
if ARCH >= 89:  # Triton has no e4m3 type before sm_89
    ptx = build(K._quantize_per_token_kernel, dict(q, xq_ptr="*fp8e4nv"),
                {"BLOCK_K": 4096, "ONE_PASS": True, "FP8": True}, 8, wide=qw)
    # e4m3 rounding by integer ops (kernels/w4a8._e4m3): the only float op on a value is the scaling
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "cvt.rn.satfinite" not in ptx and ".ftz" not in ptx
g = {"xq_ptr": "*i8", "xs_ptr": "*fp32", "qb_ptr": "*i8", "sch_ptr": "*fp32", "sg_ptr": "*fp16",
     "bias_ptr": "*fp32", "y_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
     "stride_ym": "i32", "stride_qn": "i32", "stride_gn": "i32"}
NO_SYNC = {"sync_ptr": None, "ws_ptr": None}  # the split-K reduce kernel's protocol
for gs, (bm, bn, bk, split, warps, stages), out in [(0, (16, 128, 128, 1, 4, 4), "*bf16"),
                                                   (128, (16, 64, 256, 2, 4, 4), "*i32"),
                                                   (128, (32, 64, 64, 1, 4, 4), "*fp16"),
                                                   (128, (128, 128, 128, 1, 8, 3), "*fp16")]:
    for clamp in ((True, False) if gs else (True,)):
        ptx = build(K._w4a8_kernel, dict(g, y_ptr=out), dict(
            GROUP_SIZE=gs, HAS_BIAS=True, EVEN_K=False, SPLIT_K=split, RAW=False, EMU_BF16=False, USE_ASM=True,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, CLAMP=clamp, **NO_SYNC), warps, stages,
            wide=("M", "N", "stride_xm", "stride_ym", "stride_qn"))
        assert ".s32.s8.s8" in ptx, "the int8 tiles must run on int8 tensor cores"
        if gs:  # the per-group conversion rounds once, in the fma (kernels/w4a8.py); the clamp
            # (max / min) only where asked for
            assert "fma.rn.f16x2" in ptx and "mul.rn.f16x2" not in ptx
            assert ("max.f16x2" in ptx and "min.f16x2" in ptx) == clamp, clamp
if ARCH >= 89:  # the fp8 variant: e4m3 tensor cores (sm_89+)
    for gs, (bm, bn, bk, split, warps, stages) in [(0, (16, 128, 256, 2, 4, 3)), (128, (64, 128, 128, 1, 4, 4))]:
        ptx = build(K._w4a8_kernel, dict(g, xq_ptr="*fp8e4nv", y_ptr="*fp32" if split > 1 else "*bf16"), dict(
            GROUP_SIZE=gs, HAS_BIAS=True, EVEN_K=False, SPLIT_K=split, RAW=False, EMU_BF16=False, USE_ASM=True,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, **NO_SYNC), warps, stages,
            wide=("M", "N", "stride_xm", "stride_ym", "stride_qn"))
        assert "e4m3" in ptx and ".s8.s8" not in ptx, "the fp8 tiles must run on fp8 tensor cores"
# split-K inside the GEMM (FIXUP): the slices' counter is an acq_rel atomic, the last slice reads
# the workspace past L1 (.cg); registers: _PTX_CHILD
fx = dict(g, y_ptr="*bf16", sync_ptr="*i32", ws_ptr="*i32")
ptx = build(K._w4a8_kernel, fx, dict(GROUP_SIZE=128, HAS_BIAS=True, EVEN_K=True, SPLIT_K=8, RAW=False, EMU_BF16=False,
            USE_ASM=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, CLAMP=False, FIXUP=True), 4, 4,
            wide=("stride_xm", "stride_ym", "stride_qn"))  # (workspace offsets m * N: 32-bit, M * N < 2**31)
assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx and ".s32.s8.s8" in ptx
if ARCH >= 89:
    build(K._w4a8_kernel, dict(fx, xq_ptr="*fp8e4nv", ws_ptr="*fp32"), dict(
        GROUP_SIZE=0, HAS_BIAS=False, EVEN_K=True, SPLIT_K=4, RAW=False, EMU_BF16=False, USE_ASM=True,
        BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, FIXUP=True), 4, 4)
v = {k: t for k, t in g.items() if k not in ("M", "stride_xm", "stride_ym")}
for gs, split, bk, clamp, fixup in [(0, 2, 512, True, False), (128, 1, 512, True, False), (128, 1, 64, False, False),
                                    (0, 3, 256, True, True)]:
    sync = dict(sync_ptr="*i32", ws_ptr="*i32") if fixup else {}
    build(K._w4a8_gemv_kernel, dict(v, y_ptr="*i32" if split > 1 and not fixup else "*bf16", **sync), dict(
        GROUP_SIZE=gs, HAS_BIAS=True, EVEN_K=True, SPLIT_K=split, RAW=False, EMU_BF16=False, USE_ASM=True,
        BLOCK_N=16, BLOCK_K=bk, CLAMP=clamp, FIXUP=fixup, **({} if fixup else NO_SYNC)), 4, 4,
        wide=("N", "stride_qn"))
for gs, clamp in ((0, True), (128, True), (128, False)):
    build(K._w4a8_dequant_kernel, {"qb_ptr": "*i8", "sg_ptr": "*fp16", "w_ptr": "*i8", "N": "i32", "K": "i32",
          "stride_qn": "i32", "stride_gn": "i32", "stride_wn": "i32"},
          dict(GROUP_SIZE=gs, USE_ASM=True, BLOCK_N=64, BLOCK_K=256, CLAMP=clamp), 4, 1,
          wide=("stride_qn", "stride_wn"))
for raw in (False, True):
    build(K._w4a8_splitk_reduce_kernel, {"ws_ptr": "*i32", "xs_ptr": "*fp32", "sch_ptr": "*fp32",
          "bias_ptr": "*fp32", "y_ptr": "*i32" if raw else "*bf16", "M": "i32", "N": "i32", "stride_ym": "i32"},
          dict(SPLIT_K=4, HAS_BIAS=True, RAW=raw, EMU_BF16=False, BLOCK_M=16, BLOCK_N=128), 4, 1,
          wide=("M", "N", "stride_ym"))
print("compiled")
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernels themselves")
@pytest.mark.parametrize("arch", [80, 89, 90], ids=lambda a: f"sm{a}")
def test_kernels_compile(arch, tmp_path):
    """The interpreter does not run Triton's compiler (it accepts code the compiler rejects,
    e.g. statements after a `return` in a constexpr `if`). Compile every W4A8 kernel for
    sm_80 (A100), sm_89 (L40S, RTX 4090) and sm_90 (H100 / H200) here, without a GPU; check
    the exactness-critical instructions in the PTX, and in the IR that every product of a
    row index with a row length or stride (offsets that can pass 2**31) is 64-bit."""
    pytest.importorskip("triton.backends.nvidia")
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    src_dir = os.path.dirname(os.path.dirname(sailfish.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src_dir, env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", _COMPILE_CHILD, str(arch)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


_PTX_CHILD = r"""
import sys
import warnings
from sailfish.tools.ptx import W4A8_TILES, compile_w4a8, k_loop_stats
bad = []
n = 0
for tile in W4A8_TILES:
    for gs in (-1, 128):
        for act, mma in (("int8", ".s32.s8.s8"), ("fp8", ".f32.e4m3.e4m3")):
            if act == "fp8" and gs != -1 and tile[2] > gs:
                continue  # fp8 per-group: K tiles within one group
            ptx = compile_w4a8(*tile, group_size=gs, act_dtype=act).asm["ptx"]
            st = k_loop_stats(ptx)
            n += 1
            # per-channel: nothing at all through shared memory; g128: at most the scale vector
            limit = 0 if gs == -1 else 1
            if (st is None or not st.wgmma_a_in_registers or st.ldmatrix or st.st_shared > limit
                    or mma not in ptx):
                bad.append((tile, gs, act, st))
# split-K inside the GEMM (FIXUP; ops/w4a8.fixup_tile: BM <= 32, BN 64): the same K loop, no
# spill, at most 128 registers (4 CTAs of 4 warps per SM). Registers are allocated for the whole
# kernel: an unrolled slice sum took BM 64 / BN 64 / split 8 from 80 to 255; the loop adds 12-30
# to these tiles (Triton 3.6), which measured faster all the same (docs/perf_log.md v23)
import re
from sailfish.tools.ptx import ptxas_report


def registers(ptx):
    rep = ptxas_report(ptx)
    return int(re.search(r"Used (\d+) registers", rep).group(1)), " 0 bytes spill stores" in rep


for tile in ((16, 64, 256, 8, 4, 4), (16, 64, 128, 8, 4, 6), (32, 64, 128, 8, 4, 4), (32, 64, 256, 4, 4, 4)):
    for gs in (-1, 128):
        k = compile_w4a8(*tile, group_size=gs, fixup=True)
        st = k_loop_stats(k.asm["ptx"])
        regs, no_spill = registers(k.asm["ptx"])
        n += 1
        if (st is None or not st.wgmma_a_in_registers or st.ldmatrix or st.st_shared > (gs != -1)
                or regs > 128 or not no_spill or "atom.global.gpu.acq_rel" not in k.asm["ptx"]):
            bad.append((tile, gs, "fixup", st, regs, no_spill))
print("checked", n)
sys.exit(f"int8 weight tile through shared memory, or FIXUP registers: {bad}" if bad else 0)
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check for machines without a GPU")
def test_mma_tile_stays_in_registers(tmp_path):
    """The point of the fragment-order layout (formats.qqq.PackedQQQ): compiled for sm_90a, the
    K loop of every tile shape the W4A8 tables use (BM 16-256, BK 64-256, 4-8 warps) feeds the
    int8 wgmma (s32.s8.s8; fp8 variant: f32.e4m3.e4m3) from registers, with no ldmatrix and no
    st.shared of the weight tile (tools/ptx.py). A layout or compiler change that brings a
    round trip back fails here."""
    run_compile_child(_PTX_CHILD, tmp_path)


_GLUON_PIPE_CHILD = r"""
import json
import re
import triton
from sailfish.kernels.gluon_common import pipe_shared_bytes
from sailfish.kernels.w4a8_gluon import compile_sm90
from sailfish.tuning import CONFIG_DIR, Config

cases = [dict(), dict(group_size=128), dict(group_size=128, clamp=False), dict(SPLIT_K=2), dict(raw=True),
         dict(BLOCK_M=64, STAGES=4), dict(has_bias=True, out_dtype="bf16", group_size=128, clamp=False)]
for path in sorted(CONFIG_DIR.glob("*.json")):  # every shipped tile, per channel and per group
    for key, entry in json.load(open(path)).get("configs", {}).items():
        c = Config(**entry)
        if key.startswith("w4a8|") and c.kernel == "gluon_pipe":
            tile = dict(BLOCK_M=c.BLOCK_M, STAGES=c.num_stages, SPLIT_K=c.SPLIT_K)
            # (as the package launches it on Hopper: releasing the row kernel after it early)
            for kw in (dict(tile), dict(tile, group_size=128, clamp=False, pdl_early=True)):
                if kw not in cases:
                    cases.append(kw)
bad = []
for kw in cases:
    k = compile_sm90(**kw)
    why, body = pipe_problems(k, pipe_shared_bytes(kw.get("BLOCK_M", 128), kw.get("STAGES", 3), elem_bytes=1))
    if ".s32.s8.s8" not in k.asm["ptx"]:
        why.append("not the int8 wgmma")
    # the int8 tile is made by register renaming: no byte permutes in the loop but the group asm's
    # own two per word (a join of the int8 values compiled to ~18 PRMT per word)
    if sum("PRMT" in t for t in body) > (2 * 16 * 2 if kw.get("group_size") == 128 else 0):
        why.append(f"{sum('PRMT' in t for t in body)} PRMT in the K loop")
    if why:
        bad.append((kw, why))
assert not bad, bad
print("checked", triton.__version__, len(cases))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check for machines without a GPU")
def test_gluon_pipe_kernel_compiles_for_sm90(tmp_path):
    """kernels/w4a8_gluon.py on the compiler's output for sm_90a (a format matrix and every
    shipped 'gluon_pipe' tile): int8 wgmma with A in registers, no shared-memory trip and no byte
    permutes of the weights, waits 1 and 0, no serialization, spill or wgmma register hazard, the
    rings' shared memory as the launcher counts it, 12 warps with setmaxnreg and TMA."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    run_compile_child(_GLUON_PIPE_CHILD.replace("bad = []", PIPE_PROBLEMS + "bad = []", 1), tmp_path)


_GLUON_OVERLAP_CHILD = r"""
import json
import re
import triton
from sailfish.kernels.w4a8_gluon import compile_sm90
from sailfish.tools.ptx import k_loop_stats, ptxas_report, sass, wgmma_loop
from sailfish.tuning import CONFIG_DIR, Config

cases = [dict(), dict(group_size=128), dict(group_size=128, clamp=False, STAGES=4, SPLIT_K=4), dict(raw=True),
         dict(BLOCK_M=32, group_size=128), dict(has_bias=True, out_dtype="bf16", group_size=128, clamp=False),
         dict(SPLIT_K=2, fixup=True, raw=True), dict(BLOCK_M=32, SPLIT_K=8, fixup=True, group_size=128)]
for path in sorted(CONFIG_DIR.glob("*.json")):  # every shipped tile, per channel and per group
    for key, entry in json.load(open(path)).get("configs", {}).items():
        c = Config(**entry)
        if key.startswith("w4a8|") and c.kernel == "gluon_overlap":
            tile = dict(BLOCK_M=c.BLOCK_M, STAGES=c.num_stages, SPLIT_K=c.SPLIT_K, fixup=c.SPLIT_K > 1)
            # (as the package launches it on Hopper: releasing the row kernel after it early)
            for kw in (dict(tile), dict(tile, group_size=128, clamp=False, pdl_early=True)):
                if kw not in cases:
                    cases.append(kw)
bad = []
for kw in cases:
    k = compile_sm90(kernel="gluon_overlap", **{"BLOCK_M": 16, **kw})
    ptx = k.asm["ptx"]
    text = sass(k.asm["cubin"])
    body = wgmma_loop(text) or []
    why = loop_problems(ptxas_report(ptx), text, body)
    st = k_loop_stats(ptx)
    if st is None or st.st_shared or st.ldmatrix or not st.wgmma_a_in_registers:
        why.append(f"K loop {st}")
    waits = sorted(set(re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx)))
    if waits != ["0", "2"]:  # two steps' wgmmas in flight while the next step is unpacked
        why.append(f"waits {waits}")
    if kw.get("pdl_early", False) != ("griddepcontrol.launch_dependents" in ptx):
        why.append("PDL release where not asked, or missing")
    if ".s32.s8.s8" not in ptx or ".reqntid 128" not in ptx or "cp.async.cg.shared.global" not in ptx:
        why.append("not the one-warpgroup int8 wgmma kernel with a cp.async ring")
    if sum("PRMT" in t for t in body) > (2 * 2 * 16 * 2 if kw.get("group_size") == 128 else 0):
        why.append(f"{sum('PRMT' in t for t in body)} PRMT in the K loop")
    if why:
        bad.append((kw, why))
assert not bad, bad
print("checked", triton.__version__, len(cases))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check for machines without a GPU")
def test_gluon_overlap_kernel_compiles_for_sm90(tmp_path):
    """kernels/w4a8_gluon.w4a8_gluon_overlap_kernel on the compiler's output for sm_90a (a format
    matrix, split-K with the reduce kernel or the slices added in the kernel, and every shipped
    'gluon_overlap' tile): int8 wgmma with A in registers, no shared-memory trip and no byte permutes
    of the weights beyond the group asm's, waits 2 and 0, no spill, serialization or wgmma register
    hazard, one warpgroup with a cp.async ring."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    run_compile_child(_GLUON_OVERLAP_CHILD.replace("bad = []", PIPE_PROBLEMS + "bad = []", 1), tmp_path)


# ----------------------------------------------------------------------------------
# batch invariance
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("gs", [-1, 128], ids=["chan", "g128"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
def test_int8_outputs_are_batch_invariant(gs, bias, dtype, device):
    """A token's int8 W4A8 output does not depend on the batch it is in: its per-token scale
    is its own, the int32 accumulator is exact in any order and every path (GEMV, tensor-core
    tiles, split-K, the Gluon kernel, dequantize + _int_mm) applies the same epilogue. So the
    rows of one call equal, bit for bit, the same tokens run alone or in other batches, although
    the configs (and kernels) differ by M."""
    k, n, m = 512, 200, 80
    layer = random_layer(k, n, gs, bias, device)
    x = torch.randn(m, k, device=device).to(dtype)
    y = layer(x)
    for lo, hi in ((0, 1), (7, 8), (3, 5), (10, 27), (40, 80), (0, 64)):
        assert torch.equal(layer(x[lo:hi]), y[lo:hi]), (lo, hi)
