"""`Gate`: one `--delta` rule with what it reads across calls: per-layer tables, the routers
(for entropy and margin), the previous step's confidence per row and forced rows, kept as
device tensors that the engine writes and the next step reads (no host sync)."""

from __future__ import annotations

from pathlib import Path

import torch

from moetier.config import DeltaRule
from moetier.gate.policies import ActGate, GateInputs, decide, decide_act
from moetier.gate.sketches import read_sketches, sketch_path
from moetier.gate.tables import read_table, table_path


class Gate:
    """decide(layer, hidden, ids, weights, resident) -> [T, k] bool mask; an `act` rule's
    decision is finished inside the experts op (`decide_act` -> ActGate)."""

    def __init__(
        self,
        rule: DeltaRule,
        store: Path | None = None,
        device: str = "cpu",
        moe_layers: list[int] | None = None,
    ) -> None:
        self.rule = rule
        self.device = torch.device(device)
        # a MoE layer's place among the model's MoE layers: a budget's carried fraction of a
        # pair goes on to the next MoE layer (layer numbers skip dense layers)
        self.ordinal = {layer: i for i, layer in enumerate(sorted(moe_layers or ()))}
        terms = rule.terms()
        self.needs_router = bool(terms & {"entropy", "margin"})
        # term (with @FILE) -> layer -> [E] table
        self.tables: dict[str, dict[int, torch.Tensor]] = {}
        for product in rule.score:
            for term in product:
                if term.partition("@")[0] in ("sensitivity", "hot") and term not in self.tables:
                    if store is None and "@" not in term:
                        raise ValueError(f"the gate's {term} term needs a store or @FILE")
                    path = table_path(term, store or Path("."))
                    self.tables[term] = read_table(path, self.device)
        # the act term: layer -> (down-delta sketch [E, R, I], gate_up sketch [E, R, H] or None)
        self.sketches: dict[int, tuple[torch.Tensor, torch.Tensor | None]] | None = None
        for product in rule.score:
            for term in product:
                if term.partition("@")[0] == "act" and self.sketches is None:
                    if store is None and "@" not in term:
                        raise ValueError(f"the gate's {term} term needs a store or @FILE")
                    path = sketch_path(term, store or Path("."))
                    self.sketches = read_sketches(path, self.device)
        self.routers: dict[int, torch.Tensor] = {}  # layer -> router weight [E, H]
        # the previous step's next-token confidence per row [rows] and forced rows [rows]:
        # written in place by the engine (observe / force), read by the next call whose
        # token count matches
        self.confidence: torch.Tensor | None = None
        self.forced: torch.Tensor | None = None

    def set_routers(self, routers: dict[int, torch.Tensor]) -> None:
        """Each MoE layer's router weight [E, H] (entropy and margin recompute its softmax)."""
        self.routers = {layer: w.detach() for layer, w in routers.items()}

    def observe(self, logits: torch.Tensor) -> None:
        """The sampler's distribution of this step, logits [rows, V]: keep each row's top
        probability on the device for the next step's `confidence` term."""
        top = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
        if self.confidence is None or self.confidence.shape != top.shape:
            self.confidence = top.detach().clone()
        else:
            self.confidence.copy_(top)

    def force(self, rows: torch.Tensor | None) -> None:
        """Rows inside a structured span ([rows] bool; None: none): their pairs get the delta."""
        self.forced = rows

    def inputs(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        resident: torch.Tensor | None = None,
    ) -> GateInputs:
        tokens = topk_ids.shape[0]
        probs = None
        if self.needs_router:
            router = self.routers.get(layer)
            if router is None:
                raise ValueError(f"the gate's entropy / margin needs layer {layer}'s router")
            probs = torch.softmax(hidden.float() @ router.float().t(), dim=-1)
        tables = {term: rows[layer] for term, rows in self.tables.items() if layer in rows}
        confidence = self.confidence
        if confidence is not None and confidence.shape[0] != tokens:
            confidence = None
        forced = self.forced
        if forced is not None and forced.shape[0] != tokens:
            forced = None
        return GateInputs(topk_ids, topk_weights, probs, confidence, forced, resident, tables)

    @property
    def uses_act(self) -> bool:
        """Whether the rule has the act term (its mask is finished inside the experts op)."""
        return self.sketches is not None

    def decide_act(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        resident: torch.Tensor | None = None,
    ) -> ActGate:
        """An act rule's per-pair coefficients and thresholds for the experts op."""
        assert self.sketches is not None
        sketch = self.sketches.get(layer)
        if sketch is None:
            raise ValueError(f"the gate's act sketch file has no sketch for layer {layer}")
        x = self.inputs(layer, hidden, topk_ids, topk_weights, resident)
        return decide_act(self.rule, x, hidden, sketch[0], sketch[1])

    def decide(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        resident: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = self.inputs(layer, hidden, topk_ids, topk_weights, resident)
        return decide(self.rule, inputs, self.ordinal.get(layer, layer))
