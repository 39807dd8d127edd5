"""Weight formats (pure PyTorch): quantize, pack / unpack, GPTQ import and export."""
import numpy as np
import pytest
import torch

from helpers import DTYPE_NAMES, TOL, make_g_idx, random_checkpoint_weight, random_quantized, rel_err
from sailfish import QuantLinear, QuantizedWeight, from_gptq, quantize, to_gptq
from sailfish.formats import pack, unpack
from sailfish.formats.int4 import num_groups

F16, BF16 = torch.float16, torch.bfloat16
UNIT_ROUNDOFF = {F16: 2.0 ** -11, BF16: 2.0 ** -9}


def assert_same_weight(a: QuantizedWeight, b: QuantizedWeight) -> None:
    assert a.group_size == b.group_size
    assert torch.equal(a.qweight, b.qweight)
    assert a.scales.dtype == b.scales.dtype and torch.equal(a.scales, b.scales)
    assert (a.zeros is None) == (b.zeros is None)
    if a.zeros is not None:
        assert torch.equal(a.zeros, b.zeros)
    assert torch.equal(a.group_index(), b.group_index())


# ----------------------------------------------------------------------------------
# quantize
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("gs", [32, 64, 128, 256, -1])
def test_quantize_properties(gs, sym, dtype):
    n, k = 48, 400  # K % group_size != 0: a ragged last group
    w = torch.randn(n, k) * 0.05
    w[0] = 0.0  # all-zero rows must not divide by zero
    w[1, :32] = torch.linspace(0.0, 1.0, 32)  # a group with no negative value
    qw = quantize(w, group_size=gs, sym=sym, dtype=dtype)
    g = 1 if gs == -1 else -(-k // gs)
    assert qw.qweight.shape == (n, k) and qw.qweight.dtype == torch.uint8
    assert int(qw.qweight.max()) <= 15
    assert qw.scales.shape == (g, n) and qw.scales.dtype == dtype
    assert qw.g_idx is None and qw.sym == sym
    if sym:
        assert qw.zeros is None
        assert bool((qw.qweight[0] == 8).all())  # zero weights sit at the zero point 8
    else:
        assert qw.zeros.shape == (g, n) and int(qw.zeros.max()) <= 15
    deq = qw.dequantize()
    assert torch.equal(deq[0], torch.zeros(k))
    # Round to nearest: |w - deq| <= s / 2, up to the rounding of s to `dtype`
    # (it can widen the clamped range by ~15 u steps) and of s * (q - z) to `dtype`.
    u = UNIT_ROUNDOFF[dtype]
    s = qw.scales.float()[qw.group_index()].T.abs()
    assert bool(((w - deq).abs() <= s * (0.5 + 32 * u) + deq.abs() * u).all())


def test_quantize_scales_rounded_first():
    """Codes are chosen for the stored (rounded) scale, and the default dtype follows the weight."""
    w = torch.randn(16, 128, dtype=BF16)
    qw = quantize(w, group_size=32, sym=False)
    assert qw.dtype == BF16
    s = qw.scales.float()[qw.group_index()].T
    z = qw.zeros.float()[qw.group_index()].T
    best = (torch.round(w.float() / s) + z).clamp(0, 15)
    assert torch.equal(qw.qweight.float(), best)
    assert quantize(w.float()).dtype == F16


# ----------------------------------------------------------------------------------
# pack / unpack (the kernel layout)
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("k,n,gs,sym,gidx", [
    (400, 136, 128, True, "none"),
    (272, 200, 64, False, "none"),
    (400, 64, 32, False, "descact"),
    (256, 136, 256, True, "none"),
    (400, 200, 256, False, "descact"),
    (272, 64, 32, True, "gidx"),
    (512, 136, 128, False, "gidx"),
    (400, 136, -1, False, "none"),
    (16, 8, 32, False, "none"),
], ids=["K400-N136-g128-sym", "K272-N200-g64-asym", "K400-N64-g32-asym-descact", "K256-N136-g256-sym",
        "K400-N200-g256-asym-descact", "K272-N64-g32-sym-gidx", "K512-N136-g128-asym-gidx",
        "K400-N136-g-1-asym", "K16-N8-g32-asym"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
def test_pack_unpack_roundtrip(k, n, gs, sym, gidx, dtype):
    qw = random_quantized(k, n, gs, sym, dtype, make_g_idx(gidx, k, gs))
    p = pack(qw)
    kp = -(-k // 256) * 256
    assert p.qweight.shape == (n, kp // 8) and p.qweight.dtype == torch.int32
    assert (p.perm is not None) == (gidx != "none")
    # desc_act groups are contiguous after sorting; a general g_idx needs its table
    assert (p.sorted_g_idx is not None) == (gidx == "gidx")
    back = unpack(p)
    assert_same_weight(back, qw)
    assert torch.equal(back.dequantize(), qw.dequantize())


def _fragment_position(k):
    """(word, nibble) of channel k, written out from the wgmma fp16 A-fragment ownership
    (lane t = lane % 4 holds channels 2t + e + 8h of each 16-channel step r = 2a + r0 of a
    128-channel chunk c) rather than from the packer's reshape/permute."""
    c, r = divmod(k, 128)
    step, kk = divmod(r, 16)
    a, r0 = divmod(step, 2)
    h, kk = divmod(kk, 8)
    t, e = divmod(kk, 2)
    return 16 * c + 4 * t + a, 4 * e + 2 * h + r0


def test_pack_word_layout():
    """Fragment order: channel k of a row is nibble 4e + 2h + r0 of word 16c + 4t + a."""
    k = 512
    q = torch.randint(0, 16, (3, k), dtype=torch.uint8)
    qw = QuantizedWeight(q[:, :300].contiguous(), torch.ones(3, 3, dtype=F16).T.contiguous(), None, None, 128)
    words = pack(qw).qweight
    assert words.shape == (3, k // 8)
    w64 = words.to(torch.int64) & 0xFFFFFFFF
    for ch in range(k):
        word, nib = _fragment_position(ch)
        expect = q[:, ch] if ch < 300 else torch.zeros(3, dtype=torch.uint8)  # K padding: code 0
        assert torch.equal(((w64[:, word] >> (4 * nib)) & 0xF).to(torch.uint8), expect), ch
    # the four words of lane t of a chunk are adjacent (one 16-byte load)
    assert [_fragment_position(ch)[0] for ch in (2, 34, 66, 98)] == [4, 5, 6, 7]


def test_pack_trivial_g_idx_is_not_act_order():
    qw = random_quantized(272, 64, 64, False, F16, torch.arange(272, dtype=torch.int32) // 64)
    assert pack(qw).perm is None
    assert QuantLinear.from_quantized(qw).act_order is False


# ----------------------------------------------------------------------------------
# GPTQ checkpoints: an independent packer written from the format spec
# ----------------------------------------------------------------------------------
def gptq_pack(q_kn: np.ndarray, zeros: np.ndarray, checkpoint_format="gptq"):
    """q_kn (K, N) codes -> qweight int32 (K/8, N): channel k is the nibble at bits
    4*(k%8) of row k//8.  zeros (G, N), the true zero points in [0, 15] -> qzeros int32
    (G, N/8): channel n is the nibble at bits 4*(n%8) of the word Z of column n//8; gptq_v2
    stores Z, v1 (GPTQModel) Z - 0x11111111 modulo 2**32 (a zero point of 0 borrows)."""
    k, n = q_kn.shape
    qweight = np.zeros((k // 8, n), dtype=np.uint32)
    for kk in range(k):
        qweight[kk // 8] |= q_kn[kk].astype(np.uint32) << np.uint32(4 * (kk % 8))
    g = zeros.shape[0]
    words = np.zeros((g, n // 8), dtype=np.int64)
    for nn in range(n):
        words[:, nn // 8] += zeros[:, nn].astype(np.int64) << (4 * (nn % 8))
    if checkpoint_format == "gptq":
        words = (words - 0x11111111) % 2**32
    return torch.from_numpy(qweight.view(np.int32)), torch.from_numpy(words.astype(np.uint32).view(np.int32))


def gptq_dequant(q_kn, zeros, scales, g_idx, dtype=F16):
    """W[n, k] = scales[g, n] * (q[k, n] - zero[g, n]), g = g_idx[k], with the product
    rounded once to the scale dtype (the library's effective weight)."""
    g = g_idx.long()
    s = scales.double()[g]  # (K, N)
    z = torch.from_numpy(zeros.astype(np.float64))[g]
    w = s * (torch.from_numpy(q_kn.astype(np.float64)) - z)
    return w.T.to(dtype).float()


def random_gptq(k, n, gs, kind):
    """kind: 'asym' (random zero points, 0 and 15 present, 0 in the lowest and the highest
    nibble of a word), 'sym' (all zero points 8), 'descact' (asym + GPTQ desc_act g_idx)."""
    g = 1 if gs == -1 else -(-k // gs)
    q = np.random.randint(0, 16, size=(k, n)).astype(np.uint8)
    if kind == "sym":
        zs = np.full((g, n), 8, dtype=np.uint8)
    else:
        zs = np.random.randint(0, 16, size=(g, n)).astype(np.uint8)
        zs[0, 0], zs[-1, 1], zs[0, 7], zs[-1, 8] = 15, 0, 0, 0
    scales = (torch.rand(g, n) * 0.02 + 0.001).to(F16)
    g_idx = make_g_idx("descact" if kind == "descact" else "none", k, gs)
    if g_idx is None:
        g_idx = torch.arange(k, dtype=torch.int32) // gs if gs != -1 else torch.zeros(k, dtype=torch.int32)
    return q, zs, scales, g_idx


@pytest.mark.parametrize("k,n,gs,kind,fmt", [
    (256, 64, 128, "asym", "gptq"),
    (400, 136, 128, "asym", "gptq_v2"),
    (272, 200, 32, "sym", "gptq"),
    (400, 64, 64, "descact", "gptq"),
    (512, 136, 128, "descact", "gptq_v2"),
    (256, 64, -1, "asym", "gptq"),
], ids=["K256-N64-g128-asym", "K400-N136-g128-asym-v2", "K272-N200-g32-sym", "K400-N64-g64-descact",
        "K512-N136-g128-descact-v2", "K256-N64-g-1-asym"])
def test_from_gptq(k, n, gs, kind, fmt, device):
    np.random.seed(k + n)
    q, zs, scales, g_idx = random_gptq(k, n, gs, kind)
    qweight, qzeros = gptq_pack(q, zs, fmt)
    bias = torch.randn(n).to(F16)
    layer = QuantLinear.from_gptq(qweight.to(device), qzeros.to(device), scales.to(device),
                                  g_idx.to(device), bias.to(device), group_size=gs, checkpoint_format=fmt)
    assert layer.dtype == F16 and layer.sym == (kind == "sym")
    assert layer.act_order == (kind == "descact")
    expected = gptq_dequant(q, zs, scales, g_idx)
    assert torch.equal(layer.dequantize().cpu(), expected)
    # saved back byte for byte (v1 holds no zero point of 0, so those layers go to gptq_v2)
    back = fmt if kind == "sym" else "gptq_v2"
    t = to_gptq(layer.quantized_weight(), back)
    want = dict(zip(("qweight", "qzeros"), gptq_pack(q, zs, back)), scales=scales, g_idx=g_idx)
    assert all(torch.equal(t[key].cpu(), want[key]) for key in want)
    x = torch.randn(5, k).to(F16)
    y = layer(x.to(device)).cpu()
    ref = x.float() @ expected.T + bias.float()
    assert rel_err(y, ref) <= TOL[F16]


@pytest.mark.parametrize("zeros,v1_word", [
    (range(8), 0x654320FF),                  # 0 in the lowest nibble borrows from the next
    ((1, 1, 1, 1, 1, 1, 1, 0), 0xF0000000),  # 0 in the highest: the borrow leaves the word
    ((15,) * 8, 0xEEEEEEEE),                 # no zero point of 0: each nibble is zero - 1
    ((8,) * 8, 0x77777777),                  # symmetric
])
def test_gptq_v1_zero_word_literal(zeros, v1_word):
    """v1 qzeros words as GPTQModel writes them (the zero-point word minus 0x11111111) read
    back as whole words: a zero point of 0 and its neighbour are not misread (per nibble + 1
    would give 16 and one less), and the same zero points in gptq_v2 are the plain word."""
    v2_word = sum(z << (4 * j) for j, z in enumerate(zeros))
    assert (v2_word - 0x11111111) % 2**32 == v1_word
    q = np.full((32, 8), 3, dtype=np.uint8)
    as_int32 = lambda w: torch.tensor([[np.uint32(w).view(np.int32)]])  # noqa: E731
    for fmt, word in (("gptq", v1_word), ("gptq_v2", v2_word)):
        qweight, qzeros = gptq_pack(q, np.array([zeros], dtype=np.uint8), fmt)
        assert torch.equal(qzeros, as_int32(word))
        qw = from_gptq(qweight, qzeros, torch.ones(1, 8, dtype=F16), group_size=32, checkpoint_format=fmt)
        got = [8] * 8 if qw.zeros is None else qw.zeros[0].tolist()
        assert got == list(zeros), fmt
        assert qw.dequantize()[:, 0].tolist() == [3.0 - z for z in zeros]
        if fmt == "gptq" and 0 in zeros:  # per-nibble v1 readers would misread it: refused
            with pytest.raises(ValueError, match='zero point of 0 cannot be stored in checkpoint_format "gptq"'):
                to_gptq(qw, fmt)
        else:  # saved back byte for byte
            t = to_gptq(qw, fmt)
            assert torch.equal(t["qzeros"], qzeros) and torch.equal(t["qweight"], qweight)


def test_from_gptq_g_idx_optional():
    np.random.seed(1)
    q, zs, scales, g_idx = random_gptq(272, 64, 64, "asym")
    qweight, qzeros = gptq_pack(q, zs)
    a = from_gptq(qweight, qzeros, scales, None, group_size=64)
    b = from_gptq(qweight, qzeros, scales, g_idx, group_size=64)
    assert a.g_idx is None and b.g_idx is None  # k // group_size order is not act-order
    assert torch.equal(a.dequantize(), gptq_dequant(q, zs, scales, g_idx))


def test_from_gptq_layer_dtype_bf16():
    """fp16 scales into a bf16 layer: refused unless allow_lossy_scales=True, which warns;
    scales bf16 holds exactly convert without a word."""
    np.random.seed(2)
    q, zs, scales, g_idx = random_gptq(256, 64, 128, "asym")
    qweight, qzeros = gptq_pack(q, zs)
    with pytest.raises(ValueError, match=r"scales: \d+ of 128 torch.float16 values are not exactly representable in "
                                         r"torch.bfloat16 .* allow_lossy_scales=True"):
        QuantLinear.from_gptq(qweight, qzeros, scales, g_idx, group_size=128, dtype=BF16)
    with pytest.warns(UserWarning, match="from_gptq / from_awq with allow_lossy_scales=True rounded torch.float16"):
        layer = QuantLinear.from_gptq(qweight, qzeros, scales, g_idx, group_size=128, dtype=BF16,
                                      allow_lossy_scales=True)
    assert layer.dtype == BF16
    assert torch.equal(layer.dequantize(), gptq_dequant(q, zs, scales.to(BF16), g_idx, BF16))
    pow2 = torch.exp2(torch.randint(-10, -4, scales.shape).float()).half()
    layer = QuantLinear.from_gptq(qweight, qzeros, pow2, g_idx, group_size=128, dtype=BF16)
    assert torch.equal(layer.dequantize(), gptq_dequant(q, zs, pow2, g_idx, BF16))


@pytest.mark.parametrize("sym,gidx,fmt", [(True, "none", "gptq"), (False, "none", "gptq"),
                                          (False, "descact", "gptq_v2"), (True, "gidx", "gptq_v2")],
                         ids=["sym", "asym", "asym-descact-v2", "sym-gidx-v2"])
def test_gptq_roundtrip(sym, gidx, fmt):
    k, n, gs = 400, 136, 128
    qw = random_checkpoint_weight(k, n, gs, sym, F16, make_g_idx(gidx, k, gs), min_zero=1 if fmt == "gptq" else 0)
    t = to_gptq(qw, fmt)
    assert t["qweight"].shape == (k // 8, n) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (4, n // 8) and t["qzeros"].dtype == torch.int32
    assert t["g_idx"].shape == (k,) and t["g_idx"].dtype == torch.int32
    # bit-for-bit the layout the independent packer writes
    zeros = np.full((4, n), 8) if sym else qw.zeros.numpy()
    ref_qweight, ref_qzeros = gptq_pack(qw.qweight.T.numpy(), zeros, fmt)
    assert torch.equal(t["qweight"], ref_qweight) and torch.equal(t["qzeros"], ref_qzeros)
    assert_same_weight(from_gptq(**t, group_size=gs, checkpoint_format=fmt), qw)


@pytest.mark.parametrize("edit,fmt,match", [
    (lambda qw: qw.zeros.__setitem__((0, 0), 0), "gptq", 'zero point of 0 .* allowed: "gptq_v2"'),
    (lambda qw: qw.zeros.__setitem__((0, 0), 16), "gptq_v2", r"zero point of 16 .* allowed 0..15"),
    (lambda qw: qw.scales.__setitem__((1, 2), -0.5), "gptq", r"finite and > 0; 1 of 128 .*scales\[1, 2\] = -0.5"),
    (lambda qw: None, "gptq_v3", r"checkpoint_format='gptq_v3' is not supported; allowed: \('gptq', 'gptq_v2'\)"),
], ids=["zero-0-v1", "zero-16", "negative-scale", "format"])
def test_to_gptq_refusals(edit, fmt, match):
    qw = random_checkpoint_weight(256, 64, 128, False, F16)
    edit(qw)
    with pytest.raises(ValueError, match=match):
        to_gptq(qw, fmt)


# ----------------------------------------------------------------------------------
# error messages of the format layer
# ----------------------------------------------------------------------------------
def _qw_kwargs(**over):
    kw = dict(qweight=torch.zeros(8, 64, dtype=torch.uint8), scales=torch.ones(2, 8, dtype=F16),
              zeros=None, g_idx=None, group_size=32)
    kw.update(over)
    return kw


@pytest.mark.parametrize("over,exc,match", [
    (dict(group_size=48), ValueError, "group_size=48"),
    (dict(bits=8), ValueError, "bits=8"),
    (dict(qweight=torch.zeros(8, 64, dtype=torch.int32)), TypeError, "qweight must be a uint8"),
    (dict(scales=torch.ones(2, 8)), TypeError, "scales dtype torch.float32"),
    (dict(scales=torch.ones(2, 4, dtype=F16)), ValueError, r"scales must have shape \(G, N=8\)"),
    (dict(scales=torch.ones(3, 8, dtype=F16)), ValueError, "scales has 3 groups but K=64"),
    (dict(g_idx=torch.zeros(63, dtype=torch.int32)), ValueError, r"g_idx must have shape \(K=64,\)"),
    (dict(g_idx=torch.full((64,), 2, dtype=torch.int32)), ValueError, r"g_idx values must lie in \[0, 2\)"),
    (dict(zeros=torch.zeros(2, 8)), ValueError, "zeros must be uint8"),
    (dict(zeros=torch.full((2, 8), 17, dtype=torch.uint8)), ValueError, r"zero points must lie in \[0, 16\]"),
    (dict(qweight=torch.full((8, 64), 16, dtype=torch.uint8)), ValueError, r"codes must lie in \[0, 15\]"),
], ids=["group_size", "bits", "qweight-dtype", "scales-dtype", "scales-shape", "groups",
        "g_idx-shape", "g_idx-range", "zeros-dtype", "zeros-range", "codes-range"])
def test_quantized_weight_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        QuantizedWeight(**_qw_kwargs(**over))


@pytest.mark.parametrize("call,exc,match", [
    (lambda: quantize(torch.randn(8, 64), group_size=100), ValueError, "group_size=100"),
    (lambda: quantize(torch.randn(8, 64), bits=3), ValueError, "bits=3"),
    (lambda: quantize(torch.randn(64)), ValueError, "2-D"),
    (lambda: quantize(torch.ones(8, 64, dtype=torch.int32)), TypeError, "floating point"),
    (lambda: quantize(torch.randn(8, 64), dtype=torch.float32), TypeError, "dtype=torch.float32"),
], ids=["group_size", "bits", "1d", "int", "dtype"])
def test_quantize_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _gptq_args(k=64, n=16, g=2):
    return dict(qweight=torch.zeros(k // 8, n, dtype=torch.int32),
                qzeros=torch.zeros(g, n // 8, dtype=torch.int32),
                scales=torch.ones(g, n, dtype=F16), group_size=32)


@pytest.mark.parametrize("over,exc,match", [
    (dict(bits=3), ValueError, "bits=3"),
    (dict(group_size=16), ValueError, "group_size=16"),
    (dict(qweight=torch.zeros(8, 16, dtype=torch.int64)), TypeError, "qweight must be a 2-D torch.int32"),
    (dict(qzeros=torch.zeros(2, 2, dtype=torch.uint8)), TypeError, "qzeros must be a 2-D torch.int32"),
    (dict(scales=torch.ones(2, 16)), TypeError, "scales must be a 2-D float16"),
    (dict(scales=torch.ones(2, 8, dtype=F16)), ValueError, "scales has 8 columns but qweight has N=16"),
    (dict(qzeros=torch.zeros(2, 3, dtype=torch.int32)), ValueError, r"qzeros must have shape \(G=2, N/8=2\)"),
    (dict(scales=torch.ones(3, 16, dtype=F16), qzeros=torch.zeros(3, 2, dtype=torch.int32)),
     ValueError, "scales has 3 groups but K=64"),
    (dict(g_idx=torch.zeros(32, dtype=torch.int32)), ValueError, r"g_idx must have shape \(K=64,\)"),
    (dict(scales=torch.ones(2, 16, dtype=F16).index_put_((torch.tensor(1), torch.tensor(3)), torch.tensor(float("nan"), dtype=F16))),
     ValueError, r"scales must be finite and > 0; 1 of 32 are not \(first: scales\[1, 3\] = nan\)"),
    (dict(scales=-torch.ones(2, 16, dtype=F16)), ValueError, r"32 of 32 are not \(first: scales\[0, 0\] = -1.0\)"),
    (dict(scales=torch.zeros(2, 16, dtype=F16)), ValueError, "scales must be finite and > 0"),
    (dict(checkpoint_format="gptq_v3"), ValueError, r"checkpoint_format='gptq_v3' is not supported"),
], ids=["bits", "group_size", "qweight-dtype", "qzeros-dtype", "scales-dtype", "scales-cols",
        "qzeros-shape", "groups", "g_idx-shape", "scales-nan", "scales-negative", "scales-zero", "format"])
def test_from_gptq_errors(over, exc, match):
    kw = _gptq_args()
    kw.update(over)
    with pytest.raises(exc, match=match):
        from_gptq(**kw)


def test_g_idx_weight_with_more_scale_rows_than_groups_of_k():
    """A g_idx weight may hold more scale rows than ceil(K / group_size) (a tensor-parallel
    slice of a desc_act weight): it packs, unpacks and runs exactly; fewer rows are refused,
    and so are rows past ceil(K / group_size) without a g_idx."""
    k, n, gs = 256, 16, 64
    g_idx = (torch.arange(k) % 7).to(torch.int32)                 # 7 groups > ceil(256 / 64) = 4
    assert num_groups(k, gs) == 4
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = torch.rand(7, n).half() + 0.1
    zeros = torch.randint(0, 17, (7, n), dtype=torch.uint8)
    big = QuantizedWeight(codes, scales, zeros, g_idx, gs)
    back = unpack(pack(big))
    assert torch.equal(back.dequantize(), big.dequantize())
    layer = QuantLinear.from_quantized(big)
    assert layer.scales.shape == (n, 7) and layer.act_order
    x = torch.randn(3, k).half()
    assert rel_err(layer(x), x.float() @ big.dequantize().T) <= TOL[F16]
    with pytest.raises(ValueError, match="needs at least ceil"):
        QuantizedWeight(codes, scales[:3], zeros[:3], g_idx % 3, gs)
    with pytest.raises(ValueError, match="scales has 7 groups"):
        QuantizedWeight(codes, scales, zeros, None, gs)
    with pytest.raises(ValueError, match="groups=5 is only for act_order"):
        QuantLinear(k, n, group_size=gs, groups=5)
    with pytest.raises(ValueError, match="GPTQ stores ceil"):
        to_gptq(big)
