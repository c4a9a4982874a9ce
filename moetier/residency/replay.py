"""Replays a routing trace through a replacement policy and measures the expert-cache hit rate.

A trace is the sequence of requests a decode loop makes: for each token, for each MoE layer in
order, the top-k experts and their routing weights. One request = one token in one layer, so
its experts are resident together (as in the slot pool).

Protocol: the first `calibration_fraction` of the tokens is the calibration part. The static
hot set is fitted on its counts; every policy runs over it to warm up, without counting; hit
rates are counted on the rest only, so all policies are scored on the same requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moetier.residency.policies import (
    ONLINE_POLICIES,
    Belady,
    CachePolicy,
    ExpertCache,
    StaticHotSet,
    online_policy,
)

POLICIES = (*ONLINE_POLICIES, "static", "belady-demand", "belady")
SCOPES = ("global", "layer")
ExpertKey = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class Request:
    token: int
    layer: int
    experts: tuple[int, ...]
    weights: tuple[float, ...]


@dataclass(frozen=True)
class Trace:
    name: str
    num_experts: int  # per layer
    layers: tuple[int, ...]  # the MoE layers present in the trace
    requests: tuple[Request, ...]  # token-major, layers in order

    @property
    def num_tokens(self) -> int:
        return len({r.token for r in self.requests})

    @property
    def top_k(self) -> int:
        return max(len(r.experts) for r in self.requests)


@dataclass(frozen=True)
class ReplayResult:
    trace: str
    policy: str
    scope: str
    capacity_fraction: float
    capacity: int  # slots: of the one global cache, or of each layer's cache
    total_experts: int  # the cache's universe: layers x experts (global) or experts (layer)
    calibration_tokens: int
    eval_tokens: int
    hits: int
    misses: int

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0


def cache_capacity(fraction: float, universe: int, top_k: int) -> int:
    """round(fraction x universe), at least top_k (one request must fit), at most universe."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"a cache size is a fraction of the experts in (0, 1], got {fraction}")
    return min(universe, max(top_k, round(fraction * universe)))


def make_policy(
    name: str,
    requests: Sequence[Sequence[ExpertKey]],
    calibration_requests: int,
    capacity: int,
    decay: float,
) -> CachePolicy[ExpertKey]:
    """The policy called `name` for a cache that will see `requests` (keys only)."""
    if name in ONLINE_POLICIES:
        return online_policy(name, decay)
    if name == "static":
        return StaticHotSet.fit(requests[:calibration_requests], capacity)
    if name == "belady-demand":
        return Belady(requests, bypass=False)
    if name == "belady":
        return Belady(requests, bypass=True)
    raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")


def replay(
    trace: Trace,
    policy: str,
    capacity_fraction: float,
    scope: str = "global",
    calibration_fraction: float = 0.25,
    half_life_tokens: float = 128.0,
) -> ReplayResult:
    """Hit rate of `policy` on `trace` with a cache of `capacity_fraction` of the experts.

    scope "global": one cache of (layer, expert) keys shared by all layers, sized as a fraction
    of layers x experts (what one slot pool does). scope "layer": one cache per layer, each
    sized as a fraction of the experts of a layer. The frequency policies decay their scores
    with a half-life of `half_life_tokens` tokens."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}: choose one of {', '.join(SCOPES)}")
    tokens = sorted({r.token for r in trace.requests})
    n_calib = int(len(tokens) * calibration_fraction)
    first_eval_token = tokens[n_calib] if n_calib < len(tokens) else float("inf")
    streams: dict[int, list[Request]] = {}
    for r in trace.requests:
        streams.setdefault(-1 if scope == "global" else r.layer, []).append(r)
    universe = trace.num_experts * (len(trace.layers) if scope == "global" else 1)
    capacity = cache_capacity(capacity_fraction, universe, trace.top_k)
    requests_per_token = len(trace.layers) if scope == "global" else 1
    decay = 0.5 ** (1.0 / (half_life_tokens * requests_per_token))
    hits = misses = 0
    for stream in streams.values():
        keys = [[(r.layer, e) for e in r.experts] for r in stream]
        n_calib_requests = sum(1 for r in stream if r.token < first_eval_token)
        cache = ExpertCache(capacity, make_policy(policy, keys, n_calib_requests, capacity, decay))
        for i, (r, request_keys) in enumerate(zip(stream, keys, strict=True)):
            cache.access(request_keys, r.weights, count=i >= n_calib_requests)
        hits += cache.stats.hits
        misses += cache.stats.misses
    return ReplayResult(
        trace=trace.name,
        policy=policy
        if policy not in ("lfu", "wlfu")
        else f"{policy}(half-life={half_life_tokens:g} tok)",
        scope=scope,
        capacity_fraction=capacity_fraction,
        capacity=capacity,
        total_experts=universe,
        calibration_tokens=n_calib,
        eval_tokens=len(tokens) - n_calib,
        hits=hits,
        misses=misses,
    )
