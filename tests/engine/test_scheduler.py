"""The scheduler and page pool against a simulated paged KV cache.

`PagedToyModel` keeps, per page, the token each position was computed from, writes a step's
positions through the request's page table, and derives the next token from what it reads back
through the page table (every position up to the last). A page handed to two requests with
different contents, a cached prefix that is not the request's own tokens, or a position computed
twice into the wrong place changes the tokens read back, so the outputs differ from the reference:
each request decoded alone from its prompt by the same rule with no pages at all.
"""

from __future__ import annotations

import random

import pytest

from moetier.engine.kv_pages import PagePool, page_hashes
from moetier.engine.scheduler import ContextLengthError, Request, Scheduler, State

VOCAB = 50
EOS = 0


def next_token(history: list[int]) -> int:
    """The reference rule: a function of every token so far (order matters)."""
    h = 7
    for t in history:
        h = (h * 31 + t + 1) % 1_000_003
    return 1 + h % (VOCAB - 1)  # never EOS unless a test forces it


def alone(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(prompt + out))
    return out


class PagedToyModel:
    def __init__(self, pool: PagePool) -> None:
        self.size = pool.page_size
        self.kv: list[list[int | None]] = [[None] * pool.page_size for _ in range(pool.num_pages)]
        self.computed_positions = 0

    def run(self, step, scheduler: Scheduler) -> dict[str, int]:
        sampled = {}
        for item in step.items:
            r = item.request
            if r.state is not State.RUNNING:
                continue  # finished between schedule and run (a cancel)
            for pos in range(item.start, item.start + item.count):
                page = r.pages[pos // self.size]
                assert scheduler.pool.refs(page) == 1  # never written while shared
                self.kv[page][pos % self.size] = r.tokens[pos]
            self.computed_positions += item.count
            if item.samples:
                end = item.start + item.count
                seen = [self.kv[r.pages[p // self.size]][p % self.size] for p in range(end)]
                sampled[r.id] = next_token(seen)  # type: ignore[arg-type]
        return sampled


def drive(
    scheduler: Scheduler,
    model: PagedToyModel,
    arrivals: dict[int, list[Request]],
    max_steps: int = 10_000,
    on_step=None,
) -> list[Request]:
    done: list[Request] = []
    for t in range(max_steps):
        for r in arrivals.get(t, []):
            scheduler.add(r)
        if not scheduler.has_work and t > max(arrivals, default=0):
            return done
        step = scheduler.schedule()
        assert step.num_tokens <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        assert all(not r.pages for r in scheduler.waiting)  # only running requests hold pages
        held = {p for r in scheduler.running for p in r.pages}
        assert scheduler.pool.used_pages == len(held)
        if on_step:
            on_step(t, step)
        done += scheduler.update(step, model.run(step, scheduler))
    raise AssertionError("did not finish")


def make(num_pages=64, page_size=4, max_len=512, seqs=8, tokens=32):
    pool = PagePool(num_pages, page_size)
    return Scheduler(pool, max_len, seqs, tokens), PagedToyModel(pool)


def test_batched_equals_alone_with_staggered_arrivals_and_chunked_prefill():
    rng = random.Random(0)
    scheduler, model = make(num_pages=128, tokens=16, seqs=4)
    arrivals: dict[int, list[Request]] = {}
    expected = {}
    for i in range(12):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 40))]
        n = rng.randrange(1, 20)
        arrivals.setdefault(rng.randrange(0, 30), []).append(Request(f"r{i}", prompt, n))
        expected[f"r{i}"] = alone(prompt, n)
    chunked = []
    done = drive(
        scheduler,
        model,
        arrivals,
        on_step=lambda t, s: chunked.extend(i for i in s.items if i.is_prefill and not i.samples),
    )
    assert {r.id: r.output for r in done} == expected
    assert all(r.finish_reason == "length" for r in done)
    assert chunked, "a prompt longer than the budget is read in chunks"
    assert scheduler.pool.used_pages == 0


def test_decodes_keep_running_while_a_long_prompt_is_read():
    scheduler, model = make(num_pages=64, tokens=8, seqs=4)
    short = Request("short", [1, 2, 3], 30)
    long = Request("long", list(range(1, 49)), 2)
    steps = []
    done = drive(
        scheduler,
        model,
        {0: [short], 2: [long]},
        on_step=lambda t, s: steps.append({i.request.id: i.count for i in s.items}),
    )
    reading = [s for s in steps if s.get("long", 0) > 1]
    assert len(reading) >= 6  # 48 prompt tokens in chunks of at most 8 - 1
    assert all(s.get("short") == 1 for s in reading)  # the stream decodes in each of them
    assert {r.id: r.output for r in done} == {
        "short": alone([1, 2, 3], 30),
        "long": alone(list(range(1, 49)), 2),
    }


def test_preemption_by_recompute_under_a_tiny_kv_budget():
    rng = random.Random(1)
    scheduler, model = make(num_pages=12, page_size=4, tokens=64, seqs=8)
    reqs, expected = [], {}
    for i in range(6):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 12))]
        n = rng.randrange(8, 20)
        reqs.append(Request(f"r{i}", prompt, n))
        expected[f"r{i}"] = alone(prompt, n)
    preempted = []
    done = drive(scheduler, model, {0: reqs}, on_step=lambda t, s: preempted.extend(s.preempted))
    assert preempted, "the budget forces preemption"
    assert {r.id: r.output for r in done} == expected
    assert scheduler.pool.used_pages == 0 and scheduler.preemptions == len(preempted)


def test_the_newest_running_request_is_preempted_first():
    pool = PagePool(6, 2)
    scheduler = Scheduler(pool, 64, 8, 64)
    model = PagedToyModel(pool)
    old, new = Request("old", [1, 2, 3], 6), Request("new", [4, 5, 6], 6)
    scheduler.add(old)
    scheduler.update(s := scheduler.schedule(), model.run(s, scheduler))
    scheduler.add(new)
    victims = []
    while scheduler.has_work:
        step = scheduler.schedule()
        victims += [r.id for r in step.preempted]
        scheduler.update(step, model.run(step, scheduler))
    assert victims and set(victims) == {"new"}
    assert old.output == alone([1, 2, 3], 6) and new.output == alone([4, 5, 6], 6)


def test_cancel_mid_stream_frees_pages_at_once():
    scheduler, model = make(num_pages=32, page_size=4)
    a, b = Request("a", [1, 2, 3, 4, 5], 50), Request("b", [6, 7], 5)
    scheduler.add(a)
    scheduler.add(b)
    for _ in range(3):
        scheduler.update(s := scheduler.schedule(), model.run(s, scheduler))
    held = list(a.pages)
    assert held and scheduler.finish("a", "abort") is a
    assert a.state is State.FINISHED and a.finish_reason == "abort" and a.pages == []
    assert scheduler.pool.used_pages == len(b.pages)
    assert all(scheduler.pool.refs(p) == 0 for p in held)
    assert scheduler.finish("a") is None  # twice is harmless
    # a step scheduled before the cancel skips it
    step = scheduler.schedule()
    scheduler.finish("b", "stop")
    assert scheduler.update(step, model.run(step, scheduler)) == []
    assert not scheduler.has_work and scheduler.pool.used_pages == 0


def test_cancel_while_waiting():
    scheduler, _ = make(seqs=1)
    scheduler.add(Request("a", [1, 2], 5))
    scheduler.add(Request("b", [1, 2], 5))
    scheduler.schedule()
    assert scheduler.finish("b").state is State.FINISHED
    assert [r.id for r in scheduler.waiting] == []


def test_prefix_reuse_computes_only_the_new_tokens():
    scheduler, model = make(num_pages=64, page_size=4, tokens=256)
    turn1 = list(range(1, 23))  # 22 tokens: 5 full pages
    (r1,) = drive(scheduler, model, {0: [Request("t1", turn1, 6)]})
    assert r1.cached_tokens == 0
    before = model.computed_positions
    turn2 = turn1 + r1.output + [9, 8, 7, 6, 5]
    (r2,) = drive(scheduler, model, {0: [Request("t2", turn2, 4)]})
    # turn 1's prompt and output were computed except its last sampled token: 27 positions,
    # 6 full pages; turn 2 recomputes only from the first position past them
    assert r2.cached_tokens == 24
    assert model.computed_positions - before == len(turn2) - 24 + 3
    assert r2.output == alone(turn2, 4)
    stats = scheduler.pool.stats
    assert stats.hit_tokens == 24 and stats.queried_tokens == len(turn1) + len(turn2)


def test_a_fully_cached_prompt_still_computes_its_last_position():
    scheduler, model = make(page_size=4)
    prompt = list(range(1, 9))  # two full pages
    drive(scheduler, model, {0: [Request("a", prompt, 3)]})
    (b,) = drive(scheduler, model, {0: [Request("b", prompt, 3)]})
    assert b.cached_tokens == 4 and b.output == alone(prompt, 3)


def test_shared_prefix_pages_are_shared_and_not_freed_under_a_reader():
    scheduler, model = make(num_pages=64, page_size=4, tokens=8)
    common = list(range(1, 17))
    drive(scheduler, model, {0: [Request("warm", common + [20], 1)]})
    a, b = Request("a", common + [30, 31], 10), Request("b", common + [40], 10)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.update(s := scheduler.schedule(), model.run(s, scheduler))
    shared = a.pages[:4]
    assert b.pages[:4] == shared and all(scheduler.pool.refs(p) == 2 for p in shared)
    scheduler.finish("a")
    assert all(scheduler.pool.refs(p) == 1 for p in shared)
    while scheduler.has_work:
        scheduler.update(s := scheduler.schedule(), model.run(s, scheduler))
    assert b.output == alone(common + [40], 10)


def test_lru_eviction_of_unreferenced_cached_pages():
    pool = PagePool(4, 2)
    first = pool.allocate(2)
    h = page_hashes([1, 2, 3, 4], 2)
    pool.commit(first, h)
    pool.free(first)  # freed last to first: the second page is evicted before the first
    assert pool.cached_prefix(h) == first
    fresh = pool.allocate(3)  # two never-used pages, then first[1]
    assert fresh[-1] == first[1] and pool.cached_prefix(h) == first[:1]
    assert pool.stats.evicted_pages == 1
    with pytest.raises(ValueError):
        pool.free([fresh[0], fresh[0]])


def test_page_hashes_chain_the_whole_prefix():
    a = page_hashes([1, 2, 3, 4, 5], 2)
    assert len(a) == 2
    assert page_hashes([9, 2, 3, 4], 2)[1] != a[1]  # same page tokens, other prefix
    assert page_hashes([1, 2, 3, 4, 5, 6], 2, a)[:2] == a


def test_eos_stops_unless_ignored():
    scheduler, model = make()
    prompt = [3, 4]
    want = alone(prompt, 3)
    r = Request("a", prompt, 10, eos_ids=frozenset({want[2]}))
    (done,) = drive(scheduler, model, {0: [r]})
    assert done.output == want and done.finish_reason == "stop"
    r2 = Request("b", prompt, 3, eos_ids=frozenset({want[0]}), ignore_eos=True)
    (done2,) = drive(scheduler, model, {0: [r2]})
    assert done2.output == want and done2.finish_reason == "length"


def test_context_length_is_checked_at_admission():
    scheduler, _ = make(num_pages=64, page_size=4, max_len=32)
    with pytest.raises(
        ContextLengthError, match="context length holds 32 tokens.*30 in the prompt"
    ):
        scheduler.add(Request("a", [1] * 30, 5))
    with pytest.raises(ContextLengthError):
        scheduler.add(Request("b", [1] * 32))
    r = Request("c", [1] * 20)
    scheduler.add(r)
    assert r.max_tokens == 12
    small, _ = make(num_pages=2, page_size=4, max_len=512)
    with pytest.raises(ContextLengthError, match="KV cache"):
        small.add(Request("d", [1] * 6, 5))
    with pytest.raises(ValueError, match="already"):
        scheduler.add(Request("c", [1], 1))
    with pytest.raises(ValueError):
        Request("e", [])


def test_prefix_hits_are_counted_once_per_admission():
    """A waiting request whose pages are short is retried every step; its prefix lookup counts
    once, when it is admitted."""
    scheduler, model = make(num_pages=6, page_size=4, tokens=64, seqs=8)
    common = list(range(1, 9))
    drive(scheduler, model, {0: [Request("warm", common + [30], 1)]})
    before = scheduler.pool.stats.queried_tokens
    hog = Request("hog", [40] * 15, 8)  # 6 of the 6 pages by its end
    late = Request("late", common + [50, 51], 2)
    drive(scheduler, model, {0: [hog], 1: [late]})
    assert late.output == alone(common + [50, 51], 2)
    assert scheduler.pool.stats.queried_tokens - before == len(hog.prompt) + len(late.prompt)
