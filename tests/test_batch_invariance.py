"""Batch invariance: a token's output does not depend on what else is in the batch, bit for bit.

W4A8 with int8 activations is batch-invariant with every config (its int32 sums are exact;
tests/test_w4a8.py::test_int8_outputs_are_batch_invariant). W4A16 and W4A8 with fp8 activations
are in batch-invariant mode (sailfish.set_batch_invariant / SAILFISH_BATCH_INVARIANT=1), which runs
every M on one tensor-core tile with one K order (ops/w4a16.invariant_config). Without a GPU the
kernels run in Triton's interpreter; on a GPU the same tests check the compiled kernels, whose
default configs (GEMV, split-K, Gluon kernels) differ from M to M.
"""
import pytest
import torch

import sailfish
import sailfish.ops.w4a16 as ops16
from helpers import make_g_idx, random_quantized
from sailfish import QuantLinear, QuantLinearW4A8, batch_invariant_mode

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
    """The Ms for which the launchers took batch-invariant mode's config."""
    calls = []
    real = ops16.invariant_config

    def spy(M, N, Kp):
        calls.append(M)
        return real(M, N, Kp)

    monkeypatch.setattr(ops16, "invariant_config", spy)
    import sailfish.ops.w4a8 as ops8
    monkeypatch.setattr(ops8, "invariant_config", spy)
    return calls


@pytest.mark.parametrize("gs,sym,dtype,gidx", [
    (128, True, F16, "none"), (-1, True, F16, "none"), (128, False, BF16, "none"), (32, False, F16, "descact"),
    (64, True, BF16, "gidx"),
], ids=["g128-sym-fp16", "chan-fp16", "g128-asym-bf16", "g32-actorder", "g64-gidx-bf16"])
def test_w4a16_rows_are_batch_invariant(gs, sym, dtype, gidx, device, invariant_calls):
    k, n, m = 512, 200, 150
    qw = random_quantized(k, n, gs, sym, dtype, make_g_idx(gidx, k, gs, device), device=device)
    layer = QuantLinear.from_quantized(qw, torch.randn(n, device=device).to(dtype))
    x = torch.randn(m, k, device=device).to(dtype)
    layer(x[:1])  # the default path first: its cached plan must not serve the mode's calls
    with batch_invariant_mode():
        y = layer(x)
        for lo, hi in SLICES:
            assert torch.equal(layer(x[lo:hi]), y[lo:hi]), (lo, hi)
    # (on a GPU a later call of the same M bucket takes the plan cached by the first)
    assert m in invariant_calls and set(invariant_calls) <= {hi - lo for lo, hi in SLICES} | {m}
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
            assert torch.equal(layer(x[lo:hi]), y[lo:hi]), (lo, hi)
    assert invariant_calls


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
