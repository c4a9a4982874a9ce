"""The host tier: budgeted blobs byte-identical to the store; slot-pool misses served from it."""

from __future__ import annotations

import pytest
import torch

from moetier.config import EngineConfig
from moetier.core.layout import TENSOR_ALIGN
from moetier.loader.load import load_model
from moetier.quant.store import Store
from moetier.residency.host_tier import HostTier, default_order
from moetier.residency.slot_pool import SlotPool


@pytest.fixture()
def store(tiny):
    return Store(tiny.store("qwen3_moe"))


def test_budget_order_and_bytes(store):
    row = HostTier.for_budget(store, 0).row_bytes
    tier = HostTier.for_budget(store, 5 * row + row // 2, exclude=[(0, 0, "base")], pinned=False)
    expected = [k for k in default_order(store) if k != (0, 0, "base")][:5]
    assert tier.keys == expected and len(tier) == 5 and tier.nbytes == 5 * row
    assert tier.row_bytes % 256 == 0 and all(tier.address(k) % 256 == 0 for k in tier.keys)
    for key in tier.keys:
        blob = store.blob(*key)
        assert torch.equal(tier.row(key)[: blob.numel()], blob)
    assert tier.counters.bytes == sum(store.blobs[k].nbytes for k in tier.keys)
    with pytest.raises(ValueError, match="--host-memory must not be negative"):
        HostTier.for_budget(store, -1)
    with pytest.raises(ValueError, match=r"the store has no blob \(9, 0, 'base'\)"):
        HostTier(store, [(9, 0, "base")])


def test_arenas_split_large_tiers(store, monkeypatch):
    """Several arenas (torch rounds pinned allocations to powers of two); rows stay addressable."""
    import moetier.residency.host_tier as host_tier

    row = HostTier.for_budget(store, 0).row_bytes
    monkeypatch.setattr(host_tier, "ARENA_BYTES", 3 * row + TENSOR_ALIGN)  # 3 rows + slack
    tier = HostTier(store, default_order(store)[:7], pinned=False)
    assert [a.shape[0] for a in tier.arenas] == [3, 3, 1]
    assert tier.location(tier.keys[4]) == (1, 1)
    assert torch.equal(tier.row(tier.keys[6])[:10], store.blob(*tier.keys[6])[:10])


def test_pool_misses_come_from_the_host_tier(store):
    """Blobs the host tier holds are copied from there; the others are read from the store;
    each tier counts what it served."""
    keys = [(0, e, "base") for e in range(4)]
    host = HostTier(store, keys, pinned=False)
    pool = SlotPool.for_budget(store, "cpu", max_slots=3, host=host)
    for key in keys:
        host.row(key)[0] ^= 0xFF  # mark: a copy from the host tier carries the mark
    table = pool.ensure(0, [1, 2, 6])
    assert pool.pool[table[1], 0] == store.blob(0, 1)[0] ^ 0xFF
    assert pool.pool[table[6], 0] == store.blob(0, 6)[0]  # not in the host tier: from the store
    counters = pool.telemetry()
    assert (counters["gpu"].misses, counters["host"].hits, counters["host"].misses) == (3, 2, 1)
    assert (counters["disk"].hits, counters["disk"].bytes) == (1, store.blobs[keys[0]].nbytes)


def test_host_tier_from_the_engine_config(tiny):
    """--host-memory builds the host tier under the pool; with every blob there and 2 slots,
    the logits equal those of a full cache and nothing is read from the store's file."""
    ids = torch.randint(1, 300, (1, 6), generator=torch.Generator().manual_seed(5))

    def run(**engine):
        loaded = load_model(
            tiny.store("qwen3_moe"),
            EngineConfig(native=False, device="cpu", dtype="float32", **engine),
        )
        with torch.no_grad():
            return loaded.model(ids).logits, loaded.runtime.residency

    full, _ = run()
    hosted, pool = run(expert_cache_slots=2, host_memory="64MiB")
    assert pool.host is not None and len(pool.host) == len(pool.store.blobs)
    assert torch.equal(hosted, full)
    counters = pool.telemetry()
    assert counters["host"].hits == counters["gpu"].misses > 0 and counters["disk"].hits == 0
    with pytest.raises(ValueError, match="is not a memory size"):
        run(host_memory="lots")
