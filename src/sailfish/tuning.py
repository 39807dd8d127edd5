"""Kernel configs: Config, shared heuristics and checks, a shipped per-GPU table and the tuner.

Lookup order for a problem (kernel family, K, N, bucketed M, format flags) on a device:
  1. the in-process cache: every answer below is cached per (device, problem), so a
     problem keeps one config for the life of the process (eager calls and CUDA-graph
     captures agree) and a steady-state call costs one dict lookup (the launchers keep a
     launch plan per problem on top, `Tuner.plans`, dropped whenever a config changes);
  2. the table for this GPU (kernels/configs/<gpu_key>.json), merged with the user file
     named by SAILFISH_CONFIG_FILE (with SAILFISH_CONFIG_REPLACE=1 the user file alone, so
     that an A/B of two tables compares them key for key); a format without an entry may use
     its shape's entry (`fallback_key`);
  3. only when opted in with SAILFISH_AUTOTUNE=1, on CUDA and outside graph capture:
     benchmark the candidate list once (seconds per problem, so never by default inside
     a forward);
  4. the heuristic.
`tune(model, m=[...])` (tune_model.py) benchmarks the candidates of a model's problems explicitly (and can
save them as a table). SAILFISH_HEURISTICS_ONLY=1 skips 2-3 (deterministic config choice
across machines). The environment (runtime/flags.py) is read when a problem is first seen on a
device; after changing it, call `clear_caches()`.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import warnings
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, Hashable, Iterable, List, Optional, Tuple

import torch

from .runtime import flags
from .runtime.device import forget as forget_gpus
from .runtime.device import gpu_key
from .runtime.plan import SESSION as _SESSION

CONFIG_DIR = Path(__file__).parent / "kernels" / "configs"
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class Config:
    """One launch choice. `kernel` names the path within a family (W4A16: "mma" tensor-core
    tiles, "gemv" M <= 8 (tensor cores or CUDA cores), "gluon" the Hopper Gluon kernel (its
    Triton twin elsewhere; BLOCK_K = 256, num_stages = its ring depth; "gluon_overlap" its variant
    that dequantizes a K step while the previous step's wgmmas run, "gluon_overlap_regs" that one
    with the packed words loaded straight into registers, "gluon_pipe" the large-M one that
    dequantizes each 128-channel chunk while the previous chunk's wgmmas run; num_stages: the
    chunk 0 ring, chunk 1's has one slot more), "dequant" = dequantize
    to a transient half-precision weight, then cuBLAS); the block sizes are that path's tile
    shape. num_stages of the tensor-core GEMV: 1 no pipelining, 2 the next tile's words one
    iteration ahead in registers, >= 3 a cp.async ring of that depth (ops/w4a16.gemv_stages)."""
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    kernel: str = "mma"
    # W4A16 "mma" only: the scale multiplies the fp32 product per K tile instead of every
    # weight (kernels/w4a16.py SCALE_ACC); needs BLOCK_K <= group size and no g_idx
    scale_acc: bool = False

    def launch(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def split_k_for(tiles: int, k_tiles: int, sms: int) -> int:
    """Smallest power-of-two split-K that gives >= 2 programs per SM (at most k_tiles, 16)."""
    split = 1
    while tiles * split < 2 * sms and split * 2 <= k_tiles and split < 16:
        split *= 2
    return split


def m_bucket(m: int) -> int:
    """M rounded up to a power of two, at most M_BUCKETS[-1] (the buckets are 1, 2, 4, ...)."""
    return min(next_pow2(m), M_BUCKETS[-1])


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def problem_key(family: str, k: int, n: int, m: int, flags: str) -> str:
    return f"{family}|K={k}|N={n}|M={m_bucket(m)}|{flags}"


@lru_cache(maxsize=None)
def _load_table(path: str) -> Dict[str, dict]:
    p = Path(path)
    if not p.is_file():
        return {}
    with open(p) as f:
        data = json.load(f)
    return data.get("configs", {})


# ----------------------------------------------------------------------------------
# Heuristics and config checks shared by the kernel families
# ----------------------------------------------------------------------------------
Tile = Tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages


def gemv_heuristic(n: int, k: int, kp: int, sms: int) -> Config:
    """M = 1: the CUDA-core GEMV with BLOCK_N 16, BLOCK_K 512 (256 where 512 does not divide
    the padded K), the measured best on H200 (docs/perf_log.md), split-K up to 2 programs
    per SM. k: the K the kernel tiles (the padded K where the kernel runs over it)."""
    bk = 512 if kp % 512 == 0 else 256
    return Config(1, 16, bk, split_k_for(-(-n // 16), -(-k // bk), sms), 8, 4, 4, kernel="gemv")


def mma_heuristic(m: int, n: int, k: int, sms: int, small: Tile, mid: Tile, large: Tile) -> Config:
    """Tensor-core tiles: `small` for M <= 16, `mid` for M <= 64 (BLOCK_M 32 or 64 by M),
    `large` above; BLOCK_N at most next_pow2(N) (>= 64)."""
    bm, bn, bk, warps, stages = small if m <= 16 else mid if m <= 64 else large
    if 16 < m <= 64:
        bm = 32 if m <= 32 else 64
    bn = min(bn, max(64, next_pow2(n)))
    tiles = -(-m // bm) * -(-n // bn)
    # M > 64 (BM 128, 8 warps): split-K only while the tiles fill under half the SMs. Without
    # it W4A16 4096x1024 at M = 128 ran 8 programs (46.9 us on H200; 12.4 us tuned, SPLIT_K = 16);
    # splitting up to 2 programs per SM as at small M lost on 4096x14336 M = 128 (0.71x -> 0.50x)
    split = split_k_for(tiles, -(-k // bk), sms if m <= 64 else sms // 4)
    return Config(bm, bn, bk, split, 8, warps, stages)


def gemv_candidates(space: Iterable[Tile], n: int, k: int, kp: int, sms: int):
    """GEMV configs from (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) tiles, each unsplit and
    with the split-K that gives 2 programs per SM; tiles whose BLOCK_K does not divide kp
    are left out."""
    for bm, bn, bk, warps, stages in space:
        if kp % bk == 0 and bn >= 8:
            for split in sorted({1, split_k_for(-(-n // bn), -(-k // bk), sms)}):
                yield Config(bm, bn, bk, split, 8, warps, stages, kernel="gemv")


def mma_candidates(space: Iterable[Tile], m: int, n: int, k: int, kp: int, sms: int):
    """Tensor-core configs from tiles, each with split-K 1, s0 (2 programs per SM) and 2 * s0."""
    seen = set()
    for bm, bn, bk, warps, stages in space:
        if kp % bk:
            continue
        k_tiles = -(-k // bk)
        s0 = split_k_for(-(-m // bm) * -(-n // bn), k_tiles, sms)
        for split in sorted({1, s0, min(2 * s0, k_tiles)}):
            cfg = Config(bm, bn, bk, split, 8, warps, stages)
            if cfg not in seen:
                seen.add(cfg)
                yield cfg


KERNELS = ("mma", "gemv", "dequant")


def check_config(cfg: Config, kp: int, k: int, kernels: Tuple[str, ...] = KERNELS) -> None:
    """The checks every family's launcher makes (ValueError naming the field): power-of-two
    blocks (>= 16 except BLOCK_M), a known kernel, BLOCK_M >= 16 for 'mma', BLOCK_K dividing
    the padded K, SPLIT_K in [1, k_tiles] with k_tiles = ceil(k / BLOCK_K) (k: the K the
    kernel tiles, the padded one where it runs over the padding). A family with checks of
    its own runs the three parts with its own in between."""
    check_blocks(cfg)
    check_kernel(cfg, kernels)
    check_fit(cfg, kp, k)


def check_blocks(cfg: Config) -> None:
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1) or (v < 16 and name != "BLOCK_M"):
            raise ValueError(f"config {name}={v} must be a power of two (>= 16 except BLOCK_M)")


def check_kernel(cfg: Config, kernels: Tuple[str, ...]) -> None:
    if cfg.kernel not in kernels:
        raise ValueError(f"config kernel={cfg.kernel!r} is not one of {', '.join(map(repr, kernels))}")
    if cfg.kernel == "mma" and cfg.BLOCK_M < 16:
        raise ValueError(f"config kernel='mma' needs BLOCK_M >= 16, got {cfg.BLOCK_M}")


def check_fit(cfg: Config, kp: int, k: int) -> None:
    if kp % cfg.BLOCK_K:
        raise ValueError(f"config BLOCK_K={cfg.BLOCK_K} must divide the padded K={kp}")
    k_tiles = -(-k // cfg.BLOCK_K)
    if cfg.SPLIT_K < 1 or cfg.SPLIT_K > k_tiles:
        raise ValueError(f"config SPLIT_K={cfg.SPLIT_K} must lie in [1, {k_tiles}]")


# ----------------------------------------------------------------------------------
# The tuner
# ----------------------------------------------------------------------------------
def scratch_runner(run: Callable[[Config, torch.Tensor], None], like: torch.Tensor
                   ) -> Callable[[Config], None]:
    """`run(cfg, out)` as the tuner's `run(cfg)`: candidates write into a scratch tensor shaped
    like `like`, allocated on the first benchmark only (table hits never allocate it)."""
    scratch: Optional[torch.Tensor] = None

    def bench_run(cfg: Config) -> None:
        nonlocal scratch
        if scratch is None:
            scratch = torch.empty_like(like)
        run(cfg, scratch)

    return bench_run


def _bench(fn: Callable[[], None]) -> float:
    """Median time of fn in ms (triton's do_bench: CUDA events, L2 flushed between calls)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=20, return_mode="median")


# One benchmark at a time in the process: two threads cannot tune the same key at once
# (the second finds the first one's result in the cache), and benchmarks of different keys
# would share the GPU and distort each other's timings.
_TUNE_LOCK = threading.Lock()
_TUNERS: List["Tuner"] = []


class Tuner:
    """Chooses a Config per problem; one instance per kernel family."""

    def __init__(self, family: str, heuristic: Callable[..., Config],
                 candidates: Callable[..., Iterable[Config]],
                 check: Optional[Callable[..., None]] = None):
        """heuristic(device=, **problem) -> Config; candidates(device=, **problem) -> Configs;
        check(cfg, **problem) raises ValueError for a config the problem cannot run: applied
        to every answer before it is cached (a bad table entry fails at its first use)."""
        self.family = family
        self.heuristic = heuristic
        self.candidates = candidates
        self.check = check
        self.cache: Dict[Tuple[torch.device, Hashable], Config] = {}
        # Launch plans built by the family's launcher from the cached configs (ops/w4a16.py:
        # config, grid rule and the bound compiled kernels per device and problem). Replaced
        # by a new dict whenever a cached config may change (forget_plans), so a plan built
        # from an old config by another thread lands in the discarded dict.
        self.plans: Dict[Hashable, object] = {}
        _TUNERS.append(self)

    def forget_plans(self) -> None:
        self.plans = {}

    def plan(self, key: Hashable):
        """The launch plan stored under `key`, or None (also while a tune() call runs on
        this thread)."""
        return None if _SESSION.active else self.plans.get(key)

    def plans_for_build(self) -> Optional[Dict[Hashable, object]]:
        """The dict a launcher stores a new plan in: take it *before* looking up the config
        the plan is built from. None while a tune() call runs on this thread (no plans then:
        every problem must reach the tuner)."""
        return None if _SESSION.active else self.plans

    def table(self, device: torch.device) -> Dict[str, dict]:
        user = flags.config_file()
        if flags.config_replace():
            if not user or not os.path.isfile(user):  # (else only the heuristics would be left, silently)
                raise ValueError(f"SAILFISH_CONFIG_REPLACE=1 needs SAILFISH_CONFIG_FILE to name a config table; "
                                 f"{user!r} is not a file")
            return dict(_load_table(user))
        merged = dict(_load_table(str(CONFIG_DIR / f"{gpu_key(device)}.json")))
        if user:
            merged.update(_load_table(user))
        return merged

    def lookup(self, device: torch.device, memo_key: Hashable) -> Optional[Config]:
        """The steady-state path: the cached config of `memo_key` on `device` (one dict
        lookup), or None if the problem is new there (or a tune() call is running)."""
        if _SESSION.active:
            return None
        return self.cache.get((device, memo_key))

    def get(self, key: str, device: torch.device, run: Optional[Callable[[Config], None]],
            fallback_key: Optional[str] = None, memo_key: Optional[Hashable] = None,
            **problem) -> Config:
        """The config of problem `key` (a table key) on `device`.

        run(cfg): one launch of the problem with cfg (for the autotuner), or None.
        fallback_key: a table entry to use when `key` has none (e.g. the same shape tuned
        for another weight format: every config of a family is valid for every format).
        memo_key: the cache key, if the caller has a cheaper one than `key` (what it will
        pass to `lookup`). problem: keyword arguments for the heuristic / candidates."""
        ck = (device, key if memo_key is None else memo_key)
        cfg = self.cache.get(ck)
        if cfg is None or _SESSION.active:
            cfg = self._resolve(ck, key, device, run, fallback_key, problem)
        return cfg

    def _resolve(self, ck, key, device, run, fallback_key, problem) -> Config:
        if _SESSION.active and device.type == "cuda" and run is not None:
            done = _SESSION.tuned.get((self.family, device, key))
            if done is None:
                with _TUNE_LOCK:
                    done = self.autotune(run, key, device=device, **problem)
                self._check(done, problem)
                _SESSION.tuned[(self.family, device, key)] = done
            if self.cache.get(ck) != done:
                self.cache[ck] = done
                self.forget_plans()
            return done
        cfg = self.cache.get(ck)
        if cfg is not None:
            return cfg
        if device.type != "cuda" or flags.heuristics_only():
            cfg = self.heuristic(device=device, **problem)
        else:
            table = self.table(device)
            entry = table.get(key)
            if entry is None and fallback_key is not None:
                entry = table.get(fallback_key)
            if entry is not None:
                cfg = Config(**entry)
            elif run is not None and flags.autotune() and not _capturing():
                with _TUNE_LOCK:
                    cfg = self.cache.get(ck) or self.autotune(run, key, device=device, **problem)
            else:
                cfg = self.heuristic(device=device, **problem)
        self._check(cfg, problem)
        # the first answer stored wins, so that every caller uses one config per problem
        return self.cache.setdefault(ck, cfg)

    def _check(self, cfg: Config, problem: dict) -> None:
        if self.check is not None:
            self.check(cfg, **problem)

    def autotune(self, run: Callable[[Config], None], key: str = "", **problem) -> Config:
        """The fastest candidate (median time); a candidate that fails is reported with a
        warning naming it and skipped; the heuristic if none runs."""
        best, best_t = None, math.inf
        for cfg in self.candidates(**problem):
            try:
                t = _bench(lambda: run(cfg))
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory; reported, not fatal
                warnings.warn(f"sailfish: {self.family} config {cfg} failed while tuning {key}: "
                              f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
                continue
            if t < best_t:
                best, best_t = cfg, t
        if best is None:
            best = self.heuristic(**problem)
            warnings.warn(f"sailfish: no {self.family} candidate ran for {key}; using the heuristic "
                          f"config {best}", RuntimeWarning, stacklevel=2)
        return best


def clear_caches() -> None:
    """Forget every cached config, launch plan, table and GPU name, and re-read the SAILFISH_*
    kernel switches (runtime/flags.py): what to call after changing the environment."""
    flags.reload()
    for t in _TUNERS:
        t.cache.clear()
        t.forget_plans()
    _load_table.cache_clear()
    forget_gpus()


def save_table(path: str, gpu: str, entries: Dict[str, Config], meta: Optional[dict] = None) -> None:
    """Write a config table (the format CONFIG_DIR/<gpu>.json and SAILFISH_CONFIG_FILE use)."""
    data = {"gpu": gpu, **(meta or {}),
            "configs": {k: asdict(v) for k, v in sorted(entries.items())}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    _load_table.cache_clear()


@contextlib.contextmanager
def tuning_session():
    """Inside: every problem a Tuner meets on CUDA with a runner is benchmarked once (cache
    and table notwithstanding) and cached. Yields {(family, device, table key): Config}."""
    _SESSION.active, _SESSION.tuned = True, {}
    try:
        yield _SESSION.tuned
    finally:
        _SESSION.active, _SESSION.tuned = False, {}
        for t in _TUNERS:  # (each changed config dropped its tuner's plans already)
            t.forget_plans()


def save_tuned(path: str, entries: Dict[str, Config], device: torch.device) -> None:
    """Write entries as device's config table at path, over the entries already there."""
    merged = {k: Config(**v) for k, v in _load_table.__wrapped__(str(path)).items()}
    merged.update(entries)
    save_table(str(path), gpu_key(device), merged,
               {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                "triton": __import__("triton").__version__})


