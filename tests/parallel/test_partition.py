"""The expert partitioner (residency/partition.py) and the per-GPU plan."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moetier.residency.partition import ExpertPartition, partition_layer, read_hotness


def test_round_robin_without_hotness():
    assert partition_layer(8, 2) == [0, 1, 0, 1, 0, 1, 0, 1]
    assert partition_layer(5, 3) == [0, 1, 2, 0, 1]


def test_hotness_balances_expected_load_at_equal_counts():
    # the hot experts at even ids: round-robin puts every one of them on rank 0
    load = [40, 1, 30, 1, 20, 1, 10, 1]
    owner = partition_layer(8, 2, load)
    assert [owner.count(r) for r in range(2)] == [4, 4]  # equal caches
    totals = [sum(w for w, o in zip(load, owner, strict=True) if o == r) for r in range(2)]
    assert totals == [52, 52]  # 40 + 10 + 1 + 1 and 30 + 20 + 1 + 1
    round_robin = [sum(load[r::2]) for r in range(2)]
    assert max(round_robin) - min(round_robin) == 96  # all the hot ones on rank 0


def test_no_rank_takes_more_than_its_share_of_experts():
    owner = partition_layer(7, 3, [100, 0, 0, 0, 0, 0, 0])
    assert max(owner.count(r) for r in range(3)) <= 3
    assert sorted(set(owner)) == [0, 1, 2]


def test_partition_owned_and_expected_load():
    hot = {3: [4.0, 3.0, 2.0, 1.0], 5: [1.0, 1.0, 1.0, 1.0]}
    p = ExpertPartition.build([3, 5], 4, 2, hot)
    owned = [p.owned(r) for r in range(2)]
    for layer in (3, 5):
        assert sorted(owned[0][layer] + owned[1][layer]) == [0, 1, 2, 3]
    assert owned[0][3] == [0, 3] and owned[1][3] == [1, 2]  # 4 + 1 against 3 + 2
    assert p.expected_load(hot) == pytest.approx([0.5, 0.5])
    assert p.most_owned() == 4
    with pytest.raises(ValueError, match="at least one rank"):
        partition_layer(4, 0)
    with pytest.raises(ValueError, match="3 experts for a layer of 4"):
        partition_layer(4, 2, [1.0, 2.0, 3.0])


def test_read_hotness_trace_and_table(tmp_path):
    ids = np.array([[[0, 1], [0, 2]], [[3, 3], [1, 0]]])  # [2 MoE layers, 2 tokens, k=2]
    trace = tmp_path / "trace.npz"
    np.savez(trace, expert_ids=ids)
    assert read_hotness(trace, [1, 2], 4) == {1: [2.0, 1.0, 1.0, 0.0], 2: [1.0, 1.0, 0.0, 2.0]}
    with pytest.raises(ValueError, match="must be \\[3 MoE layers"):
        read_hotness(trace, [1, 2, 3], 4)
    table = tmp_path / "hot.json"
    table.write_text(json.dumps({"layers": {"2": [1, 2, 3, 4]}}))
    assert read_hotness(table, [1, 2], 4) == {2: [1.0, 2.0, 3.0, 4.0]}
    with pytest.raises(ValueError, match="layer 2 with 4 entries"):
        read_hotness(table, [1, 2], 8)
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="routing trace .npz or a JSON table"):
        read_hotness(tmp_path / "bad.json", [1], 4)


def test_plan_per_gpu_counts_each_ranks_experts(tiny):
    from moetier.quant.store import Store
    from moetier.residency.planner import plan

    store = Store(tiny.store("qwen3_moe"))
    one = plan(store, 2**30)
    two = plan(store, 2**30, ranks=2)
    experts = store.model_config.num_experts
    assert two.base_blobs == one.base_blobs // experts * -(-experts // 2)
    assert two.dense_bytes == one.dense_bytes and two.kv_bytes == one.kv_bytes  # replicated
    assert two.blobs_per_token == -(-one.blobs_per_token // 2)
    assert "each of 2 (expert parallel)" in two.render()
    assert plan(store, 2**30, ranks=1) == one
