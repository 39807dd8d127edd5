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


def check_devices(fake: bool = False, **tensors) -> None:
    """Raise ValueError unless the named tensors (None skipped) share one device, CUDA or CPU
    (fake=True, for the fake kernels: any one device, e.g. meta while tracing). The ops call
    it after a cheap get_device() comparison fails or gives -1, which is the index of the CPU
    and of meta alike: comparing indices alone let a meta layer "run" on a CPU input."""
    named = {k: t.device for k, t in tensors.items() if t is not None}
    devices = set(named.values())
    if len(devices) == 1 and (fake or next(iter(devices)).type in ("cuda", "cpu")):
        return
    got = ", ".join(f"{k} on {d}" for k, d in named.items())
    where = "one device" if fake else "one CUDA device or all on the CPU"
    raise ValueError(f"the tensors must be on {where}, got {got}; move the layer to the "
                     "input's device (layer.to(x.device))")


def _probes():
    """The checks of direct_call_ok, or None if this torch lacks one (then never direct)."""
    C = torch._C
    names = ("_len_torch_dispatch_stack", "_is_torch_function_mode_enabled", "_get_tracing_state",
             "_are_functorch_transforms_active")
    if not all(hasattr(C, n) for n in names) or not hasattr(torch.autograd, "_profiler_enabled"):
        return None
    return (C._len_torch_dispatch_stack, C._is_torch_function_mode_enabled, C._get_tracing_state,
            C._are_functorch_transforms_active, torch.autograd._profiler_enabled)


_PROBES = _probes()
_is_compiling = torch.compiler.is_compiling


def direct_call_ok(x: torch.Tensor) -> bool:
    """May a layer call an op's implementation as a plain function instead of through the
    dispatcher? Only where the dispatcher would run exactly that implementation and record
    nothing: x a plain CUDA torch.Tensor (no subclass: FakeTensor, DTensor, ...), no torch
    dispatch or function mode, no functorch transform, no torch.jit trace, no profiler,
    not inside torch.compile's tracing. (The caller also needs no gradient.) Saves the
    Python-kernel dispatch, ~12 us per call on the H200 host (bench/overhead.py)."""
    # compiling first: under torch.compile this folds to False before any other probe
    if _is_compiling() or type(x) is not torch.Tensor or not x.is_cuda:
        return False
    return plain_context()


def plain_context() -> bool:
    """No torch dispatch / function mode, functorch transform, jit trace or profiler active."""
    if _PROBES is None:
        return False
    dispatch_stack, function_mode, tracing_state, functorch, profiler = _PROBES
    return not (dispatch_stack() or function_mode() or tracing_state() is not None or functorch()
                or profiler())


# Batch-invariant mode (docs/batch_invariance.md): every M of a W4A16 problem, and of a W4A8
# problem with fp8 activations, runs one tensor-core tile with one K order (ops/w4a16.py
# invariant_config), so a token's output does not depend on the batch it is in. W4A8 with int8
# activations is batch-invariant without it (exact int32 accumulation, one epilogue).
_BATCH_INVARIANT = [os.environ.get("SAILFISH_BATCH_INVARIANT", "0") == "1"]


def batch_invariant() -> bool:
    """Whether batch-invariant mode is on (SAILFISH_BATCH_INVARIANT=1, set_batch_invariant)."""
    return _BATCH_INVARIANT[0]


def set_batch_invariant(enabled: bool) -> None:
    """Turn batch-invariant mode on or off for this process: with it, a token's output is the same,
    bit for bit, whatever else is in the batch (W4A16, W4A8 fp8; W4A8 int8 always is), at the
    speed of one fixed tensor-core tile (no GEMV, split-K, Gluon kernels or cuBLAS at large M).
    Takes effect at the next call (the configs and cached plans are kept per mode; a CUDA graph
    or compiled model keeps the kernels it captured)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_batch_invariant: enabled must be a bool, got {enabled!r}")
    _BATCH_INVARIANT[0] = enabled


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True):
    """`with batch_invariant_mode(): ...` : set_batch_invariant(enabled) inside, the previous
    mode restored on exit."""
    previous = batch_invariant()
    set_batch_invariant(enabled)
    try:
        yield
    finally:
        set_batch_invariant(previous)


# The hot ops are defined on this library fragment rather than with torch.library.custom_op:
# custom_op's Python dispatch layers cost ~25 us per call on top of the kernel launch
# (torch 2.13, 2-core x86 host; H200 host: W4A16 op 70 us vs its launcher 41 us), a
# Library op whose kernel is a Python function ~4 us, and an autograd formula on it
# (torch.library.register_autograd) another ~7 us, paid even under no_grad.
LIB = torch.library.Library("sailfish", "FRAGMENT")


def define_op(name: str, schema: str, impl, fake):
    """sailfish::<name><schema> with `impl` for every device (CompositeExplicitAutograd: no
    autograd formula unless one is registered) and `fake` for FakeTensor / meta tracing
    (torch.compile). Returns the op's overload."""
    LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"sailfish::{name}", fake, lib=LIB)
    return getattr(getattr(torch.ops.sailfish, name), "default")


from . import w4a16  # noqa: E402,F401  (registers torch.ops.sailfish.w4a16_gemm)
from . import w4a8  # noqa: E402,F401  (registers sailfish::quantize_per_token, sailfish::w4a8_gemm)
from . import autograd  # noqa: E402,F401  (input-gradient formulas; sailfish::w4a8_linear)
from . import moe  # noqa: E402,F401  (registers sailfish::moe_w4a16)
