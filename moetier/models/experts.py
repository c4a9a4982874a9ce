"""The experts op: the one place that knows about expert residency and formats.

transformers' MoE families decorate their experts class with `@use_experts_implementation`,
which dispatches `forward` through `ALL_EXPERTS_FUNCTIONS[config._experts_implementation]`.
We register "moetier" there; each experts module carries a `moetier_experts` handle (set by the
loader) naming its layer and the shared `ExpertsRuntime`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat
from moetier.gate.policies import ActGate
from moetier.gate.state import Gate
from moetier.kernels.cpu.experts import cpu_experts
from moetier.kernels.moe_ops import format_id, moe_experts, sum_pairs, triton_supports
from moetier.kernels.residency_ops import stage_guesses, stage_join, stage_scores
from moetier.residency.host_tier import HostTier
from moetier.residency.hybrid_graph import HybridGraph, refusal
from moetier.residency.hybrid_split import HybridSpeeds, measure_speeds, split_misses
from moetier.residency.predict import predict_experts
from moetier.residency.slot_pool import BlobKey, SlotPool
from moetier.residency.telemetry import ResidencyTelemetry, TierCounters
from moetier.residency.zero_copy import ZeroCopyPlacement

IMPLEMENTATION_NAME = "moetier"
STREAM_TOKENS = 256  # a call of this many tokens or more streams its layer's experts


def _sum_pairs(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out [T, k, H] -> [T, H] in dtype: a step of one row sums in the compiled code (fused
    with what follows), more rows through `moetier::sum_pairs` (see there)."""
    if out.shape[0] == 1:
        return out.sum(dim=1).to(dtype)
    return sum_pairs(out, dtype)


def _keys(layer: int, experts: list[int], delta_experts: list[int]) -> list[BlobKey]:
    return [(layer, e, "base") for e in experts] + [(layer, e, "delta") for e in delta_experts]


@dataclass
class HybridCpu:
    """Hybrid misses (`ExpertsRuntime.enable_hybrid`): the cost model's speeds, or a forced
    share; the thread the CPU part runs on beside the GPU's work (None on CPU: inline); what
    the CPU computed (pairs, blob bytes read, seconds of CPU work)."""

    speeds: HybridSpeeds | None
    share: float | None
    executor: ThreadPoolExecutor | None
    pairs: int = 0
    bytes: int = 0
    seconds: float = 0.0
    # the split's decisions: calls split, missed experts left to the GPU and sent to the CPU
    # (totals: a server runs millions of calls)
    calls: int = 0
    gpu_misses: int = 0
    cpu_misses: int = 0


@dataclass(frozen=True)
class ExpertShard:
    """This process's part of expert parallelism (`--gpus N`, moetier/parallel): the experts it
    owns in each MoE layer (residency/partition.py) and `combine(layer, out)`, which sums the
    pairs' rows out [T, k, H] float32 over the ranks in place. Each row is computed by the one
    rank that owns its expert and is zero on the others, so the sum is that row exactly and
    the result is bit-identical to one process's."""

    rank: int
    ranks: int
    owned: dict[int, list[int]]
    combine: Callable[[int, torch.Tensor], None]


class ExpertsRuntime:
    """Routes each MoE layer's (hidden, top-k) through the slot pool and the kernel."""

    def __init__(
        self,
        residency: SlotPool,
        formats: dict[int, BlobFormat],
        activation: ExpertActivation,
        delta_formats: dict[int, BlobFormat] | None = None,
        delta_threshold: float | None = None,
    ) -> None:
        self.residency = residency
        self.formats = formats  # layer -> base-plane format
        self.activation = activation
        self.delta_formats = (
            delta_formats or {}
        )  # layer -> delta-plane format (if the store has one)
        # Pairs with routing weight >= threshold use the delta (None: never, 0: every pair, NaN:
        # `gate` decides); the mask is an input of the kernel.
        self.delta_threshold = delta_threshold if self.delta_formats else None
        self.gate: Gate | None = None  # the confidence gate (moetier/gate) for other --delta rules
        # the op names formats by small ints; looked up once here (torch.compile traces ints)
        self.format_ids = {layer: format_id(fmt) for layer, fmt in formats.items()}
        self.delta_format_ids = {
            layer: format_id(fmt) for layer, fmt in (delta_formats or {}).items()
        }
        self.pairs = 0
        self.delta_pairs = 0
        # Called as observer(layer, hidden, topk_ids, topk_weights) before each layer's experts
        # run (calibration statistics); None on the normal path.
        self.observer: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        # layer -> (base table, delta table or None) once every expert is pinned resident
        self.pinned: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        # pairs served by the pinned path: counted by the caller per forward (`count_pinned`),
        # since the captured step itself touches no Python state
        self.pinned_pairs = 0
        # zero-copy mode: hot blobs in GPU slots, the rest read from pinned host rows
        self.zero_copy: ZeroCopyPlacement | None = None
        self.count_accesses = True  # zero-copy: count pairs per expert on the device
        # prefetch (enable_prefetch): layer -> (next MoE layer, its router [E, H], norm ratio [H])
        self.predictors: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self.prefetch_m = 0
        self._predicted: dict[int, list[BlobKey]] = {}  # layer -> blobs predicted for it
        # layer -> the next MoE layer's router with its columns scaled (zero-copy staging), and
        # the layers some earlier layer guesses for
        self._scaled_routers: dict[int, torch.Tensor] = {}
        self._guess_scores: dict[int, torch.Tensor] = {}  # staging: the next layer's scores
        # what staging guesses from: "input" (the MoE input, scores beside the kernel) or
        # "output" (the residual after the layer, `after_layer`; native models)
        self.guess_from = "input"
        # set by the native loader, whose MoE blocks call `after_layer` (so "output" can work)
        self.layer_outputs = False
        self._guessed_layers: set[int] = set()
        # layer-streamed prefill from this many tokens per call (0: off)
        self.stream_tokens = STREAM_TOKENS
        self.hybrid: HybridCpu | None = None  # hybrid misses (enable_hybrid)
        # hybrid misses on the zero-copy (CUDA-graph) step (enable_hybrid_graph)
        self.hybrid_graph: HybridGraph | None = None
        # a decode step of fixed shape (engine/runner.py): which rows are real, [T] bool on the
        # device, set around the model's call; None: every row. Padding rows take row 0's
        # experts, so they read no expert of their own and are not counted
        self.live: torch.Tensor | None = None
        # expert parallel (set_shard): this rank's experts per layer; None: every expert here
        self.shard: ExpertShard | None = None
        self._owned: dict[int, frozenset[int]] = {}

    def set_shard(self, shard: ExpertShard) -> None:
        """Expert parallel: compute only the pairs of `shard.owned`'s experts (the others' rows
        stay zero) and combine every layer's rows with the other ranks' before the sum. Set
        before anything is pinned, placed or prefetched."""
        if self.pinned or self.zero_copy is not None:
            raise ValueError("set the expert shard before pinning or placing experts")
        missing = [layer for layer in self.formats if layer not in shard.owned]
        if missing:
            raise ValueError(f"the expert shard names no experts for MoE layers {missing}")
        self.shard = shard
        self._owned = {layer: frozenset(experts) for layer, experts in shard.owned.items()}

    def _mine(self, layer: int, experts: list[int]) -> list[int]:
        """Of `experts`, those this rank computes (all of them without a shard)."""
        if self.shard is None:
            return experts
        owned = self._owned[layer]
        return [e for e in experts if e in owned]

    def _combined(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        """out [T, k, H] with the other ranks' rows added (expert parallel; else as it is)."""
        if self.shard is not None:
            self.shard.combine(layer, out)
        return out

    def _check_capturable(self, what: str) -> None:
        """On CUDA, every layer's formats must run in the Triton kernels (the reference path
        syncs with the host and addresses only the plain pool layout)."""
        if self.residency.device.type != "cuda":
            return
        for layer, fmt in self.formats.items():
            delta = self.delta_formats.get(layer) if self.delta_threshold is not None else None
            if not triton_supports(fmt, delta):
                raise ValueError(
                    f"layer {layer}'s experts ({fmt.name}) run on the reference path, which "
                    f"syncs with the host and cannot be captured: convert with --experts "
                    f"q2s, nvfp4, mxfp4 or nested (NVFP4), or do not {what}"
                )

    def _delta_mask(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, ActGate | None]:
        """Which pairs use the delta: the gate's mask, else routing weight >= threshold. An act
        rule gives its candidates and what the op finishes the mask with (ActGate): the mask
        is final only once the op has run."""
        if self.gate is None:
            assert self.delta_threshold is not None
            return topk_weights >= self.delta_threshold, None
        resident = None  # pinned: every delta is on the GPU
        if self.gate.rule.resident and layer not in self.pinned:
            zc = self.zero_copy
            if zc is not None and zc.delta_table is not None and layer in zc.layer_index:
                resident = zc.delta_table[zc.layer_index[layer]] < zc.slots  # on the device
            else:  # the residency path (host decisions): deltas in slots before this call
                experts = self.residency.store.model_config.num_experts
                slots = [self.residency.slot_of((layer, e, "delta")) for e in range(experts)]
                resident = torch.tensor([s is not None for s in slots], device=hidden.device)
        if getattr(self.gate, "uses_act", False):  # (stand-in gates of studies have no act term)
            if self.hybrid is not None:
                raise ValueError("the gate's act term does not run with --cpu-experts yet")
            act = self.gate.decide_act(layer, hidden, topk_ids, topk_weights, resident)
            return act.mask, act
        return self.gate.decide(layer, hidden, topk_ids, topk_weights, resident), None

    def planes(self) -> list[str]:
        """The planes a forward reads: base, and delta when the delta is applied."""
        return ["base"] + (["delta"] if self.delta_threshold is not None else [])

    def enable_zero_copy(
        self,
        host: HostTier | None = None,
        hot: list[BlobKey] | None = None,
        stage: int = 0,
        delta_slots: int | None = None,
    ) -> ZeroCopyPlacement:
        """Zero-copy mode: every blob addressable without a host sync, `hot` blobs (default:
        the first the pool holds, layer by layer) in GPU slots and every other blob read by the
        kernel from its pinned row in `host` (default: the pool's host tier). `forward` then
        runs one kernel call per layer from fixed tables, capturable in a CUDA graph;
        `zero_copy.rebalance()` between steps moves the hot set. Numbers are unchanged.
        `delta_slots`: a delta cache of that many slots (`--delta-memory`; ZeroCopyPlacement).
        `stage`: that many pool slots per layer become staging slots: with predictors set
        (`enable_prefetch`), each one-token step copies the next layer's best guesses off the
        GPU into them on a side stream, overlapping the next layer's attention
        (`moetier::stage_guesses`)."""
        if self.pinned:
            raise ValueError("experts are pinned already: zero-copy mode replaces pin_all")
        if self.shard is not None:
            raise ValueError(
                "zero-copy decode is not built for expert parallel (--gpus N) yet: its steps run "
                "on the residency path"
            )
        host = host if host is not None else self.residency.host
        if host is None:
            raise ValueError(
                "zero-copy mode reads blobs from the host tier: give --host-memory (or a HostTier)"
            )
        if self.residency.device.type == "cuda" and not host.pinned:
            raise ValueError("zero-copy reads need the host tier in pinned memory")
        self._check_capturable("use zero-copy mode")
        mtp_layers = list(getattr(self.residency.store, "mtp_modules", {}))
        placement = ZeroCopyPlacement(
            self.residency, host, list(self.formats), self.planes(), stage, delta_slots,
            preferred=mtp_layers,  # drafting reads them k times a step: kept on the GPU
        )  # fmt: skip
        if hot is None:
            hot = placement.hot_keys(placement.scores)  # all zero: key order, base first
        placement.promote(hot[: max(0, self.residency.capacity - len(placement.fixed))])
        self.zero_copy = placement
        return placement

    def count_pinned(self, tokens: int) -> None:
        """Record that a forward of `tokens` tokens ran with every expert pinned: each of its
        (token, expert) pairs in each MoE layer was a GPU hit."""
        if self.pinned:
            top_k = self.residency.store.model_config.top_k
            self.pinned_pairs += tokens * len(self.pinned) * top_k

    def telemetry(self) -> ResidencyTelemetry:
        """The pool's counters (residency.telemetry), plus the pinned path's pairs (hits of the
        pool's tier) and, in zero-copy mode, the pairs read from GPU slots (gpu hits) and from
        pinned host rows (gpu misses, host hits), whose base-plane bytes count as moved into the
        GPU (one host read of the device counters). Staged guesses (zero-copy `stage`) are the
        gpu tier's prefetches: issued = blobs copied into staging slots (their bytes moved in
        too), used = pairs then read from them, needed = pairs read off the cached slots (host
        rows or staging)."""
        out = self.residency.telemetry()
        out[self.residency.tier_name].hits += self.pinned_pairs
        cpu_pairs = 0  # of the zero-copy step's misses, those the host's cores computed
        if self.hybrid is not None:  # hybrid misses: pairs the host's cores computed, the blob
            # bytes their kernel read and its seconds (so /metrics' tier="cpu" GB/s)
            h = self.hybrid
            cpu = TierCounters(hits=h.pairs, bytes=h.bytes, busy_seconds=h.seconds)
            if self.hybrid_graph is not None and self.zero_copy is not None:  # (C-side counts)
                done = self.hybrid_graph.counters()
                cpu_pairs = done.pairs
                cpu.hits += done.pairs
                cpu.bytes += done.blobs * max(self.zero_copy.blob_bytes.values())
                cpu.busy_seconds += done.seconds
            out.tiers["cpu"] = cpu
        zc = self.zero_copy
        if zc is not None:  # (streamed prefill pairs are in the pool's counters already)
            pairs, gpu = int(zc.counts.sum()) - zc.streamed_pairs, int(zc.gpu_pairs)
            blob = max(zc.blob_bytes.values())
            out["gpu"].hits += gpu
            out["gpu"].misses += pairs - gpu
            out["host"].hits += pairs - gpu - cpu_pairs
            out["gpu"].bytes += (pairs - gpu - cpu_pairs) * blob
            staged, used = int(zc.staged_blobs), int(zc.staged_pairs)
            if zc.stage:
                out["gpu"].bytes += staged * blob
                out["gpu"].prefetch_issued += staged
                out["gpu"].prefetch_used += used
                out["gpu"].prefetch_needed += pairs - gpu + used
        return out

    def pin_all(self) -> None:
        """Make every expert of every layer resident for good (both planes where the delta is
        used); `forward` then runs one kernel call per layer from fixed slot tables, without host
        syncs, so a decode step captures into a CUDA graph. The numbers are unchanged (each pair
        is computed into its own row either way). Raises ValueError when the pool is too small."""
        store = self.residency.store
        needed = sum(
            1
            for key in store.blobs
            if (key[2] == "base" or self.delta_threshold is not None)
            and (self.shard is None or key[1] in self._owned.get(key[0], ()))
        )
        if needed > self.residency.capacity:
            raise ValueError(
                f"pinning every expert needs {needed} slots, the expert cache has "
                f"{self.residency.capacity}: raise --expert-cache-mb (0 = room for all) or "
                "--gpu-memory"
            )
        if self.zero_copy is not None:
            raise ValueError("zero-copy mode is on: pin_all would replace it")
        self._check_capturable("pin")
        every = list(range(store.model_config.num_experts))
        for layer in self.formats:
            experts = self._mine(layer, every)  # expert parallel: this rank's, the rest -1
            with_delta = experts if self.delta_threshold is not None else []
            self.pinned[layer] = self.residency.ensure_planes(layer, experts, with_delta)

    def forward(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, H], topk_ids [T, k], topk_weights [T, k] -> [T, H] in hidden's dtype."""
        topk_ids = topk_ids.long()
        if self.observer is not None:
            self.observer(layer, hidden, topk_ids, topk_weights)
        tokens, k = topk_ids.shape
        live = self.live if self.live is not None and self.live.shape[0] == tokens > 1 else None
        if live is not None:  # padding rows: row 0's experts, counted as none (row 0 is real)
            topk_ids = torch.where(live[:, None], topk_ids, topk_ids[:1])
        out = torch.zeros(tokens, k, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        mask = act = None
        if self.delta_threshold is not None:
            # [T, k]; with the act term the candidates, narrowed in place by the op
            mask, act = self._delta_mask(layer, hidden, topk_ids, topk_weights)
            if live is not None:  # (in place: the act term's op narrows this tensor)
                mask.logical_and_(live[:, None])
        if layer in self.pinned:
            # every expert resident: no host sync, no Python state touched (pairs are not
            # counted: a mutated int would make torch.compile recompile the step every call)
            base_table, delta_table = self.pinned[layer]
            self._run(layer, hidden, topk_ids, topk_weights, base_table, delta_table, mask, out,
                      act=act)  # fmt: skip
            return _sum_pairs(self._combined(layer, out), hidden.dtype)
        zc = self.zero_copy
        streamed = 0 < self.stream_tokens <= topk_ids.shape[0]
        if zc is not None and layer in zc.layer_index and streamed and not zc.fixed:
            # a long prompt: the grouped kernel would read a host row once per block of pairs
            # (several times its bytes over PCIe); stream the layer's experts in once instead.
            # The tables point at host rows until the next rebalance (the Generator's, after
            # each prefill), so the slots are free for the stream
            if self.count_accesses:
                zc.record(zc.layer_index[layer], topk_ids)  # the rebalance's counts
                zc.streamed_pairs += topk_ids.numel()
            if not zc.demoted:
                zc.demote_all()
        elif zc is not None and layer in zc.layer_index:
            # every blob addressable: GPU slot or pinned host row; no host sync on CUDA
            index = zc.layer_index[layer]
            # staging: one-token steps copy the next layer's guesses into staging slots
            # (len, not bool: dynamo of torch 2.11 cannot trace bool(dict), and a graph break
            # here sent the whole decoder loop back to eager)
            staging = zc.stage > 0 and topk_ids.shape[0] == 1 and len(self.predictors) > 0
            if staging and layer in self._guessed_layers:
                stage_join(zc.table[index], index)  # this layer's staged copies have landed
            record_delta = self.count_accesses and mask is not None and zc.delta_slots is not None
            if self.count_accesses:
                zc.record(
                    index, topk_ids if live is None else torch.where(live[:, None], topk_ids, -1)
                )
                if record_delta and act is None and mask is not None:
                    zc.record_delta(index, topk_ids, mask)  # the delta cache's ranking
            guess = staging and layer in self.predictors and self.guess_from == "input"
            if guess:  # the next layer's scores, on the side stream beside this layer's kernel
                self._score_next(layer, hidden)
            delta_table = zc.delta_table[index] if zc.delta_table is not None else None
            split = self.hybrid_graph
            if split is not None:  # hybrid misses: the flagged experts' pairs to the CPU
                split.start(layer, hidden, topk_ids, topk_weights, live)
            if self.residency.device.type == "cuda":
                self._run(layer, hidden, topk_ids, topk_weights, zc.table[index], delta_table,
                          mask, out, zc.offsets, zero_copy=True, act=act)  # fmt: skip
            else:
                pool, table, delta = zc.gather(index, topk_ids)
                self._run(layer, hidden, topk_ids, topk_weights, table, delta, mask, out,
                          pool=pool, act=act)  # fmt: skip
            if split is not None:  # their rows, before the sum over k
                split.join(layer, out)
            if record_delta and act is not None:  # the act term's mask is final only now
                assert mask is not None
                zc.record_delta(index, topk_ids, mask)
            if guess:  # after this layer's kernel (`out`, an input here, orders the two)
                self._stage_next(layer, out)
            return _sum_pairs(out, hidden.dtype)
        self.pairs += topk_ids.numel()
        if mask is not None and act is None:
            self.delta_pairs += int(mask.sum())
        # host syncs: residency decisions are made on the host (the reference path); the
        # distinct experts are found on the device, so one sync moves at most E ints
        needed = self._mine(layer, torch.unique(topk_ids).tolist())  # sorted
        weight_sum = None  # each expert's summed routing weight, for weight-aware policies only
        if self.residency.policy.weighted:
            weight_sum = (
                torch.zeros(self.residency.store.model_config.num_experts)
                .index_add_(0, topk_ids.flatten().cpu(), topk_weights.flatten().float().cpu())
                .tolist()
            )
        with_delta = set(topk_ids[mask].tolist()) if mask is not None else set()
        self._score_prediction(layer, needed, with_delta)
        cpu_part = None
        if self.hybrid is not None and not streamed:  # (prefill keeps layer streaming)
            needed, cpu_part = self._start_cpu_part(
                layer, hidden, topk_ids, topk_weights, needed, with_delta
            )
        # Experts are computed in chunks the pool can hold (base + delta blobs); each pair's result
        # lands in its own row of `out`, so the sum is identical whatever the chunking.
        capacity = self.residency.capacity // 2 if with_delta else self.residency.capacity
        if capacity < 1:
            raise ValueError("the delta plane needs an expert cache of at least 2 slots")
        # Layer-streamed prefill: half the pool computes while the other half fills with the
        # next chunk (or the next layer's first), copies on the pool's copy stream.
        if streamed:
            capacity = max(1, capacity // 2)
        chunks = [needed[start : start + capacity] for start in range(0, len(needed), capacity)]
        for i, chunk in enumerate(chunks):
            delta_experts = [e for e in chunk if e in with_delta]
            base_table, delta_table = self.residency.ensure_planes(
                layer,
                chunk,
                delta_experts,
                [weight_sum[e] for e in chunk] if weight_sum is not None else None,
            )
            current = _keys(layer, chunk, delta_experts)
            if streamed:
                if i + 1 < len(chunks):
                    following = [e for e in chunks[i + 1] if e in with_delta]
                    upcoming = _keys(layer, chunks[i + 1], following)
                else:  # (a predictor syncs with the host: before this chunk's kernel is queued)
                    upcoming = self._next_layer_guess(layer, hidden, capacity)
                # the chunk's kernel is queued before the next chunk's copies are issued (their
                # host-side issue would delay it); the copies wait only for the work queued up
                # to here (`ready`), so they overlap this kernel and overwrite no slot it reads
                ready = self.residency.mark()
                self._run(layer, hidden, topk_ids, topk_weights, base_table, delta_table, mask,
                          out, act=act)  # fmt: skip
                self.residency.prefetch(upcoming, protect=current, after=ready)
                continue
            if len(chunks) == 1 and layer in self.predictors:
                self._prefetch_next(layer, hidden, current)
            self._run(layer, hidden, topk_ids, topk_weights, base_table, delta_table, mask, out,
                      act=act)  # fmt: skip
        if mask is not None and act is not None:  # the op has narrowed the mask
            self.delta_pairs += int(mask.sum())
        if cpu_part is not None:
            self._finish_cpu_part(cpu_part, out)
        return self._combined(layer, out).sum(dim=1).to(hidden.dtype)  # [T, H]

    def enable_hybrid(self, share: float | None = None, threads: int = 0) -> HybridCpu:
        """Hybrid misses on the residency path (eager steps): in each layer the misses that are
        in the host tier are split by the cost model (residency/hybrid_split.py; its speeds
        measured now), or `share` of them are forced onto the CPU; the host's cores compute the
        CPU's share from the host tier's rows (kernels/cpu) while the GPU fetches and computes
        the rest, and the results land in their pairs' rows (on CUDA the CPU part runs on a
        thread beside the GPU's work). Experts whose pairs use the delta plane stay on the GPU
        path. `threads`: the CPU kernel's (0: every core, less one on CUDA)."""
        from moetier.kernels.cpu.dram import host_cores, set_threads

        host = self.residency.host
        if host is None:
            raise ValueError("--cpu-experts computes misses from the host tier: give --host-memory")
        cuda = self.residency.device.type == "cuda"
        set_threads(threads if threads > 0 else max(1, host_cores() - (1 if cuda else 0)))
        executor = ThreadPoolExecutor(1, thread_name_prefix="moetier-cpu-experts") if cuda else None
        speeds = None
        if share is None:
            from moetier.residency.links import h2d_bandwidth

            layer = min(self.formats)
            keys = [k for k in host.keys if k[0] == layer and k[2] == "base"][:8]
            if not keys:
                raise ValueError(f"the host tier holds no expert of layer {layer} to measure")
            fmt = self.formats[layer]
            hidden_size = self.residency.store.model_config.hidden_size

            def run_cpu(n: int, pairs: int) -> None:
                chosen = keys[: min(n, len(keys))]
                addresses = torch.tensor([host.address(k) for k in chosen]).repeat_interleave(pairs)
                tokens = torch.arange(addresses.numel())
                x = torch.randn(addresses.numel(), hidden_size)
                cpu_experts(x, tokens, torch.ones(tokens.numel()), addresses, fmt, self.activation)

            blob = self.residency.store.blobs[keys[0]].nbytes
            gpu_path = h2d_bandwidth(self.residency.device.type)
            speeds = measure_speeds(gpu_path, run_cpu, len(keys), blob, self.residency.device,
                                    hidden_size, executor)  # fmt: skip
        self.hybrid = HybridCpu(speeds, share, executor)
        return self.hybrid

    def hybrid_graph_refusal(self) -> str | None:
        """Why the zero-copy (CUDA-graph) step cannot split misses with --cpu-experts here
        (None: it can; `enable_hybrid_graph`)."""
        return refusal(self.formats, self.delta_threshold is not None)

    def enable_hybrid_graph(self) -> HybridGraph:
        """Hybrid misses on the zero-copy step (after `enable_hybrid` and `enable_zero_copy`):
        each layer's cold host-tier experts that the cost model (or the forced share) gives the
        CPU are marked between steps (`HybridGraph.mark`, now and after each rebalance); the
        step packs their pairs, the C kernel computes them (a host node on CUDA) and their rows
        join the layer's output (residency/hybrid_graph.py). Raises ValueError where it cannot
        run (`hybrid_graph_refusal`)."""
        zc, hybrid = self.zero_copy, self.hybrid
        if zc is None or hybrid is None:
            raise ValueError("the graph step's split needs --cpu-experts and zero-copy mode")
        why = self.hybrid_graph_refusal()
        if why is not None:
            raise ValueError(why)
        config = self.residency.store.model_config
        graph = HybridGraph(zc, self.formats, self.activation, config.hidden_size, config.top_k,
                            hybrid.speeds, hybrid.share)  # fmt: skip
        graph.mark()
        self.hybrid_graph = graph
        return graph

    def disable_hybrid_graph(self) -> None:
        """Back to the zero-copy step without the CPU split (every table entry restored)."""
        if self.hybrid_graph is not None and self.zero_copy is not None:
            self.zero_copy.set_skip(torch.zeros_like(self.zero_copy.skip))
        self.hybrid_graph = None

    def _start_cpu_part(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        needed: list[int],
        with_delta: set[int],
    ) -> tuple[list[int], tuple[Future[torch.Tensor], torch.Tensor, torch.Tensor] | None]:
        """Split this layer's misses; start the CPU's share (a thread on CUDA, inline on CPU).
        Returns the experts left for the GPU path and the CPU part to join (or None)."""
        hybrid, host, pool = self.hybrid, self.residency.host, self.residency
        assert hybrid is not None and host is not None
        candidates = [
            e
            for e in needed
            if pool.slot_of((layer, e, "base")) is None
            and (layer, e, "base") in host
            and e not in with_delta
        ]
        if not candidates:
            return needed, None
        ids = topk_ids.cpu()
        counts = torch.bincount(ids.flatten(), minlength=pool.store.model_config.num_experts)
        blob = pool.store.blobs[(layer, candidates[0], "base")].nbytes
        speeds = hybrid.speeds or HybridSpeeds(1.0, 1.0)  # (a forced share does not use them)
        split = split_misses({e: int(counts[e]) for e in candidates}, blob, speeds, hybrid.share)
        hybrid.calls += 1
        hybrid.gpu_misses += len(split.gpu)
        hybrid.cpu_misses += len(split.cpu)
        if not split.cpu:
            return needed, None
        on_cpu = torch.zeros(counts.numel(), dtype=torch.bool)
        on_cpu[split.cpu] = True
        token, k = torch.where(on_cpu[ids])
        address = torch.zeros(counts.numel(), dtype=torch.int64)
        address[split.cpu] = torch.tensor([host.address((layer, e, "base")) for e in split.cpu])
        x, weight = hidden.detach().to("cpu"), topk_weights.detach().cpu()[token, k]
        fmt, act = self.formats[layer], self.activation
        hybrid.pairs += token.numel()
        hybrid.bytes += len(split.cpu) * blob

        def work() -> torch.Tensor:
            import time

            start = time.perf_counter()
            y = cpu_experts(x, token, weight, address[ids[token, k]], fmt, act)
            hybrid.seconds += time.perf_counter() - start
            return y

        future: Future[torch.Tensor]
        if hybrid.executor is not None:
            future = hybrid.executor.submit(work)
        else:
            future = Future()
            future.set_result(work())
        cpu_set = set(split.cpu)
        return [e for e in needed if e not in cpu_set], (future, token, k)

    def _finish_cpu_part(
        self, part: tuple[Future[torch.Tensor], torch.Tensor, torch.Tensor], out: torch.Tensor
    ) -> None:
        """Join the CPU part and write its pairs' rows of `out` [T, k, H]."""
        future, token, k = part
        rows = future.result().to(out.device, non_blocking=True)
        out[token.to(out.device), k.to(out.device)] = rows

    def after_layer(self, layer: int, residual: torch.Tensor) -> None:
        """Native decoder layers call this with the residual after `layer`'s MLP, x'' [B, T, H].
        With staging guessing from layer outputs (`enable_prefetch(..., guess_from="output")`),
        a one-token zero-copy step scores the next MoE layer's experts on it
        (`moetier::stage_scores`, on the compute stream) and stages the best
        (`moetier::stage_guesses`, on the side stream; the next layer joins it as with
        "input")."""
        zc = self.zero_copy
        if (
            self.guess_from != "output"
            or zc is None
            or zc.stage == 0
            or layer not in self.predictors
            or layer not in zc.layer_index
            or residual.numel() != residual.shape[-1]  # one token
        ):
            return
        self._score_next(layer, residual.reshape(1, -1))
        self._stage_next(layer, residual)

    def _score_next(self, layer: int, x: torch.Tensor) -> None:
        """Staging: the next MoE layer's scores of its experts on x [1, H] (on the side stream when
        guessing from the input, on the compute stream from the output)."""
        assert self.zero_copy is not None
        nxt = self.zero_copy.layer_index[self.predictors[layer][0]]
        stage_scores(x, self._scaled_routers[layer], self._guess_scores[layer], nxt,
                     self.guess_from == "input")  # fmt: skip

    def _stage_next(self, layer: int, after: torch.Tensor) -> None:
        """Staging: the next MoE layer's best guesses by `_score_next`'s scores copied into its
        staging slots (side stream), ordered after `after`'s producer."""
        zc = self.zero_copy
        assert zc is not None
        next_layer = self.predictors[layer][0]
        nxt = zc.layer_index[next_layer]
        stage_guesses(self._guess_scores[layer], zc.table[nxt], zc.host_entry[nxt], zc.offsets,
                      self.residency.pool, zc.stage_first, zc.staging[nxt], zc.staged[nxt],
                      zc.staged_blobs, zc.blob_bytes[next_layer], nxt, after)  # fmt: skip

    def enable_prefetch(
        self,
        routers: dict[int, torch.Tensor],
        norms: dict[int, torch.Tensor],
        m: int = 0,
        guess_from: str = "input",
    ) -> None:
        """Prefetch on the residency path: layer L's experts op guesses the next MoE layer N's
        experts with N's router (residency/predict.py) and copies the `m` best per token
        (default: top-k) on the pool's copy stream while L computes. `routers[layer]`: [E, H]
        router weight; `norms[layer]`: [H] weight of the RMSNorm in front of it.

        The op's input is x·r·w_L (r: x's RMS factor, w_L: L's norm weight); N's router sees
        x'·r'·w_N for the later residual x'. The guess applies N's router to x·r·w_N =
        input · (w_N / w_L): the next layer's routing as if the residual stopped changing.

        guess_from (zero-copy staging only): "input" guesses so, from the MoE input, the scores
        computed beside the layer's kernel; "output" guesses from the residual after the layer
        (N's router on x'' = x + this layer's MLP output, columns scaled by w_N: only N's
        attention is missing), which native models hand over after the layer (`after_layer`),
        so the scores wait for the kernel. On CPU, top-2 guesses off a 25% cache were right
        0.80 -> 0.89 of the time on eval-moe-70m and 0.74 -> 1.0 on the random-weight 8-layer
        Qwen3-30B-A3B slice the H200 bench decodes, which "output" decodes at 621-626 tok/s
        against 595 (docs/residency.md); the Generator takes it where `layer_outputs` is set."""
        if guess_from not in ("input", "output"):
            raise ValueError(f"guess_from is 'input' or 'output', got {guess_from!r}")
        self.guess_from = guess_from
        layers = sorted(self.formats)
        missing = [layer for layer in layers if layer not in routers or layer not in norms]
        if missing:
            raise ValueError(f"prefetch needs each MoE layer's router and norm; missing {missing}")
        top_k = self.residency.store.model_config.top_k
        self.predictors = {}
        for layer, following in zip(layers, layers[1:], strict=False):
            w_here, w_next = norms[layer].float(), norms[following].float()
            scale = torch.where(w_here != 0, w_next / torch.where(w_here != 0, w_here, 1), 0)
            self.predictors[layer] = (following, routers[following].detach(), scale.detach())
            router = routers[following].detach()
            columns = scale if guess_from == "input" else w_next
            self._scaled_routers[layer] = (router.float() * columns).to(router.dtype)
            self._guess_scores[layer] = torch.empty(
                router.shape[0], dtype=router.dtype, device=router.device
            )
        self._guessed_layers = {following for following, _, _ in self.predictors.values()}
        self.prefetch_m = m or top_k

    def _predict(self, layer: int, hidden: torch.Tensor, m: int) -> tuple[int, list[int]]:
        """(next MoE layer, its predicted experts: union over tokens of the top-m)."""
        following, router, scale = self.predictors[layer]
        guess = predict_experts(hidden.float() * scale, router, min(m, router.shape[0]))
        return following, sorted(set(guess.flatten().tolist()))

    def _prefetch_next(self, layer: int, hidden: torch.Tensor, current: list[BlobKey]) -> None:
        following, experts = self._predict(layer, hidden, self.prefetch_m)
        experts = self._mine(following, experts)
        keys = _keys(following, experts, experts if self.delta_threshold == 0 else [])
        self._predicted[following] = keys
        self.residency.prefetch(keys, protect=current)

    def _score_prediction(self, layer: int, needed: list[int], with_delta: set[int]) -> None:
        keys = self._predicted.pop(layer, None)
        if keys is not None:
            needed_keys = _keys(layer, needed, [e for e in needed if e in with_delta])
            if self.delta_threshold != 0:  # only base blobs were predicted
                needed_keys = [k for k in needed_keys if k[2] == "base"]
            self.residency.score_prediction(keys, needed_keys)

    def _next_layer_guess(self, layer: int, hidden: torch.Tensor, capacity: int) -> list[BlobKey]:
        """Blobs to stream in for the next MoE layer while `layer`'s last chunk computes: the
        predicted experts when a predictor is set, else the lowest ids (a long prompt needs
        nearly all experts, and chunks go in id order)."""
        layers = sorted(self.formats)
        if layer == layers[-1]:
            return []
        if layer in self.predictors:
            following, experts = self._predict(layer, hidden, self.prefetch_m)
        else:
            following = layers[layers.index(layer) + 1]
            experts = list(range(self.residency.store.model_config.num_experts))
        experts = self._mine(following, experts)[:capacity]
        return _keys(following, experts, experts if self.delta_threshold == 0 else [])

    def _run(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        base_table: torch.Tensor,
        delta_table: torch.Tensor | None,
        mask: torch.Tensor | None,
        out: torch.Tensor,
        offsets: torch.Tensor | None = None,
        pool: torch.Tensor | None = None,
        zero_copy: bool = False,
        act: ActGate | None = None,
    ) -> None:
        """One kernel call; slots are `offsets` entries from `pool`'s first byte (default: the
        slot pool's own table and memory; a `pool` alone is addressed row by row); zero_copy:
        some entries are pinned host rows; act: the gate's act term (the op narrows `mask`)."""
        if pool is not None and offsets is None:
            offsets = torch.arange(pool.shape[0], dtype=torch.int64, device=pool.device)
            offsets *= pool.stride(0)
        moe_experts(
            hidden,
            topk_ids,
            topk_weights,
            base_table,
            offsets if offsets is not None else self.residency.slot_offsets,
            pool if pool is not None else self.residency.pool,
            out,
            mask,
            delta_table,
            self.format_ids[layer],
            self.delta_format_ids.get(layer, -1),
            self.activation.kind,
            self.activation.alpha,
            self.activation.limit,
            zero_copy,
            act.sketch if act is not None else None,
            act.coef if act is not None else None,
            act.threshold if act is not None else None,
        )


def router_weights(
    model: torch.nn.Module, layers: list[int]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """(router weight [E, H], pre-router norm weight [H]) of each MoE layer of a Qwen3-MoE-style
    model (native or transformers: `model.layers[i].mlp.gate` and `.post_attention_layernorm`),
    for `ExpertsRuntime.enable_prefetch`."""
    decoder = getattr(model, "model", model)
    blocks: Any = getattr(decoder, "layers", None)
    if blocks is None:
        raise ValueError("prefetch prediction needs the model's decoder layers (`model.layers`)")
    routers, norms = {}, {}
    for layer in layers:
        block = blocks[layer]
        gate = getattr(getattr(block, "mlp", None), "gate", None)
        norm = getattr(block, "post_attention_layernorm", None)
        if gate is None or norm is None or not hasattr(gate, "weight"):
            raise ValueError(
                f"layer {layer} has no mlp.gate router or post_attention_layernorm: prefetch "
                "prediction supports Qwen3-MoE-style layers"
            )
        routers[layer], norms[layer] = gate.weight, norm.weight
    return routers, norms


@dataclass(frozen=True)
class ExpertsHandle:
    runtime: ExpertsRuntime
    layer: int


def moetier_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Signature of transformers' experts implementations (`self, hidden, ids, weights`)."""
    handle: ExpertsHandle | None = getattr(module, "moetier_experts", None)
    if handle is None:
        raise RuntimeError(
            f"{type(module).__name__} uses experts_implementation='moetier' but was not loaded by "
            "moetier (load models with moetier.loader.load_model)"
        )
    return handle.runtime.forward(handle.layer, hidden_states, top_k_index, top_k_weights)


def register_experts_implementation() -> None:
    """Make 'moetier' a valid `experts_implementation` in transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION_NAME, moetier_experts_forward)
