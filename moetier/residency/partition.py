"""Which rank owns which expert under expert parallelism (`--gpus N`, moetier/parallel).

Every MoE layer's experts are split between the ranks; a rank keeps only its own experts in its
slots and host tier and computes only the (token, expert) pairs routed to them. With measured
hotness (a routing trace or a table of per-expert counts, `--expert-hotness`) each layer's
experts go, hottest first, to the rank with the least expected load so far (longest processing
time first), no rank holding more than ceil(E / N) experts of a layer so the caches stay equal;
without it, expert e goes to rank e mod N. Pure Python over ints and floats: the same inputs give
the same partition on every rank, so no rank has to send it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def partition_layer(num_experts: int, ranks: int, load: Sequence[float] | None = None) -> list[int]:
    """The owning rank of each of a layer's `num_experts` experts. `load`: each expert's expected
    share of the layer's pairs (any scale; None: round-robin)."""
    if ranks < 1:
        raise ValueError(f"expert parallel needs at least one rank, got {ranks}")
    if load is None:
        return [e % ranks for e in range(num_experts)]
    if len(load) != num_experts:
        raise ValueError(f"hotness has {len(load)} experts for a layer of {num_experts}")
    cap = math.ceil(num_experts / ranks)
    totals, counts = [0.0] * ranks, [0] * ranks
    owner = [0] * num_experts
    for e in sorted(range(num_experts), key=lambda e: (-float(load[e]), e)):
        open_ranks = [r for r in range(ranks) if counts[r] < cap]
        rank = min(open_ranks, key=lambda r: (totals[r], counts[r], r))
        owner[e] = rank
        totals[rank] += float(load[e])
        counts[rank] += 1
    return owner


@dataclass(frozen=True)
class ExpertPartition:
    """The owner of every expert of every MoE layer: `owners[layer][e]` is a rank < `ranks`."""

    ranks: int
    owners: dict[int, tuple[int, ...]]

    @classmethod
    def build(
        cls,
        layers: Sequence[int],
        num_experts: int,
        ranks: int,
        hotness: Mapping[int, Sequence[float]] | None = None,
    ) -> ExpertPartition:
        """Every layer of `layers` split by `partition_layer` (its hotness row where given)."""
        hot = hotness or {}
        return cls(
            ranks,
            {layer: tuple(partition_layer(num_experts, ranks, hot.get(layer))) for layer in layers},
        )

    def owned(self, rank: int) -> dict[int, list[int]]:
        """layer -> the experts `rank` owns, ascending."""
        return {
            layer: [e for e, r in enumerate(row) if r == rank] for layer, row in self.owners.items()
        }

    def most_owned(self) -> int:
        """The most experts (summed over layers) any rank owns: what its cache must hold to
        keep all of its experts."""
        return max(sum(len(v) for v in self.owned(r).values()) for r in range(self.ranks))

    def expected_load(self, hotness: Mapping[int, Sequence[float]]) -> list[float]:
        """Each rank's share of all pairs under `hotness` (1 / ranks each when balanced)."""
        totals = [0.0] * self.ranks
        for layer, row in self.owners.items():
            load = hotness.get(layer)
            if load is None:
                continue
            whole = float(sum(load)) or 1.0
            for e, r in enumerate(row):
                totals[r] += float(load[e]) / whole
        layers = sum(1 for layer in self.owners if layer in hotness) or 1
        return [t / layers for t in totals]


def read_hotness(
    path: str | Path, moe_layers: Sequence[int], num_experts: int
) -> dict[int, list[float]]:
    """Per MoE layer, each expert's use count from `path`: a routing trace .npz (`expert_ids`
    [MoE layers, tokens, k], trace layer i = the store's i-th MoE layer, as `moetier quality
    --trace` reads it) or a JSON table {"layers": {"<layer>": [E numbers]}} keyed by the store's
    layer index (gate/tables.py's format)."""
    path = Path(path)
    if path.suffix == ".npz":
        import numpy as np

        with np.load(path) as data:
            if "expert_ids" not in data.files:
                raise ValueError(f"{path}: a routing trace needs expert_ids [layers, tokens, k]")
            ids = data["expert_ids"].astype(np.int64)
        if ids.ndim != 3 or ids.shape[0] != len(moe_layers):
            raise ValueError(
                f"{path}: expert_ids {tuple(ids.shape)} must be [{len(moe_layers)} MoE layers, "
                "tokens, k] for this store"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
            raise ValueError(f"{path}: expert ids outside 0..{num_experts - 1}")
        return {
            layer: np.bincount(ids[i].ravel(), minlength=num_experts).astype(float).tolist()
            for i, layer in enumerate(moe_layers)
        }
    try:
        rows = json.loads(path.read_text())["layers"]
        table = {int(layer): [float(v) for v in row] for layer, row in rows.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"--expert-hotness {path}: give a routing trace .npz or a JSON table "
            f'{{"layers": {{"<layer>": [counts]}}}} ({err})'
        ) from err
    for layer, row in table.items():
        if layer not in moe_layers or len(row) != num_experts:
            raise ValueError(
                f"--expert-hotness {path}: layer {layer} with {len(row)} entries; the store's MoE "
                f"layers are {list(moe_layers)} with {num_experts} experts each"
            )
    return table
