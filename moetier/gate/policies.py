"""Gate policies: per (token, expert) pair scores and the masks they give (`--delta`'s grammar,
`moetier.config.DeltaRule`; docs/gate.md).

Each term scores a pair, higher meaning "more in need of the delta":
- weight: the pair's routing weight;
- entropy: the router's entropy over all experts, divided by log E (uncertain routing);
- margin: 1 - (p1 - p2) of the router's two largest probabilities (a close call);
- confidence: 1 - the top probability of the previous step's next-token distribution for the
  row (an unsure model), 0 where the row has none;
- sensitivity / hot: a per-(layer, expert) table looked up at the pair's expert;
- random: uniform in [0, 1) (the baseline);
- forced: 1 in rows inside a structured span (tool call, grammar), else 0.
A score is a sum of products of terms. A rule keeps pairs whose score is >= T, or the best
floor(F * T * k) pairs of the call (`budget_mask`); forced rows always get the delta, and
`resident` keeps only pairs whose delta is on the GPU. Everything stays on the tensors' device
with shapes fixed by [T, k], so a gate captures in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetier.config import DeltaRule


@dataclass
class GateInputs:
    """What one experts call knows. topk_ids / topk_weights [T, k]; router_probs [T, E] (the
    router's probabilities over every expert), confidence [T] (previous distribution's top
    probability per row), forced [T] bool, resident [E] bool (this layer's deltas on the GPU),
    tables: term name (with @FILE) -> this layer's [E] row. None: not known here."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    router_probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    forced: torch.Tensor | None = None
    resident: torch.Tensor | None = None
    tables: dict[str, torch.Tensor] | None = None


def router_entropy(probs: torch.Tensor) -> torch.Tensor:
    """[T, E] probabilities -> [T] entropy / log E, in [0, 1]."""
    p = probs.float()
    h = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    return h / math.log(max(2, probs.shape[-1]))


def router_margin(probs: torch.Tensor) -> torch.Tensor:
    """[T, E] -> [T]: 1 - (largest - second largest probability)."""
    top2 = torch.topk(probs.float(), 2, dim=-1).values
    return 1.0 - (top2[:, 0] - top2[:, 1])


def term_score(term: str, x: GateInputs) -> torch.Tensor:
    """One term's score, [T, k] or [T, 1] float32 (see the module docstring)."""
    tokens = x.topk_ids.shape[0]
    device = x.topk_weights.device
    name = term.partition("@")[0]
    if name == "weight":
        return x.topk_weights.float()
    if name in ("entropy", "margin"):
        if x.router_probs is None:
            raise ValueError(f"the gate's {name} term needs the router's probabilities")
        f = router_entropy if name == "entropy" else router_margin
        return f(x.router_probs).unsqueeze(1)
    if name == "confidence":
        if x.confidence is None:
            return torch.zeros(tokens, 1, device=device)
        return (1.0 - x.confidence.float()).unsqueeze(1)
    if name in ("sensitivity", "hot"):
        table = (x.tables or {}).get(term)
        if table is None:
            raise ValueError(f"the gate's {term} term has no table for this layer")
        return table.float()[x.topk_ids.long()]
    if name == "random":
        return torch.rand(x.topk_ids.shape, device=device)
    if name == "forced":
        if x.forced is None:
            return torch.zeros(tokens, 1, device=device)
        return x.forced.float().unsqueeze(1)
    raise ValueError(f"unknown gate term {term!r}")


def score(rule: DeltaRule, x: GateInputs) -> torch.Tensor:
    """The rule's score of every pair: [T, k] float32."""
    total = torch.zeros(x.topk_ids.shape, device=x.topk_weights.device)
    for product in rule.score:
        part = torch.ones((), device=total.device)
        for term in product:
            part = part * term_score(term, x)
        total = total + part
    return total


def budget_count(pairs: int, fraction: float) -> int:
    """Pairs a budget of `fraction` allows out of `pairs` (from shapes: no host sync)."""
    return int(math.floor(fraction * pairs + 1e-9))


def budget_mask(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """[T, k] scores -> bool mask of the best floor(fraction * T * k) pairs (top-k over the
    flattened scores: fixed shapes, no host sync)."""
    flat = scores.flatten()
    n = budget_count(flat.numel(), fraction)
    mask = torch.zeros(flat.shape, dtype=torch.bool, device=flat.device)
    if n > 0:
        mask[torch.topk(flat, n, sorted=False).indices] = True
    return mask.view(scores.shape)


def decide(rule: DeltaRule, x: GateInputs) -> torch.Tensor:
    """The rule's [T, k] bool mask: which pairs use the delta."""
    if rule.everywhere:
        mask = torch.ones(x.topk_ids.shape, dtype=torch.bool, device=x.topk_ids.device)
    else:
        s = score(rule, x)
        if rule.budget is not None:
            mask = budget_mask(s, rule.budget)
        else:
            assert rule.threshold is not None
            mask = s >= rule.threshold
    if x.forced is not None:
        mask = mask | x.forced.bool().unsqueeze(1)
    if rule.resident and x.resident is not None:
        mask = mask & x.resident.bool()[x.topk_ids.long()]
    return mask
