"""Shared set-up for the Sailfish tests.

SAILFISH_AUTOTUNE=0 (unless set): configs come from the shipped table or the heuristic.

Without a GPU the kernel tests run the real Triton kernels in Triton's interpreter.
TRITON_INTERPRET must be in the environment before any @triton.jit function is
defined (triton reads it when a kernel module is imported), so it is set here, before
sailfish or triton is imported. Importing torch does not import triton.
"""
import os
import sys

import torch

# The kernel tests take the shipped config table or the heuristic, never the autotuner:
# on a GPU without a table, tuning would benchmark candidates inside the tested calls,
# making the path under test depend on timing (and cost minutes of compilation). The
# explicit-config tests cover every path; tests of the tuner itself set what they need.
os.environ.setdefault("SAILFISH_AUTOTUNE", "0")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "sailfish.kernels.w4a16" in sys.modules:
        raise RuntimeError("sailfish's kernels were imported before tests/conftest.py could set "
                           "TRITON_INTERPRET=1; run pytest in a fresh process")

import pytest  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    # Define the kernels now, in interpreter mode: the ops import them on first use, and a test
    # that sets TRITON_INTERPRET=0 to run the PyTorch reference (test_checkpoint's
    # reference_path) must not be the one whose first use defines them as compiled kernels,
    # which every later interpreter test would then fail to launch.
    import sailfish.kernels.w4a8  # noqa: E402,F401
    import sailfish.kernels.w4a16  # noqa: E402,F401
    import sailfish.kernels.rowwise  # noqa: E402,F401
    import sailfish.kernels.router  # noqa: E402,F401

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py


@pytest.fixture(scope="session")
def device() -> str:
    """Where the tensors live: the GPU when there is one, else the CPU (interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
