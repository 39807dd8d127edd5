"""Kernel configs: heuristics, a shipped per-GPU table, and an autotuner.

Lookup order for a problem (kernel family, K, N, bucketed M, format flags):
  1. the in-process cache;
  2. the table shipped for this GPU (kernels/configs/<gpu>.json), or a user file named
     by SAILFISH_CONFIG_FILE;
  3. on CUDA and outside graph capture: benchmark the pruned candidate list once
     (SAILFISH_AUTOTUNE=0 skips this step);
  4. the heuristic.
SAILFISH_HEURISTICS_ONLY=1 skips 1-3 (no table, no tuning): handy to compare, and for
deterministic config choice across machines.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

CONFIG_DIR = Path(__file__).parent / "kernels" / "configs"
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class Config:
    """One launch choice. `kernel` names the path within a family (W4A16: "mma" tensor-core
    tiles, "gemv" CUDA-core M=1, "dequant" = dequantize to a transient half-precision
    weight, then cuBLAS); the block sizes are that path's tile shape."""
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    kernel: str = "mma"

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
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def gpu_key(device: torch.device) -> str:
    """'h100', 'h200', ... from the device name; lowercase alphanumerics otherwise."""
    name = torch.cuda.get_device_name(device).lower()
    m = re.search(r"\b([a-z]\d{2,4})\b", name)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", name).strip("_")


@lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


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


class Tuner:
    """Chooses a Config per problem; one instance per kernel family."""

    def __init__(self, family: str, heuristic: Callable[..., Config],
                 candidates: Callable[..., Iterable[Config]]):
        self.family = family
        self.heuristic = heuristic
        self.candidates = candidates
        self.cache: Dict[Tuple[str, str], Config] = {}

    def table(self, device: torch.device) -> Dict[str, dict]:
        user = os.environ.get("SAILFISH_CONFIG_FILE")
        merged = dict(_load_table(str(CONFIG_DIR / f"{gpu_key(device)}.json")))
        if user:
            merged.update(_load_table(user))
        return merged

    def get(self, key: str, device: torch.device, run: Optional[Callable[[Config], None]],
            fallback_key: Optional[str] = None, **problem) -> Config:
        """problem: keyword arguments for the heuristic / candidate functions.
        fallback_key: a table entry to use when `key` has none (e.g. the same shape tuned
        for another weight format: every config of a family is valid for every format)."""
        if device.type != "cuda" or _env_flag("SAILFISH_HEURISTICS_ONLY"):
            return self.heuristic(device=device, **problem)
        ck = (gpu_key(device), key)
        if ck in self.cache:
            return self.cache[ck]
        table = self.table(device)
        entry = table.get(key, table.get(fallback_key) if fallback_key else None)
        if entry is not None:
            cfg = Config(**entry)
        elif (run is not None and os.environ.get("SAILFISH_AUTOTUNE", "1") != "0"
              and not torch.cuda.is_current_stream_capturing()):
            cfg = self.autotune(run, device=device, **problem)
        else:
            return self.heuristic(device=device, **problem)
        self.cache[ck] = cfg
        return cfg

    def autotune(self, run: Callable[[Config], None], **problem) -> Config:
        from triton.testing import do_bench

        best, best_t = None, float("inf")
        for cfg in self.candidates(**problem):
            try:
                t = do_bench(lambda: run(cfg), warmup=5, rep=20, return_mode="median")
            except Exception:  # a config the compiler rejects (e.g. out of shared memory)
                continue
            if t < best_t:
                best, best_t = cfg, t
        return best if best is not None else self.heuristic(**problem)


def save_table(path: str, gpu: str, entries: Dict[str, Config], meta: Optional[dict] = None) -> None:
    """Write a config table (the format CONFIG_DIR/<gpu>.json and SAILFISH_CONFIG_FILE use)."""
    data = {"gpu": gpu, **(meta or {}),
            "configs": {k: asdict(v) for k, v in sorted(entries.items())}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    _load_table.cache_clear()

