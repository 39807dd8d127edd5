"""Batch invariance: a token's output does not depend on what else is in the batch, bit for bit.

W4A8 with int8 activations is batch-invariant with every config (its int32 sums are exact;
tests/test_w4a8.py::test_int8_outputs_are_batch_invariant). W4A16 and W4A8 with fp8 activations
are in batch-invariant mode (sailfish.set_batch_invariant / SAILFISH_BATCH_INVARIANT=1), which runs
every M on one tensor-core tile with one K order (ops/w4a16.invariant_config). Without a GPU the
kernels run in Triton's interpreter; on a GPU the same tests check the compiled kernels, whose
default configs (GEMV, split-K, Gluon kernels) differ from M to M.

On the CPU the interpreter's tl.dot goes through numpy's BLAS, whose summation order depends on the
matrix size and the CPU, so random data cannot show bit-identical rows there (5 of 8000 outputs
differed by 1.5e-5 on one CPU). What the interpreter can show honestly: every M takes a config with
the same K order (BLOCK_K, split, scale placement), and with data whose products and partial sums
are exact in fp32 in any order (small integer activations, power-of-two scales) every row slice is
bit-identical to the whole batch and to the reference. The random-data checks run on the GPU.
"""
import dataclasses

import pytest
import torch

import sailfish
import sailfish.ops.w4a16 as ops16
from helpers import assert_close_per_element, make_g_idx, random_quantized
from sailfish import QuantLinear, QuantLinearW4A8, batch_invariant_mode
from sailfish.tuning import clear_caches

F16, BF16 = torch.float16, torch.bfloat16
# (lo, hi) row slices of one batch of M = 150: single tokens, small batches, every M bucket
SLICES = ((0, 1), (7, 8), (3, 5), (10, 27), (40, 80), (0, 64), (17, 150))


@pytest.fixture(autouse=True)
def _mode_restored():
    previous = sailfish.batch_invariant()
    yield
    sailfish.set_batch_invariant(previous)


@pytest.fixture
def invariant_calls(monkeypatch):
    """(M, config) for each call in which the launchers took batch-invariant mode's config."""
    clear_caches()  # a plan cached by an earlier test of the same problem would skip the choice
    calls = []
    real = ops16.invariant_config

    def spy(M, N, Kp):
        config = real(M, N, Kp)
        calls.append((M, config))
        return config

    monkeypatch.setattr(ops16, "invariant_config", spy)
    import sailfish.ops.w4a8 as ops8
    monkeypatch.setattr(ops8, "invariant_config", spy)
    return calls


def _k_order(configs):
    """What decides each output element's K order: everything of a config but the tile's M / N
    extent, warps and stages."""
    return {(c.kernel, c.BLOCK_K, c.SPLIT_K, c.scale_acc) for c in configs}


def _exact_data(qw, m, k, dtype, device):
    """The weight with power-of-two scales (2^-4 .. 2^-8, both signs) and integer activations in
    [-4, 4]: |x * s * (q - z)| <= 4 * 2^-4 * 16 in steps of 2^-8, so every product and every
    partial sum over K = 512 is an integer below 2^19 times 2^-8, exact in fp32 in any order."""
    g = qw.scales.shape[0]
    exp = torch.randint(4, 9, (g, qw.scales.shape[1]), device=device).float()
    sign = torch.where(torch.rand(exp.shape, device=device) < 0.1, -1.0, 1.0)
    scales = (sign * torch.exp2(-exp)).to(dtype)
    qw = dataclasses.replace(qw, scales=scales)
    x = torch.randint(-4, 5, (m, k), device=device).to(dtype)
    return qw, x


@pytest.mark.parametrize("data", ["random", "exact"])
@pytest.mark.parametrize("gs,sym,dtype,gidx", [
    (128, True, F16, "none"), (-1, True, F16, "none"), (128, False, BF16, "none"), (32, False, F16, "descact"),
    (64, True, BF16, "gidx"),
], ids=["g128-sym-fp16", "chan-fp16", "g128-asym-bf16", "g32-actorder", "g64-gidx-bf16"])
def test_w4a16_rows_are_batch_invariant(gs, sym, dtype, gidx, data, device, invariant_calls):
    if data == "random" and device == "cpu":
        pytest.skip("random data: the interpreter's tl.dot sums in the order of numpy's BLAS, which "
                    "depends on the shape and the CPU (checked on the GPU; 'exact' runs here)")
    k, n, m = 512, 200, 150
    qw = random_quantized(k, n, gs, sym, dtype, make_g_idx(gidx, k, gs, device), device=device)
    x = torch.randn(m, k, device=device).to(dtype)
    if data == "exact":
        qw, x = _exact_data(qw, m, k, dtype, device)
    layer = QuantLinear.from_quantized(qw, torch.randn(n, device=device).to(dtype))
    layer(x[:1])  # the default path first: its cached plan must not serve the mode's calls
    with batch_invariant_mode():
        y = layer(x)
        for lo, hi in SLICES:
            assert torch.equal(layer(x[lo:hi]), y[lo:hi]), (lo, hi)
    if data == "exact":  # exact sums: the kernel's rows equal the fp32 reference's bits too
        ref = x.float() @ layer.dequantize().T.to(device) + layer.bias.float()
        assert torch.equal(y, ref.to(dtype))
    # (on a GPU a later call of the same M bucket takes the plan cached by the first)
    ms = {mm for mm, _ in invariant_calls}
    assert m in ms and ms <= {hi - lo for lo, hi in SLICES} | {m}
    assert len(_k_order(c for _, c in invariant_calls)) == 1
    assert not sailfish.batch_invariant()


def test_w4a8_fp8_rows_are_batch_invariant(device, invariant_calls):
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 activations need sm_89+")
    k, n, m = 512, 200, 150
    lin = torch.nn.Linear(k, n, device=device)
    layer = QuantLinearW4A8.from_linear(lin, group_size=128, act_dtype="fp8")
    x = torch.randn(m, k, device=device).to(F16)
    with batch_invariant_mode():
        y = layer(x)
        for lo, hi in SLICES:
            got = layer(x[lo:hi])
            if device == "cuda":
                assert torch.equal(got, y[lo:hi]), (lo, hi)
            else:  # BLAS order (module docstring): each slice against the reference, per element
                x_q, x_s = layer.quantize_input(x[lo:hi])
                x_eff = x_q.float() * x_s.float().reshape(-1, 1)
                assert_close_per_element(got, x_eff, layer.dequantize(), layer.bias)
    ms = {mm for mm, _ in invariant_calls}
    assert ms == {hi - lo for lo, hi in SLICES} | {m} or device == "cuda"
    assert len(_k_order(c for _, c in invariant_calls)) == 1


def test_int8_w4a8_keeps_its_configs(device, invariant_calls):
    """int8 W4A8 is batch-invariant anyway: the mode leaves its (faster) configs alone."""
    layer = QuantLinearW4A8.from_linear(torch.nn.Linear(512, 200, device=device), group_size=-1)
    x = torch.randn(20, 512, device=device).to(F16)
    with batch_invariant_mode():
        y = layer(x)
    assert torch.equal(y, layer(x)) and not invariant_calls


@pytest.mark.parametrize("n,kp,split", [(4096, 4096, 8), (4096, 14336, 8), (57344, 8192, 1), (200, 512, 4)])
def test_invariant_configs_share_the_k_order(n, kp, split):
    """Only BLOCK_M / BLOCK_N / warps follow M; the K tiling, split and scale placement depend on
    the shape alone (not on the GPU either)."""
    cfgs = [ops16.invariant_config(m, n, kp) for m in (1, 16, 17, 33, 64, 65, 4096)]
    assert {(c.kernel, c.BLOCK_K, c.SPLIT_K, c.scale_acc) for c in cfgs} == {("mma", 128, split, False)}
    assert [c.BLOCK_M for c in cfgs] == [16, 16, 32, 64, 64, 128, 128]


@pytest.mark.parametrize("value", [1, "yes", None])
def test_set_batch_invariant_takes_a_bool(value):
    with pytest.raises(TypeError, match="enabled must be a bool"):
        sailfish.set_batch_invariant(value)


def test_mode_context_restores():
    sailfish.set_batch_invariant(False)
    with batch_invariant_mode():
        assert sailfish.batch_invariant()
        with batch_invariant_mode(False):
            assert not sailfish.batch_invariant()
        assert sailfish.batch_invariant()
    assert not sailfish.batch_invariant()
