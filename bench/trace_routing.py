"""Trace-replayed routing for the decode bench: each MoE layer's top-k taken from a recorded
routing trace instead of the model's router (`bench/decode.py --routing trace:PATH`).

Trace file: an .npz with `expert_ids` [trace layers, tokens, k] (ints, experts of each token
ranked by routing weight, highest first), optionally `router_probs` of the same shape (the
weights) and `num_experts` (a scalar; default max id + 1). That is the format of
eval-moe-70m's `router_trace.npz` (5 layers x 16,384 held-out tokens, 32 experts, top-4).

Mapping onto a bench shape of E experts, top-k, L layers from a trace of E_t experts, top-k_t,
L_t layers (E_t must divide E, and G = E / E_t must divide k with k / G <= k_t):
  - each bench layer's E experts are G groups of E_t: bench expert g * E_t + e is expert e of
    group g;
  - group g of bench layer l replays one "source": trace layer s mod L_t at a token offset of
    (s div L_t) * (T div R) (s = l * G + g, R = ceil(L * G / L_t) rounds over the trace layers;
    tokens wrap around), so the G * L sources are distinct streams of real routing;
  - each group contributes the k / G highest-weight experts of its source's token;
  - weights are the trace's probabilities of those experts renormalised over the k (uniform
    1 / k without `router_probs`).
For eval-moe-70m onto the Qwen3-30B-A3B shape (128 experts, top-8, 8 layers): G = 4 groups of
32, 2 experts each, 32 sources over the 5 trace layers at offsets 0, 2340, ... 14040 tokens. Each
group then routes to the top 2/32 of its experts, the shape's own 8/128 ratio (the trace's own
4/32 is twice that).
Each source keeps its layer's load skew and its token-to-token reuse (what a cache sees); the
groups are independent streams. Bench token t of every layer is mapped trace token t (the
router's own cursor: prefill and decode consume the trace in order).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn


def load_trace(path: Path) -> tuple[np.ndarray, np.ndarray | None, int]:
    """(expert_ids [L_t, T, k_t] int64, router_probs [L_t, T, k_t] float32 or None,
    experts per trace layer) of a trace .npz."""
    with np.load(path) as data:
        if "expert_ids" not in data.files:
            raise ValueError(f"{path}: a routing trace needs `expert_ids` [layers, tokens, k]")
        ids = data["expert_ids"].astype(np.int64)
        probs = data["router_probs"].astype(np.float32) if "router_probs" in data.files else None
        experts = int(data["num_experts"]) if "num_experts" in data.files else int(ids.max()) + 1
    if ids.ndim != 3 or (probs is not None and probs.shape != ids.shape):
        raise ValueError(f"{path}: expert_ids must be [layers, tokens, k], router_probs alike")
    return ids, probs, experts


def map_trace(
    ids: np.ndarray,
    probs: np.ndarray | None,
    trace_experts: int,
    layers: int,
    num_experts: int,
    top_k: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The module docstring's mapping: (ids [layers, T, top_k] int64, weights [layers, T,
    top_k] float32) for a bench shape of `num_experts` experts, `top_k`, `layers` MoE layers."""
    trace_layers, tokens, trace_k = ids.shape
    if num_experts % trace_experts:
        raise ValueError(
            f"a trace of {trace_experts} experts cannot be mapped onto {num_experts}: the bench "
            "shape's experts must be a multiple of the trace's"
        )
    groups = num_experts // trace_experts
    if top_k % groups or top_k // groups > trace_k:
        raise ValueError(
            f"top-{top_k} over {groups} groups of {trace_experts} experts needs "
            f"{top_k / groups:g} experts per group from a top-{trace_k} trace"
        )
    per_group = top_k // groups
    if probs is None:
        probs = np.ones(ids.shape, dtype=np.float32)
    order = np.argsort(-probs, axis=-1, kind="stable")[..., :per_group]  # [L_t, T, per_group]
    best_ids = np.take_along_axis(ids, order, axis=-1)
    best_probs = np.take_along_axis(probs, order, axis=-1)
    rounds = math.ceil(layers * groups / trace_layers)
    stride = tokens // rounds
    out_ids = np.empty((layers, tokens, top_k), dtype=np.int64)
    out_w = np.empty((layers, tokens, top_k), dtype=np.float32)
    for layer in range(layers):
        for g in range(groups):
            source = layer * groups + g
            rows = (np.arange(tokens) + (source // trace_layers) * stride) % tokens
            cols = slice(g * per_group, (g + 1) * per_group)
            out_ids[layer, :, cols] = best_ids[source % trace_layers, rows] + g * trace_experts
            out_w[layer, :, cols] = best_probs[source % trace_layers, rows]
    out_w /= out_w.sum(axis=-1, keepdims=True)
    return out_ids, out_w


class TraceRouter(nn.Module):
    """Stands in for one MoE layer's router: x [T, H] -> the next T rows of the mapped trace
    (ids [T, k] int64, weights [T, k] in x's dtype). The cursor lives on the device and
    advances in place, so a captured CUDA graph replays the next token each time. `weight` is
    the replaced router's (prefetch prediction reads it)."""

    def __init__(self, ids: torch.Tensor, weights: torch.Tensor, router: nn.Module) -> None:
        super().__init__()
        self.register_buffer("ids", ids)  # [N, k] int64
        self.register_buffer("routing_weights", weights)  # [N, k] float32
        self.register_buffer("cursor", torch.zeros(1, dtype=torch.int64, device=ids.device))
        self.weight = router.weight

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = (self.cursor + torch.arange(x.shape[0], device=x.device)) % self.ids.shape[0]
        self.cursor.add_(x.shape[0])
        return self.ids[rows], self.routing_weights[rows].to(x.dtype)


def install(model: nn.Module, ids: np.ndarray, weights: np.ndarray) -> list[TraceRouter]:
    """Replace the router (`mlp.gate`) of each MoE layer of a native model, in layer order, by
    a TraceRouter over mapped trace layer i; returns them."""
    blocks = [block.mlp for block in model.model.layers if hasattr(block.mlp, "gate")]  # type: ignore[union-attr, operator]
    if len(blocks) > ids.shape[0]:
        raise ValueError(f"{len(blocks)} MoE layers, the mapped trace has {ids.shape[0]}")
    routers = []
    for i, block in enumerate(blocks):
        device = block.gate.weight.device
        router = TraceRouter(
            torch.from_numpy(ids[i]).to(device), torch.from_numpy(weights[i]).to(device), block.gate
        )
        block.gate = router
        routers.append(router)
    return routers


def trace_counts(ids: np.ndarray, rows: range, num_experts: int) -> np.ndarray:
    """Pairs per (layer, expert) [layers, num_experts] over trace `rows` (wrapping) of mapped
    ids [layers, tokens, k]."""
    layers, tokens, _ = ids.shape
    picked = ids[:, [r % tokens for r in rows]]  # [L, R, k]
    return np.stack(
        [np.bincount(picked[layer].ravel(), minlength=num_experts) for layer in range(layers)]
    )


def oracle_hot_set(counts: np.ndarray, slots: int) -> np.ndarray:
    """The `slots` most requested (layer, expert) blobs of `counts` [layers, E], as a bool mask
    [layers, E]: the best fixed GPU placement for those requests, known in hindsight (the
    trace floor's placement; a policy can only beat it by moving blobs mid-run)."""
    flat = counts.ravel()
    mask = np.zeros(flat.shape, dtype=bool)
    mask[np.argsort(-flat, kind="stable")[:slots]] = True
    return mask.reshape(counts.shape)
