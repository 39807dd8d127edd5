"""Every SAILFISH_* environment variable, read and parsed here and nowhere else.

Two kinds, both documented in the README's environment table:
- kernel switches (`FLAGS`): read when sailfish is imported and again by
  `sailfish.tuning.clear_caches()` (which calls `reload()`); the launchers read the attributes
  of `FLAGS` when they build a launch plan, never on the steady-state path;
- config-choice switches (`config_file()`, `config_replace()`, `autotune()`,
  `heuristics_only()`, `pdl_mode()`): read when a problem is first seen on a device (a cached
  config or plan is not re-decided; `clear_caches()` forgets those).

One parser (`_read`): an unset or empty variable takes its default; booleans accept
1 / 0, true / false, yes / no, on / off (any case); three-way switches also 'auto'. Anything
else is a ValueError naming the variable, its value and what is allowed.

Batch-invariant mode is process state (`set_batch_invariant`, docs/batch_invariance.md) that
SAILFISH_BATCH_INVARIANT only initializes; it lives here too so that every layer below the
ops can read it.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _read(name: str, default: str, auto: bool = False) -> str:
    """SAILFISH_<name> as '1', '0' or (auto=True) 'auto'; `default` when unset or empty."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return "1"
    if value in _FALSE:
        return "0"
    if auto and value == "auto":
        return "auto"
    allowed = "1 / 0 (true / false, yes / no, on / off)" + (" or auto" if auto else "")
    raise ValueError(f"{name}={raw!r} is not understood; allowed: {allowed}")


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean SAILFISH_* variable (see _read)."""
    return _read(name, "1" if default else "0") == "1"


class Flags:
    """The kernel switches, as read by reload() (attributes may be set by tests)."""

    __slots__ = ("gluon", "gemv_mma", "paired_scales", "scale_prefetch", "acc_fence", "split_fixup")

    def __init__(self):
        self.reload()

    def reload(self) -> None:
        # The Hopper Gluon kernels (W4A16 'gluon*' and W4A8 'gluon_pipe' / 'gluon_overlap' configs) where they
        # apply; 0: their Triton twins everywhere, and no Gluon tiles among the tuner's
        # candidates. Also turned off for the process when a Gluon kernel fails to compile.
        self.gluon = env_flag("SAILFISH_GLUON", True)
        # W4A16 'gemv' configs on the tensor-core GEMV where it applies; 0: the CUDA-core GEMV.
        self.gemv_mma = env_flag("SAILFISH_GEMV_MMA", True)
        # the W4A16 mma kernel's scales / zeros as int32 pairs of adjacent groups (v12)
        self.paired_scales = env_flag("SAILFISH_PAIRED_SCALES", True)
        # the W4A16 mma kernel's one-tile-early scale load: 'auto' (the rule of
        # ops/w4a16.prefetch_scales), '0' never, '1' wherever possible (v17)
        self.scale_prefetch = _read("SAILFISH_SCALE_PREFETCH", "auto", auto=True)
        # the W4A16 mma kernel's accumulator fence: 'auto' (Triton < 3.9), '0', '1'
        self.acc_fence = _read("SAILFISH_ACC_FENCE", "auto", auto=True)
        # split-K slices added inside the GEMM: W4A8 on the tiles where that measured faster
        # (ops/w4a8.fixup_tile, v23), W4A16 in its GEMVs (ops/w4a16.gemv_fixup); 0: always the
        # reduce kernel
        self.split_fixup = env_flag("SAILFISH_SPLIT_FIXUP", True)


FLAGS = Flags()


def config_file() -> Optional[str]:
    """SAILFISH_CONFIG_FILE: a config table merged over the shipped one (a path), or None."""
    return os.environ.get("SAILFISH_CONFIG_FILE") or None


def config_replace() -> bool:
    """SAILFISH_CONFIG_REPLACE=1: SAILFISH_CONFIG_FILE instead of the shipped table."""
    return env_flag("SAILFISH_CONFIG_REPLACE")


def autotune() -> bool:
    """SAILFISH_AUTOTUNE=1: benchmark a problem without a table entry on its first call."""
    return env_flag("SAILFISH_AUTOTUNE")


def heuristics_only() -> bool:
    """SAILFISH_HEURISTICS_ONLY=1: the heuristics alone (no table, no autotuning)."""
    return env_flag("SAILFISH_HEURISTICS_ONLY")


def pdl_mode() -> str:
    """SAILFISH_PDL: 'auto' (sm_90+), '0' never, '1' always (runtime/device.pdl)."""
    return _read("SAILFISH_PDL", "auto", auto=True)


# ----------------------------------------------------------------------------------
# Batch-invariant mode (docs/batch_invariance.md): every M of a W4A16 problem, and of a W4A8
# problem with fp8 activations, runs one tensor-core tile with one K order (ops/w4a16.py
# invariant_config), so a token's output does not depend on the batch it is in. W4A8 with int8
# activations is batch-invariant without it (exact int32 accumulation, one epilogue).
# ----------------------------------------------------------------------------------
_BATCH_INVARIANT = [env_flag("SAILFISH_BATCH_INVARIANT")]


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


def reload() -> None:
    """Re-read the kernel switches (FLAGS). Batch-invariant mode is left as it is: it is
    switched at run time with set_batch_invariant."""
    FLAGS.reload()
