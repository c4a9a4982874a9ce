"""One pool of fixed-size expert slots (GPU memory with CUDA, else host): the GPU tier.

Which blob to evict is a replacement policy's choice (residency/policies.py: LRU by default,
decayed LFU, routing-weight LFU). A miss is fetched, blocking, from the host tier when it holds
the blob (an H2D copy from pinned RAM, residency/host_tier.py), else from the store's file (its
memory mapping, or the disk reader's parallel direct reads). `prefetch` copies blobs ahead of
need on a separate CUDA stream with an event per copy (synchronously on CPU); `place` makes an
exact set resident (zero-copy promotions, layer-streamed prefill). Knows nothing of models: it
moves blobs identified by (layer, expert, plane) and counts per tier what it served.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from moetier.core.layout import TENSOR_ALIGN, align_up
from moetier.quant.store import Store
from moetier.quant.verify import CorruptBlob, FirstReadCheck
from moetier.residency.disk import DiskReader, read_size
from moetier.residency.host_tier import HostTier
from moetier.residency.policies import LRU, CachePolicy, online_policy
from moetier.residency.telemetry import ResidencyTelemetry, TierCounters

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
        host: HostTier | None = None,
        check: FirstReadCheck | None = None,
    ) -> None:
        """`disk`: fetch misses with parallel (O_DIRECT where allowed) preads of the store's
        file instead of copying from its memory mapping (which goes through the page cache).
        `host`: the host tier; misses it holds are copied from there. `check`: a blob read from
        the store is verified (crc32) the first time, before it is copied into a slot; a
        corrupted one raises CorruptBlob and is not left resident (quant/verify.py)."""
        if num_slots < 1:
            raise ValueError(
                "the expert cache needs at least one slot: raise --expert-cache-mb or --gpu-memory"
            )
        self.store = store
        self.device = torch.device(device)
        self.slot_bytes = align_up(slot_bytes, TENSOR_ALIGN)
        if host is not None and host.store is not store:
            raise ValueError("the host tier holds blobs of another store")
        self.num_slots = num_slots
        self.pool = torch.empty(num_slots, self.slot_bytes, dtype=torch.uint8, device=self.device)
        # byte offset of each slot from the pool's first byte: the kernels' slot -> address map
        self.slot_offsets = torch.arange(num_slots, device=self.device, dtype=torch.int64)
        self.slot_offsets *= self.slot_bytes
        self.policy: CachePolicy[BlobKey] = policy if policy is not None else LRU()
        self._slots: dict[BlobKey, int] = {}
        self.disk = disk
        self.host = host
        self.check = check
        self._free = list(range(num_slots - 1, -1, -1))
        self.reserved = 0  # the last `reserved` slots are scratch (`reserve`), never cached
        self.stats = ResidencyStats()
        # gpu-tier counters beyond `stats` (stall seconds, prefetch) and the disk tier's
        self.counters = TierCounters()
        self.disk_counters = TierCounters()
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending: dict[int, torch.cuda.Event] = {}  # slot -> its prefetch copy's event

    @classmethod
    def for_budget(
        cls,
        store: Store,
        device: torch.device | str,
        budget_bytes: int = 0,
        max_slots: int = 0,
        policy: CachePolicy[BlobKey] | None = None,
        disk: DiskReader | None = None,
        host: HostTier | None = None,
        check: FirstReadCheck | None = None,
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
        return cls(store, device, num_slots, slot_bytes, policy, disk, host, check)

    @property
    def capacity(self) -> int:
        """Slots that hold cached blobs: all but the `reserve`d ones."""
        return self.num_slots - self.reserved

    def reserve(self, n: int) -> list[int]:
        """Take the last `n` slots not yet reserved out of caching for good (their blobs are
        dropped) and return them: scratch space addressed through the same offsets, e.g. the
        zero-copy mode's staging slots."""
        if not 0 <= n <= self.capacity - 1:
            raise ValueError(
                f"cannot reserve {n} of {self.capacity} slots: one must stay for caching"
            )
        end = self.num_slots - self.reserved
        slots = list(range(end - n, end))
        taken = set(slots)
        for key, slot in list(self._slots.items()):
            if slot in taken:
                del self._slots[key]
                self.policy.on_evict(key)
        self._free = [s for s in self._free if s not in taken]
        self.reserved += n
        return slots

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
        if len(experts) > self.capacity:
            raise ValueError(
                f"{len(experts)} experts asked for at once, the pool caches {self.capacity}"
            )
        slots = self._ensure_keys([(layer, e, plane) for e in experts], weights)
        table = [-1] * self.store.model_config.num_experts
        for expert, slot in zip(experts, slots, strict=True):
            table[expert] = slot
        return self._table(table)

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
        if len(keys) > self.capacity:
            raise ValueError(
                f"{len(keys)} blobs asked for at once, the pool caches {self.capacity}"
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
            self._table(base),
            self._table(delta),
        )

    def _table(self, values: list[int]) -> torch.Tensor:
        """An expert->slot table [E] int32 on the pool's device. On CUDA it is uploaded from
        pinned memory without a host sync (a plain `.to("cuda")` synchronises the stream, so
        the host would wait for every copy the compute stream waits on, e.g. a streamed layer's
        prefetch, before it could queue the kernel and the next copies); the caching host
        allocator keeps the pinned block until the copy has run."""
        table = torch.tensor(values, dtype=torch.int32)
        if self.device.type != "cuda":
            return table
        return table.pin_memory().to(self.device, non_blocking=True)

    def _ensure_keys(
        self, keys: list[BlobKey], weights: Sequence[float] | None = None, count: bool = True
    ) -> list[int]:
        """Make `keys` resident (none of them evicted for another); returns their slots.
        `count`: a request of the model (hit/miss counters, the policy's access), not a
        placement."""
        wanted = set(keys)
        waited: dict[int, torch.cuda.Event] = {}  # prefetch events waited on (one per batch)
        missing = [key for key in dict.fromkeys(keys) if key not in self._slots]
        for key, slot in zip(missing, self._take_slots(len(missing), wanted), strict=True):
            self._slots[key] = slot
        misses = [(key, self._slots[key]) for key in missing]
        fresh = set(missing)
        slots = []
        for key in keys:
            slot = self._slots[key]
            if key not in fresh:
                self._wait_prefetch(slot, waited)
            if count:
                if key in fresh:
                    self.stats.misses += 1
                else:
                    self.stats.hits += 1
            slots.append(slot)
        self._fetch(misses)
        if count:
            self.policy.on_access(keys, weights)
        return slots

    def place(self, keys: Sequence[BlobKey]) -> dict[BlobKey, int]:
        """Make exactly-chosen `keys` resident (a placement, not a model request: no hit/miss
        counts, no policy access); returns key -> slot for them. Blobs not in `keys` may stay
        resident where room allows."""
        keys = list(dict.fromkeys(keys))
        if len(keys) > self.capacity:
            raise ValueError(f"{len(keys)} blobs to place, the pool caches {self.capacity}")
        return dict(zip(keys, self._ensure_keys(keys, count=False), strict=True))

    def slot_of(self, key: BlobKey) -> int | None:
        return self._slots.get(key)

    def _take_slots(self, n: int, protected: set[BlobKey], partial: bool = False) -> list[int]:
        """`n` slots: free ones first, then those of the policy's victims among blobs not in
        `protected`, chosen in one batch. `partial`: fewer when not enough are evictable
        (else RuntimeError). (A policy's `admit` is not consulted: a miss is always cached;
        serving it uncached is the zero-copy mode of models/experts.py, which reads the host
        tier directly.)"""
        slots = [self._free.pop() for _ in range(min(n, len(self._free)))]
        if len(slots) < n:
            candidates = [key for key in self._slots if key not in protected]
            victims = self.policy.victims(candidates, n - len(slots))
            if len(victims) < n - len(slots) and not partial:
                raise RuntimeError("no evictable slot")  # callers keep requests <= num_slots
            for victim in victims:
                self.policy.on_evict(victim)
                self.stats.evictions += 1
                slots.append(self._slots.pop(victim))
        return slots

    def _wait_prefetch(self, slot: int, waited: dict[int, torch.cuda.Event] | None = None) -> None:
        """Make the compute stream wait (on the GPU, no host sync) for a prefetch copy into
        `slot` still in flight, before the slot is read or overwritten. `waited`: the events
        this request already waited on, by id (a prefetch batch shares one event; held here so
        no id is reused), skipped."""
        event = self._pending.pop(slot, None)
        if event is not None and (waited is None or id(event) not in waited):
            torch.cuda.current_stream(self.device).wait_event(event)
            if waited is not None:
                waited[id(event)] = event

    def _copy_in(self, misses: list[tuple[BlobKey, int]]) -> None:
        """Copy blobs into slots on the current stream: from the host tier where it holds them,
        else from the store (mmap, or the disk reader's parallel direct reads). A blob that
        fails its first-read check leaves every slot of `misses` free again, then raises."""
        try:
            self._copy_slots(misses)
        except CorruptBlob:
            for key, slot in misses:
                if self._slots.get(key) == slot:
                    del self._slots[key]
                    self._pending.pop(slot, None)
                    self._free.append(slot)
            raise

    def _copy_slots(self, misses: list[tuple[BlobKey, int]]) -> None:
        from_disk = []
        from_host = []
        for key, slot in misses:
            if self.host is not None and key in self.host:
                from_host.append((key, slot))
                self.stats.bytes_fetched += self.store.blobs[key].nbytes
                self.host.counters.hits += 1
            else:
                from_disk.append((key, slot))
                if self.host is not None:
                    self.host.counters.misses += 1
        self._copy_from_host(from_host)
        if not from_disk:
            return
        self.disk_counters.hits += len(from_disk)
        if self.disk is None:
            blobs = [self.store.blob(*key) for key, _ in from_disk]
            if self.check is not None:
                self.check.check([(key, b) for (key, _), b in zip(from_disk, blobs, strict=True)])
            for (_, slot), blob in zip(from_disk, blobs, strict=True):
                self.pool[slot, : blob.numel()].copy_(blob)
                self.stats.bytes_fetched += blob.numel()
                self.disk_counters.bytes += blob.numel()
            return
        sizes = [self.store.blobs[key].nbytes for key, _ in from_disk]
        staging = DiskReader.allocate(sum(read_size(n) for n in sizes))  # 4 KiB-aligned pieces
        starts = [0]
        for n in sizes[:-1]:
            starts.append(starts[-1] + read_size(n))
        buffers = [staging[s : s + read_size(n)] for s, n in zip(starts, sizes, strict=True)]
        self.disk.read_blobs(self.store, [key for key, _ in from_disk], buffers)
        if self.check is not None:
            self.check.check(
                [(key, b[:n]) for (key, _), b, n in zip(from_disk, buffers, sizes, strict=True)]
            )
        for (_, slot), buffer, n in zip(from_disk, buffers, sizes, strict=True):
            self.pool[slot, :n].copy_(buffer[:n])
            self.stats.bytes_fetched += n
            self.disk_counters.bytes += n

    def _copy_from_host(self, items: list[tuple[BlobKey, int]]) -> None:
        """Host-tier rows into slots (asynchronous from pinned memory): one copy per run of
        consecutive rows of an arena going to consecutive slots, whole rows, when rows and slots
        have the same stride (a streamed layer's experts usually form one run: one copy call
        instead of one per blob, less host time and per-copy DMA overhead); else one copy of
        each blob's bytes."""
        host = self.host
        if host is None or not items:
            return
        if host.row_bytes != self.slot_bytes:
            for key, slot in items:
                n = self.store.blobs[key].nbytes
                self.pool[slot, :n].copy_(host.row(key)[:n], non_blocking=True)
            return
        runs: list[list[int]] = []  # [arena, first row, first slot, count]
        for key, slot in items:
            arena, row = host.location(key)
            last = runs[-1] if runs else None
            if last and last[0] == arena and last[1] + last[3] == row and last[2] + last[3] == slot:
                last[3] += 1
            else:
                runs.append([arena, row, slot, 1])
        for arena, row, slot, count in runs:
            src = host.arenas[arena][row : row + count]  # [count, row_bytes]
            self.pool[slot : slot + count].copy_(src, non_blocking=True)

    def _fetch(self, misses: list[tuple[BlobKey, int]]) -> None:
        """Blocking fetch of the missed blobs into their slots (all in flight together when
        reading with the disk reader). Stall seconds: host time spent here."""
        if not misses:
            return
        start = time.perf_counter()
        for _, slot in misses:
            self._wait_prefetch(slot)  # a prefetch copy into a reused slot finishes first
        self._copy_in(misses)
        self.counters.stall_seconds += time.perf_counter() - start

    def mark(self) -> torch.cuda.Event | None:
        """An event recorded now on the compute stream (None on CPU): `prefetch(after=...)`
        copies wait for the work queued up to this point only."""
        if self._copy_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def prefetch(
        self,
        keys: Sequence[BlobKey],
        protect: Iterable[BlobKey] = (),
        after: torch.cuda.Event | None = None,
    ) -> int:
        """Start copying the blobs of `keys` that are not resident into slots, never evicting a
        blob of `keys` or `protect` (the request being computed); on CUDA on the pool's copy
        stream, after the work already queued on the compute stream (so no slot a queued
        kernel reads is overwritten), with an event the compute stream waits on before the slot
        is next read or overwritten; on CPU synchronously. `after` (from `mark`): wait only for
        the work queued before it instead; the caller guarantees that what it queued since
        reads no slot outside `keys` and `protect`. Stops when no slot is evictable; returns the
        number of copies issued."""
        keep = set(keys) | set(protect)
        todo = [k for k in dict.fromkeys(keys) if k not in self._slots]
        placed = list(zip(todo, self._take_slots(len(todo), keep, partial=True), strict=False))
        for key, slot in placed:
            self._slots[key] = slot
        if not placed:
            return 0
        if self._copy_stream is None:
            self._copy_in(placed)
        else:
            compute = torch.cuda.current_stream(self.device)
            for _, slot in placed:  # an older prefetch into the same slot, on the same stream
                self._pending.pop(slot, None)
            if after is not None:
                self._copy_stream.wait_event(after)
            else:
                self._copy_stream.wait_stream(compute)
            with torch.cuda.stream(self._copy_stream):
                self._copy_in(placed)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            for _, slot in placed:
                self._pending[slot] = event
        return len(placed)

    def wait_prefetches(self) -> None:
        """The compute stream waits for every prefetch copy in flight."""
        for slot in list(self._pending):
            self._wait_prefetch(slot)

    def score_prediction(self, predicted: Iterable[BlobKey], needed: Iterable[BlobKey]) -> None:
        """Count a layer's prediction against what it then asked for (precision: used /
        predicted; recall: used / needed)."""
        predicted, needed = set(predicted), set(needed)
        self.counters.prefetch_issued += len(predicted)
        self.counters.prefetch_used += len(predicted & needed)
        self.counters.prefetch_needed += len(needed)

    def resident(self) -> list[BlobKey]:
        return list(self._slots)

    @property
    def tier_name(self) -> str:
        """This pool's tier in telemetry: "gpu" under CUDA or above a host tier, else "host"."""
        return "gpu" if self.device.type == "cuda" or self.host is not None else "host"

    def telemetry(self) -> ResidencyTelemetry:
        """Counters for /metrics: this pool's tier ("gpu" under CUDA or when a host tier sits
        below it, else "host"), the host tier and the store's file ("disk")."""
        out = ResidencyTelemetry()
        tier = out[self.tier_name]
        tier.add(self.counters)
        tier.hits, tier.misses = self.stats.hits, self.stats.misses
        tier.bytes = self.stats.bytes_fetched
        if self.host is not None:
            out["host"].add(self.host.counters)
        out["disk"].add(self.disk_counters)
        return out
