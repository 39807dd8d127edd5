"""The row-wise ops (ops/rowwise.py, kernels/rowwise.py): rms_norm and silu_mul against their
references (transformers' roundings), their _quant forms against sailfish's per-token quantizer
applied to the kernel's own output (bit for bit) and to the reference, NaN / Inf rows, leading
dims, the chunked path, bad input, and registration (opcheck, torch.compile fullgraph)."""
import pytest
import torch
import torch.nn.functional as F

from sailfish.formats.qqq import quantize_activations
from sailfish.ops import rowwise as R
from sailfish.ops.rowwise import (rms_norm, rms_norm_quant, rms_norm_quant_fp8, rms_norm_quant_reference,
                                  rms_norm_reference, silu_mul, silu_mul_quant, silu_mul_quant_fp8,
                                  silu_mul_quant_reference, silu_mul_reference)
from sailfish.ops.w4a8 import quantize_per_token_fp8_impl, quantize_per_token_impl

DTYPES = [torch.float16, torch.bfloat16]
EPS = 1e-6


def _wide_range(shape, dtype, device, spread=6):
    """Random values spanning ~2**(2 * spread) per row, times a per-row scale of 2**[-spread,
    spread] (fp16 stays below its overflow: at most ~4 * 2**(2 * spread))."""
    e = torch.randint(-spread, spread + 1, shape, device=device).float()
    row = torch.randint(-spread, spread + 1, (*shape[:-1], 1), device=device).float()
    return (torch.randn(shape, device=device) * torch.exp2(e + row)).to(dtype)


def _neighbours(h):
    """h and its two neighbours in its dtype."""
    inf = torch.full_like(h, float("inf"))
    return h, torch.nextafter(h, inf), torch.nextafter(h, -inf)


def assert_one_rounding_off(y, h_ref, other, min_equal=0.99):
    """The kernels may differ from the reference only in the fp32 value that is rounded to h
    (RMSNorm's normalized x: the order of the sum of squares and rsqrt; silu: exp), by a few fp32
    ulps: so h is h_ref or one of its neighbours in the dtype, and y = other * h rounded once,
    as torch multiplies (other: the weight, or up). NaN exactly where the reference's is; at
    least min_equal of the elements equal the reference's y."""
    ref = other * h_ref
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert torch.equal(y.isnan(), ref.isnan())
    ok = torch.zeros_like(y, dtype=torch.bool)
    for h in _neighbours(h_ref):
        ok |= (y == other * h)
    ok |= y.isnan()
    assert ok.all(), (y[~ok][:8], ref[~ok][:8])
    same = (y == ref) | y.isnan()
    assert same.float().mean() >= min_equal, same.float().mean()


def _rms_h(x, eps=EPS):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _same_bits(a, b):
    """Equal codes (int8, or float8 compared as bytes) or equal scales, NaN where the other's is."""
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    return torch.equal(a, b)


def assert_quant_of(q, s, y, act_dtype="int8"):
    """(q, s) is exactly quantize_per_token (fp8: quantize_per_token_fp8) of y, the kernel's
    own output for the same rows."""
    quantize = quantize_per_token_fp8_impl if act_dtype == "fp8" else quantize_per_token_impl
    q_ref, s_ref = quantize(y.reshape(-1, y.shape[-1]))
    assert _same_bits(q, q_ref) and _same_bits(s, s_ref)


def assert_quant_near_reference(q, s, y, y_ref, q_ref, s_ref):
    """Against the reference's quantization: rows where y is the reference's bit for bit give the
    reference's codes and scales; elsewhere the dequantized codes are within half a quantization
    step of y (int8: s / 2; float8 e4m3: 2**-4 of the value, at least 2**-10 * s; the fp32 scale
    computations adding ~1e-6 of it) plus |y - y_ref| of y_ref."""
    y, y_ref = y.reshape(q.shape).float(), y_ref.reshape(q.shape).float()
    same = ((y == y_ref) | (y.isnan() & y_ref.isnan())).all(dim=1)
    assert _same_bits(q[same], q_ref[same]) and _same_bits(s[same], s_ref[same])
    ok = ~s.isnan()
    s_ok, y_ok = s[ok, None], y[ok]
    half_step = s_ok * 0.5 if q.dtype == torch.int8 else torch.maximum(y_ok.abs() * 2**-4, s_ok * 2**-10)
    err = (q[ok].float() * s_ok - y_ref[ok]).abs()
    assert (err <= half_step * (1 + 1e-5) + (y_ok - y_ref[ok]).abs()).all()


# ----------------------------------------------------------------------------------
# rms_norm, rms_norm_quant
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 200), (1, 1024), (19, 128)])
def test_rms_norm_matches_reference(shape, dtype, device):
    """(5, 96) and (19, 128): several rows a program (masked rows and columns); (1, 1024): one."""
    x = _wide_range(shape, dtype, device)
    w = (torch.randn(shape[-1], device=device) * 2).to(dtype)
    y = rms_norm(x, w, EPS)
    assert_one_rounding_off(y, _rms_h(x), w)
    assert torch.equal(rms_norm_reference(x, w, EPS), w * _rms_h(x))  # (the helper is the reference)

    q, s = rms_norm_quant(x, w, EPS)
    assert q.shape == (x.numel() // shape[-1], shape[-1]) and q.dtype == torch.int8 and s.dtype == torch.float32
    assert_quant_of(q, s, y)
    assert_quant_near_reference(q, s, y, rms_norm_reference(x, w, EPS), *rms_norm_quant_reference(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_chunked_rows(dtype, device):
    """Rows wider than the tile (the launcher's block_k; by default past ROW_ONE_PASS_MAX):
    the sum pass, then the output pass (and the max pass for the _quant form)."""
    x = _wide_range((3, 100), dtype, device)
    w = torch.randn(100, device=device).to(dtype)
    y = R.rms_norm_launch(x, w, EPS, block_k=32)
    assert_one_rounding_off(y, _rms_h(x), w)
    q, s = R.rms_norm_launch(x, w, EPS, quant="int8", block_k=32)
    assert_quant_of(q, s, y)
    assert R._tile(20000, None)["BLOCK_K"] == R.ROW_CHUNK and R._tile(R.ROW_ONE_PASS_MAX, None)["ONE_PASS"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_nonfinite_and_zero_rows(dtype, device):
    """A row holding Inf: its Inf entries become NaN and the rest 0 (x * rsqrt(inf) as torch);
    NaN rows are NaN; the quantized forms give those rows scale NaN and codes 0, as the per-token
    quantizer does; an all-zero row gives 0 (eps > 0), scale 0 and codes 0; with eps = 0 it is NaN."""
    x = _wide_range((6, 64), dtype, device)
    x[1, 3] = float("nan")
    x[2, 10] = float("inf")
    x[3, 0], x[3, 7] = float("-inf"), float("nan")
    x[4] = 0
    w = torch.randn(64, device=device).to(dtype)
    y = rms_norm(x, w, EPS)
    assert_one_rounding_off(y, _rms_h(x), w, min_equal=0.9)
    assert y[1].isnan().all() and y[2, 10].isnan() and (y[2, :10] == 0).all() and (y[4] == 0).all()
    q, s = rms_norm_quant(x, w, EPS)
    assert_quant_of(q, s, y)
    assert s[1:4].isnan().all() and (q[1:4] == 0).all() and s[4] == 0 and (q[4] == 0).all()
    assert not s[[0, 5]].isnan().any() and (s[[0, 5]] > 0).all()
    y0 = rms_norm(x[4:5], w, 0.0)
    assert y0.isnan().all() and torch.equal(y0.isnan(), rms_norm_reference(x[4:5], w, 0.0).isnan())


def test_leading_dims(device):
    """Leading dims of any layout, walked in place where one or two strides reach every row
    (_row_layout), copied otherwise; the bits of the contiguous input's result (the same (M, K)
    problem computed twice). Qwen3's q/k norms with fused q/k/v: (B, S, H, D) views of slices of
    the (B, S, (H + 2G) D) projection output. Also a strided weight, and silu_mul on a slice."""
    base = _wide_range((4, 3, 160), torch.float16, device)
    w = torch.randn(80, device=device).half()
    qkv = _wide_range((2, 3, (4 + 2 * 2) * 32), torch.float16, device)
    q, k = qkv[..., :128].view(2, 3, 4, 32), qkv[..., 128:192].view(2, 3, 2, 32)
    w32 = torch.randn(32, device=device).half()
    odd = torch.randn(4, 4, 4, 160, device=device).half()[::2, ::2, ::2, :80]  # three levels: copied
    cases = [(base[..., :80], w, (160, 1, 1)),                      # one row stride
             (base[..., :80].transpose(0, 1), w, (160, 4, 480)),    # two levels
             (q, w32, (8 * 32, 4, 32)), (k, w32, (8 * 32, 2, 32)),  # Qwen3's q_norm / k_norm views
             (base[:1, :1, :80], w, (80, 1, 1)),                    # (one row: contiguous)
             (base[:1, :, :80].expand(4, 3, 80), w, (0, 3, 160)),   # (stride 0: repeated rows)
             (odd, w, None)]                                        # copied
    for x, weight, layout in cases:
        assert R._row_layout(x) == layout, (x.stride(), R._row_layout(x))
        y = rms_norm(x, weight, EPS)
        assert y.shape == x.shape and y.is_contiguous() and torch.equal(y, rms_norm(x.contiguous(), weight, EPS))
        q8, s8 = rms_norm_quant(x, weight, EPS)
        q_ref, s_ref = rms_norm_quant(x.contiguous(), weight, EPS)
        assert torch.equal(q8, q_ref) and torch.equal(s8, s_ref)
    x = base[:, 0, :80]
    assert torch.equal(rms_norm(x, torch.stack([w, w], 1)[:, 0], EPS), rms_norm(x, w, EPS))  # (a strided weight)
    gu = base[..., :96].transpose(0, 1)
    assert torch.equal(silu_mul(gu).isnan(), silu_mul(gu.contiguous()).isnan())
    assert torch.equal(silu_mul(gu).nan_to_num(), silu_mul(gu.contiguous()).nan_to_num())
    hq, hs = silu_mul_quant(gu)
    hq_ref, hs_ref = silu_mul_quant(gu.contiguous())
    assert _same_bits(hq, hq_ref) and _same_bits(hs, hs_ref)  # (rows that overflow fp16: NaN scales)


def test_rows_do_not_depend_on_the_batch(device):
    """A row's result is the same whatever the number of rows around it (one tile per row
    group, M not specialized: on CUDA the second and third calls reuse the first one's kept
    kernel with other M)."""
    x = _wide_range((17, 128), torch.float16, device)
    w = torch.randn(128, device=device).half()
    gu = _wide_range((17, 96), torch.float16, device, spread=2)
    y, (q, s), h, (hq, hs) = rms_norm(x, w, EPS), rms_norm_quant(x, w, EPS), silu_mul(gu), silu_mul_quant(gu)
    for m in (1, 5, 16):
        assert torch.equal(rms_norm(x[:m], w, EPS), y[:m])
        qm, sm = rms_norm_quant(x[:m], w, EPS)
        assert torch.equal(qm, q[:m]) and torch.equal(sm, s[:m])
        assert torch.equal(silu_mul(gu[:m]), h[:m])
        qm, sm = silu_mul_quant(gu[:m])
        assert torch.equal(qm, hq[:m]) and torch.equal(sm, hs[:m])


# ----------------------------------------------------------------------------------
# silu_mul, silu_mul_quant
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 48), (2, 3, 2 * 100), (1, 2 * 1024)])
def test_silu_mul_matches_reference(shape, dtype, device):
    gu = _wide_range(shape, dtype, device, spread=3)
    i = shape[-1] // 2
    h = silu_mul(gu)
    assert h.shape == (*shape[:-1], i)
    assert_one_rounding_off(h, F.silu(gu[..., :i]), gu[..., i:])
    assert torch.equal(silu_mul_reference(gu), F.silu(gu[..., :i]) * gu[..., i:])
    q, s = silu_mul_quant(gu)
    assert q.shape == (h.numel() // i, i)
    assert_quant_of(q, s, h)
    assert_quant_near_reference(q, s, h, silu_mul_reference(gu), *silu_mul_quant_reference(gu))
    # the chunked path: elementwise, so the same bits
    assert torch.equal(R.silu_mul_launch(gu, block_k=16), h)
    qc, sc = R.silu_mul_launch(gu, quant="int8", block_k=16)
    assert torch.equal(qc, q) and torch.equal(sc, s)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_nonfinite_rows(dtype, device):
    """silu(+inf) = inf, silu(-inf) = NaN (-inf / inf, as torch), inf * 0 = NaN: the products
    follow torch; a row with any NaN / Inf in h quantizes to scale NaN, codes 0."""
    gu = _wide_range((5, 64), dtype, device, spread=2)
    gu[1, 3] = float("inf")        # gate +inf
    gu[2, 5] = float("-inf")       # gate -inf -> NaN
    gu[3, 32 + 4] = float("nan")   # up NaN
    gu[4] = 0
    h = silu_mul(gu)
    assert_one_rounding_off(h, F.silu(gu[:, :32]), gu[:, 32:], min_equal=0.9)
    assert h[2, 5].isnan() and h[3, 4].isnan() and (h[4] == 0).all()
    q, s = silu_mul_quant(gu)
    assert_quant_of(q, s, h)
    bad = ~h.isfinite().all(dim=1)
    assert s[bad].isnan().all() and (q[bad] == 0).all() and s[4] == 0 and not s[0].isnan()


@pytest.mark.parametrize("act_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,i,block_k,one_pass_max", [(3, 300, 64, None), (1, 100, 16, None), (4, 200, 32, 64)],
                         ids=["5-parts", "m1-7-parts", "tail-chunks"])
def test_silu_mul_quant_split_rows(m, i, block_k, one_pass_max, dtype, act_dtype, device, monkeypatch):
    """The split form (each row over programs, the row's last program quantizing it): the one-
    program kernel's codes and scales bit for bit, NaN / Inf / zero rows included, twice (the
    row counters are back at zero after a call); one_pass_max: the last program's pass over the row
    in chunks (as rows past ROW_ONE_PASS_MAX take it)."""
    if act_dtype == "fp8" and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 e4m3 needs sm_89+")
    if one_pass_max is not None:
        monkeypatch.setattr(R, "ROW_ONE_PASS_MAX", one_pass_max)
    gu = _wide_range((m, 2 * i), dtype, device, spread=3)
    if m > 2:
        gu[1, 7] = float("-inf")  # silu(-inf) = NaN
        gu[2] = 0
    want_q, want_s = R.silu_mul_launch(gu, act_dtype, split=False)
    for _ in range(2):
        q, s = R.silu_mul_launch(gu, act_dtype, block_k, split=True)
        assert torch.equal(q.view(torch.int8), want_q.view(torch.int8))
        assert torch.equal(s.isnan(), want_s.isnan()) and torch.equal(s[~s.isnan()], want_s[~want_s.isnan()])
    assert_quant_of(q, s, silu_mul(gu), act_dtype)


def test_silu_mul_quant_split_rule():
    """Split by default: quantizing, at most SPLIT_ROWS_MAX rows, two SPLIT_BLOCK parts a row or
    more (Llama-3-8B's 14336 channels at decode batch sizes); split=True asks the quantizing form."""
    assert R._split(16, 14336, "int8", None, None) and R._split(1, 2 * R.SPLIT_BLOCK, "fp8", None, None)
    assert not R._split(R.SPLIT_ROWS_MAX + 1, 14336, "int8", None, None)
    assert not R._split(16, 14336, None, None, None) and not R._split(16, 2 * R.SPLIT_BLOCK - 1, "int8", None, None)
    assert not R._split(16, 14336, "int8", 64, None)  # (a block_k asks for the chunked one-program kernel)
    with pytest.raises(ValueError, match="split=True is the quantizing form's"):
        R._split(2, 4096, None, None, True)


# ----------------------------------------------------------------------------------
# float8 (e4m3) codes
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("block_k", [None, 32])
def test_fp8_forms(block_k, device):
    """rms_norm_quant_fp8 / silu_mul_quant_fp8: quantize_per_token_fp8 of the kernel's own
    output, bit for bit (one pass and chunked), NaN / Inf rows included, and near the reference's."""
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 e4m3 needs sm_89+")
    x = _wide_range((4, 80), torch.bfloat16, device)
    x[2, 5] = float("inf")
    w = torch.randn(80, device=device).bfloat16()
    y = rms_norm(x, w, EPS)
    q, s = rms_norm_quant_fp8(x, w, EPS) if block_k is None else R.rms_norm_launch(x, w, EPS, "fp8", block_k)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (4, 80) and s[2].isnan()
    assert_quant_of(q, s, y, "fp8")
    assert_quant_near_reference(q, s, y, rms_norm_reference(x, w, EPS), *rms_norm_quant_reference(x, w, EPS, "fp8"))
    h = silu_mul(x)
    q, s = silu_mul_quant_fp8(x) if block_k is None else R.silu_mul_launch(x, "fp8", block_k)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (4, 40)
    assert_quant_of(q, s, h, "fp8")
    assert_quant_near_reference(q, s, h, silu_mul_reference(x), *silu_mul_quant_reference(x, "fp8"))


# ----------------------------------------------------------------------------------
# Empty input, bad input
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_empty_rows(lead, device):
    x = torch.empty((*lead, 64), device=device, dtype=torch.float16)
    w = torch.ones(64, device=device, dtype=torch.float16)
    assert rms_norm(x, w, EPS).shape == x.shape
    q, s = rms_norm_quant(x, w, EPS)
    assert q.shape == (0, 64) and q.dtype == torch.int8 and s.shape == (0,) and s.dtype == torch.float32
    assert silu_mul(x).shape == (*lead, 32)
    q, s = silu_mul_quant(x)
    assert q.shape == (0, 32) and s.shape == (0,)


def _bad_cases(device):
    h = torch.float16
    x = torch.randn(4, 64, device=device, dtype=h)
    w = torch.ones(64, device=device, dtype=h)
    return [
        ("rms", (x.float(), w.float(), EPS), TypeError, "x dtype torch.float32 is not supported; allowed: float16"),
        ("rms", (x, w.bfloat16(), EPS), TypeError,
         "weight must be a tensor of x's dtype torch.float16, got torch.bfloat16"),
        ("rms", (x, torch.ones(65, device=device, dtype=h), EPS), ValueError,
         r"weight must have shape \(64,\).*\(65,\)"),
        ("rms", (x, torch.ones(1, 64, device=device, dtype=h), EPS), ValueError, r"weight must have shape \(64,\)"),
        ("rms", (x.t().contiguous().t(), w, EPS), ValueError,
         r"contiguous last dimension \(stride 1\), got strides \(1, 4\)"),
        ("rms", (x[:, :0], w[:0], EPS), ValueError, r"x must have shape \(\.\.\., n\) with n > 0, got \(4, 0\)"),
        ("rms", (x, w, -1.0), ValueError, "eps must be a finite float >= 0, got -1.0"),
        ("rms", (x, w, float("inf")), ValueError, "eps must be a finite float >= 0, got inf"),
        ("rms", (x, w.to("meta"), EPS), ValueError, "weight on meta"),
        ("silu", (x[:, :63],), ValueError, "gu's last dim must be even .* got 63"),
        ("silu", (x.int(),), TypeError, "gu dtype torch.int32 is not supported; allowed: float16, bfloat16"),
        ("silu", (x.t().contiguous().t(),), ValueError, r"gu must have a contiguous last dimension"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_bad_input_is_refused(case, device):
    """Each op of the pair (the plain and the _quant form) refuses the input with a message
    naming the argument, the value and what is allowed."""
    kind, args, err, match = _bad_cases(device)[case]
    for op in ((rms_norm, rms_norm_quant) if kind == "rms" else (silu_mul, silu_mul_quant)):
        with pytest.raises(err, match=match):
            op(*args)


# ----------------------------------------------------------------------------------
# Registration: opcheck, torch.compile
# ----------------------------------------------------------------------------------
def _op_args(device):
    x = _wide_range((2, 3, 64), torch.bfloat16, device)
    w = torch.randn(64, device=device).bfloat16()
    return {"rms_norm": (x, w, EPS), "rms_norm_quant": (x, w, EPS), "rms_norm_quant_fp8": (x, w, EPS),
            "silu_mul": (x,), "silu_mul_quant": (x,), "silu_mul_quant_fp8": (x,)}


@pytest.mark.parametrize("name", ["rms_norm", "rms_norm_quant", "rms_norm_quant_fp8", "silu_mul", "silu_mul_quant",
                                  "silu_mul_quant_fp8"])
def test_ops_pass_opcheck(name, device):
    result = torch.library.opcheck(getattr(torch.ops.sailfish, name).default, _op_args(device)[name])
    assert all(v == "SUCCESS" for v in result.values()), result


def test_torch_compile_fullgraph(device):
    """The ops trace through their fake implementations (fullgraph: no break) and compute what
    eager does; the plain-torch forms for compiled models are the references."""
    args = _op_args(device)
    x, w, _ = args["rms_norm"]

    def block(x, w):
        y = rms_norm(x, w, EPS)
        q, s = rms_norm_quant(x, w, EPS)
        hq, hs = silu_mul_quant(y)
        return silu_mul(y), q, s, hq, hs

    backend = "inductor" if device == "cuda" else "aot_eager"
    got = torch.compile(block, fullgraph=True, backend=backend)(x, w)
    for a, b in zip(got, block(x, w)):
        assert torch.equal(a, b)
    assert R.rms_norm_torch is rms_norm_reference and R.silu_mul_torch is silu_mul_reference
    assert R.quantize_per_token_torch is quantize_activations



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kept_plans_and_cuda_graphs():
    """CUDA: the first call keeps its bound kernel (ops/rowwise.py _RowPlans), later calls
    launch it directly (other M too: M is not specialized) and compute the same; a CUDA graph
    captures the direct launches and replays them on new data."""
    x = _wide_range((4, 256), torch.bfloat16, "cuda")
    w = torch.randn(256, device="cuda").bfloat16()
    ops = [lambda t: (rms_norm(t, w, EPS),), lambda t: rms_norm_quant(t, w, EPS), lambda t: (silu_mul(t),),
           silu_mul_quant]
    R._RowPlans.plans.clear()
    first = [f(x) for f in ops]
    assert len(R._RowPlans.plans) == 4
    for f, want in zip(ops, first):
        for got, ref, row in zip(f(x), want, f(x[1:2])):
            assert torch.equal(got, ref) and torch.equal(row, ref[1:2])
    assert len(R._RowPlans.plans) == 4  # (M = 1 took the same plans)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [f(static) for f in ops]
    new = _wide_range((4, 256), torch.bfloat16, "cuda")
    static.copy_(new)
    graph.replay()
    for f, got in zip(ops, outs):
        for g, e in zip(got, f(new)):
            assert torch.equal(g, e)

def test_row_kernels_launch_as_dependents(device, monkeypatch):
    """On Hopper the row kernels are launched as programmatic dependents (ops/common.as_dependent:
    PDL, the kernel waiting first, and launch_pdl), so that a W4A8 GEMM or the decode attention
    that releases early hides their launch (docs/perf_log.md v52); on the CPU and with
    SAILFISH_PDL=0 they are plain launches, and the numbers are the same either way."""
    from sailfish.ops.common import as_dependent
    from sailfish.runtime import device as D

    dev = 0 if device == "cuda" else -1
    want = {"PDL": True, "launch_pdl": True} if D.pdl(dev) else {}
    assert as_dependent(dev) == want and as_dependent(-1) == {}
    monkeypatch.setenv("SAILFISH_PDL", "0")
    assert as_dependent(dev) == {}
    monkeypatch.delenv("SAILFISH_PDL")
    x = _wide_range((3, 4096), torch.float16, device)
    w = torch.rand(4096, device=device).half() + 0.5
    R._RowPlans.plans.clear()
    q, sc = R.rms_norm_launch(x, w, EPS, "int8")
    if device == "cuda":
        (launch,) = R._RowPlans.plans.values()
        assert {k: launch.meta.get(k) for k in want} == want and ("PDL" in launch.meta) == bool(want)
    assert_quant_of(q, sc, R.rms_norm_launch(x, w, EPS))


_SM90_CHILD = r"""
import triton
from triton.backends.compiler import GPUTarget
from sailfish.kernels.rowwise import rowwise_kernel
from sailfish.tools.ptx import ast_source

sig = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "s_ptr": "*fp32", "M": "i32", "n": "i32",
       "stride_am": "i32", "inner": "i32", "stride_ai": "i32", "eps": "fp32"}
for rms, quant, bk, rows, dt in [(True, None, 128, 16, "*fp16"), (True, "*i8", 4096, 1, "*bf16"),
                                 (False, "*i8", 16384, 1, "*bf16"), (False, None, 1024, 2, "*fp16"),
                                 (True, "*fp8e4nv", 4096, 1, "*bf16")]:
    s = dict(sig, a_ptr=dt, w_ptr=dt, out_ptr=quant or dt)
    consts = dict(RMS=rms, BLOCK_K=bk, ROWS=rows, ONE_PASS=bk != 4096, QUANT=quant is not None,
                  FP8=quant == "*fp8e4nv", EMU_BF16=False)
    ptx = triton.compile(ast_source(rowwise_kernel, s, consts), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4 if bk * rows <= 2048 else 16}).asm["ptx"]
    # IEEE divisions (the mean, silu, the quantizer's scale); silu * up and the quantization
    # round each product once (no fma; RMSNorm's come from its sum of squares)
    assert "div.rn.f32" in ptx and "div.full" not in ptx, consts
    assert rms or "fma" not in ptx, consts
# the split-row silu_mul_quant (Llama-3-8B's 14336 channels: 7 parts of 2048, a 16384-wide last pass)
from sailfish.kernels.rowwise import silu_mul_quant_split_kernel
from sailfish.tools.ptx import ptxas_report
for dt, codes in [("*fp16", "*i8"), ("*bf16", "*fp8e4nv")]:
    s = {"a_ptr": dt, "h_ptr": dt, "pam_ptr": "*fp32", "out_ptr": codes, "s_ptr": "*fp32", "sync_ptr": "*i32",
         "M": "i32", "n": "i32", "stride_am": "i32"}
    consts = dict(BLOCK_K=2048, PARTS=8, BLOCK_Q=16384, FP8=codes == "*fp8e4nv", EMU_BF16=False)
    ptx = triton.compile(ast_source(silu_mul_quant_split_kernel, s, consts), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 16}).asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full" not in ptx, consts
    assert consts["FP8"] or "fma" not in ptx, consts  # (fp8's encoding has its own, as rowwise_kernel's)
    assert ".acq_rel.add" in ptx and "ld.global.cg" in ptx, consts  # (the row counter, h read past L1)
    rep = ptxas_report(ptx)
    assert " 0 bytes spill stores" in rep, rep[-400:]
# launched as programmatic dependents (ops/common.as_dependent): griddepcontrol.wait comes before
# every global load and atomic, in the PTX and in the SASS (ACQBULK before the first LDG / ATOM)
from sailfish.kernels.rowwise import add_rms_norm_quant_kernel
from sailfish.kernels.w4a8 import _quantize_per_token_kernel
from sailfish.tools.ptx import sass
dependents = [
    (rowwise_kernel, dict(sig, out_ptr="*i8"), dict(RMS=True, BLOCK_K=4096, ROWS=1, ONE_PASS=True, QUANT=True,
                                                    FP8=False, EMU_BF16=False), 8),
    (silu_mul_quant_split_kernel, {"a_ptr": "*fp16", "h_ptr": "*fp16", "pam_ptr": "*fp32", "out_ptr": "*i8",
                                   "s_ptr": "*fp32", "sync_ptr": "*i32", "M": "i32", "n": "i32", "stride_am": "i32"},
     dict(BLOCK_K=2048, PARTS=8, BLOCK_Q=16384, FP8=False, EMU_BF16=False), 16),
    (add_rms_norm_quant_kernel, {"a_ptr": "*fp16", "b_ptr": "*fp16", "w_ptr": "*fp16", "sum_ptr": "*fp16",
                                 "out_ptr": "*i8", "s_ptr": "*fp32", "M": "i32", "n": "i32", "eps": "fp32"},
     dict(BLOCK_K=4096, ROWS=1, FP8=False, EMU_BF16=False), 8),
    (_quantize_per_token_kernel, {"x_ptr": "*fp16", "xq_ptr": "*i8", "s_ptr": "*fp32", "K": "i32", "stride_xm": "i32",
                                  "stride_qm": "i32"}, dict(BLOCK_K=4096, ONE_PASS=True, FP8=False), 8),
]
for fn, s, consts, warps in dependents:
    for on in (False, True):
        k = triton.compile(ast_source(fn, s, dict(consts, PDL=on)), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "launch_pdl": on})
        lines = [ln.strip() for ln in k.asm["ptx"].splitlines()]
        waits = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")]
        mem = [i for i, ln in enumerate(lines) if "ld.global" in ln or "atom.global" in ln]
        assert len(waits) == on and (not on or waits[0] < mem[0]), (fn.__name__, on)
        if on:
            code = sass(k.asm["cubin"]).splitlines()
            acq = next(i for i, ln in enumerate(code) if "ACQBULK" in ln)
            assert acq < next(i for i, ln in enumerate(code) if "LDG" in ln or "ATOM" in ln), fn.__name__
print("checked")
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernel itself")
def test_kernel_compiles_for_sm90(tmp_path):
    """The interpreter does not run Triton's compiler: compile the kernel's variants for sm_90."""
    from helpers import run_compile_child
    run_compile_child(_SM90_CHILD, tmp_path)
