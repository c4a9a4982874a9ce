"""The miss cost model's arithmetic against hand-computed values."""

from __future__ import annotations

import math

import pytest

from moetier.residency.cost import LinkSpeeds, TokenTraffic, choose, floor_seconds, miss_costs

GB = 1e9
# round figures: HBM 4000 GB/s, H2D 50 GB/s, zero-copy reads 40 GB/s, disk 5 GB/s
SPEEDS = LinkSpeeds(hbm=4000 * GB, h2d=50 * GB, zero_copy=40 * GB, disk=5 * GB)


def test_hand_values_without_disk():
    # dense 0.4 GB, 1.2 GB of experts on the GPU, 0.4 GB in host RAM: active 2.0 GB
    traffic = TokenTraffic(dense=0.4 * GB, gpu=1.2 * GB, host=0.4 * GB)
    costs = miss_costs(traffic, SPEEDS, recall=0.75, precision=0.5)
    compute = 2.0 / 4000  # 0.5 ms: every active byte read from HBM
    assert costs["blocking"] == pytest.approx(compute + 0.4 / 50)  # 0.5 + 8 ms
    # predicted copy 0.75 * 0.4 / 0.5 = 0.6 GB -> 12 ms on the copy engine, overlapping 0.5 ms;
    # the unpredicted 0.1 GB blocks for 2 ms
    assert costs["prefetch"] == pytest.approx(0.6 / 50 + 0.1 / 50)
    assert costs["zero_copy"] == pytest.approx(1.6 / 4000 + 0.4 / 40)  # 0.4 + 10 ms
    assert choose(costs) == "blocking"  # 8.5 ms < 10.4 ms < 14 ms
    assert floor_seconds(traffic, SPEEDS) == pytest.approx(compute + 0.4 / 50)


def test_prefetch_hides_copies_behind_compute():
    # compute 1 ms (4 GB at 4000 GB/s); 0.04 GB from host: a perfect prediction copies it in
    # 0.8 ms while compute runs
    traffic = TokenTraffic(dense=1 * GB, gpu=2.96 * GB, host=0.04 * GB, predict_seconds=1e-5)
    costs = miss_costs(traffic, SPEEDS, recall=1.0, precision=1.0)
    assert costs["prefetch"] == pytest.approx(1e-3 + 1e-5)
    assert costs["blocking"] == pytest.approx(1e-3 + 0.8e-3)
    assert costs["zero_copy"] == pytest.approx(3.96 / 4000 + 0.04 / 40)  # 0.99 + 1 ms
    assert choose(costs) == "prefetch"


def test_disk_bytes_rule_out_zero_copy_and_add_to_each():
    traffic = TokenTraffic(dense=0, gpu=0, host=0.1 * GB, disk=0.05 * GB)
    costs = miss_costs(traffic, SPEEDS)
    disk = 0.05 / 5 + 0.05 / 50  # read, then copy: 11 ms
    assert costs["blocking"] == pytest.approx(0.15 / 4000 + 0.1 / 50 + disk)
    assert costs["prefetch"] == pytest.approx(0.1 / 50 + disk)  # copy 2 ms > compute
    assert math.isinf(costs["zero_copy"]) and choose(costs) in ("blocking", "prefetch")
    assert floor_seconds(traffic, SPEEDS) == pytest.approx(0.15 / 4000 + 0.15 / 50 + 0.05 / 5)


def test_zero_copy_wins_by_the_host_syncs_it_saves():
    """Copying at 50 GB/s beats reading at 40 GB/s byte for byte; what zero-copy saves is the
    per-layer host sync and launch overhead of deciding residency on the host (2 ms here)."""
    traffic = TokenTraffic(dense=0.1 * GB, gpu=0.3 * GB, host=0.3 * GB, sync_seconds=2e-3)
    costs = miss_costs(traffic, SPEEDS, recall=0.1, precision=0.1)
    assert costs["blocking"] == pytest.approx(0.7 / 4000 + 0.3 / 50 + 2e-3)  # 8.175 ms
    # predicted copy 0.1 * 0.3 / 0.1 = 0.3 GB: 6 ms; unpredicted 0.27 GB: 5.4 ms
    assert costs["prefetch"] == pytest.approx(0.3 / 50 + 0.27 / 50 + 2e-3)
    assert costs["zero_copy"] == pytest.approx(0.4 / 4000 + 0.3 / 40)  # 7.6 ms
    assert choose(costs) == "zero_copy"
    no_sync = miss_costs(TokenTraffic(dense=0.1 * GB, gpu=0.3 * GB, host=0.3 * GB), SPEEDS)
    # a perfect prediction: the 6 ms copy hides the 0.175 ms compute
    assert no_sync["prefetch"] == pytest.approx(0.3 / 50) and choose(no_sync) == "prefetch"


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="link speed h2d must be positive"):
        LinkSpeeds(hbm=1, h2d=0, zero_copy=1, disk=1)
    with pytest.raises(ValueError, match="recall must be in"):
        miss_costs(TokenTraffic(0, 0, 0), SPEEDS, recall=1.5)
