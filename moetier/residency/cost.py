"""The miss cost model: predicted seconds per token of each way to serve GPU-cache misses.

Owns the arithmetic that picks how decode reads experts that are not in GPU slots, from the
bytes a token reads per tier and measured link speeds (residency/links.py measures each in
the same run):

  blocking   copy every missed blob into a slot (H2D), then compute: copies and compute add up;
  prefetch   the predicted share (recall r) is copied on the copy stream while the previous
             layer computes, so it costs max(compute, copy time of the predicted bytes / precision)
             instead of their sum; the unpredicted share is fetched blocking; plus the
             prediction's own time;
  zero_copy  the kernel reads missed blobs straight from pinned host memory at the zero-copy
             read rate, no copy into a slot, and the step needs no host sync (a CUDA graph):
             it does not pay `sync_seconds`; blobs only on disk cannot be served this way
             (decode may not wait on the host), so it is ruled out when a token reads any.

Disk bytes always cost a disk read and an H2D copy. Every figure is in bytes and bytes/second;
the model is per token and takes no overlap between layers into account beyond prefetch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STRATEGIES = ("blocking", "prefetch", "zero_copy")


@dataclass(frozen=True)
class LinkSpeeds:
    """Measured rates in bytes/s: `hbm` GPU memory (read by the kernels), `h2d` pinned host to
    GPU copies, `zero_copy` a kernel reading pinned host memory, `disk` the store's file."""

    hbm: float
    h2d: float
    zero_copy: float
    disk: float

    def __post_init__(self) -> None:
        for name in ("hbm", "h2d", "zero_copy", "disk"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"link speed {name} must be positive bytes/s, got {getattr(self, name)}"
                )


@dataclass(frozen=True)
class TokenTraffic:
    """Bytes one decode token reads: `dense` (non-expert weights, on the GPU), `gpu` expert
    bytes found in GPU slots, `host` expert bytes missing there but in host RAM, `disk` expert
    bytes only in the store's file; `predict_seconds` the prediction time of prefetch;
    `sync_seconds` the host synchronisation and launch overhead of a step whose residency is
    decided on the host (blocking, prefetch: one sync per MoE layer, no CUDA graph), which the
    graph-captured zero-copy step does not pay (measure it as eager minus graph step time)."""

    dense: float
    gpu: float
    host: float
    disk: float = 0.0
    predict_seconds: float = 0.0
    sync_seconds: float = 0.0

    @property
    def active(self) -> float:
        return self.dense + self.gpu + self.host + self.disk


def distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a layer reads for `tokens` tokens routed uniformly at random,
    each to `top_k` of `num_experts`: E * (1 - (1 - k/E)^T)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def floor_seconds(traffic: TokenTraffic, speeds: LinkSpeeds) -> float:
    """The bench's floor: every active byte read once at HBM speed, every byte missing on the
    GPU moved once over PCIe at the H2D rate, disk bytes read once at the disk rate."""
    missed = traffic.host + traffic.disk
    return traffic.active / speeds.hbm + missed / speeds.h2d + traffic.disk / speeds.disk


def zero_copy_floor_seconds(traffic: TokenTraffic, speeds: LinkSpeeds) -> float | None:
    """The floor of the path that reads misses zero-copy (the CUDA-graph step's): every active
    byte read once at HBM speed, every missed byte once at the measured zero-copy read rate.
    None where some bytes are only on disk (that path needs every blob in host RAM)."""
    if traffic.disk > 0:
        return None
    return traffic.active / speeds.hbm + traffic.host / speeds.zero_copy


def miss_costs(
    traffic: TokenTraffic, speeds: LinkSpeeds, recall: float = 1.0, precision: float = 1.0
) -> dict[str, float]:
    """Seconds per token of each strategy (STRATEGIES); `recall` / `precision` of the prefetch
    prediction (bytes needed that were predicted / bytes predicted that were needed)."""
    if not (0.0 <= recall <= 1.0 and 0.0 < precision <= 1.0):
        raise ValueError(
            f"recall must be in [0, 1] and precision in (0, 1], got {recall}, {precision}"
        )
    disk = traffic.disk / speeds.disk + traffic.disk / speeds.h2d
    compute = traffic.active / speeds.hbm  # fetched blobs are read from slots like hits
    blocking = compute + traffic.host / speeds.h2d + disk + traffic.sync_seconds
    predicted_copy = recall * traffic.host / precision / speeds.h2d
    prefetch = (
        max(compute + traffic.predict_seconds, predicted_copy)
        + (1 - recall) * traffic.host / speeds.h2d
        + disk
        + traffic.sync_seconds
    )
    zero_copy = (
        (traffic.dense + traffic.gpu) / speeds.hbm + traffic.host / speeds.zero_copy
        if traffic.disk == 0
        else math.inf
    )
    return {"blocking": blocking, "prefetch": prefetch, "zero_copy": zero_copy}


def choose(costs: dict[str, float]) -> str:
    """The cheapest strategy (ties in STRATEGIES order: the simpler one)."""
    return min(STRATEGIES, key=lambda name: (costs[name], STRATEGIES.index(name)))
