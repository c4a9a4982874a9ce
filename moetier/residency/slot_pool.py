"""One pool of fixed-size expert slots (GPU memory with CUDA, else host) with LRU eviction.

Misses are fetched blocking from the store's memory-mapped experts file. Knows nothing of
models: it moves blobs identified by (layer, expert, plane).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moetier.core.layout import TENSOR_ALIGN, align_up
from moetier.quant.store import Store

BlobKey = tuple[int, int, str]


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
    """`num_slots` slots of `slot_bytes` on `device`; an LRU map (layer, expert, plane) -> slot."""

    def __init__(
        self, store: Store, device: torch.device | str, num_slots: int, slot_bytes: int
    ) -> None:
        if num_slots < 1:
            raise ValueError("the expert cache needs at least one slot: raise --expert-cache-mb")
        self.store = store
        self.device = torch.device(device)
        self.slot_bytes = align_up(slot_bytes, TENSOR_ALIGN)
        self.num_slots = num_slots
        self.pool = torch.empty(num_slots, self.slot_bytes, dtype=torch.uint8, device=self.device)
        # byte offset of each slot from the pool's first byte: the kernels' slot -> address map
        self.slot_offsets = torch.arange(num_slots, device=self.device, dtype=torch.int64)
        self.slot_offsets *= self.slot_bytes
        self._lru: OrderedDict[BlobKey, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self.stats = ResidencyStats()

    @classmethod
    def for_budget(
        cls, store: Store, device: torch.device | str, budget_bytes: int = 0, max_slots: int = 0
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
                f"({slot_bytes / 2**20:.2f} MiB each): raise --expert-cache-mb"
            )
        return cls(store, device, num_slots, slot_bytes)

    @property
    def capacity(self) -> int:
        return self.num_slots

    def ensure(self, layer: int, experts: Sequence[int], plane: str = "base") -> torch.Tensor:
        """Make `experts` of `layer` resident; returns the expert->slot table [E] int32 on the
        pool's device, -1 for experts not asked for. Evicts least recently used slots that are
        not part of this request."""
        if len(experts) > self.num_slots:
            raise ValueError(
                f"{len(experts)} experts asked for at once, the pool has {self.num_slots} slots"
            )
        slots = self._ensure_keys([(layer, e, plane) for e in experts])
        table = [-1] * self.store.model_config.num_experts
        for expert, slot in zip(experts, slots, strict=True):
            table[expert] = slot
        return torch.tensor(table, dtype=torch.int32).to(self.device)

    def ensure_planes(
        self, layer: int, experts: Sequence[int], delta_experts: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Base blobs of `experts` and delta blobs of `delta_experts`, resident together;
        returns (base table, delta table or None), each [E] int32 like `ensure`."""
        if not delta_experts:
            return self.ensure(layer, experts), None
        keys = [(layer, e, "base") for e in experts] + [(layer, e, "delta") for e in delta_experts]
        if len(keys) > self.num_slots:
            raise ValueError(
                f"{len(keys)} blobs asked for at once, the pool has {self.num_slots} slots"
            )
        slots = self._ensure_keys(keys)
        base = [-1] * self.store.model_config.num_experts
        delta = list(base)
        for (_, expert, plane), slot in zip(keys, slots, strict=True):
            (base if plane == "base" else delta)[expert] = slot
        return (
            torch.tensor(base, dtype=torch.int32).to(self.device),
            torch.tensor(delta, dtype=torch.int32).to(self.device),
        )

    def _ensure_keys(self, keys: list[BlobKey]) -> list[int]:
        """Make `keys` resident (none of them evicted for another); returns their slots."""
        wanted = set(keys)
        slots = []
        for key in keys:
            slot = self._lru.get(key)
            if slot is not None:
                self._lru.move_to_end(key)
                self.stats.hits += 1
            else:
                slot = self._take_slot(wanted)
                self._fetch(key, slot)
                self._lru[key] = slot
                self.stats.misses += 1
            slots.append(slot)
        return slots

    def _take_slot(self, protected: set[BlobKey]) -> int:
        if self._free:
            return self._free.pop()
        for key in self._lru:  # oldest first
            if key not in protected:
                self.stats.evictions += 1
                return self._lru.pop(key)
        raise RuntimeError("no evictable slot")  # unreachable: len(experts) <= num_slots

    def _fetch(self, key: BlobKey, slot: int) -> None:
        blob = self.store.blob(*key)
        self.pool[slot, : blob.numel()].copy_(blob)
        self.stats.bytes_fetched += blob.numel()

    def resident(self) -> list[BlobKey]:
        return list(self._lru)
