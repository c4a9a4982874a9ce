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

from typing import Any

import torch
import torch.distributed as dist

from moetier.config import EngineConfig
from moetier.models.experts import ExpertShard
from moetier.parallel.group import TIMEOUT_ENV, RankGroup
from moetier.quant.store import INDEX_FILE, Store
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
    """This rank's experts and the combine over `group`, after every rank agreed on what
    decides routing (`check_agreement`)."""
    split = partition(store, engine_config, group.ranks)
    check_agreement(group, fingerprint(store, engine_config, split))
    return ExpertShard(group.rank, group.ranks, split.owned(group.rank), Combine(group))


def fingerprint(
    store: Store, engine_config: EngineConfig, split: ExpertPartition
) -> dict[str, str]:
    """What must be the same on every rank for their routers to agree bit for bit: a
    (token, expert) pair is computed only by the rank that owns the expert its own router
    chose, so a rank that routes differently drops or doubles pairs without an error."""
    import hashlib

    from moetier.kernels.moe_dispatch import _device_name, tuned_configs

    def digest(value: Any) -> str:
        return hashlib.sha256(repr(value).encode()).hexdigest()[:16]

    index = store.path / INDEX_FILE
    device = _device_name() if engine_config.resolved_device().startswith("cuda") else "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {
        "store": hashlib.sha256(index.read_bytes()).hexdigest()[:16],
        "partition": digest([split.owned(r) for r in range(split.ranks)]),
        "engine": digest((engine_config.dtype, engine_config.delta)),
        "torch": torch.__version__,
        "triton": triton_version,
        "device": device,
        "kernel configs": digest(sorted(tuned_configs(device).items())),
    }


def check_agreement(group: RankGroup, mine: dict[str, str]) -> None:
    """Every rank's `fingerprint` against rank 0's (all_gather over the control group): a
    ValueError on every rank naming the ranks and what differs, before any step runs."""
    every: list[Any] = [None] * group.ranks
    dist.all_gather_object(every, mine, group=group.control)
    differ = {
        rank: sorted(k for k in every[0] if theirs.get(k) != every[0][k])
        for rank, theirs in enumerate(every)
        if theirs != every[0]
    }
    if differ:
        said = "; ".join(f"rank {r}: {', '.join(keys)}" for r, keys in sorted(differ.items()))
        raise ValueError(
            f"the ranks do not agree with rank 0 on what decides routing ({said}): every rank "
            "needs the same store, --expert-hotness file, engine flags, GPU model, torch / "
            "Triton versions and kernel configs (`moetier tune` on every node, or on none)"
        )
