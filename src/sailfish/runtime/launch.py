"""Steady-state kernel launches that skip Triton's per-call binding.

`kernel[grid](*args, **meta)` spends ~15-25 us of host time per launch before the GPU sees
it (JITFunction.run: binding the arguments, building the specialization key and the
options string, the kernel cache lookup, launch metadata), as much as the M = 1 kernels
themselves run. A `Launch` makes its first call that way and keeps the CompiledKernel it
returns; later calls hand the arguments straight to the compiled kernel's launcher
(CompiledKernel.run, the call JITFunction.run ends with; the same signature in Triton 3.6
and 3.9).

That is only correct while the arguments specialize as they did at the first call (pointer
dtypes and 16-byte alignment; ints equal to 1, divisible by 16, or 64-bit): the caller keys
its Launch objects on exactly that (see runtime/plan.py). The first call runs on
the caller's stream and device like any launch; later calls use the current stream of the
device (the caller makes the tensors' device current, as Triton itself requires).

Triton's launch hooks (profilers such as proton install them) need the full path:
`hooks_idle()` tells the caller when it may take the direct one.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch


_RUNTIME = _CHAIN = None  # triton.knobs.runtime and triton.knobs.HookChain, on first use


def hooks_idle() -> bool:
    """True when no Triton launch hook is installed (the direct launch skips them)."""
    global _RUNTIME, _CHAIN
    if _RUNTIME is None:
        from triton import knobs

        _RUNTIME, _CHAIN = knobs.runtime, getattr(knobs, "HookChain", None)
    enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
    # empty HookChains (Triton 3.6 / 3.9), or None (older releases); anything else, e.g. a
    # function assigned by a profiler, is a hook
    return ((enter is None or (type(enter) is _CHAIN and not enter.calls))
            and (leave is None or (type(leave) is _CHAIN and not leave.calls)))


def pointers(*tensors: Optional[torch.Tensor]) -> Optional[tuple]:
    """The tensors' data pointers as ints (None entries stay None), or None unless every
    one is a multiple of 16 bytes (how Triton specialized them at the first call). A
    compiled kernel's launcher takes an int as a pointer argument as it is, where a tensor
    costs it a data_ptr() call and a cuPointerGetAttribute check each (Triton 3.6 and 3.9):
    the steady-state launches pass these ints (the ops have checked the devices)."""
    ptrs = tuple(None if t is None else t.data_ptr() for t in tensors)
    acc = 0
    for p in ptrs:
        if p is not None:
            acc |= p
    return None if acc & 15 else ptrs


def aligned(*tensors: Optional[torch.Tensor]) -> bool:
    """Every tensor's data pointer is a multiple of 16 bytes (how Triton specializes a
    pointer argument); None entries are skipped."""
    return pointers(*tensors) is not None


def stream_getter():
    """Triton's current-stream function (torch's raw current stream of a device index)."""
    from triton.runtime import driver

    return driver.active.get_current_stream


class Launch:
    """One @triton.jit kernel with its constexpr arguments and launch options bound.

    `launch(grid, *args)`: grid (x, y) or (x, y, z); args: the kernel's runtime (non-constexpr)
    parameters in signature order, which must come first in the signature. The first call goes through
    the JIT (compiling if needed); it then binds the CompiledKernel, and later calls launch
    it directly on the current stream of `device_index`."""

    __slots__ = ("fn", "meta", "device_index", "tail", "kernel", "run", "function", "packed", "stream")
    takes_tensors = False  # (as a plan: runtime/plan.py run_steady passes pointers)

    def __init__(self, fn, meta: dict, device_index: int):
        self.fn, self.meta, self.device_index = fn, meta, device_index
        self.tail: Optional[Tuple[Any, ...]] = None
        self.kernel = self.run = self.function = self.packed = self.stream = None

    def __call__(self, grid: Sequence[int], *args) -> None:
        if self.run is not None:
            self.run(grid[0], grid[1], grid[2] if len(grid) > 2 else 1, self.stream(self.device_index),
                     self.function, self.packed, None, None, None, *args, *self.tail)
            return
        kernel = self.fn[grid](*args, **self.meta)
        self._bind(kernel, len(args))

    def prepare(self, grid: Sequence[int], *args) -> None:
        """Compile and bind the kernel for these arguments (as the first call would) without
        launching it (Triton's warmup): for a plan's second path, which its first call did not
        take (ops/w4a16.py _GemmPlan)."""
        if self.run is None:
            self._bind(self.fn.warmup(*args, grid=grid, **self.meta), len(args))

    def bound(self) -> bool:
        """Whether the compiled kernel is bound (later calls launch it directly)."""
        return self.run is not None

    def _bind(self, kernel, n_runtime: int) -> None:
        """Keep `kernel` (a CompiledKernel) for direct launches, if this Triton exposes what
        they need; otherwise every call keeps taking the JIT path."""
        if hasattr(kernel, "result"):  # an asynchronous compilation's future (Triton 3.6)
            kernel = kernel.result()
        params = getattr(self.fn, "params", None)
        if params is None or not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            return
        constexpr = [p.is_constexpr for p in params]
        if any(constexpr[:n_runtime]) or not all(constexpr[n_runtime:]):
            return  # the runtime parameters must be the leading ones
        tail = []
        for p in params[n_runtime:]:
            if p.name in self.meta:
                tail.append(self.meta[p.name])
            elif getattr(p, "has_default", False):
                tail.append(p.default)
            else:
                return
        self.stream = stream_getter()
        self.tail = tuple(tail)
        run = kernel.run  # a property: loads the module if the JIT launch has not
        self.kernel, self.function, self.packed = kernel, kernel.function, kernel.packed_metadata
        self.run = run
