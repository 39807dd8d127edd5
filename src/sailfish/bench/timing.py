"""The decode-step timing method (docs/benchmarking.md in the repository), in one place.

A model runs hundreds of different layers back to back, each weight read once from HBM,
inside a CUDA graph. So: R distinct weight copies (R x bytes >= 3 x L2, R >= 2), one
CUDA graph calling the kernel once per copy, median over >= 10 replays timed with CUDA
events; time per call = median / R. The HBM ceiling is a >= 1 GiB device-to-device copy
in the same process.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch


def copies_needed(weight_bytes: int, device=None, factor: int = 3, minimum: int = 2,
                  maximum: int = 4096) -> int:
    """R such that R * weight_bytes >= factor * L2 (at least `minimum`)."""
    l2 = torch.cuda.get_device_properties(device or 0).L2_cache_size
    r = -(-factor * l2 // max(1, weight_bytes))
    return int(min(maximum, max(minimum, r)))


def graph_time_us(calls: Sequence[Callable[[], object]], replays: int = 20, warmup: int = 2) -> float:
    """Median time of one call (us): capture all `calls` in one CUDA graph, replay it.

    `calls` should already have been run once (compilation, autotuning) outside the graph.
    """
    graph = capture_graph(calls)
    t = replay_time_us(graph, replays, warmup) / len(calls)
    del graph
    return t


def interleaved_graph_times_us(paths: Dict[str, Callable[[], object]], graph_calls: int,
                               rounds: int) -> Dict[str, float]:
    """{name: us per call} for competing paths: each run once (compilation), then `rounds`
    interleaved rounds of graph_time_us over `graph_calls` calls of each path, the median per path
    (interleaving spreads clock and thermal drift over all paths alike)."""
    for fn in paths.values():
        fn()
    times: Dict[str, List[float]] = {n: [] for n in paths}
    for _ in range(rounds):
        for n, fn in paths.items():
            times[n].append(graph_time_us([fn] * graph_calls))
    return {n: statistics.median(v) for n, v in times.items()}


def capture_graph(calls: Sequence[Callable[[], object]], capture_error_mode: str = "global"):
    """One CUDA graph of `calls`, after a warm-up run on the capture stream (allocator, lazy
    init). capture_error_mode="thread_local" lets other threads (NCCL's watchdog) make CUDA
    calls during the capture, as collectives inside a graph need."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        for fn in calls:
            fn()
    return graph


def replay_time_us(graph, replays: int = 20, warmup: int = 2) -> float:
    """Median wall time of one replay of `graph` (us), timed with CUDA events."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times: List[float] = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def call_times_us(fn: Callable[[], object], n: int, cuda: bool,
                  before: Optional[Callable[[], object]] = None) -> List[float]:
    """Time of each of n calls of fn (us), with no graph: what a caller of fn sees, host
    overhead included. cuda=True (fn runs on the current CUDA device): events around each
    call, one synchronisation at the end (a host-bound fn shows its host time, a device-bound
    one its device time); else the wall clock. before(), when given, runs ahead of each
    call, outside the timed interval."""
    if not cuda:
        out = []
        for _ in range(n):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    events = []
    for _ in range(n):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in events]


def transient_bytes(fn: Callable[[], object], cuda: bool) -> Optional[int]:
    """CUDA memory one call of fn allocates beyond what was allocated before it (peak minus
    resident, bytes). cuda=False: None, and fn is not called."""
    if not cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - resident)


def hbm_ceiling_gbps(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second, in GB/s."""
    us = _copy_us(nbytes, reps)
    torch.cuda.empty_cache()  # (the buffers died with _copy_us)
    return 2 * nbytes / us / 1e3


def _copy_us(nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return _event_median_us(lambda: dst.copy_(src), reps, warmup=2)


def _event_median_us(fn, reps: int, warmup: int) -> float:
    """Median time of fn() in us, each call timed alone with CUDA events after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def tensor_core_peaks(size: int = 8192, reps: int = 10) -> dict:
    """The best dense rates cuBLAS reaches on a size^3 GEMM, flop per us: "half" (fp16
    F.linear) and "8bit" (the better of int8 torch._int_mm and fp8 torch._scaled_mm, where
    this torch and GPU have them). The P of the limit fraction (docs/benchmarking.md) when a
    run's own cuBLAS rows are all small-M, memory-bound ones (their rate is far below P)."""
    out = _peak_rates(size, reps)
    torch.cuda.empty_cache()  # (the operands died with _peak_rates)
    return out


def _peak_rates(size: int, reps: int) -> dict:
    a = torch.randn(size, size, dtype=torch.float16, device="cuda")
    b = torch.randn(size, size, dtype=torch.float16, device="cuda")
    calls = {"half": [lambda: torch.nn.functional.linear(a, b)]}
    a8, b8 = a.to(torch.int8), b.to(torch.int8)
    calls["8bit"] = [lambda: torch._int_mm(a8, b8.t())]
    if hasattr(torch, "float8_e4m3fn") and torch.cuda.get_device_capability() >= (8, 9):
        af, bf = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        calls["8bit"].append(lambda: torch._scaled_mm(af, bf.t(), one, one, out_dtype=torch.float16))
    out = {}
    for fam, fns in calls.items():
        for fn in fns:
            try:
                us = _event_median_us(fn, reps, warmup=3)
            except (RuntimeError, TypeError):  # an op this torch / GPU lacks
                continue
            out[fam] = max(out.get(fam, 0.0), 2.0 * size ** 3 / us)
    return out


def w4a16_min_bytes(m: int, k: int, n: int, group_size: int, zeros: bool = False) -> int:
    """Fewest bytes a W4A16 GEMM must move: 4-bit weights, fp16 scales (+ zeros), x, y."""
    groups = 1 if group_size == -1 else -(-k // group_size)
    return n * k // 2 + 2 * n * groups * (2 if zeros else 1) + 2 * m * k + 2 * m * n
