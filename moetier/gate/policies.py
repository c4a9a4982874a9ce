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
- forced: 1 in rows inside a structured span (tool call, grammar), else 0;
- act: ‖S_e h‖² (+ ‖S_gu,e x‖²), h the pair's base hidden activation act(W_gate x, W_up x) and
  S_e the top singular directions of expert e's down delta (gate/sketches.py): known only
  inside the experts op, after its base gate_up. A rule with it is split as score = a + b · act
  (`act_split`): the gate hands the op b and T − a per pair (`ActGate`), the op finishes the
  mask (`moe_ref.act_mask_ref`, the Triton kernels' `act_gate`).
A score is a sum of products of terms. A rule keeps pairs whose score is >= T, or the best
F * T * k pairs of the call (`budget_mask`; a fraction of a pair carried on to the next layer,
so a step of few rows still gets its share); forced rows always get the delta, and
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
    act: torch.Tensor | None = None  # [T, k] the act term's values, where computed outside the op


@dataclass
class ActGate:
    """An act rule's decision as the experts op takes it: a pair uses the delta where
    mask & (coef · ‖sketch[e] h‖² >= threshold), h its base hidden activation. mask [T, k] bool
    (the candidates: resident pairs, else all; the op narrows it in place), sketch [E, R, I]
    float32 (this layer's down-delta sketch), coef and threshold [T, k] float32 (-inf in forced
    rows)."""

    mask: torch.Tensor
    sketch: torch.Tensor
    coef: torch.Tensor
    threshold: torch.Tensor


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
    if name == "act":
        if x.act is None:
            raise ValueError("the gate's act term is computed inside the experts op (act_split)")
        return x.act.float()
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


def act_split(rule: DeltaRule, x: GateInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """An act rule's score as a + b · act: (a, b), [T, k] float32 each (the products without
    act summed into a, the other factors of those with it into b)."""
    shape = x.topk_ids.shape
    a = torch.zeros(shape, device=x.topk_weights.device)
    b = torch.zeros(shape, device=a.device)
    for product in rule.score:
        part = torch.ones((), device=a.device)
        has_act = False
        for term in product:
            if term.partition("@")[0] == "act":
                has_act = True
                continue
            part = part * term_score(term, x)
        if has_act:
            b = b + part
        else:
            a = a + part
    return a, b


def gate_up_energy(hidden: torch.Tensor, ids: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """‖S_gu,e x‖² of every pair: hidden [T, H], ids [T, k], sketch [E, R, H] -> [T, k] float32
    (one [H, E · R] product, then each pair's R values gathered)."""
    experts, rank, width = sketch.shape
    y = hidden.float() @ sketch.reshape(experts * rank, width).t()  # [T, E * R]
    y = y.view(hidden.shape[0], experts, rank)
    picked = torch.gather(y, 1, ids.long()[:, :, None].expand(-1, -1, rank))  # [T, k, R]
    return picked.pow(2).sum(-1)


def decide_act(
    rule: DeltaRule,
    x: GateInputs,
    hidden: torch.Tensor,
    sketch: torch.Tensor,
    gate_up_sketch: torch.Tensor | None = None,
) -> ActGate:
    """An act rule (threshold form) as the experts op finishes it (`ActGate`): the pair's delta
    where a + b · (‖S h‖² + ‖S_gu x‖²) >= T, i.e. b · ‖S h‖² >= T − a − b · ‖S_gu x‖²; forced
    rows always (threshold -inf); `resident:` narrows the candidates."""
    assert rule.threshold is not None and rule.budget is None
    a, b = act_split(rule, x)
    if gate_up_sketch is not None:
        a = a + b * gate_up_energy(hidden, x.topk_ids, gate_up_sketch)
    threshold = rule.threshold - a
    if x.forced is not None:
        threshold = torch.where(x.forced.bool().unsqueeze(1), -math.inf, threshold)
    mask = torch.ones(x.topk_ids.shape, dtype=torch.bool, device=x.topk_ids.device)
    if rule.resident and x.resident is not None:
        mask = x.resident.bool()[x.topk_ids.long()]
    return ActGate(mask.contiguous(), sketch, b.contiguous(), threshold.contiguous())


def budget_count(pairs: int, fraction: float, layer: int = 0) -> int:
    """Pairs a budget of `fraction` allows out of `pairs` in layer `layer`'s call (from shapes
    and the layer's index: no host sync): floor((layer + 1) F pairs) - floor(layer F pairs),
    so layers 0..L-1 together take floor(L F pairs) and no layer more than ceil(F pairs). A
    fraction of a pair is carried on instead of dropped in every layer: at batch 1 with 8
    experts a token, a 10% budget gives 6 pairs over 8 layers, where floor(0.8) gave none."""

    def upto(n: int) -> int:
        return int(math.floor(n * fraction * pairs + 1e-9))

    return upto(layer + 1) - upto(layer)


def budget_mask(scores: torch.Tensor, fraction: float, layer: int = 0) -> torch.Tensor:
    """[T, k] scores -> bool mask of the best `budget_count(T * k, fraction, layer)` pairs
    (top-k over the flattened scores: fixed shapes, no host sync)."""
    flat = scores.flatten()
    n = budget_count(flat.numel(), fraction, layer)
    mask = torch.zeros(flat.shape, dtype=torch.bool, device=flat.device)
    if n > 0:
        # index_fill_ takes the value as a scalar argument (`mask[i] = True` copies it to the
        # device from pageable memory: a host sync, caught on an H100 at 8c63926)
        mask.index_fill_(0, torch.topk(flat, n, sorted=False).indices, True)
    return mask.view(scores.shape)


def decide(rule: DeltaRule, x: GateInputs, layer: int = 0) -> torch.Tensor:
    """The rule's [T, k] bool mask in the call of the `layer`-th MoE layer (counted from 0
    over the MoE layers only: a budget's carried fraction): which pairs use the delta."""
    if rule.everywhere:
        mask = torch.ones(x.topk_ids.shape, dtype=torch.bool, device=x.topk_ids.device)
    else:
        s = score(rule, x)
        if rule.budget is not None:
            mask = budget_mask(s, rule.budget, layer)
        else:
            assert rule.threshold is not None
            mask = s >= rule.threshold
    if x.forced is not None:
        mask = mask | x.forced.bool().unsqueeze(1)
    if rule.resident and x.resident is not None:
        mask = mask & x.resident.bool()[x.topk_ids.long()]
    return mask
