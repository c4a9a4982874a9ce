"""The slot pool: eviction by policy, fetched bytes, budget sizing, telemetry."""

from __future__ import annotations

import pytest
import torch

from moetier.config import EngineConfig
from moetier.loader.load import load_model
from moetier.quant.store import Store
from moetier.residency.slot_pool import SlotPool, make_policy


@pytest.fixture()
def store(tiny):
    return Store(tiny.store("qwen3_moe"))


def test_table_points_at_the_right_bytes(store):
    pool = SlotPool.for_budget(store, "cpu", max_slots=4)
    table = pool.ensure(1, [6, 2, 5])
    assert table.dtype == torch.int32 and table.shape == (store.model_config.num_experts,)
    assert [i for i, s in enumerate(table.tolist()) if s >= 0] == [2, 5, 6]
    for e in (2, 5, 6):
        blob = store.blob(1, e)
        assert torch.equal(pool.pool[table[e], : blob.numel()], blob)


def test_lru_eviction_and_stats(store):
    pool = SlotPool.for_budget(store, "cpu", max_slots=3)
    pool.ensure(0, [0, 1, 2])
    pool.ensure(0, [0])  # 0 becomes most recent; 1 is now the oldest
    pool.ensure(1, [7])  # evicts (0, 1)
    assert set(pool.resident()) == {(0, 0, "base"), (0, 2, "base"), (1, 7, "base")}
    assert (pool.stats.hits, pool.stats.misses, pool.stats.evictions) == (1, 4, 1)
    assert pool.stats.bytes_fetched == 4 * store.blobs[(0, 0, "base")].nbytes
    # Experts asked for together are never evicted to make room for each other.
    table = pool.ensure(1, [3, 4, 7])
    assert (table >= 0).sum() == 3 and len(set(table[table >= 0].tolist())) == 3


def test_budget_sizing_and_errors(store):
    blob = store.blobs[(0, 0, "base")].nbytes
    assert SlotPool.for_budget(store, "cpu").capacity == len(store.blobs)
    assert SlotPool.for_budget(store, "cpu", budget_bytes=5 * blob + 10).capacity == 5
    with pytest.raises(ValueError, match="holds no expert.*raise --expert-cache-mb"):
        SlotPool.for_budget(store, "cpu", budget_bytes=blob // 2)
    pool = SlotPool.for_budget(store, "cpu", max_slots=2)
    with pytest.raises(ValueError, match="3 experts asked for at once, the pool caches 2"):
        pool.ensure(0, [1, 2, 3])


def test_reserved_slots_leave_caching(store):
    """`reserve` takes the last slots for good: their blobs are dropped, they are never handed
    out again, and requests are bounded by the slots that remain."""
    pool = SlotPool.for_budget(store, "cpu", max_slots=5)
    table = pool.ensure(0, [0, 1, 2, 3, 4])
    last = {int(table[e]): e for e in range(5)}
    assert pool.reserve(2) == [3, 4] and pool.capacity == 3
    assert set(pool.resident()) == {(0, last[s], "base") for s in (0, 1, 2)}
    table = pool.ensure(1, [5, 6, 7])  # evicts into slots 0-2 only
    assert sorted(int(table[e]) for e in (5, 6, 7)) == [0, 1, 2]
    with pytest.raises(ValueError, match="4 experts asked for at once, the pool caches 3"):
        pool.ensure(1, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="cannot reserve 3 of 3 slots"):
        pool.reserve(3)


def test_policy_chooses_the_victim(store):
    """Under LFU the often-used expert survives where LRU would evict it."""
    pool = SlotPool.for_budget(store, "cpu", max_slots=3, policy=make_policy("lfu"))
    for _ in range(3):
        pool.ensure(0, [0])
    pool.ensure(0, [1])
    pool.ensure(0, [2])  # 0 is now the least recent but the most used
    pool.ensure(0, [3])
    assert (0, 0, "base") in pool.resident() and (0, 1, "base") not in pool.resident()
    with pytest.raises(ValueError, match="unknown cache policy 'mru': choose one of lru, lfu"):
        make_policy("mru")


def test_telemetry_counts_the_pool_and_the_store(store):
    pool = SlotPool.for_budget(store, "cpu", max_slots=2)
    pool.ensure(0, [0, 1])
    pool.ensure(0, [1])
    counters = pool.telemetry()
    assert (counters["host"].hits, counters["host"].misses) == (1, 2)
    assert counters["host"].bytes == 2 * store.blobs[(0, 0, "base")].nbytes
    assert counters["disk"].hits == 2


@pytest.mark.parametrize("policy", ["lfu", "wlfu"])
def test_policies_never_change_numerics(tiny, policy):
    ids = torch.randint(1, 300, (2, 12), generator=torch.Generator().manual_seed(3))
    store = tiny.store("qwen3_moe")

    def logits(**engine):
        loaded = load_model(
            store, EngineConfig(native=False, device="cpu", dtype="float32", **engine)
        )
        with torch.no_grad():
            return loaded.model(ids).logits

    assert torch.equal(logits(expert_cache_slots=3, cache_policy=policy), logits())


def test_frequency_policies_halve_over_the_half_life():
    """Counts decay per access (one per MoE layer per token): after half_life_tokens tokens of
    a 4-layer model, a count is worth half."""
    policy = make_policy("lfu", moe_layers=4, half_life_tokens=10)
    assert policy.decay ** (4 * 10) == pytest.approx(0.5)


def test_residency_configurations_are_bit_identical(tiny, tmp_path):
    """Every expert resident; 2 slots; 2 slots filled by parallel direct reads of a copy of the
    store in a temporary directory (O_DIRECT where the filesystem allows it): same logits."""
    import shutil

    store = shutil.copytree(tiny.store("qwen3_moe"), tmp_path / "store")
    ids = torch.randint(1, 300, (2, 12), generator=torch.Generator().manual_seed(4))

    def run(**engine):
        loaded = load_model(
            store, EngineConfig(native=False, device="cpu", dtype="float32", **engine)
        )
        with torch.no_grad():
            return loaded.model(ids).logits, loaded.runtime.residency

    full, _ = run()
    two, _ = run(expert_cache_slots=2)
    direct, pool = run(expert_cache_slots=2, expert_reads="direct")
    assert pool.disk is not None and pool.disk.bytes_read >= pool.stats.bytes_fetched > 0
    assert torch.equal(two, full) and torch.equal(direct, full)
    with pytest.raises(ValueError, match="--expert-reads 'nvme': use mmap or direct"):
        run(expert_reads="nvme")


def test_host_rows_are_copied_in_runs(store):
    """Consecutive host rows going to consecutive slots cross in one copy (whole rows), others
    one copy per run; the slots hold the store's bytes either way."""
    from torch.profiler import ProfilerActivity, profile

    from moetier.residency.host_tier import HostTier

    host = HostTier(store, sorted(store.blobs), pinned=False)
    pool = SlotPool.for_budget(store, "cpu", max_slots=8, host=host)
    assert pool.slot_bytes == host.row_bytes

    def copies(keys):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            pool.place(keys)
        return sum(e.count for e in prof.key_averages() if e.key == "aten::copy_")

    assert copies([(0, e, "base") for e in range(5)]) == 1  # rows 0-4 into slots 0-4
    assert copies([(1, 0, "base"), (1, 2, "base"), (1, 3, "base")]) == 2  # a gap in the rows
    for key in pool.resident():
        n = store.blobs[key].nbytes
        assert torch.equal(pool.pool[pool.slot_of(key), :n], store.blob(*key)), key
