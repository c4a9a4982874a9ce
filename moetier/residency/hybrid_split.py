"""Hybrid misses, the cost model: which of a layer's GPU-cache misses the host's cores compute
(from the host tier, at DRAM speed) while the others take the GPU path (copied or read over PCIe).

One MoE layer's misses are experts not in GPU slots, each with the number of (token, k) pairs
routed to it this step. On the GPU path an expert costs its blob's bytes over PCIe, once for all
its pairs; on the CPU its bytes at the CPU kernel's read rate, plus `pair_cost` of that for each
further pair (the kernel redoes its integer work per pair), and the CPU part as a whole adds
`sync` seconds (activations to the host, outputs back, the join). Both run at once, so a split
costs max(GPU path, CPU part). The experts with the fewest pairs go to the CPU first; the
split is the best prefix of that order (research/offload.md §3.1: with one pair each it sends
BW_PCIe / (BW_PCIe + BW_CPU) of the misses over PCIe, `fetch_share`). With more tokens per step
the CPU's share shrinks, as its cost grows with pairs and a PCIe read serves them all.

`measure_speeds` measures the three rates on this machine, in the run that uses them.
Knows nothing of models: experts are ints, blobs are bytes at host addresses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HybridSpeeds:
    """`gpu_path` bytes/s a missed blob reaches the GPU kernel (pinned H2D copy); `cpu` bytes/s
    the CPU kernel reads blobs at with one pair each; `sync` seconds per layer the CPU part adds
    beyond its work; `pair_cost` the CPU cost of each further pair of an expert as a share of
    its first."""

    gpu_path: float
    cpu: float
    sync: float = 0.0
    pair_cost: float = 1.0

    def __post_init__(self) -> None:
        if not (self.gpu_path > 0 and self.cpu > 0 and self.sync >= 0 and self.pair_cost >= 0):
            raise ValueError(f"hybrid speeds must be positive (sync, pair_cost >= 0): {self}")


@dataclass(frozen=True)
class Split:
    """A layer's misses split: `gpu` and `cpu` experts; `seconds` the split's predicted time,
    `fetch_only` that of sending every miss over the GPU path."""

    gpu: list[int]
    cpu: list[int]
    seconds: float
    fetch_only: float


def cpu_seconds(blob_bytes: int, pairs: int, speeds: HybridSpeeds) -> float:
    """Seconds the CPU kernel takes for one expert's `pairs` pairs."""
    return blob_bytes * (1 + speeds.pair_cost * max(0, pairs - 1)) / speeds.cpu


def split_cost(
    gpu_pairs: list[int], cpu_pairs: list[int], blob_bytes: int, speeds: HybridSpeeds
) -> float:
    """Predicted seconds of one layer's misses with these experts' pair counts on each side."""
    gpu = len(gpu_pairs) * blob_bytes / speeds.gpu_path
    if not cpu_pairs:
        return gpu
    cpu = sum(cpu_seconds(blob_bytes, n, speeds) for n in cpu_pairs) + speeds.sync
    return max(gpu, cpu)


def split_misses(
    misses: Mapping[int, int],
    blob_bytes: int,
    speeds: HybridSpeeds,
    share: float | None = None,
) -> Split:
    """Split `misses` (expert -> its pairs this step) between the GPU path and the CPU: the
    cheapest prefix of the experts ordered by pairs (then id) goes to the CPU, or, with `share`
    (a test knob, `--cpu-experts share:F`), the first round(share * misses) of them."""
    order = sorted(misses, key=lambda e: (misses[e], e))
    pairs = [misses[e] for e in order]
    fetch_only = split_cost(pairs, [], blob_bytes, speeds)
    if share is not None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"a forced CPU share is in [0, 1], got {share}")
        n = round(share * len(order))
    else:
        costs = [
            split_cost(pairs[i:], pairs[:i], blob_bytes, speeds) for i in range(len(order) + 1)
        ]
        n = min(range(len(costs)), key=lambda i: (costs[i], i))
    cost = split_cost(pairs[n:], pairs[:n], blob_bytes, speeds)
    return Split(gpu=sorted(order[n:]), cpu=sorted(order[:n]), seconds=cost, fetch_only=fetch_only)


def fetch_share(speeds: HybridSpeeds) -> float:
    """The share of one-pair misses the best split sends over the GPU path, ignoring sync:
    BW_PCIe / (BW_PCIe + BW_CPU)."""
    return speeds.gpu_path / (speeds.gpu_path + speeds.cpu)


def describe(speeds: HybridSpeeds) -> str:
    """One line for the planner's output."""
    return (
        f"hybrid misses: GPU path {speeds.gpu_path / 1e9:.1f} GB/s, CPU kernel "
        f"{speeds.cpu / 1e9:.1f} GB/s, sync {speeds.sync * 1e6:.0f} us/layer, further pairs "
        f"x{speeds.pair_cost:.2f}: one-pair misses go {fetch_share(speeds):.0%} over PCIe, "
        f"{1 - fetch_share(speeds):.0%} to the CPU"
    )


def measure_speeds(
    gpu_path: float,
    run_cpu: Callable[[int, int], None],
    experts: int,
    blob_bytes: int,
    device: torch.device,
    hidden_size: int,
    executor: Executor | None = None,
    reps: int = 5,
) -> HybridSpeeds:
    """The CPU kernel's rate and pair cost and the sync cost, measured now. `run_cpu(n, pairs)`
    runs the kernel on `n` distinct experts with `pairs` pairs each; `gpu_path` is measured
    by the caller (residency/links.py's h2d_bandwidth); `executor`: the thread the CPU part
    runs on beside the GPU's work (None: inline)."""

    def best(fn: Callable[[], object]) -> float:  # the least of `reps` timings (noise adds)
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    n = max(1, experts)
    one = best(lambda: run_cpu(n, 1))
    two = best(lambda: run_cpu(n, 2))
    x = torch.zeros(1, hidden_size, device=device)
    y = torch.zeros(1, hidden_size)

    def handoff() -> None:  # activations to the host, an output back, and a thread's join
        host = x.to("cpu")
        if executor is not None:
            executor.submit(lambda: host).result()
        y.to(device, non_blocking=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return HybridSpeeds(
        gpu_path=gpu_path,
        cpu=n * blob_bytes / one,
        sync=best(handoff),
        # a further pair reads no new bytes: at most the first pair's cost (bounds noise)
        pair_cost=min(1.0, max(0.0, (two - one) / one)),
    )
