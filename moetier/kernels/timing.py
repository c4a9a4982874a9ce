"""GPU timing the kernel tuner and the benchmarks share: `time_cuda` (median ms of a call by
CUDA events) and `graph_ms` (ms per call of calls replayed as one CUDA graph)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_cuda(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() timed with CUDA events."""
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
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


WARM_S = 0.05  # seconds of replays before a graph is timed


def graph_ms(fn_list: list[Callable[[], object]]) -> float:
    """Median ms per call of the calls in fn_list, replayed as one CUDA graph, after WARM_S
    seconds of replays (identical configs timed twice in one run after 3 warm-up replays
    differed by 5-7%, the first timed the slower; after WARM_S, 0.987-1.027x on the H200:
    docs/benchmarks.md)."""
    for fn in fn_list:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fn_list:
            fn()
    start = time.perf_counter()
    while time.perf_counter() - start < WARM_S:
        graph.replay()
        torch.cuda.synchronize()
    return time_cuda(graph.replay, reps=20) / len(fn_list)
