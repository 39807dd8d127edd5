"""W4A16: a NaN or Inf in an input row must make that row's outputs non-finite (as F.linear
does) and leave every other row as it is. (A file of its own: tests/test_w4a16.py is being
rewritten with the W4A16 layout.)"""
import pytest
import torch

from helpers import DTYPE_NAMES, TOL, rel_err
from sailfish import QuantLinear


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch):
    monkeypatch.setenv("SAILFISH_AUTOTUNE", "0")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, interpreter
@pytest.mark.parametrize("m", [1, 5, 20], ids=lambda m: f"M{m}")  # GEMV, small and larger tiles
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_NAMES.get)
def test_nonfinite_rows(m, dtype, device):
    k, n = 256, 72
    lin = torch.nn.Linear(k, n, dtype=dtype, device=device)
    layer = QuantLinear.from_linear(lin, group_size=128)
    x = torch.randn(m, k, device=device).to(dtype)
    bad = torch.zeros(m, dtype=torch.bool, device=device)
    x[0, 7] = float("nan")
    bad[0] = True
    if m > 1:
        x[2, k - 1] = float("inf")
        x[3, 0] = float("-inf")
        bad[2:4] = True
    y = layer(x)
    assert y[0].isnan().all()  # NaN in, NaN out, for every output channel
    assert not torch.isfinite(y[bad]).any()  # +-Inf in: +-Inf or NaN out
    good = ~bad
    if good.any():
        assert torch.isfinite(y[good]).all()
        ref = x[good].float() @ layer.dequantize().T + layer.bias.float()
        assert rel_err(y[good], ref) <= TOL[dtype]
