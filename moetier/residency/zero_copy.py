"""Zero-copy placement: every expert blob addressable by the kernel without a host sync.

Owns the address tables of the zero-copy decode mode: hot blobs sit in the GPU slot pool, every
other blob is read by the kernel straight from its pinned host-tier row (CUDA's unified
addressing). One address space indexes both: entries [0, S) are the pool's S slots, entries
[S, S + H) the host tier's H rows, and `offsets` [S + H] int64 gives each entry's byte offset
from the pool's first byte (host rows: host address - pool address, which may be negative or
far beyond the pool; the Triton kernels add it to the pool pointer as a signed 64-bit offset).

`table[i]` / `delta_table[i]` [E] int32 map each expert of the i-th MoE layer to its entry. The
tensors are allocated once and only ever written in place (`promote`, between steps on the
host), so a captured CUDA graph keeps reading the current placement. The decode step counts
expert accesses on the device (`record`); `rebalance` reads those counts between steps and
promotes the most used blobs (decayed counts), demoting others to their host rows.

Knows nothing of models: layers, experts and planes are ints and names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moetier.kernels.residency_ops import count_pairs
from moetier.residency.host_tier import HostTier
from moetier.residency.slot_pool import BlobKey, SlotPool


def staging_slots(stage: int, capacity: int, layers: int) -> int:
    """Staging slots per MoE layer that zero-copy decode takes for `--zero-copy-stage stage`
    from an expert cache of `capacity` slots: at most a quarter of it in all; 0 with fewer than
    two MoE layers (no later layer to guess for)."""
    if layers < 2:
        return 0
    return max(0, min(stage, capacity // (4 * layers)))


# the share of the GPU's expert slots that `preferred` layers' blobs may take first
PREFERRED_SHARE = 0.25


class ZeroCopyPlacement:
    """Tables addressing the blobs of `layers` × experts × `planes` in `pool` or `host`."""

    def __init__(
        self,
        pool: SlotPool,
        host: HostTier,
        layers: Sequence[int],
        planes: Sequence[str],
        stage: int = 0,
        delta_slots: int | None = None,
        preferred: Sequence[int] = (),
    ) -> None:
        """`stage`: staging slots per layer (reserved from the pool) for guessed experts that
        the decode step copies in ahead of their layer (`moetier::stage_guesses`).
        `delta_slots`: the delta cache (`--delta-memory`): that many of the pool's slots hold
        delta blobs only, chosen by how often the gate applied each expert's delta
        (`record_delta`), the others base blobs by their pairs; None: both planes share the
        slots, a delta blob ranked as its expert.
        `preferred`: layers whose base blobs take GPU slots before any other's, whatever their
        counts, while they fill at most PREFERRED_SHARE of the slots (an MTP layer: drafting
        runs it k times a step, one token a row each, so each of its misses is read again for
        every draft instead of once for the step's k + 1 tokens as in the main layers)."""
        if pool.host is not None and pool.host is not host:
            raise ValueError("the zero-copy host tier must be the slot pool's host tier")
        if host.row_bytes > pool.slot_bytes:
            raise ValueError("host rows are larger than the pool's slots")
        self.pool, self.host = pool, host
        self.layers, self.planes = list(layers), list(planes)
        self.layer_index = {layer: i for i, layer in enumerate(self.layers)}
        self.num_experts = pool.store.model_config.num_experts
        self.keys = [
            (layer, e, plane)
            for plane in self.planes
            for layer in self.layers
            for e in range(self.num_experts)
        ]
        self.stage = stage
        reserved = pool.reserve(stage * len(self.layers)) if stage else []
        self.fixed = [k for k in self.keys if k not in host]  # only the GPU can hold these
        if delta_slots is not None:
            if "delta" not in self.planes:
                raise ValueError("--delta-memory: this model applies no delta plane")
            room = pool.capacity - len(self.fixed)
            if not 0 <= delta_slots <= room:
                raise ValueError(
                    f"--delta-memory asks for {delta_slots} expert slots of the {room} the "
                    "expert cache has: lower it or raise the GPU budget"
                )
        self.delta_slots = delta_slots
        self.preferred = [layer for layer in preferred if layer in self.layer_index]
        if len(self.fixed) > pool.capacity:
            raise ValueError(
                f"zero-copy reads need every blob off the GPU in the host tier: "
                f"{len(self.fixed)} blobs are not in it and the GPU holds {pool.capacity}; "
                "raise --host-memory (or the GPU expert budget)"
            )
        device = pool.device
        self.slots = pool.num_slots
        offsets = [int(o) for o in pool.slot_offsets.cpu()]
        base = pool.pool.data_ptr()
        offsets += [host.address(key) - base for key in host.keys]
        self.offsets = torch.tensor(offsets, dtype=torch.int64, device=device)
        shape = (len(self.layers), self.num_experts)
        self.table = torch.full(shape, -1, dtype=torch.int32, device=device)
        self.delta_table = (
            torch.full(shape, -1, dtype=torch.int32, device=device)
            if "delta" in self.planes
            else None
        )
        # staging: entries >= stage_first are not cached GPU slots (staging slots, host rows);
        # staging[i] the entries of layer i's slots, staged[i] their experts (-1: none);
        # host_entry[i, e] the entry of expert e's base blob in the host tier (-1: none)
        self.stage_first = pool.capacity
        self.staging = torch.tensor(reserved, dtype=torch.int32, device=device).view(
            len(self.layers), stage
        )
        self.staged = torch.full((len(self.layers), stage), -1, dtype=torch.int32, device=device)
        host_entry = torch.full(shape, -1, dtype=torch.int32)
        for layer in self.layers:
            for e in range(self.num_experts):
                if (layer, e, "base") in host:
                    host_entry[self.layer_index[layer], e] = (
                        self.slots + host.index[(layer, e, "base")]
                    )
        self.host_entry = host_entry.to(device)
        self.blob_bytes = {
            layer: pool.store.blobs[(layer, 0, "base")].nbytes for layer in self.layers
        }
        self.staged_blobs = torch.zeros((), dtype=torch.int64, device=device)  # blobs copied
        self.staged_pairs = torch.zeros((), dtype=torch.int64, device=device)  # pairs read there
        # device-side access counts (pairs per expert) and hits, written by the decode step
        self.counts = torch.zeros(shape, dtype=torch.int64, device=device)
        self.gpu_pairs = torch.zeros((), dtype=torch.int64, device=device)
        self.scores = torch.zeros(shape, dtype=torch.float64)  # host: decayed counts
        self._seen = torch.zeros(shape, dtype=torch.int64)
        # the delta cache: pairs that applied each expert's delta (device), decayed (host)
        self.delta_counts = torch.zeros(shape, dtype=torch.int64, device=device)
        self.delta_scores = torch.zeros(shape, dtype=torch.float64)
        self._delta_seen = torch.zeros(shape, dtype=torch.int64)
        self.promotions = 0
        self.promoted_bytes = 0
        # hybrid misses on this step (residency/hybrid_graph.py): base blobs whose pairs the
        # host's cores compute; their table entries are -1, so the GPU kernels skip their pairs
        self.skip = torch.zeros(shape, dtype=torch.bool)
        # every table entry at its host row (demote_all), slots free for a streamed prefill,
        # until the next promote
        self.demoted = False
        # pairs of `counts` that a streamed prefill served through the slot pool (counted for
        # the rebalance, not as zero-copy reads)
        self.streamed_pairs = 0

    def entry(self, key: BlobKey) -> int:
        """The address entry of `key` now: its pool slot, else S + its host row."""
        slot = self.pool.slot_of(key)
        if slot is not None:
            return slot
        return self.slots + self.host.index[key]

    def promote(self, gpu_keys: Sequence[BlobKey]) -> int:
        """Make `gpu_keys` (plus the blobs only the GPU can hold) the pool's contents and
        rewrite the tables in place; call between steps, outside a CUDA graph. Blobs are copied
        on the current stream before the tables, so a later step sees both together. Returns
        the number of blobs copied."""
        wanted = list(dict.fromkeys([*self.fixed, *gpu_keys]))
        # a prefetch copy (streamed prefill) into a slot the new tables point at lands before
        # any later kernel reads it
        self.pool.wait_prefetches()
        before = self.pool.stats.bytes_fetched
        resident = set(self.pool.resident())
        self.pool.place(wanted[: self.pool.capacity])
        copied = sum(1 for k in wanted[: self.pool.capacity] if k not in resident)
        self.promoted_bytes += self.pool.stats.bytes_fetched - before
        self.promotions += copied
        self._write_tables(self.entry, demoted=False)
        return copied

    def demote_all(self) -> None:
        """Point every table entry at its host row, in place on the current stream (queued
        before whatever reuses the slots): the pool's slots are then free for other use, e.g.
        a streamed prefill copying each layer's experts in once, until the next `promote` /
        `rebalance` puts the hot set back. Needs every blob in the host tier."""
        if self.fixed:
            raise ValueError("blobs outside the host tier must stay in GPU slots: cannot demote")
        self._write_tables(lambda key: self.slots + self.host.index[key], demoted=True)

    def set_skip(self, skip: torch.Tensor) -> None:
        """Mark base blobs [layers, E] bool whose pairs the GPU kernels skip (entry -1: the
        host's cores compute them, residency/hybrid_graph.py); between steps, tables rewritten
        in place. Only blobs in the host tier can be skipped."""
        for i, e in skip.nonzero().tolist():
            if (self.layers[i], e, "base") not in self.host:
                raise ValueError(f"expert {e} of layer {self.layers[i]} is not in the host tier")
        self.skip = skip.clone()
        if self.demoted:
            self._write_tables(lambda key: self.slots + self.host.index[key], demoted=True)
        else:
            self._write_tables(self.entry, demoted=False)

    def _write_tables(self, entry_of: Callable[[BlobKey], int], demoted: bool) -> None:
        """Every blob's table entry from `entry_of` (-1 for skipped base blobs), written in
        place on the current stream; no entry points at a staging slot afterwards."""
        table = torch.empty(self.table.shape, dtype=torch.int32)
        delta = torch.empty(self.table.shape, dtype=torch.int32)
        for layer, expert, plane in self.keys:
            target = table if plane == "base" else delta
            target[self.layer_index[layer], expert] = entry_of((layer, expert, plane))
        table[self.skip] = -1
        self.table.copy_(table)
        if self.delta_table is not None:
            self.delta_table.copy_(delta)
        self.staged.fill_(-1)
        self.demoted = demoted

    def record(self, index: int, topk_ids: torch.Tensor) -> None:
        """Count layer `index`'s pairs [T, k] on the device (no host sync; capturable): one
        launch (`moetier::count_pairs`)."""
        count_pairs(topk_ids, self.counts[index], self.table[index], self.offsets,
                    self.pool.pool.numel(), self.gpu_pairs,
                    self.stage_first * self.pool.slot_bytes, self.staged_pairs)  # fmt: skip

    def record_delta(self, index: int, topk_ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Count layer `index`'s pairs that apply the delta ([T, k] ids and gate mask) per
        expert, on the device (no host sync; capturable): the delta cache's ranking."""
        self.delta_counts[index].index_add_(0, topk_ids.flatten().long(), mask.flatten().long())

    def hot_keys(
        self, scores: torch.Tensor, delta_scores: torch.Tensor | None = None
    ) -> list[BlobKey]:
        """Blobs by descending score [layers, E] (ties: resident first, then key order), as
        many as the pool holds beyond the fixed ones; a delta blob scores as its expert. With
        a delta cache (`delta_slots`): that many delta blobs by `delta_scores` and base blobs
        by `scores` for the rest."""
        resident = set(self.pool.resident())
        e = self.num_experts
        room = max(0, self.pool.capacity - len(self.fixed))

        def ranked(keys: list[BlobKey], values: torch.Tensor) -> list[BlobKey]:
            flat = values.flatten().tolist()
            return sorted(
                keys, key=lambda k: (-flat[self.layer_index[k[0]] * e + k[1]], k not in resident)
            )

        keys = [k for k in self.keys if k in self.host]
        first = [k for k in keys if k[0] in self.preferred and k[2] == "base"]
        if len(first) > room * PREFERRED_SHARE:
            first = []  # too many to prefer: ranked with the others
        if self.delta_slots is None:
            return list(dict.fromkeys([*first, *ranked(keys, scores)]))[:room]
        delta = ranked([k for k in keys if k[2] == "delta"], self.delta_scores
                       if delta_scores is None else delta_scores)[: self.delta_slots]  # fmt: skip
        base = list(dict.fromkeys([*first, *ranked([k for k in keys if k[2] != "delta"], scores)]))
        return base[: room - len(delta)] + delta

    def rebalance(self, decay: float = 0.5) -> int:
        """Host side, between steps: fold the counts since the last call into decayed scores
        (one device-to-host read) and promote the top blobs. Returns the blobs copied."""
        counts = self.counts.cpu()
        self.scores = self.scores * decay + (counts - self._seen).double()
        self._seen = counts
        if self.delta_slots is not None:
            used = self.delta_counts.cpu()
            self.delta_scores = self.delta_scores * decay + (used - self._delta_seen).double()
            self._delta_seen = used
        return self.promote(self.hot_keys(self.scores))

    def gather(
        self, index: int, topk_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """CPU path: the reference kernel reads slots of one tensor, so the blobs layer `index`
        needs for `topk_ids` are gathered, through their address entries, from the pool and
        the host arenas into one scratch pool; returns (pool, table, delta table) over it."""
        tables = [self.table[index]] + (
            [self.delta_table[index]] if self.delta_table is not None else []
        )
        needed = torch.unique(topk_ids.flatten())
        entries = torch.unique(torch.cat([t[needed] for t in tables]).long())
        entries = entries[entries >= 0]  # (-1: no blob; hybrid misses' skipped experts)
        rows = []
        for entry in entries.tolist():
            if entry < self.slots:
                rows.append(self.pool.pool[entry])
            else:
                rows.append(self.host.row(self.host.keys[entry - self.slots]))
        scratch = torch.zeros(len(rows), self.pool.slot_bytes, dtype=torch.uint8)
        for i, row in enumerate(rows):
            scratch[i, : row.numel()] = row
        lut = torch.full((self.slots + len(self.host),), -1, dtype=torch.int32)
        lut[entries] = torch.arange(len(rows), dtype=torch.int32)
        remapped = [torch.where(t >= 0, lut[t.long().clamp(min=0)], -1) for t in tables]
        return scratch, remapped[0], remapped[1] if len(remapped) > 1 else None

    def gpu_hit_rate(self) -> float:
        """Share of counted pairs whose base blob was in a GPU slot (one host read)."""
        pairs = int(self.counts.sum()) - self.streamed_pairs
        return int(self.gpu_pairs) / pairs if pairs else float("nan")
