"""`moetier quality STORE ... --write-sensitivity`: the gate's per-(layer, expert) sensitivity
table, measured on a text (use calibration text, not the text the gate is judged on).

For each MoE layer l, the KLD (against the reference) that the delta on layer l alone removes,
ΔKLD_l = KLD(base only) - KLD(delta on l only), is shared among l's experts by their delta's
output error in a base-only pass: A[l, e] = Σ over e's pairs of ||w · (f_delta(x) - f_base(x))||².
A pair's expected impact is then ΔKLD_l / Σ_e A[l, e] · w² · U[l, e], with U[l, e] the mean of
||f_delta(x) - f_base(x)||² over e's pairs; the table holds ΔKLD_l / Σ_e A[l, e] · U[l, e]
(scaled to mean 1), so the score of a pair is `weight*weight*sensitivity`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from moetier.config import DeltaRule
from moetier.engine.quality import compare
from moetier.gate.tables import write_table


class _MaskGate:
    """A gate stand-in whose mask the measurement sets per call."""

    def __init__(self) -> None:
        self.rule = DeltaRule.parse("weight:0")
        self.mask: Any = None  # callable (layer, ids) -> [T, k] bool

    def decide(
        self, layer: int, hidden: Any, ids: torch.Tensor, weights: Any, resident: Any = None
    ) -> torch.Tensor:
        return self.mask(layer, ids)


def measure_sensitivity(
    loaded: Any, reference: Any, token_chunks: torch.Tensor, args: argparse.Namespace
) -> int:
    runtime = loaded.runtime
    if runtime.delta_threshold is None:
        raise SystemExit("--write-sensitivity needs a store with a delta plane")
    layers = sorted(runtime.formats)
    experts = loaded.store.model_config.num_experts
    gate = _MaskGate()
    runtime.gate = gate
    forward = runtime.forward
    a = torch.zeros(max(layers) + 1, experts, dtype=torch.float64)
    u = torch.zeros_like(a)
    n = torch.zeros_like(a)

    def none(layer: int, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)

    def measuring(layer: int, hidden: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Any:
        gate.mask = none
        base = forward(layer, hidden, ids, w).float()
        for j in range(ids.shape[1]):
            gate.mask = lambda _, i, j=j: torch.zeros_like(i, dtype=torch.bool).index_fill_(
                1, torch.tensor([j], device=i.device), True
            )  # noqa: E501
            energy = (forward(layer, hidden, ids, w).float() - base).pow(2).sum(-1).double().cpu()
            e = ids[:, j].long().cpu()
            ww = w[:, j].double().cpu().pow(2).clamp_min(1e-12)
            a[layer].index_add_(0, e, energy)
            u[layer].index_add_(0, e, energy / ww)
            n[layer].index_add_(0, e, torch.ones_like(energy))
        gate.mask = none
        return base.to(hidden.dtype)

    cache: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}

    def theirs(batch: torch.Tensor) -> torch.Tensor:
        key = (batch.data_ptr(), tuple(batch.shape))
        if key not in cache:
            cache[key] = reference(batch.to(loaded.device)).logits
        return cache[key]

    def ours(batch: torch.Tensor) -> torch.Tensor:
        return loaded.model(batch.to(loaded.device)).logits

    def kld() -> float:
        return compare(ours, theirs, token_chunks, args.batch_size).mean_kld

    runtime.forward = measuring
    base_kld = kld()  # (also accumulates A, U, N)
    runtime.forward = forward
    removed = {}
    for layer in layers:
        gate.mask = lambda lay, ids, layer=layer: torch.full(
            ids.shape, lay == layer, device=ids.device
        )
        removed[layer] = base_kld - kld()
        print(
            f"layer {layer}: delta alone removes {removed[layer]:.6f} of {base_kld:.6f}",
            file=sys.stderr,
        )
    table: dict[int, list[float]] = {}
    for layer in layers:
        per_pair = u[layer] / n[layer].clamp_min(1)
        fallback = per_pair[n[layer] > 0].mean() if (n[layer] > 0).any() else torch.tensor(1.0)
        per_pair = torch.where(n[layer] > 0, per_pair, fallback)
        c = max(removed[layer], 1e-9) / max(float(a[layer].sum()), 1e-30)
        table[layer] = (c * per_pair).tolist()
    mean = sum(sum(row) for row in table.values()) / sum(len(row) for row in table.values())
    table = {layer: [v / mean for v in row] for layer, row in table.items()}
    out = Path(args.table_out) if args.table_out else loaded.store.path / "gate_sensitivity.json"
    how = (
        f"moetier quality --write-sensitivity on {Path(args.text).name}, {token_chunks.shape[0]} "
        f"chunks of {token_chunks.shape[1]}; KLD base only {base_kld:.6f}, removed by the delta "
        f"on one layer: {', '.join(f'{k}: {v:.6f}' for k, v in removed.items())}"
    )
    write_table(out, "sensitivity", table, how)
    removed_6 = {k: round(v, 6) for k, v in removed.items()}
    line = {"table": str(out), "kind": "sensitivity", "base_kld": round(base_kld, 6)}
    print(json.dumps({**line, "removed_by_layer": removed_6}))
    return 0
