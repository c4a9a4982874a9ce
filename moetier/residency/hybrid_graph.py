"""Hybrid misses on the zero-copy decode step (the one CUDA graphs capture): which cold experts
the host's cores compute, decided between steps, and the device tables the step reads.

A captured step cannot read the router's choice back, so the split is made per expert between
steps (beside `ZeroCopyPlacement.rebalance`): `mark` takes each layer's experts that are in the
host tier and not in a GPU slot, estimates each one's pairs a step from the placement's decayed
counts, and lets the cost model (residency/hybrid_split.py's speeds) choose those the CPU
computes, the fewest pairs first (`choose_cpu`); a forced share takes that share of them. Their
zero-copy table entries become -1 (`ZeroCopyPlacement.set_skip`: the GPU kernels skip their
pairs) and `flags` [layers, E] bool on the device names them; `addresses` [layers, E] int64 holds
each expert's host-tier address. Both are written in place (captured steps hold them).

In the step, `start` / `join` (models/experts.py calls them around the layer's GPU kernel) run
kernels/cpu/graph_part.py's ops: the flagged pairs packed, computed by the C kernel (a host node
on CUDA), added into the layer's [T, k, H] output.

Knows nothing of models: layers and experts are ints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat
from moetier.kernels.cpu.graph_part import Counters, CpuPart, cpu_part_join, cpu_part_start
from moetier.residency.hybrid_split import HybridSpeeds, cpu_seconds
from moetier.residency.zero_copy import ZeroCopyPlacement


def refusal(formats: Mapping[int, BlobFormat], delta: bool) -> str | None:
    """Why the captured step cannot split misses for these layers' formats (None: it can)."""
    from moetier.kernels.cpu.build import load
    from moetier.kernels.cpu.experts import cpu_supports

    if delta:
        return "the graph step's CPU pairs apply no delta plane"
    if load() is None:
        return "no C compiler built the CPU expert kernel the graph step calls"
    for layer, fmt in formats.items():
        if not cpu_supports(fmt, "c"):
            return f"layer {layer}'s experts ({fmt.name}) have no C CPU kernel"
    return None


def expected_pairs(scores: torch.Tensor, tokens: float, top_k: int) -> torch.Tensor:
    """Each expert's expected pairs in a step of `tokens` tokens from one layer's decayed counts
    [E]: its share of the counts times tokens·k (uniform where nothing is counted yet)."""
    total = float(scores.sum())
    if total <= 0:
        return torch.full_like(scores, tokens * top_k / scores.numel(), dtype=torch.float64)
    return scores.double() / total * tokens * top_k


def choose_cpu(
    expected: Mapping[int, float],
    blob_bytes: int,
    speeds: HybridSpeeds,
    share: float | None = None,
) -> list[int]:
    """Of cold experts with `expected` pairs a step, those the CPU computes: a prefix of them by
    expected pairs (then id). With `share`, round(share · n) of them; else the prefix of least
    expected cost, max(GPU path, CPU part) with an expert reached in a step with probability
    1 - exp(-m) (m its expected pairs) and m / that many pairs when reached; the CPU part pays
    `sync` whenever it has any expert (the host node runs every step)."""
    order = sorted(expected, key=lambda e: (expected[e], e))
    if share is not None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"a forced CPU share is in [0, 1], got {share}")
        return sorted(order[: round(share * len(order))])

    def reached(e: int) -> float:
        return 1.0 - math.exp(-expected[e])

    def cpu_cost(e: int) -> float:
        p = reached(e)
        return p * cpu_seconds(blob_bytes, max(1, round(expected[e] / p)), speeds) if p else 0.0

    gpu = [reached(e) * blob_bytes / speeds.gpu_path for e in order]
    cpu = [cpu_cost(e) for e in order]
    best, best_cost = 0, sum(gpu)
    for n in range(1, len(order) + 1):
        cost = max(sum(gpu[n:]), sum(cpu[:n]) + speeds.sync)
        if cost < best_cost:
            best, best_cost = n, cost
    return sorted(order[:best])


class HybridGraph:
    """The zero-copy step's CPU pairs over `placement` (module docstring)."""

    def __init__(
        self,
        placement: ZeroCopyPlacement,
        formats: Mapping[int, BlobFormat],
        activation: ExpertActivation,
        hidden: int,
        top_k: int,
        speeds: HybridSpeeds | None,
        share: float | None,
    ) -> None:
        if speeds is None and share is None:
            raise ValueError("the graph step's split needs the cost model's speeds or a share")
        zc = placement
        self.placement, self.speeds, self.share, self.top_k = zc, speeds, share, top_k
        device = zc.pool.device
        shape = (len(zc.layers), zc.num_experts)
        self.flags = torch.zeros(shape, dtype=torch.bool, device=device)
        addresses = torch.zeros(shape, dtype=torch.int64)
        for layer in zc.layers:
            for e in range(zc.num_experts):
                if (layer, e, "base") in zc.host:
                    addresses[zc.layer_index[layer], e] = zc.host.address((layer, e, "base"))
        self.addresses = addresses.to(device)
        self.part = CpuPart({layer: formats[layer] for layer in zc.layers}, activation, top_k,
                            hidden, device)  # fmt: skip
        self.marked: list[list[int]] = [[] for _ in zc.layers]  # per layer index, host side
        self.tokens = 1.0  # tokens a decode step (mean since the last mark), for the estimate

    def mark(self, tokens: float | None = None) -> int:
        """Choose each layer's CPU experts now (between steps, on the current stream) and write
        the flags and the placement's tables in place. Returns the experts marked."""
        zc = self.placement
        if tokens is not None:
            self.tokens = max(1.0, tokens)
        skip = torch.zeros(self.flags.shape, dtype=torch.bool)
        resident = set(zc.pool.resident()) if not zc.demoted else set()
        for layer in zc.layers:
            i = zc.layer_index[layer]
            cold = [
                e
                for e in range(zc.num_experts)
                if (layer, e, "base") in zc.host and (layer, e, "base") not in resident
            ]
            expected = expected_pairs(zc.scores[i], self.tokens, self.top_k)
            chosen = choose_cpu({e: float(expected[e]) for e in cold}, zc.blob_bytes[layer],
                                self.speeds or HybridSpeeds(1.0, 1.0), self.share)  # fmt: skip
            skip[i, chosen] = True
            self.marked[i] = chosen
        self.flags.copy_(skip)
        zc.set_skip(skip)
        return int(skip.sum())

    def start(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        live: torch.Tensor | None,
    ) -> None:
        i = self.placement.layer_index[layer]
        cpu_part_start(hidden, topk_ids, topk_weights, self.flags[i], self.addresses[i], live,
                       self.part.ticket, self.part.part_id, layer)  # fmt: skip

    def join(self, layer: int, out: torch.Tensor) -> None:
        cpu_part_join(out, self.part.ticket, self.part.part_id, layer)

    def counters(self) -> Counters:
        """Pairs, distinct blobs, calls and seconds of the C calls so far."""
        return self.part.counters()
