"""The launch-plan machinery every kernel family plugs into.

A *plan* is what one problem (a kernel family's key: device, dtypes, sizes, strides, optional
operands, M's bucket and Triton specialization) needs to run without the tuner or Triton's
argument binding: its config and its bound kernels (runtime/launch.py `Launch`). The family's
tuner (tuning.Tuner) keeps the plans in `Tuner.plans`, a dict replaced whenever a config may
change.

One call of a family's launcher, on CUDA without an explicit config:

    steady state   key -> plan lookup -> hooks idle -> pointers (16-byte aligned) -> right
                   device -> run                                           (`run_steady`)
    first call     config (invariant / cached / table / tuner / heuristic) -> build the plan
                   -> run it, with the one Gluon-compile retry (`run_built`) -> store it if
                   its kernels are bound and the operands aligned (`keep`)

The steady path is tuned to microseconds: `run_steady` is the only layer between a launcher
and its plan (it replaces the Tuner.plan call), and does no work beyond the list above.

A kernel family implements (ops/w4a16.py, ops/w4a8.py, ops/moe.py; the activation quantizer's
plan is a bare `Launch`), all under public names:
  - `<family>_heuristic(*, device, M, ...)` and `<family>_candidates(...)` -> Configs, and
    `check_<family>_config(cfg, ...)` (ValueError naming the field; built from
    tuning.check_blocks / check_kernel / check_fit), wired into one `tuning.Tuner`;
  - `<family>_key(...)` (the table key) and `<family>_config(device, M, ...)`: the lookup the
    launcher and the offline tuner (bench/tune.py) share (invariant mode, cache, tuner);
  - a plan class (`Plan` subclass: `kind`, `bound()`, `takes_tensors`) whose
    `__call__(head, *operands, *tail)` launches the kernels, the operands given as tensors
    (first call) or as data-pointer ints (steady state);
  - its launcher: the plan key (a tuple of everything the kernels are compiled for except
    pointer alignment), then `run_steady`, else config -> `run_built(build, run,
    gluon_kinds, family)` -> `keep`.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Hashable, Optional, Tuple

from .device import current_device, device_of
from .flags import FLAGS
from .launch import aligned, hooks_idle, pointers


class _Session(threading.local):
    """A `tune()` call in progress on this thread: every problem it meets is benchmarked
    once, whatever the cache or the table say (so no plan is used or kept); `tuned` collects
    the results (tuning.tuning_session)."""
    active = False
    tuned: Dict[Tuple[str, object, str], object] = {}


SESSION = _Session()


class Plan:
    """Base of the families' plans: the config that runs (`config`), which kernel path
    (`kind`), the bound GEMM launch and the split-K reduce (None when there is none)."""

    __slots__ = ("config", "kind", "gemm", "reduce")
    takes_tensors = False  # steady calls pass data-pointer ints (True: the tensors themselves)

    def bound(self) -> bool:
        """Whether every kernel has been bound (its first launch went through the JIT)."""
        return self.gemm.run is not None and (self.reduce is None or self.reduce.run is not None)


def run_steady(tuner, key: Hashable, device_index: int, anchor, head, tensors: tuple, tail: tuple) -> bool:
    """The steady-state call: run the plan `tuner` keeps under `key` as
    `plan(head, *pointers(tensors), *tail)` (the tensors themselves for a plan that
    takes_tensors) on device `device_index`, made current from `anchor` (a tensor on it) when
    it is not. False, having run nothing, when there is no plan (or a tune() call is running),
    a Triton launch hook is installed, or a pointer is not 16-byte aligned: then the caller
    takes the first-call path."""
    plan = None if SESSION.active else tuner.plans.get(key)
    if plan is None or not hooks_idle():
        return False
    ptrs = pointers(*tensors)
    if ptrs is None:
        return False
    args = tensors if plan.takes_tensors else ptrs
    if current_device() == device_index:
        plan(head, *args, *tail)
    else:
        with device_of(anchor):
            plan(head, *args, *tail)
    return True


def gluon_compile_failed(err: Exception, family: str) -> bool:
    """Whether `err` is a Gluon kernel failing to compile (a Triton whose Gluon differs from
    the tested 3.6-3.9); if so, warn once and run every Gluon config (every family: one switch,
    FLAGS.gluon) as its Triton twin from now on (a CUDA or launch error is not this, and is
    raised). family: the kernel that failed, for the warning."""
    from triton.compiler.errors import CompilationError

    if not isinstance(err, CompilationError):
        return False
    import warnings

    import triton

    FLAGS.gluon = False
    last = str(err).strip().splitlines()[-1] if str(err).strip() else ""
    warnings.warn(f"sailfish: the Gluon {family} kernel does not compile with Triton {triton.__version__} "
                  f"({type(err).__name__}: {last}); every Gluon config (W4A16 and W4A8) runs as its Triton "
                  "twin from now on", RuntimeWarning, stacklevel=5)
    return True


def run_built(build: Callable[[], object], run: Callable[[object], None], gluon_kinds: Tuple[str, ...],
              family: str):
    """The first-call path's launch: plan = build(), run(plan); if that was a Gluon kernel
    (plan.kind in gluon_kinds) that does not compile, the one retry: build() again (now the
    Triton twin, gluon_compile_failed having turned Gluon off) and run that. Returns the plan
    that ran."""
    plan = build()
    try:
        run(plan)
    except Exception as e:  # noqa: BLE001 - only a Gluon compile failure is handled
        if plan.kind not in gluon_kinds or not gluon_compile_failed(e, family):
            raise
        plan = build()  # (the twin, from now on)
        run(plan)
    return plan


def keep(plans: Optional[dict], key: Hashable, plan, *tensors) -> None:
    """Store `plan` under `key` in `plans` (the dict the launcher took from
    Tuner.plans_for_build before its config lookup; None: keep nothing) if its kernels are
    bound and every operand is 16-byte aligned (how Triton specialized them)."""
    if plans is not None and plan is not None and plan.bound() and aligned(*tensors):
        plans[key] = plan
