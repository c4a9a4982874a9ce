"""Each rank's share of the experts (residency/partition.py) and the combine of a MoE layer's
pairs across the ranks.

Dense layers run on every rank over the same tokens, so every rank already holds every token's
hidden state when a MoE layer starts: dispatching a (token, expert) pair to its expert's rank
moves no bytes, the rank simply computes the pairs of the experts it owns (the experts op leaves
the other pairs' rows zero). What must move is the combine: every rank needs every pair's
output for the next dense layer. That is an all-reduce (sum) of the [T, k, H] float32 rows:
each row is non-zero on exactly one rank, so the sum is that rank's row bit for bit, and the sum
over k that follows is the one process's, in the same order: output identical to one GPU's.
(An all-to-all, which gloo on CPU also supports in torch 2.13 — all_to_all and
all_to_all_single both ran between two gloo processes — is the transport where ranks hold
different tokens, i.e. with data-parallel attention; with replicated dense layers the rows
every rank needs are all of them, which all_reduce, or all_gather + a local reduce, delivers.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moetier.config import EngineConfig
from moetier.models.experts import ExpertShard
from moetier.parallel.group import TIMEOUT_ENV, RankGroup
from moetier.quant.store import Store
from moetier.residency.partition import ExpertPartition, read_hotness


class Combine:
    """`(layer, out [T, k, H] float32)`: out summed over the ranks in place (all_reduce over
    the compute group); a rank that exited or did not join within the group's timeout is an
    error naming the layer, not a hang."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.calls = 0
        self.bytes = 0  # bytes each rank contributed to the combines

    def __call__(self, layer: int, out: torch.Tensor) -> None:
        g = self.group
        try:
            dist.all_reduce(out, group=g.compute)
        except (RuntimeError, dist.DistError) as err:
            raise RuntimeError(
                f"rank {g.rank} of {g.ranks}: the expert combine of MoE layer {layer} failed: "
                f"another rank exited or did not join within {g.timeout_s:.0f} s "
                f"({TIMEOUT_ENV}); see that rank's error ({err})"
            ) from err
        self.calls += 1
        self.bytes += out.numel() * out.element_size()


def partition(store: Store, engine_config: EngineConfig, ranks: int) -> ExpertPartition:
    """The run's partition: by `--expert-hotness` where given (balanced expected load), else
    round-robin. Every rank computes the same one from the same store and file."""
    cfg = store.model_config
    hotness = None
    if engine_config.expert_hotness:
        hotness = read_hotness(engine_config.expert_hotness, store.moe_layers, cfg.num_experts)
    return ExpertPartition.build(store.moe_layers, cfg.num_experts, ranks, hotness)


def expert_shard(store: Store, engine_config: EngineConfig, group: RankGroup) -> ExpertShard:
    """This rank's experts and the combine over `group`."""
    owned = partition(store, engine_config, group.ranks).owned(group.rank)
    return ExpertShard(group.rank, group.ranks, owned, Combine(group))
