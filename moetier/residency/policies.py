"""Expert-cache replacement policies: pure Python over hashable keys, no tensors.

A key is whatever the cache stores, e.g. (layer, expert, plane). The cache (`ExpertCache` in
trace replay, `SlotPool` in the engine, where one access is a layer's experts for a whole batch)
asks the policy three things:

    victim(candidates)    on a miss with the cache full: which resident key would make room
                          (candidates never include keys of the request being served);
                          victims(candidates, n) the same for a batch of misses
    admit(key, victim)    on a miss: take a slot for `key`, evicting `victim` (None: a slot is
                          free)? False serves the miss without caching it, e.g. by a zero-copy
                          read of the host-pinned blob
    on_access(keys, w)    after each request: the keys one token needs in one layer, with their
                          routing weights; called for hits and misses alike

and tells it `on_evict(key)`. Policies keep their own statistics; they never see slot numbers.
"""

from __future__ import annotations

import bisect
import heapq
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class CachePolicy(ABC, Generic[K]):
    """The interface every replacement policy implements (see the module docstring)."""

    name: str = "policy"
    weighted: bool = False  # whether on_access uses the routing weights (else pass None)

    @abstractmethod
    def on_access(self, keys: Sequence[K], weights: Sequence[float] | None = None) -> None:
        """Record one request: `keys` needed together, `weights` their routing weights."""

    @abstractmethod
    def victim(self, candidates: Sequence[K]) -> K:
        """The key to evict among `candidates` (resident, not part of the current request)."""

    def victims(self, candidates: Sequence[K], n: int) -> list[K]:
        """The keys `victim` would pick one after another among `candidates`, each gone before
        the next pick: at most `n` (a batch of misses). Policies whose `victim` is a minimum
        over a per-key order override it with one partial sort (O(C log n), not O(C n))."""
        remaining, out = list(candidates), []
        for _ in range(min(n, len(remaining))):
            out.append(self.victim(remaining))
            remaining.remove(out[-1])
        return out

    def admit(self, key: K, victim: K | None) -> bool:
        """Whether a missed `key` takes a slot, evicting `victim` when that is not None
        (default: always, i.e. demand caching)."""
        return True

    def on_evict(self, key: K) -> None:
        """`key` left the cache."""

    def preload(self) -> list[K]:
        """Keys to make resident before the first request (static placements)."""
        return []


class LRU(CachePolicy[K]):
    """Least recently used: evict the candidate whose last access is oldest."""

    name = "lru"

    def __init__(self) -> None:
        self._clock = 0
        self._last: dict[K, int] = {}

    def on_access(self, keys: Sequence[K], weights: Sequence[float] | None = None) -> None:
        self._clock += 1
        for key in keys:
            self._last[key] = self._clock

    def victim(self, candidates: Sequence[K]) -> K:
        return min(candidates, key=lambda k: self._last.get(k, 0))

    def victims(self, candidates: Sequence[K], n: int) -> list[K]:
        # nsmallest is a stable sort's first n: the same keys, in the order of repeated `victim`
        return heapq.nsmallest(n, candidates, key=lambda k: self._last.get(k, 0))


class DecayedFrequency(CachePolicy[K]):
    """Frequency with exponential decay: after each request every score is multiplied by
    `decay`, then each accessed key gains its increment (1, or its routing weight when
    `weighted`). Evicts the lowest score; ties go to the least recently used.

    Scores are kept for every key ever seen, resident or not, so an expert that comes back keeps
    its history. The decay is applied lazily: increments are scaled by decay**-t and stored
    scores renormalised when that factor grows large, so a request costs O(len(keys)).
    """

    def __init__(self, decay: float = 0.999, weighted: bool = False) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.weighted = weighted
        self.name = f"{'wlfu' if weighted else 'lfu'}(decay={decay:g})"
        self._scale = 1.0  # value of one fresh unit of score, relative to stored scores
        self._score: dict[K, float] = {}
        self._clock = 0
        self._last: dict[K, int] = {}

    def on_access(self, keys: Sequence[K], weights: Sequence[float] | None = None) -> None:
        if self.weighted and weights is None:
            raise ValueError("the routing-weight-aware policy needs the routing weights")
        self._clock += 1
        self._scale /= self.decay
        if self._scale > 1e100:  # renormalise before the floats overflow
            self._score = {k: v / self._scale for k, v in self._score.items()}
            self._scale = 1.0
        for i, key in enumerate(keys):
            increment = float(weights[i]) if self.weighted and weights is not None else 1.0
            self._score[key] = self._score.get(key, 0.0) + increment * self._scale
            self._last[key] = self._clock

    def score(self, key: K) -> float:
        """The key's decayed score in units of one access made by the latest request."""
        return self._score.get(key, 0.0) / self._scale

    def victim(self, candidates: Sequence[K]) -> K:
        return min(candidates, key=lambda k: (self._score.get(k, 0.0), self._last.get(k, 0)))

    def victims(self, candidates: Sequence[K], n: int) -> list[K]:
        return heapq.nsmallest(
            n, candidates, key=lambda k: (self._score.get(k, 0.0), self._last.get(k, 0))
        )


class LFU(DecayedFrequency[K]):
    """Least frequently used with exponential decay (count 1 per access)."""

    def __init__(self, decay: float = 0.999) -> None:
        super().__init__(decay, weighted=False)


class WeightedLFU(DecayedFrequency[K]):
    """Routing-weight-aware frequency: each access counts its routing weight, so an expert
    chosen with weight 0.9 counts nine times one chosen with 0.1."""

    def __init__(self, decay: float = 0.999) -> None:
        super().__init__(decay, weighted=True)


class StaticHotSet(CachePolicy[K]):
    """A fixed set of the `capacity` most used keys of a calibration run, resident from the
    start and never evicted; other keys are never cached (their misses are served from the
    host tier). Ties in the counts go to the smaller key, so the set is deterministic."""

    name = "static"

    def __init__(self, counts: Mapping[K, float], capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        self.hot: list[K] = [k for k, _ in ranked[:capacity]]
        self._rank = {k: i for i, k in enumerate(self.hot)}

    @classmethod
    def fit(cls, requests: Iterable[Sequence[K]], capacity: int) -> StaticHotSet[K]:
        """Count how often each key is requested in `requests` (the calibration part)."""
        counts: dict[K, int] = {}
        for keys in requests:
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
        return cls(counts, capacity)

    def on_access(self, keys: Sequence[K], weights: Sequence[float] | None = None) -> None:
        pass

    def admit(self, key: K, victim: K | None) -> bool:
        return key in self._rank

    def victim(self, candidates: Sequence[K]) -> K:
        # Evicts only when the hot set is larger than the cache: the coldest goes.
        return max(candidates, key=lambda k: self._rank.get(k, -1))

    def preload(self) -> list[K]:
        return list(self.hot)


class Belady(CachePolicy[K]):
    """Belady's MIN: evict the candidate whose next use is furthest in the future. Needs the
    whole request sequence up front. With `bypass`, a missed key whose next use is later than
    the victim's is not cached at all: the offline optimum when misses may bypass the cache (as
    the static hot set's do; exact for one key per request), never below plain MIN, the optimum
    of demand caching (`bypass=False`)."""

    def __init__(self, requests: Sequence[Sequence[K]], bypass: bool = True) -> None:
        self.bypass = bypass
        self.name = "belady" if bypass else "belady-demand"
        self._uses: dict[K, list[int]] = {}
        for t, keys in enumerate(requests):
            for key in keys:
                uses = self._uses.setdefault(key, [])
                if not uses or uses[-1] != t:
                    uses.append(t)
        self._now = -1  # index of the request being served

    def on_access(self, keys: Sequence[K], weights: Sequence[float] | None = None) -> None:
        self._now += 1

    def next_use(self, key: K) -> float:
        """Index of the first request after the current one that needs `key` (inf: never).
        Valid while serving request `_now + 1` (victim runs before on_access)."""
        uses = self._uses.get(key, [])
        i = bisect.bisect_right(uses, self._now + 1)
        return uses[i] if i < len(uses) else float("inf")

    def victim(self, candidates: Sequence[K]) -> K:
        return max(candidates, key=self.next_use)

    def admit(self, key: K, victim: K | None) -> bool:
        if not self.bypass or victim is None:
            return True
        return self.next_use(key) < self.next_use(victim)


@dataclass
class CacheStats:
    requests: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ExpertCache(Generic[K]):
    """A cache of `capacity` keys driven by a policy: what the slot pool does, without bytes.

    Keys of one request are never evicted for each other (as in the slot pool), so a request
    needs at most `capacity` keys."""

    def __init__(self, capacity: int, policy: CachePolicy[K]) -> None:
        if capacity < 1:
            raise ValueError(f"the cache needs at least one slot, got capacity {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.resident: set[K] = set()
        self.stats = CacheStats()
        for key in policy.preload()[:capacity]:
            self.resident.add(key)

    def access(
        self, keys: Sequence[K], weights: Sequence[float] | None = None, count: bool = True
    ) -> int:
        """Serve one request; returns its number of hits. `count=False` warms the cache
        without touching the statistics."""
        if len(set(keys)) > self.capacity:
            raise ValueError(f"{len(keys)} keys asked for at once, the cache holds {self.capacity}")
        protected = set(keys)
        hits = 0
        for key in keys:
            if key in self.resident:
                hits += 1
                continue
            victim = None
            if len(self.resident) >= self.capacity:
                victim = self.policy.victim([k for k in self.resident if k not in protected])
            if not self.policy.admit(key, victim):
                continue
            if victim is not None:
                self.resident.discard(victim)
                self.policy.on_evict(victim)
                if count:
                    self.stats.evictions += 1
            self.resident.add(key)
        self.policy.on_access(keys, weights)
        if count:
            self.stats.requests += 1
            self.stats.hits += hits
            self.stats.misses += len(keys) - hits
        return hits


ONLINE_POLICIES = ("lru", "lfu", "wlfu")


def online_policy(name: str, decay: float = 0.999) -> CachePolicy[Any]:
    """A policy that needs neither calibration counts nor the future: lru, lfu (decayed
    frequency) or wlfu (decayed routing-weight sum); `decay` per access for the last two."""
    if name == "lru":
        return LRU()
    if name in ("lfu", "wlfu"):
        return DecayedFrequency(decay, weighted=name == "wlfu")
    raise ValueError(f"unknown cache policy {name!r}: choose one of {', '.join(ONLINE_POLICIES)}")
