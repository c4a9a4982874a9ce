"""Which tokens of which requests the next engine step computes (pure Python, no tensors).

Requests wait in arrival order and run in admission order. Each step has a budget of
`max_num_batched_tokens` positions: every running request first gets what it needs (one
position to decode, or the next chunk of its prompt), then waiting requests are admitted while
the budget, `max_num_seqs` and the free KV pages allow, each with its prompt's longest cached
prefix taken from the page pool and its next chunk of prompt (chunked prefill: running streams
keep decoding while a long prompt is read). When a running request needs a page and none is
free, the newest running request is preempted: its pages are freed and it goes back to the
front of the queue, to be recomputed from its prompt and the tokens it has already produced.

The engine calls `schedule()`, computes the step, then `update(step, sampled)` with the token
sampled for every item whose last position ends its known tokens. Requests finish at an
end-of-sequence token, at `max_tokens`, or when the caller says so (`finish`: a stop string,
a client gone); their pages are freed at once.

With an MTP layer (`mtp_kv`: speculative decoding) a page holds the layer's KV too, whose entry
at position p needs the token at p + 1 and is written by the drafter after the step
(`Request.mtp_written`): full pages enter the prefix cache once that KV covers all their
positions (`commit`, called by the engine after drafting; `on_end` lets it write the KV of a
finishing request before its pages are freed), keyed with the token after them
(kv_pages.next_token_key), so a hit never reads an MTP entry computed for another continuation
or never written.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from moetier.engine.kv_pages import PagePool, next_token_key, page_hashes


class ContextLengthError(ValueError):
    """A request that can never run: longer than the model's context or the KV cache. Its
    numbers: `prompt` tokens, `new` to generate, `limit` (the most the context and the KV
    cache hold), for an API that words the refusal its own way."""

    def __init__(self, message: str, prompt: int = 0, new: int = 0, limit: int = 0) -> None:
        super().__init__(message)
        self.prompt, self.new, self.limit = prompt, new, limit


class State(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ARRIVALS = itertools.count()


@dataclass(eq=False)
class Request:
    """One sequence: its prompt, what it has produced, and its place in the KV cache."""

    id: str
    prompt: list[int]
    max_tokens: int | None = None  # None: up to the context length (resolved by `add`)
    params: Any = None  # sampling parameters: the engine's, opaque here
    eos_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    output: list[int] = field(default_factory=list)
    state: State = State.WAITING
    finish_reason: str | None = None
    computed: int = 0  # leading positions whose KV is in `pages`
    pages: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    preemptions: int = 0
    prefix_cache: bool = True  # False: compute every position (its prompt logprobs need them)
    # every (token, expert) pair of its positions takes the delta plane (the confidence gate's
    # forced rows: a grammar-constrained output, the quality meter's full-delta twin)
    gate_forced: bool = False
    # its KV neither comes from the prefix cache nor enters it (the quality meter's twin, whose
    # KV is computed with the delta everywhere)
    private_kv: bool = False
    # speculative decoding: tokens proposed after the last one (an MTP layer's drafts), computed
    # with it by the next step and kept as far as the model agrees (`update`'s `accepted`)
    drafts: list[int] = field(default_factory=list)
    # with an MTP layer: leading positions whose MTP KV is in `pages` (the drafter's, or a hit's)
    mtp_written: int = 0
    arrival: int = field(default_factory=lambda: next(_ARRIVALS))
    _tokens: list[int] = field(default_factory=list, repr=False)
    _hashes: list[bytes] = field(default_factory=list, repr=False)
    _committed: int = 0  # pages keyed in the prefix cache

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a request needs at least one prompt token")
        self._tokens = [*self.prompt, *self.output]

    @property
    def tokens(self) -> list[int]:
        """Prompt then output: every token whose KV the request needs (read-only)."""
        return self._tokens

    def _append(self, token: int) -> None:
        self.output.append(token)
        self._tokens.append(token)


@dataclass(frozen=True)
class Scheduled:
    """Positions [start, start + count) of `request` computed in this step; `samples`: the last
    of them is the request's last known token, so the step samples its next token."""

    request: Request
    start: int
    count: int
    drafts: int = 0  # the last `drafts` positions hold the request's drafts (speculative)

    @property
    def samples(self) -> bool:
        return self.start + self.count - self.drafts == len(self.request.tokens)

    @property
    def is_prefill(self) -> bool:
        return self.start < len(self.request.prompt) or self.count - self.drafts > 1


@dataclass
class Step:
    items: list[Scheduled]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(item.count for item in self.items)


class Scheduler:
    """Waiting and running queues over a `PagePool`."""

    def __init__(
        self,
        pool: PagePool,
        max_model_len: int,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.pool = pool
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.preemptions = 0
        # an MTP layer's KV in the pages: full pages are cached once it is written (`commit`),
        # keyed with their next token; `on_end` is called for a request that finishes in
        # `update` before its pages are freed (the engine writes its last MTP KV there)
        self.mtp_kv = False
        self.on_end: Callable[[Request], None] | None = None

    # -- requests in and out -----------------------------------------------------------------

    def add(self, request: Request, front: bool = False) -> None:
        """Queue a request (at the queue's front with `front`: a sequence of a request already
        running); ContextLengthError if it can never run, ValueError on a duplicate id.
        `max_tokens` None becomes what the context and the KV cache leave."""
        if request.id in self.requests:
            raise ValueError(f"request id {request.id!r} is already queued or running")
        request.max_tokens = self.check(len(request.prompt), request.max_tokens)
        request.state = State.WAITING
        self.requests[request.id] = request
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    @property
    def context_limit(self) -> int:
        """The most tokens a request's prompt and completion hold: the model's context, or the
        KV cache's pages where they hold fewer (what the server reports as max_model_len)."""
        return min(self.max_model_len, self.pool.num_pages * self.pool.page_size)

    def room(self, prompt: int) -> int:
        """Tokens the context and the KV cache leave after a prompt of `prompt` tokens."""
        return self.context_limit - prompt

    def check(self, prompt: int, max_tokens: int | None) -> int:
        """The tokens a request of `prompt` tokens may generate (max_tokens None: what the
        context and the KV cache leave); ContextLengthError if it can never run."""
        room = self.room(prompt)
        wanted = room if max_tokens is None else max_tokens
        if wanted < 1 or wanted > room:
            capacity = self.pool.num_pages * self.pool.page_size
            new = max(1, wanted)
            raise ContextLengthError(
                _too_long(self.max_model_len, capacity, prompt, new),
                prompt,
                new,
                min(self.max_model_len, capacity),
            )
        return wanted

    def finish(self, request_id: str, reason: str = "abort") -> Request | None:
        """End a request now (a stop string, a client gone): its pages are freed at once.
        None if it is not here (already finished)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.state is State.RUNNING:
            self.running.remove(request)
        elif request.state is State.WAITING:
            self.waiting.remove(request)
        self._end(request, reason)
        return request

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> Step:
        """The next step's items: running requests first (in admission order), then waiting
        ones admitted while the token budget, `max_num_seqs` and free pages allow."""
        budget = self.max_num_batched_tokens
        items: list[Scheduled] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            count = min(len(request.tokens) - request.computed, budget)
            drafts = self._drafts(request, count, budget)
            count += drafts
            while not self._grow(request, request.computed + count):
                victim = self.running.pop()  # the newest; never one already scheduled
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.state is State.RUNNING:
                items.append(Scheduled(request, request.computed, count, drafts))
                budget -= count
                i += 1
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not preempted  # pages are short: let the running ones finish first
        ):
            request = self.waiting[0]
            self._take_cached_prefix(request)
            count = min(len(request.tokens) - request.computed, budget)
            if not self._grow(request, request.computed + count):
                self._release(request)
                break
            self.waiting.popleft()
            request.state = State.RUNNING
            self.running.append(request)
            if request.preemptions == 0:  # the prefix hit, counted once a request is admitted
                request.cached_tokens = request.computed
                self.pool.record_hits(len(request.prompt), request.computed)
            items.append(Scheduled(request, request.computed, count))
            budget -= count
        return Step(items, preempted)

    def _drafts(self, request: Request, count: int, budget: int) -> int:
        """Draft positions a decoding request computes with its last token: its drafts, as
        far as the token budget, the context and max_tokens leave room."""
        if count != 1 or not request.drafts:
            request.drafts = []
            return 0
        room = min(
            budget - 1,
            self.max_model_len - len(request.tokens),
            (request.max_tokens or 0) - len(request.output) - 1,
        )
        del request.drafts[max(0, room) :]
        return len(request.drafts)

    def update(
        self,
        step: Step,
        sampled: Mapping[str, int],
        accepted: Mapping[str, list[int]] | None = None,
    ) -> list[Request]:
        """Record a computed step: positions advance, full pages enter the prefix cache, each
        sampling item's token (`sampled[request.id]`) is appended; returns the requests that
        finished (eos or max_tokens). Items of requests finished meanwhile are skipped; a
        sampling item with no token in `sampled` computes its last position again next step.
        An item with drafts: `accepted[request.id]` the drafts the model agreed with (a prefix of
        them), appended before the sampled token; the positions of the others are computed
        again (their KV is overwritten when they are)."""
        done = []
        for item in step.items:
            request = item.request
            if request.state is not State.RUNNING:
                continue
            token = sampled.get(request.id) if item.samples else None
            waits = item.samples and token is None  # its last position is computed again
            kept = list((accepted or {}).get(request.id, ()))[: item.drafts]
            request.drafts = []
            reason = None
            for new in [*kept, token] if token is not None else []:
                request._append(new)
                if new in request.eos_ids and not request.ignore_eos:
                    reason = "stop"
                elif len(request.output) >= (request.max_tokens or 0):
                    reason = "length"
                if reason is not None:
                    break
            computed = item.start + item.count - item.drafts + len(kept) - int(waits)
            request.computed = min(computed, len(request.tokens))  # (ended at a kept draft)
            self._commit_full_pages(request)
            if reason is not None:
                self.running.remove(request)
                if self.on_end is not None:  # (its last MTP KV: those pages are final now)
                    self.on_end(request)
                    self._commit_full_pages(request)
                self._end(request, reason)
                done.append(request)
        return done

    def commit(self, request: Request) -> None:
        """Key the request's full pages in the prefix cache as far as they are final (with an
        MTP layer: as far as `mtp_written`, which the drafter advances after a step)."""
        if request.state is State.RUNNING:
            self._commit_full_pages(request)

    def reserve(self, request: Request, positions: int) -> bool:
        """Pages for `positions` positions of a running request, where free pages allow (no
        preemption): a speculative step's drafts. -> whether it has them."""
        return request.state is State.RUNNING and self._grow(request, positions)

    def reserve_next(self, step: Step) -> None:
        """Give each item's request the page of its next position now where a page is free
        (no preemption): the runner may launch that step before this one's tokens are seen."""
        for item in step.items:
            following = item.start + item.count + 1  # positions with the next one
            if item.request.state is State.RUNNING and following <= self.max_model_len:
                self._grow(item.request, following)

    # -- pages -------------------------------------------------------------------------------

    def _grow(self, request: Request, positions: int) -> bool:
        need = self.pool.pages_for(positions) - len(request.pages)
        if need <= 0:
            return True
        pages = self.pool.allocate(need)
        if pages is None:
            return False
        request.pages.extend(pages)
        return True

    def _take_cached_prefix(self, request: Request) -> None:
        """On admission: the longest cached run of the request's full pages, leaving at least
        one position to compute (its logits give the next token)."""
        if request.pages or not request.prefix_cache or request.private_kv:
            return
        size = self.pool.page_size
        request._hashes = page_hashes(request.tokens, size, request._hashes)
        usable = (len(request.tokens) - 1) // size
        pages = self.pool.cached_prefix(self._keys(request, 0, usable))
        self.pool.take(pages)
        request.pages = list(pages)
        request.computed = request._committed = request.mtp_written = len(pages) * size

    def _keys(self, request: Request, first: int, end: int) -> list[bytes]:
        """The prefix-cache keys of the request's full pages first..end - 1 (their hashes
        computed): with an MTP layer, each with the token after it."""
        hashes = request._hashes[first:end]
        if not self.mtp_kv:
            return hashes
        size, tokens = self.pool.page_size, request.tokens
        return [next_token_key(h, tokens[(first + i + 1) * size]) for i, h in enumerate(hashes)]

    def _commit_full_pages(self, request: Request) -> None:
        if request.private_kv:
            return
        final = min(request.computed, request.mtp_written) if self.mtp_kv else request.computed
        full = final // self.pool.page_size
        if full <= request._committed // self.pool.page_size:
            return
        size = self.pool.page_size
        request._hashes = page_hashes(request.tokens[: full * size], size, request._hashes)
        first = request._committed // size
        self.pool.commit(request.pages[first:full], self._keys(request, first, full))
        request._committed = full * size

    def _release(self, request: Request) -> None:
        self.pool.free(request.pages)
        request.pages = []
        request.computed = request._committed = request.mtp_written = 0

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.drafts = []
        request.state = State.WAITING
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def _end(self, request: Request, reason: str) -> None:
        self._release(request)
        request.state = State.FINISHED
        request.finish_reason = reason
        del self.requests[request.id]


def _too_long(context: int, capacity: int, prompt: int, new: int) -> str:
    limit = min(context, capacity)
    what = "context length" if context <= capacity else "KV cache"
    return (
        f"this model's {what} holds {limit} tokens, but the request needs {prompt + new} "
        f"({prompt} in the prompt, {new} to generate): shorten the prompt or lower max_tokens"
    )
