"""W4A16 outputs checked per element (helpers.elementwise_bound), up to K = 28672.

Each element must lie within the rounding of one fp32-accumulated result of the exact
float64 product x @ W_eff.T (+ bias), W_eff = layer.dequantize(): output rounding to the
layer dtype plus a worst-case fp32 accumulation term that grows with K. The checker itself
is tested first: it must reject the faults a global norm lets through.
On CPU the kernels run in Triton's interpreter (tests/conftest.py): small M and N there.
"""
import pytest
import torch

from helpers import (DTYPE_NAMES, assert_close_per_element, check_per_element, make_g_idx,
                     random_quantized)
from sailfish import Config, QuantLinear
from sailfish.ops.w4a16 import w4a16_launch

F16, BF16 = torch.float16, torch.bfloat16


def make_layer(k, n, gs, sym, gidx, dtype, bias, device):
    qw = random_quantized(k, n, gs, sym, dtype, make_g_idx(gidx, k, gs, device), device)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return QuantLinear.from_quantized(qw, b)


# ----------------------------------------------------------------------------------
# the checker can fail
# ----------------------------------------------------------------------------------
def fp16_tile_accumulation(x, w, block_k):
    """A faulty kernel's numbers: fp32 products within each K tile, the running sum kept
    in fp16 across tiles."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=F16)
    for k0 in range(0, x.shape[1], block_k):
        acc = (acc.float() + x[:, k0:k0 + block_k].float() @ w[:, k0:k0 + block_k].T).half()
    return acc


@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
def test_checker_rejects_faults(dtype):
    k, n, m = 4096, 64, 4
    w = random_quantized(k, n, 128, False, dtype).dequantize()
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    ref = x.double() @ w.double().T + bias.double()
    good = ref.to(dtype)  # correctly rounded: the best a kernel can do
    assert check_per_element(good, x, w, bias) is None
    # a correct fp32 accumulation in another order passes too
    assert check_per_element((x.float() @ w.T + bias.float()).to(dtype), x, w, bias) is None

    one = good.clone()
    i, j = divmod(int(ref.abs().argmax()), n)
    one[i, j] = (ref[i, j] * 1.1).to(dtype)
    assert "1 of 256 elements" in check_per_element(one, x, w, bias)

    row = good.clone()
    row[2] = (ref[2] * 1.01).to(dtype)
    assert check_per_element(row, x, w, bias) is not None

    nan = good.clone()
    nan[0, 0] = float("nan")
    assert check_per_element(nan, x, w, bias) is not None

    if dtype == F16:  # the failure the issue measured (8.5e-4 global error at K = 4096)
        assert check_per_element(fp16_tile_accumulation(x, w, 128) + bias, x, w, bias) is not None


# ----------------------------------------------------------------------------------
# kernels against the bound
# ----------------------------------------------------------------------------------
#   M    K      N    gs   sym    g_idx      dtype bias
CASES = [
    (1, 28672, 16, 128, True, "none", F16, False),     # GEMV (split-K), Llama-70B down K
    (2, 28672, 8, 128, False, "descact", BF16, True),   # tensor-core tiles
    (3, 28672, 16, -1, True, "none", BF16, False),
    (1, 8192, 16, 64, False, "gidx", BF16, True),
    (3, 4096, 64, 32, True, "gidx", F16, True),
    (17, 400, 136, 128, False, "descact", F16, False),
    (64, 272, 200, 256, True, "none", BF16, True),
]


def case_id(m, k, n, gs, sym, gidx, dtype, bias):
    return "-".join([f"M{m}", f"K{k}", f"N{n}", f"g{gs}", "sym" if sym else "asym", gidx,
                     DTYPE_NAMES[dtype]] + (["bias"] if bias else []))


@pytest.mark.parametrize("m,k,n,gs,sym,gidx,dtype,bias", CASES, ids=[case_id(*c) for c in CASES])
def test_layer_per_element(m, k, n, gs, sym, gidx, dtype, bias, device):
    layer = make_layer(k, n, gs, sym, gidx, dtype, bias, device)
    x = torch.randn(m, k, device=device).to(dtype)
    assert_close_per_element(layer(x), x, layer.dequantize(), layer.bias)


PATHS = [(Config(1, 16, 512, 1, kernel="gemv"), F16), (Config(4, 16, 256, 4, kernel="gemv"), BF16),
         (Config(16, 64, 128, 1), BF16), (Config(16, 64, 256, 7), F16),
         (Config(1, 64, 256, 1, kernel="dequant"), F16)]


def path_id(case):
    c, dtype = case
    return f"{c.kernel}-bm{c.BLOCK_M}-bk{c.BLOCK_K}-s{c.SPLIT_K}-{DTYPE_NAMES[dtype]}"


@pytest.mark.parametrize("cfg,dtype", PATHS, ids=[path_id(c) for c in PATHS])
def test_paths_per_element_k28672(cfg, dtype, device):
    """Every W4A16 path, explicitly configured (split-K too), at the largest Llama K."""
    k, n, m = 28672, 16, min(cfg.BLOCK_M, 3)
    layer = make_layer(k, n, 128, False, "none", dtype, True, device)
    x = torch.randn(m, k, device=device).to(dtype)
    y = w4a16_launch(x, layer.qweight, layer.scales, layer.zeros, None, None, layer.bias,
                     k, 128, config=cfg)
    assert_close_per_element(y, x, layer.dequantize(), layer.bias)
