"""Replacement policies against hand-computed small cases, and the trace replay."""

from __future__ import annotations

import random

import pytest

from moetier.residency.policies import (
    LFU,
    LRU,
    Belady,
    ExpertCache,
    StaticHotSet,
    WeightedLFU,
)
from moetier.residency.replay import Request, Trace, cache_capacity, replay


def run(cache, requests, weights=None):
    return [
        cache.access(keys, None if weights is None else weights[i])
        for i, keys in enumerate(requests)
    ]


def test_lru_evicts_the_least_recently_used():
    cache = ExpertCache(2, LRU())
    # a b a c: c evicts b (a was used after b); then b evicts a (c is more recent).
    assert run(cache, [["a"], ["b"], ["a"], ["c"], ["b"]]) == [0, 0, 1, 0, 0]
    assert cache.resident == {"c", "b"}
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 4, 2)


def test_lfu_without_decay_keeps_the_most_used():
    cache = ExpertCache(2, LFU(decay=1.0))
    # counts a=2, b=1 when c arrives: b goes; then b returns: c (1) goes, not a (2).
    assert run(cache, [["a"], ["a"], ["b"], ["c"], ["b"]]) == [0, 1, 0, 0, 0]
    assert cache.resident == {"a", "b"}


def test_lfu_decay_forgets_old_counts():
    policy = LFU(decay=0.5)
    cache = ExpertCache(2, policy)
    run(cache, [["a"], ["a"], ["b"]])
    # a: (1 * 0.5 + 1) * 0.5 = 0.75, b: 1, in units of the latest access.
    assert policy.score("a") == pytest.approx(0.75) and policy.score("b") == pytest.approx(1.0)
    cache.access(["c"])  # without decay b (count 1 < 2) would go; with decay 0.5 a goes
    assert cache.resident == {"b", "c"}


def test_lfu_ties_fall_back_to_lru():
    cache = ExpertCache(2, LFU(decay=1.0))
    run(cache, [["a"], ["b"], ["c"]])
    assert cache.resident == {"b", "c"}


def test_weighted_frequency_counts_routing_weights():
    requests = [["a"], ["b"], ["c"]]
    weights = [[0.9], [0.2], [0.5]]
    weighted = ExpertCache(2, WeightedLFU(decay=1.0))
    run(weighted, requests, weights)
    assert weighted.resident == {"a", "c"}  # b had the smallest weight
    plain = ExpertCache(2, LFU(decay=1.0))
    run(plain, requests, weights)
    assert plain.resident == {"b", "c"}  # counts tie, a is the oldest
    with pytest.raises(ValueError, match="needs the routing weights"):
        ExpertCache(2, WeightedLFU()).access(["a"])


def test_static_hot_set_from_calibration_counts():
    policy = StaticHotSet.fit([["a", "b"], ["a"], ["c", "a"], ["c"]], capacity=2)
    assert policy.hot == ["a", "c"]  # counts a=3, c=2, b=1
    cache = ExpertCache(2, policy)
    assert cache.resident == {"a", "c"}  # preloaded
    assert run(cache, [["b"], ["a"], ["c", "b"]]) == [0, 1, 1]
    assert cache.resident == {"a", "c"}  # b is never admitted
    assert StaticHotSet({"y": 1, "x": 1, "z": 1}, 2).hot == ["x", "y"]  # ties: smaller key


def test_belady_evicts_the_furthest_next_use():
    requests = [["a"], ["b"], ["c"], ["a"], ["b"], ["c"]]
    # MIN: at c, a (next at 3) stays and b (next at 4) goes; at b, a (never again) goes.
    assert run(ExpertCache(2, Belady(requests, bypass=False)), requests) == [0, 0, 0, 1, 0, 1]
    assert run(ExpertCache(2, LRU()), requests) == [0] * 6


def test_belady_with_bypass_keeps_out_a_key_needed_later():
    requests = [["a"], ["b"], ["c"], ["a"], ["b"], ["c"], ["a"], ["b"]]
    # Demand MIN must let c in at t=2 and again at t=5; with bypass c (needed latest) stays out
    # and a, b hit from then on.
    demand = ExpertCache(2, Belady(requests, bypass=False))
    assert sum(run(demand, requests)) == 3
    bypass = ExpertCache(2, Belady(requests))
    assert run(bypass, requests) == [0, 0, 0, 1, 1, 0, 1, 1]
    assert bypass.resident == {"a", "b"}


def test_belady_is_the_ceiling_on_random_traces():
    rng = random.Random(0)
    for trial in range(20):
        requests = [[rng.randrange(12)] for _ in range(300)]
        weights = [[rng.random()] for _ in requests]
        demand = sum(run(ExpertCache(4, Belady(requests, bypass=False)), requests))
        best = sum(run(ExpertCache(4, Belady(requests)), requests))
        assert demand <= best
        for policy in (LRU(), LFU(0.9), WeightedLFU(0.9)):
            assert sum(run(ExpertCache(4, policy), requests, weights)) <= demand, trial
        assert sum(run(ExpertCache(4, StaticHotSet.fit(requests, 4)), requests)) <= best


def test_requests_larger_than_the_cache_are_refused():
    with pytest.raises(ValueError, match="3 keys asked for at once, the cache holds 2"):
        ExpertCache(2, LRU()).access(["a", "b", "c"])


def tiny_trace():
    # 2 layers x 4 experts, top-1, 8 tokens; layer 0 alternates 0/1, layer 1 always expert 3.
    requests = []
    for t in range(8):
        requests.append(Request(t, 0, (t % 2,), (1.0,)))
        requests.append(Request(t, 1, (3,), (1.0,)))
    return Trace("tiny", num_experts=4, layers=(0, 1), requests=tuple(requests))


def test_replay_counts_only_the_evaluation_part():
    trace = tiny_trace()
    # Per layer, 2 slots each: after warm-up every request hits.
    result = replay(trace, "lru", 0.5, scope="layer", calibration_fraction=0.25)
    assert (result.capacity, result.calibration_tokens, result.eval_tokens) == (2, 2, 6)
    assert (result.hits, result.misses) == (12, 0)
    # One global slot of 8 (fraction 1/8): LRU alternates keys and never hits.
    result = replay(trace, "lru", 0.125, scope="global", calibration_fraction=0.25)
    assert (result.capacity, result.hits, result.misses) == (1, 0, 12)
    # The static hot set of size 1 is layer 1's expert 3: hits on half of the requests.
    result = replay(trace, "static", 0.125, scope="global", calibration_fraction=0.25)
    assert (result.hits, result.misses) == (6, 6)
    # Belady with 2 global slots keeps (1, 3) and one of layer 0's experts.
    result = replay(trace, "belady", 0.25, scope="global", calibration_fraction=0.25)
    assert result.hit_rate >= replay(trace, "lru", 0.25, calibration_fraction=0.25).hit_rate


def test_cache_capacity_rounds_and_clamps():
    assert cache_capacity(0.1, 256, 2) == 26
    assert cache_capacity(0.1, 8, 2) == 2  # one request must fit
    assert cache_capacity(1.0, 8, 2) == 8
    with pytest.raises(ValueError, match="fraction of the experts"):
        cache_capacity(0.0, 8, 2)


@pytest.mark.parametrize(
    "make",
    [
        LRU,
        lambda: LFU(0.9),
        lambda: WeightedLFU(0.9),
        lambda: StaticHotSet.fit([[k] for k in range(40) for _ in range(k % 5)], 10),  # default
    ],
)
def test_batched_victims_are_the_repeated_victims(make):
    """victims(candidates, n) (one partial sort, for a batch of misses) picks what n calls of
    victim would, in order, ties included."""
    rng = random.Random(3)
    policy = make()
    keys = list(range(40))
    for _ in range(200):
        request = rng.sample(keys, 4)
        policy.on_access(request, [rng.random() for _ in request])
    candidates = rng.sample(keys, 30)
    remaining, want = list(candidates), []
    for _ in range(12):
        want.append(policy.victim(remaining))
        remaining.remove(want[-1])
    assert policy.victims(candidates, 12) == want
    assert policy.victims(candidates, 50) == policy.victims(candidates, 30)  # at most all
