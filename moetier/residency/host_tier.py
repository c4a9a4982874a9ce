"""The host tier: expert blobs held in host RAM, page-locked (pinned) when CUDA is available.

Owns which (layer, expert, plane) blobs sit in host memory under a byte budget (`--host-memory`)
and the memory that holds them. Blobs are copied in once, byte for byte, from the store, so
whatever reads them (an H2D copy into a GPU slot, or the kernel itself through a zero-copy slot
offset) sees exactly the store's bytes: numerics never depend on the tier.

Memory is a list of arenas, each [rows, row_bytes] uint8 and at most `ARENA_BYTES`: torch's
pinned allocator rounds every allocation up to a power of two, so one arena per GiB keeps the
waste below a GiB. Every row starts on a TENSOR_ALIGN boundary (row_bytes is a multiple of it
and each arena starts on one), as the kernels require of a slot.

Contents are fixed once filled (a static placement, as the planner decides it); what moves at
run time is the GPU slot pool above it (residency/slot_pool.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from moetier.core.layout import TENSOR_ALIGN, align_up
from moetier.quant.store import Store
from moetier.quant.verify import FirstReadCheck
from moetier.residency.telemetry import TierCounters

BlobKey = tuple[int, int, str]
ARENA_BYTES = 2**30


def default_order(store: Store) -> list[BlobKey]:
    """Blobs in the order a budget takes them: every base plane (layer, then expert), then
    every delta plane; base and delta are separate entries."""
    keys = sorted(store.blobs)
    return [k for k in keys if k[2] == "base"] + [k for k in keys if k[2] != "base"]


class HostTier:
    """`keys` of `store` copied into host arenas of `row_bytes` rows (pinned when `pinned`,
    default: when CUDA is available); with `check`, each row's crc32 verified once it is filled
    (quant/verify.py: a corrupted blob raises CorruptBlob); `progress(keys, label)` wraps the
    fill loop (a progress bar)."""

    def __init__(
        self,
        store: Store,
        keys: Sequence[BlobKey],
        row_bytes: int | None = None,
        pinned: bool | None = None,
        check: FirstReadCheck | None = None,
        progress: Callable[[list[BlobKey], str], Iterable[BlobKey]] | None = None,
    ) -> None:
        unknown = [k for k in keys if k not in store.blobs]
        if unknown:
            raise ValueError(f"the store has no blob {unknown[0]} (layer, expert, plane)")
        if len(set(keys)) != len(keys):
            raise ValueError("a blob is listed twice for the host tier")
        largest = max((store.blobs[k].nbytes for k in keys), default=0)
        if row_bytes is None:
            row_bytes = largest
        self.row_bytes = align_up(max(row_bytes, 1), TENSOR_ALIGN)
        if largest > self.row_bytes:
            raise ValueError(f"rows of {self.row_bytes} bytes cannot hold a {largest}-byte blob")
        self.store = store
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        if self.pinned and not torch.cuda.is_available():
            raise ValueError("pinned host memory needs CUDA: pass pinned=False on a CPU machine")
        # an arena's rows plus the alignment slack stay within ARENA_BYTES: the pinned allocator
        # rounds a request up to a power of two, so 1 GiB + 256 bytes would take 2 GiB
        per_arena = max(1, (ARENA_BYTES - TENSOR_ALIGN) // self.row_bytes)
        self.arenas: list[torch.Tensor] = []
        for start in range(0, len(keys), per_arena):
            rows = min(per_arena, len(keys) - start)
            raw = torch.empty(
                rows * self.row_bytes + TENSOR_ALIGN, dtype=torch.uint8, pin_memory=self.pinned
            )
            first = (-raw.data_ptr()) % TENSOR_ALIGN  # host allocators align to 64 bytes only
            self.arenas.append(raw[first : first + rows * self.row_bytes].view(rows, -1))
        self.per_arena = per_arena
        self.index: dict[BlobKey, int] = {key: i for i, key in enumerate(keys)}
        self.keys = list(keys)
        # hits: misses of the GPU tier served from here; misses: passed on to the disk tier;
        # bytes: filled in from the store
        self.counters = TierCounters()
        for key in progress(self.keys, "host tier") if progress else self.keys:
            blob = store.blob(*key)
            self.row(key)[: blob.numel()].copy_(blob)
            self.counters.bytes += blob.numel()
        if check is not None:
            check.check([(key, self.row(key)[: store.blobs[key].nbytes]) for key in self.keys])

    @classmethod
    def for_budget(
        cls,
        store: Store,
        budget_bytes: int,
        exclude: Iterable[BlobKey] = (),
        order: Sequence[BlobKey] | None = None,
        row_bytes: int | None = None,
        pinned: bool | None = None,
        check: FirstReadCheck | None = None,
        progress: Callable[[list[BlobKey], str], Iterable[BlobKey]] | None = None,
    ) -> HostTier:
        """As many blobs of `order` (default `default_order`) as `budget_bytes` holds, skipping
        `exclude` (e.g. the blobs the GPU keeps for good). Rows are sized for the store's
        largest blob, so the budget counts rows, not exact blob bytes."""
        largest = max(e.nbytes for e in store.blobs.values())
        row = align_up(max(row_bytes or 0, largest), TENSOR_ALIGN)
        if budget_bytes < 0:
            raise ValueError(f"--host-memory must not be negative, got {budget_bytes} bytes")
        skip = set(exclude)
        order = order if order is not None else default_order(store)
        wanted = [k for k in order if k not in skip]
        return cls(store, wanted[: budget_bytes // row], row, pinned, check, progress)

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.row_bytes

    def row(self, key: BlobKey) -> torch.Tensor:
        """The [row_bytes] uint8 row holding `key` (its first nbytes are the blob)."""
        i = self.index[key]
        return self.arenas[i // self.per_arena][i % self.per_arena]

    def location(self, key: BlobKey) -> tuple[int, int]:
        """(arena, row in arena) of `key`."""
        i = self.index[key]
        return i // self.per_arena, i % self.per_arena

    def address(self, key: BlobKey) -> int:
        """Host address of `key`'s first byte (with CUDA's unified addressing, also the address
        a kernel reads a pinned row at)."""
        return self.row(key).data_ptr()
