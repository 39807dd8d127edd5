"""The decode-step timing method (docs/benchmarking.md in the repository), in one place.

A model runs hundreds of different layers back to back, each weight read once from HBM,
inside a CUDA graph. So: R distinct weight copies (R x bytes >= 3 x L2, R >= 2), one
CUDA graph calling the kernel once per copy, median over >= 10 replays timed with CUDA
events; time per call = median / R. The HBM ceiling is a >= 1 GiB device-to-device copy
in the same process.
"""
from __future__ import annotations

import statistics
from typing import Callable, List, Sequence

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
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm-up on the capture stream (allocator, lazy init)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
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
    del graph
    return statistics.median(times) / len(calls)


def hbm_ceiling_gbps(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second, in GB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e9


def w4a16_min_bytes(m: int, k: int, n: int, group_size: int, zeros: bool = False) -> int:
    """Fewest bytes a W4A16 GEMM must move: 4-bit weights, fp16 scales (+ zeros), x, y."""
    groups = 1 if group_size == -1 else -(-k // group_size)
    return n * k // 2 + 2 * n * groups * (2 if zeros else 1) + 2 * m * k + 2 * m * n
