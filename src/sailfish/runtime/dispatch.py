"""How the ops reach PyTorch: the `sailfish` torch.library fragment the ops are defined on
(`define_op`), and when a layer may call an op's implementation directly (`direct_call_ok`)."""
import torch


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


