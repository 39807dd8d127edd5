"""W4A16 kernel against the reference x.float() @ W_eff.T (+ bias), W_eff = layer.dequantize().

On CPU these run the Triton kernels in the interpreter (tests/conftest.py), on CUDA on the GPU.
"""
import pytest
import torch

from helpers import DTYPE_NAMES, TOL, make_g_idx, random_quantized, rel_err, run_compile_child
from sailfish.runtime.flags import FLAGS
from sailfish import Config, QuantLinear
from sailfish.ops import use_triton
from sailfish.ops.w4a16 import gemv_on_tensor_cores, w4a16_launch

F16, BF16 = torch.float16, torch.bfloat16

# A pairwise-style selection, not the cartesian product: every pair of
# (group size, sym, g_idx mode, dtype, bias, M) values occurs at least once, with N not
# a multiple of 64 (136, 200), K not a multiple of 128 (272, 400) and, for most cases,
# a ragged last group (K % group_size != 0).
#   M    K    N    gs   sym    g_idx      dtype bias
CASES = [
    (1, 400, 136, 128, True, "none", F16, True),
    (1, 272, 200, 64, False, "gidx", BF16, False),
    (1, 1024, 256, 256, False, "descact", F16, False),
    (1, 512, 64, -1, True, "none", BF16, True),
    (1, 400, 200, 32, True, "descact", BF16, True),
    (1, 4096, 512, 128, True, "none", F16, False),      # Llama K, decode
    (2, 272, 200, 32, False, "none", BF16, True),
    (2, 400, 64, -1, False, "none", F16, False),
    (2, 512, 136, 128, True, "gidx", F16, True),
    (2, 400, 256, 256, True, "descact", BF16, False),
    (2, 272, 256, 64, True, "none", F16, False),
    (3, 400, 200, 64, True, "descact", F16, False),
    (3, 400, 64, 256, False, "gidx", F16, True),
    (3, 272, 136, 128, False, "none", BF16, True),
    (3, 272, 200, -1, False, "none", BF16, False),
    (3, 400, 136, 32, False, "gidx", F16, False),
    (16, 512, 136, -1, True, "none", BF16, False),
    (16, 400, 256, 256, True, "descact", BF16, True),
    (16, 272, 64, 32, False, "gidx", F16, False),
    (16, 400, 200, 64, False, "none", F16, True),
    (16, 400, 136, 128, False, "descact", BF16, False),
    (17, 272, 136, 128, False, "gidx", BF16, False),
    (17, 1024, 200, -1, False, "none", F16, True),
    (17, 400, 64, 32, True, "descact", F16, True),
    (17, 400, 200, 256, False, "none", F16, False),
    (17, 512, 256, 64, True, "gidx", BF16, True),
    (64, 400, 136, 32, True, "gidx", F16, True),
    (64, 272, 256, 64, False, "descact", BF16, True),
    (64, 512, 200, 256, True, "none", F16, False),
    (64, 400, 64, 128, False, "gidx", BF16, False),
    (64, 272, 136, -1, True, "none", F16, True),
    (100, 400, 200, 128, False, "descact", F16, False),
    (100, 512, 136, 256, True, "gidx", BF16, True),
    (100, 272, 64, 32, False, "none", BF16, False),
    (100, 400, 256, -1, True, "none", BF16, True),
    (100, 272, 136, 64, True, "none", F16, True),
    # K a multiple of 128 but not of 256 (the padded K): K tiles past K must be masked
    (4, 384, 136, 64, False, "gidx", F16, True),
    (17, 896, 200, 128, True, "gidx", BF16, False),
]


def case_id(m, k, n, gs, sym, gidx, dtype, bias):
    parts = [f"M{m}", f"K{k}", f"N{n}", f"g{gs}", "sym" if sym else "asym"]
    if gidx != "none":
        parts.append(gidx)
    parts.append(DTYPE_NAMES[dtype])
    if bias:
        parts.append("bias")
    return "-".join(parts)


def test_kernels_are_used(device):
    """The suite checks the Triton kernels: on CPU through the interpreter, not the
    PyTorch fallback (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU)."""
    assert use_triton(torch.empty(1, device=device))


def make_layer(k, n, gs, sym, gidx, dtype, bias, device):
    qw = random_quantized(k, n, gs, sym, dtype, make_g_idx(gidx, k, gs, device), device)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    layer = QuantLinear.from_quantized(qw, b)
    assert layer.act_order == (gidx != "none")
    return layer


def reference(layer, x):
    ref = x.float() @ layer.dequantize().T
    if layer.bias is not None:
        ref = ref + layer.bias.float()
    return ref


@pytest.mark.parametrize("m,k,n,gs,sym,gidx,dtype,bias",
                         [pytest.param(*c, id=case_id(*c)) for c in CASES])
def test_matches_reference(m, k, n, gs, sym, gidx, dtype, bias, device):
    layer = make_layer(k, n, gs, sym, gidx, dtype, bias, device)
    x = torch.randn(m, k, device=device).to(dtype)
    y = layer(x)
    assert y.shape == (m, n) and y.dtype == dtype and y.device == x.device
    assert torch.isfinite(y).all()
    assert rel_err(y, reference(layer, x)) <= TOL[dtype]


def test_leading_dims_and_strides(device):
    layer = make_layer(272, 136, 64, False, "descact", F16, True, device)
    x = torch.randn(2, 3, 272, device=device).to(F16)
    y = layer(x)
    assert y.shape == (2, 3, 136)
    assert torch.equal(y.reshape(6, 136), layer(x.reshape(6, 272)))
    xt = torch.randn(272, 5, device=device).to(F16).T  # not contiguous
    assert torch.equal(layer(xt), layer(xt.contiguous()))


# Explicit kernel configs: split-K (including splits that divide the K tiles unevenly
# and one split left with no K tile), BLOCK_K below and above the group size (one or two
# 128-channel chunks of the fragment-order layout), large BLOCK_M.
CONFIGS = [
    Config(16, 64, 128, 1),
    Config(16, 64, 256, 4),
    Config(32, 32, 128, 2),
    Config(64, 64, 128, 1),
    Config(16, 64, 128, 3),    # K=784 (Kp=1024): 8 K tiles over 3 splits, 3 + 3 + 2
    Config(16, 128, 256, 3),   # 4 K tiles over 3 splits, 2 + 2 + 0 (an empty split)
    Config(128, 64, 128, 1, GROUP_M=2),
]
#   M    K    N    gs    sym    g_idx      dtype bias
CONFIG_CASES = [
    (1, 784, 136, 128, True, "none", F16, True),
    (5, 784, 200, 64, False, "descact", BF16, False),
    (33, 784, 136, 32, False, "gidx", F16, True),
    (100, 784, 64, 256, True, "none", BF16, True),
    (3, 784, 136, -1, False, "none", F16, False),
]


def cfg_id(c):
    return f"BM{c.BLOCK_M}-BN{c.BLOCK_N}-BK{c.BLOCK_K}-SK{c.SPLIT_K}-GM{c.GROUP_M}"


def launch(layer, x, cfg):
    p = layer.packed()
    return w4a16_launch(x, p.qweight, p.scales, p.zeros, p.perm, p.sorted_g_idx, layer.bias,
                        p.in_features, p.group_size, config=cfg)


@pytest.mark.parametrize("cfg", [pytest.param(c, id=cfg_id(c)) for c in CONFIGS])
@pytest.mark.parametrize("m,k,n,gs,sym,gidx,dtype,bias",
                         [pytest.param(*c, id=case_id(*c)) for c in CONFIG_CASES])
def test_explicit_config(m, k, n, gs, sym, gidx, dtype, bias, cfg, device):
    layer = make_layer(k, n, gs, sym, gidx, dtype, bias, device)
    x = torch.randn(m, k, device=device).to(dtype)
    y = launch(layer, x, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    assert torch.isfinite(y).all()
    assert rel_err(y, reference(layer, x)) <= TOL[dtype]
    if cfg.SPLIT_K > 1:  # the split-K reduction is deterministic by design
        assert torch.equal(y, launch(layer, x, cfg))


# The other two paths: CUDA-core GEMV (BLOCK_M >= M) and dequantize + cuBLAS.
PATH_CONFIGS = [
    Config(1, 16, 512, 1, kernel="gemv"),
    Config(1, 32, 256, 3, kernel="gemv"),   # 784 -> 4 K tiles over 3 splits
    Config(4, 16, 256, 1, kernel="gemv"),
    Config(8, 64, 128, 2, kernel="gemv"),
    Config(1, 64, 256, 1, kernel="dequant"),
    Config(1, 32, 128, 1, kernel="dequant"),
]
#   M    K    N    gs    sym    g_idx      dtype bias
PATH_CASES = [
    (1, 784, 136, 128, True, "none", F16, True),
    (1, 784, 200, 32, False, "gidx", BF16, False),
    (3, 784, 64, -1, False, "none", BF16, True),
    (1, 784, 136, 64, True, "descact", F16, False),
]


def path_id(c):
    return (f"{c.kernel}-BM{c.BLOCK_M}-BN{c.BLOCK_N}-BK{c.BLOCK_K}-SK{c.SPLIT_K}-w{c.num_warps}"
            + ("-sa" if c.scale_acc else ""))


@pytest.mark.parametrize("m,k,n,gs,sym,gidx,dtype,bias,cfg", [
    pytest.param(*case, cfg, id=f"{case_id(*case)}-{path_id(cfg)}")
    for case in PATH_CASES for cfg in PATH_CONFIGS
    if not (cfg.kernel == "gemv" and case[0] > cfg.BLOCK_M)])  # gemv needs BLOCK_M >= M
def test_gemv_and_dequant_paths(m, k, n, gs, sym, gidx, dtype, bias, cfg, device):
    layer = make_layer(k, n, gs, sym, gidx, dtype, bias, device)
    x = torch.randn(m, k, device=device).to(dtype)
    y = launch(layer, x, cfg)
    assert y.shape == (m, n) and torch.isfinite(y).all()
    assert rel_err(y, reference(layer, x)) <= TOL[dtype]


def test_gemv_refuses_large_m(device):
    layer = make_layer(400, 64, 128, True, "none", F16, False, device)
    with pytest.raises(ValueError, match="BLOCK_M >= M"):
        launch(layer, torch.randn(3, 400, device=device).to(F16), Config(2, 16, 256, 1, kernel="gemv"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the inline-asm dequant runs on CUDA only")
@pytest.mark.parametrize("cfg", [Config(1, 16, 256, 1, kernel="gemv"), Config(16, 64, 128, 2),
                                 Config(64, 64, 256, 1), Config(1, 64, 256, 1, kernel="dequant")],
                         ids=path_id)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("gs,sym", [(128, True), (32, False), (-1, False)], ids=["g128-sym", "g32-asym", "g-1-asym"])
def test_asm_dequant_matches_pure_triton(gs, sym, dtype, cfg):
    """The lop3/half2 inline asm and its pure-Triton twin (what the interpreter runs)
    produce bit-identical outputs. The tensor-core GEMV (group sizes of whole 128-channel
    chunks) sums on the tensor cores, in another order than its twin: both must lie within
    the per-element bound there (its exact dequantization: test_w4a16_gemv.py, one-hot x)."""
    layer = make_layer(784, 200, gs, sym, "none", dtype, True, "cuda")
    x = torch.randn(1 if cfg.kernel == "gemv" else 17, 784, device="cuda").to(dtype)
    p = layer.packed()
    args = (x, p.qweight, p.scales, p.zeros, p.perm, p.sorted_g_idx, layer.bias, p.in_features, p.group_size)
    y_asm, y_pure = w4a16_launch(*args, config=cfg, use_asm=True), w4a16_launch(*args, config=cfg, use_asm=False)
    if cfg.kernel == "gemv" and gemv_on_tensor_cores(cfg, x, 0 if gs == -1 else gs, False):
        from helpers import assert_close_per_element

        for y in (y_asm, y_pure):
            assert_close_per_element(y, x, layer.dequantize(), layer.bias)
    else:
        assert torch.equal(y_asm, y_pure)


@pytest.mark.parametrize("cfg", [Config(16, 64, 128, 3, scale_acc=True), Config(32, 64, 256, 1, scale_acc=True),
                                 Config(16, 64, 256, 2, scale_acc=True)],
                         ids=path_id)
@pytest.mark.parametrize("gs,sym,dtype", [(128, True, F16), (128, False, BF16), (-1, False, F16),
                                          (-1, True, BF16), (256, False, F16), (64, True, F16)],
                         ids=["g128-sym-f16", "g128-asym-bf16", "g-1-asym-f16", "g-1-sym-bf16", "g256-asym-f16",
                              "g64-sym-f16"])
def test_scale_acc(gs, sym, dtype, cfg, device):
    """SCALE_ACC (the mma kernel dequantizes to q - z and multiplies the fp32 product by the
    scales, per K tile or, per channel, at the end; a BLOCK_K 256 tile of two g128 groups as
    two half tiles) stays within the per-element bound; on CUDA its unscaled asm gives the
    same bits as its pure-Triton twin. Other tiles wider than a group are refused."""
    from helpers import assert_close_per_element

    import sailfish.ops.w4a16 as ops16

    if not ops16.scale_acc_tile(cfg.BLOCK_K, gs):
        assert gs != -1 and cfg.BLOCK_K > gs and not (cfg.BLOCK_K == 2 * gs and gs >= 128)
        layer = make_layer(784, 200, gs, sym, "none", dtype, True, device)
        with pytest.raises(ValueError, match="scale_acc=True needs"):
            launch(layer, torch.randn(17, 784, device=device).to(dtype), cfg)
        return
    assert ops16.scale_acc(cfg, gs, False) and not ops16.scale_acc(cfg, gs, True)
    layer = make_layer(784, 200, gs, sym, "none", dtype, True, device)
    x = torch.randn(17, 784, device=device).to(dtype)
    y = launch(layer, x, cfg)
    # the exact s * (q - z): no weight is rounded to fp16 / bf16 on this path
    assert_close_per_element(y, x, layer.quantized_weight().dequantize(rounded=False), layer.bias)
    if device == "cuda":
        p = layer.packed()
        y_pure = w4a16_launch(x, p.qweight, p.scales, p.zeros, p.perm, p.sorted_g_idx, layer.bias, p.in_features,
                              p.group_size, config=cfg, use_asm=False)
        assert torch.equal(y, y_pure)


@pytest.mark.parametrize("cfg", [Config(16, 64, 128, 3, scale_acc=True), Config(32, 128, 128, 1, scale_acc=True)],
                         ids=path_id)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_scale_prefetch_changes_no_bit(dtype, cfg, device, monkeypatch):
    """PREFETCH_S (the next K tile's scales loaded one iteration early; on by default for
    SCALE_ACC with one group per tile and no zero points) only moves loads: the outputs are
    bit-equal with it off, including the last tile of each split-K slice (its prefetch
    address is clamped to that tile)."""
    import sailfish.ops.w4a16 as ops16

    layer = make_layer(1152, 200, 128, True, "none", dtype, True, device)
    x = torch.randn(9, 1152, device=device).to(dtype)
    assert ops16.prefetch_scales(cfg, 128) and not ops16.prefetch_scales(cfg, 128, has_zeros=True)
    assert not ops16.prefetch_scales(Config(16, 64, 256, 1, scale_acc=True), 128)  # two groups per tile
    y_on = launch(layer, x, cfg)
    monkeypatch.setattr(FLAGS, "scale_prefetch", "0")
    assert not ops16.prefetch_scales(cfg, 128)
    assert torch.equal(y_on, launch(layer, x, cfg))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel's wgmma pipelining, on the GPU")
@pytest.mark.parametrize("cfg", [Config(64, 128, 128, 8, 8, 8, 4), Config(128, 128, 128, 2, 8, 8, 3),
                                 Config(64, 128, 128, 8, 8, 4, 4, scale_acc=True)], ids=path_id)
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_long_k_loop_is_deterministic(cfg, sym):
    """Per-channel tiles whose outputs were wrong and differed run to run on an H200 with
    Triton 3.6 before ACC_FENCE (wgmmas in flight across the K loop's back edge while the
    next tile's dequantization reused their A registers; 32183 of 131072 elements off by up
    to 1e4x the bound): 64 K tiles, every element within its bound, two runs bit-equal."""
    from helpers import assert_close_per_element

    layer = make_layer(8192, 4096, -1, sym, "none", F16, False, "cuda")
    x = torch.randn(64, 8192, device="cuda").to(F16)
    y = launch(layer, x, cfg)
    w = layer.quantized_weight().dequantize(rounded=not cfg.scale_acc)
    assert_close_per_element(y, x, w, None)
    assert torch.equal(y, launch(layer, x, cfg))


@pytest.mark.parametrize("cfg", [None, Config(16, 64, 128, 2), Config(32, 32, 128, 1),
                                 Config(128, 64, 256, 1), Config(4, 16, 256, 1, kernel="gemv"),
                                 Config(4, 16, 128, 2, kernel="gemv")],
                         ids=lambda c: "heuristic" if c is None else path_id(c))
@pytest.mark.parametrize("k", [384, 896, 400])
def test_reads_nothing_past_x(k, cfg, device):
    """x may be a view into a larger buffer: what follows it (NaN here) must not reach y.
    K = 384 and 896 are multiples of 128 but not of the padded K (a multiple of 256), so
    the K tiles past K must be masked even though K % BLOCK_K == 0."""
    m, n = 3, 64
    layer = make_layer(k, n, 128, False, "none", F16, True, device)
    buf = torch.full((m * k + 4096,), float("nan"), device=device, dtype=F16)
    x = buf[:m * k].view(m, k)
    x.copy_(torch.randn(m, k, device=device))
    y = layer(x) if cfg is None else launch(layer, x, cfg)
    bad_rows = (~torch.isfinite(y).all(dim=1)).nonzero().flatten().tolist()
    assert bad_rows == []
    assert rel_err(y, reference(layer, x)) <= TOL[F16]


@pytest.mark.parametrize("cfg,match", [
    (Config(16, 64, 48, 1), "BLOCK_K=48"),
    (Config(16, 64, 64, 1), "BLOCK_K=64 must be a multiple of 128"),
    (Config(16, 48, 64, 1), "BLOCK_N=48"),
    (Config(16, 64, 1024, 1), "BLOCK_K=1024 must divide the padded K=512"),
    (Config(16, 64, 128, 5), "SPLIT_K=5 must lie in"),
    (Config(16, 64, 128, 0), "SPLIT_K=0"),
], ids=["BK48", "BK64", "BN48", "BK1024", "SK5", "SK0"])
def test_bad_config(cfg, match, device):
    layer = make_layer(400, 64, 128, True, "none", F16, False, device)
    x = torch.randn(2, 400, device=device).to(F16)
    with pytest.raises(ValueError, match=match):
        launch(layer, x, cfg)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("gs,sym,gidx", [
    (128, True, "none"), (64, False, "none"), (32, False, "descact"),
    (64, True, "gidx"), (-1, False, "none"),
], ids=["g128-sym", "g64-asym", "g32-asym-descact", "g64-sym-gidx", "g-1-asym"])
def test_identity_activations(gs, sym, gidx, dtype, device):
    """x = I gives back exactly the effective weight: the kernels dequantize bit-exactly."""
    k, n = 256, 136
    layer = make_layer(k, n, gs, sym, gidx, dtype, False, device)
    y = layer(torch.eye(k, device=device, dtype=dtype))
    assert torch.equal(y, layer.dequantize().T.to(dtype))


def test_empty_batch(device):
    layer = make_layer(256, 64, 128, True, "none", F16, True, device)
    y = layer(torch.empty(0, 256, device=device, dtype=F16))
    assert y.shape == (0, 64)


def test_from_linear_end_to_end(device):
    """A real nn.Linear through from_linear: kernel matches its effective weight, and
    the 4-bit error against the unquantized layer is what RTN at g128 gives (~10%)."""
    lin = torch.nn.Linear(512, 256, dtype=F16, device=device)
    layer = QuantLinear.from_linear(lin, group_size=128, sym=True)
    x = torch.randn(8, 512, device=device).to(F16)
    y = layer(x)
    assert rel_err(y, reference(layer, x)) <= TOL[F16]
    assert rel_err(y, lin.float()(x.float())) < 0.2


def test_dequant_path_bounds_its_transient(monkeypatch, device):
    """The large-M path dequantizes and multiplies in slices of N: with a 64 KiB cap, N = 200
    runs as slices of 64 rows (a ragged last one), and the result is the same function."""
    import sailfish.ops.w4a16 as ops16

    layer = make_layer(784, 200, 64, False, "descact", F16, True, device)
    x = torch.randn(5, 784, device=device).to(F16)
    monkeypatch.setattr(ops16, "DEQUANT_SLICE_BYTES", 64 * 1024)  # 64 KiB / (2 * 784 B) -> 64 rows
    y = launch(layer, x, Config(1, 64, 256, 1, kernel="dequant"))
    assert rel_err(y, reference(layer, x)) <= TOL[F16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="launch plans are kept for CUDA calls only")
def test_dequant_plan_steady_calls(monkeypatch):
    """The large-M path kept as a launch plan (ops/w4a16._DequantPlan): after the first call
    of a problem, later calls launch the dequantization of each slice directly with its
    pointers as ints. With 64 KiB slices (N = 200: 64-row slices and a ragged last one) the
    steady calls, on the first layer and on a second one with other buffers, give exactly
    what a fresh first call gives."""
    import sailfish.ops.w4a16 as ops16
    from sailfish.tuning import clear_caches

    monkeypatch.setattr(ops16, "DEQUANT_SLICE_BYTES", 64 * 1024)
    monkeypatch.setenv("SAILFISH_HEURISTICS_ONLY", "1")  # M >= 1024 on CUDA: the dequant path
    clear_caches()
    try:
        layers = [make_layer(784, 200, 128, False, "none", F16, True, "cuda") for _ in range(2)]
        x = torch.randn(1024, 784, device="cuda").to(F16)
        first = [launch(layers[0], x, Config(1, 64, 256, 1, kernel="dequant")),
                 launch(layers[1], x, Config(1, 64, 256, 1, kernel="dequant"))]
        for layer, want in zip(layers, first):
            p = layer.packed()
            ys = [ops16.w4a16_launch(x, p.qweight, p.scales, p.zeros, p.perm, p.sorted_g_idx, layer.bias,
                                     p.in_features, p.group_size) for _ in range(3)]
            for y in ys:
                assert torch.equal(y, want)
        plans = [pl for pl in ops16.W4A16_TUNER.plans.values() if getattr(pl, "kind", "") == "dequant"]
        assert plans and all(pl.bound() for pl in plans) and set(plans[0].launches) == {64, 8}
    finally:
        clear_caches()


_PTX_CHILD = r"""
import sys
from sailfish.tools.ptx import compile_mma, k_loop_stats, sass, shipped_mma_configs, wgmma_register_hazard
cases = [(cfg, dict(scale_acc=cfg.scale_acc)) for _, cfg in shipped_mma_configs()]
for c in [(16, 128, 256, 2, 4, 3), (64, 128, 128, 1, 4, 4), (128, 256, 128, 1, 8, 3)]:
    for kw in (dict(dtype="bf16", has_zeros=True), dict(group_size=32), dict(group_size=-1, has_zeros=True),
               dict(group_size=256)):
        cases.append((c, kw))
# tiles that gave wrong outputs without ACC_FENCE on an H200 with Triton 3.6 (per channel)
for c in [(64, 128, 128, 1, 8, 4), (128, 128, 128, 2, 8, 3), (64, 128, 128, 8, 4, 4)]:
    cases.append((c, dict(group_size=-1)))
    cases.append((c, dict(group_size=-1, acc_fence=True)))  # the fence holds on any Triton
    cases.append((c, dict(group_size=-1, scale_acc=True)))
bad, hazards = [], []
for cfg, kw in cases:
    c = cfg if isinstance(cfg, tuple) else (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.SPLIT_K, cfg.num_warps,
                                              cfg.num_stages)
    k = compile_mma(*c, **kw)
    st = k_loop_stats(k.asm["ptx"])
    if st is None or st.roundtrip:
        bad.append((c, kw, st))
    if wgmma_register_hazard(sass(k.asm["cubin"])):
        hazards.append((c, kw))
print("checked", len(cases))
sys.exit(f"dequantized tile through shared memory: {bad}; wgmma register hazard: {hazards}"
         if bad or hazards else 0)
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check for machines without a GPU")
def test_mma_tile_stays_in_registers(tmp_path):
    """The point of the fragment-order layout: compiled for sm_90a, the K loop of every shipped
    mma config (and a format matrix) feeds wgmma from registers with no shared-memory round
    trip of the dequantized tile (tools/ptx.py). A layout or compiler change that brings the
    round trip back fails here. Group size 64 is not checked: with zero points Triton still
    converts its tile through shared memory (docs/perf_log.md v9). The same kernels' SASS
    must have no wgmma register hazard (tools/ptx.wgmma_register_hazard): with the launcher's
    ACC_FENCE rule for the installed Triton, and with the fence forced on."""
    run_compile_child(_PTX_CHILD, tmp_path)


_PDL_CHILD = r"""
import triton
from triton.backends.compiler import GPUTarget
from sailfish.tools.ptx import ast_source, compile_mma
from sailfish.kernels.w4a16 import _splitk_reduce_kernel
ptx = compile_mma(16, 128, 256, 4, 4, 3, pdl_early=True).asm["ptx"]
assert ptx.count("griddepcontrol.launch_dependents") == 1 and "griddepcontrol.wait" not in ptx, "GEMM"
assert "griddepcontrol" not in compile_mma(16, 128, 256, 4, 4, 3).asm["ptx"], "PDL off"
sig = {"ws_ptr": "*fp32", "bias_ptr": "*fp16", "y_ptr": "*fp16", "M": "i32", "N": "i32", "stride_ym": "i32"}
src = ast_source(_splitk_reduce_kernel, sig, dict(SPLIT_K=4, HAS_BIAS=True, EMU_BF16=False, BLOCK=1024, PDL=True))
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
# the partial sums (the GEMM's output) are read only after the wait
assert "griddepcontrol.wait" in ptx and ptx.index("griddepcontrol.wait") < ptx.index("ld.global"), "reduce"
print("checked")
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check for machines without a GPU")
def test_split_k_chain_compiles_with_pdl(tmp_path):
    """Programmatic dependent launch of the split-K chain (ops/launch.py pdl, sm_90+): the GEMM
    releases the reduce at its start, the reduce waits before reading the partial sums; with
    PDL off nothing is emitted. The interpreter cannot run griddepcontrol, so this compiles
    for sm_90 without a GPU; on an sm_90 GPU every split-K test runs the chain with PDL on
    (the default there), e.g. test_long_k_loop_is_deterministic."""
    run_compile_child(_PDL_CHILD, tmp_path)
