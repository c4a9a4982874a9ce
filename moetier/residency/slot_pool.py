"""One pool of fixed-size expert slots (GPU memory with CUDA, else host).

Which blob to evict is a replacement policy's choice (residency/policies.py: LRU by default,
decayed LFU, routing-weight LFU). Misses are fetched blocking from the store's memory-mapped
experts file. Knows nothing of models: it moves blobs identified by (layer, expert, plane).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moetier.core.layout import TENSOR_ALIGN, align_up
from moetier.quant.store import Store
from moetier.residency.disk import DiskReader, read_size
from moetier.residency.policies import LRU, CachePolicy, online_policy
from moetier.residency.telemetry import ResidencyTelemetry

BlobKey = tuple[int, int, str]


def make_policy(
    name: str, moe_layers: int = 1, half_life_tokens: float = 128.0
) -> CachePolicy[BlobKey]:
    """The pool's policy (`--cache-policy`; policies.online_policy). The pool reports one access
    per MoE layer per forward, so the frequency policies decay per access such that a count
    halves over `half_life_tokens` decoded tokens (128: the best half-life of the trace replays,
    docs/residency.md). The static hot set and Belady need calibration counts or the future and
    live in trace replay only."""
    decay = 0.5 ** (1.0 / (half_life_tokens * max(1, moe_layers)))
    policy: CachePolicy[BlobKey] = online_policy(name, decay)
    return policy


@dataclass
class ResidencyStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_fetched: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class SlotPool:
    """`num_slots` slots of `slot_bytes` on `device`; a map (layer, expert, plane) -> slot whose
    evictions `policy` chooses."""

    def __init__(
        self,
        store: Store,
        device: torch.device | str,
        num_slots: int,
        slot_bytes: int,
        policy: CachePolicy[BlobKey] | None = None,
        disk: DiskReader | None = None,
    ) -> None:
        """`disk`: fetch misses with parallel (O_DIRECT where allowed) preads of the store's
        file instead of copying from its memory mapping (which goes through the page cache)."""
        if num_slots < 1:
            raise ValueError(
                "the expert cache needs at least one slot: raise --expert-cache-mb or --gpu-memory"
            )
        self.store = store
        self.device = torch.device(device)
        self.slot_bytes = align_up(slot_bytes, TENSOR_ALIGN)
        self.num_slots = num_slots
        self.pool = torch.empty(num_slots, self.slot_bytes, dtype=torch.uint8, device=self.device)
        # byte offset of each slot from the pool's first byte: the kernels' slot -> address map
        self.slot_offsets = torch.arange(num_slots, device=self.device, dtype=torch.int64)
        self.slot_offsets *= self.slot_bytes
        self.policy: CachePolicy[BlobKey] = policy if policy is not None else LRU()
        self._slots: dict[BlobKey, int] = {}
        self.disk = disk
        self._free = list(range(num_slots - 1, -1, -1))
        self.stats = ResidencyStats()

    @classmethod
    def for_budget(
        cls,
        store: Store,
        device: torch.device | str,
        budget_bytes: int = 0,
        max_slots: int = 0,
        policy: CachePolicy[BlobKey] | None = None,
        disk: DiskReader | None = None,
    ) -> SlotPool:
        """Size the pool from a byte budget (0 = every expert of the store fits)."""
        slot_bytes = align_up(max(e.nbytes for e in store.blobs.values()), TENSOR_ALIGN)
        n_blobs = len(store.blobs)
        num_slots = n_blobs if budget_bytes <= 0 else min(n_blobs, budget_bytes // slot_bytes)
        if max_slots > 0:
            num_slots = min(num_slots, max_slots)
        if num_slots < 1:
            raise ValueError(
                f"an expert cache of {budget_bytes / 2**20:.1f} MiB holds no expert "
                f"({slot_bytes / 2**20:.2f} MiB each): raise --expert-cache-mb or --gpu-memory"
            )
        return cls(store, device, num_slots, slot_bytes, policy, disk)

    @property
    def capacity(self) -> int:
        return self.num_slots

    def ensure(
        self,
        layer: int,
        experts: Sequence[int],
        plane: str = "base",
        weights: Sequence[float] | None = None,
    ) -> torch.Tensor:
        """Make `experts` of `layer` resident; returns the expert->slot table [E] int32 on the
        pool's device, -1 for experts not asked for. Evicts the policy's victims among slots
        that are not part of this request. `weights`: each expert's summed routing weight in
        this request (for routing-weight-aware policies)."""
        if len(experts) > self.num_slots:
            raise ValueError(
                f"{len(experts)} experts asked for at once, the pool has {self.num_slots} slots"
            )
        slots = self._ensure_keys([(layer, e, plane) for e in experts], weights)
        table = [-1] * self.store.model_config.num_experts
        for expert, slot in zip(experts, slots, strict=True):
            table[expert] = slot
        return torch.tensor(table, dtype=torch.int32).to(self.device)

    def ensure_planes(
        self,
        layer: int,
        experts: Sequence[int],
        delta_experts: Sequence[int],
        weights: Sequence[float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Base blobs of `experts` and delta blobs of `delta_experts`, resident together;
        returns (base table, delta table or None), each [E] int32 like `ensure`. `weights`
        are the experts' routing weights (`ensure`); a delta blob counts with its expert's."""
        if not delta_experts:
            return self.ensure(layer, experts, weights=weights), None
        keys = [(layer, e, "base") for e in experts] + [(layer, e, "delta") for e in delta_experts]
        if len(keys) > self.num_slots:
            raise ValueError(
                f"{len(keys)} blobs asked for at once, the pool has {self.num_slots} slots"
            )
        key_weights = None
        if weights is not None:
            by_expert = dict(zip(experts, weights, strict=True))
            key_weights = list(weights) + [by_expert[e] for e in delta_experts]
        slots = self._ensure_keys(keys, key_weights)
        base = [-1] * self.store.model_config.num_experts
        delta = list(base)
        for (_, expert, plane), slot in zip(keys, slots, strict=True):
            (base if plane == "base" else delta)[expert] = slot
        return (
            torch.tensor(base, dtype=torch.int32).to(self.device),
            torch.tensor(delta, dtype=torch.int32).to(self.device),
        )

    def _ensure_keys(
        self, keys: list[BlobKey], weights: Sequence[float] | None = None
    ) -> list[int]:
        """Make `keys` resident (none of them evicted for another); returns their slots."""
        wanted = set(keys)
        slots = []
        misses = []
        for key in keys:
            slot = self._slots.get(key)
            if slot is not None:
                self.stats.hits += 1
            else:
                slot = self._take_slot(wanted)
                self._slots[key] = slot
                misses.append((key, slot))
                self.stats.misses += 1
            slots.append(slot)
        self._fetch(misses)
        self.policy.on_access(keys, weights)
        return slots

    def _take_slot(self, protected: set[BlobKey]) -> int:
        """A free slot, or the slot of the policy's victim among blobs not in this request.
        (A policy's `admit` is not consulted: the kernel reads every blob from a slot; serving a
        miss uncached needs the host-pinned tier.)"""
        if self._free:
            return self._free.pop()
        candidates = [key for key in self._slots if key not in protected]
        if not candidates:  # unreachable: a request never exceeds num_slots
            raise RuntimeError("no evictable slot")
        victim = self.policy.victim(candidates)
        self.policy.on_evict(victim)
        self.stats.evictions += 1
        return self._slots.pop(victim)

    def _fetch(self, misses: list[tuple[BlobKey, int]]) -> None:
        """Blocking fetch of the missed blobs into their slots (all in flight together when
        reading with the disk reader)."""
        if not misses:
            return
        if self.disk is None:
            for key, slot in misses:
                blob = self.store.blob(*key)
                self.pool[slot, : blob.numel()].copy_(blob)
                self.stats.bytes_fetched += blob.numel()
            return
        sizes = [self.store.blobs[key].nbytes for key, _ in misses]
        staging = DiskReader.allocate(sum(read_size(n) for n in sizes))  # 4 KiB-aligned pieces
        starts = [0]
        for n in sizes[:-1]:
            starts.append(starts[-1] + read_size(n))
        buffers = [staging[s : s + read_size(n)] for s, n in zip(starts, sizes, strict=True)]
        self.disk.read_blobs(self.store, [key for key, _ in misses], buffers)
        for (_, slot), buffer, n in zip(misses, buffers, sizes, strict=True):
            self.pool[slot, :n].copy_(buffer[:n])
            self.stats.bytes_fetched += n

    def resident(self) -> list[BlobKey]:
        return list(self._slots)

    def telemetry(self) -> ResidencyTelemetry:
        """Counters for /metrics: this pool's tier (gpu or host) and the store below it."""
        out = ResidencyTelemetry()
        tier = out["gpu" if self.device.type == "cuda" else "host"]
        tier.hits, tier.misses = self.stats.hits, self.stats.misses
        tier.bytes = self.stats.bytes_fetched
        out["disk"].hits = self.stats.misses  # every miss is served from the store's file
        return out
