"""Launchers and torch.library ops, one module per kernel family.

Device policy for every op: CUDA tensors run the Triton kernels. CPU tensors run the
same Triton kernels through Triton's interpreter when TRITON_INTERPRET=1 is set before
triton is first imported; otherwise the op computes the identical math with the
PyTorch reference, so a CPU model still gives the numbers.
"""
import contextlib
import os

import torch


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or (x.device.type == "cpu" and interpreter_enabled())


def device_of(x: torch.Tensor):
    """Context for launching kernels on x's data: torch.cuda.device(x.device) for a CUDA
    tensor, a no-op otherwise. Triton launches on the *current* CUDA device, so without it
    tensors on cuda:1 while cuda:0 is current fail ("Pointer argument cannot be accessed
    from Triton (cpu tensor?)"); the previous device is restored on exit."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


from . import w4a16  # noqa: E402,F401  (registers torch.ops.sailfish.w4a16_gemm)
from . import w4a8  # noqa: E402,F401  (registers sailfish::quantize_per_token, sailfish::w4a8_gemm)
from . import autograd  # noqa: E402,F401  (input-gradient formulas; sailfish::w4a8_linear)
