"""The serving engine (scheduler + paged runner) against each request generated alone by the
Generator over the static cache (float32, tiny native models of both attention kinds): staggered
arrivals, mixed prompt and output lengths, chunked prefill, preemption forced by a tiny KV
budget, cancellation mid-stream, prefix reuse, seeded sampling independent of the batch."""

from __future__ import annotations

import random

import pytest
import torch

from moetier.config import EngineConfig
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.generate import Generator
from moetier.engine.sampler import SamplingParams
from moetier.engine.scheduler import ContextLengthError
from moetier.loader.load import load_model
from moetier.models.layers import MLA_DECODE_KERNEL

FP32 = EngineConfig(device="cpu", dtype="float32", native=True)
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "glm_moe_dsa"])
def native(request, tiny):
    return load_model(tiny.store(request.param), FP32)


def alone(loaded, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    done = Generator(loaded).generate(prompt, params)
    return done.token_ids, done.finish_reason


def run(engine: Engine, arrivals: dict[int, list[tuple]], on_step=None) -> dict[str, list]:
    """arrivals: step -> [(id, prompt, params)]; -> id -> [tokens, text, finish, last output]."""
    got: dict[str, list] = {}
    for t in range(10_000):
        for rid, prompt, params in arrivals.get(t, []):
            engine.add(rid, prompt, params)
            got[rid] = [[], "", None, None]
        if not engine.has_work and t > max(arrivals):
            return got
        for out in engine.step():
            entry = got[out.request_id]
            entry[0] += out.token_ids
            entry[1] += out.text
            entry[2], entry[3] = out.finish_reason, out
        if on_step:
            on_step(t)
    raise AssertionError("did not finish")


def random_requests(vocab: int, count: int, seed: int, max_prompt: int = 30, max_new: int = 12):
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, max_prompt))]
        params = SamplingParams(temperature=0, max_new_tokens=rng.randrange(1, max_new))
        requests.append((f"r{i}", prompt, params, rng.randrange(0, 12)))
    return requests


def check_against_alone(loaded, engine, requests):
    arrivals: dict[int, list[tuple]] = {}
    for rid, prompt, params, at in requests:
        arrivals.setdefault(at, []).append((rid, prompt, params))
    got = run(engine, arrivals)
    for rid, prompt, params, _ in requests:
        tokens, finish = alone(loaded, prompt, params)
        assert got[rid][0] == tokens, rid
        assert got[rid][2] == finish, rid
    assert engine.pool.used_pages == 0 and not engine.has_work
    return got


def test_batched_greedy_equals_alone_with_chunked_prefill(native):
    engine = Engine(native, EngineLimits(num_pages=64, page_size=4, max_num_batched_tokens=8))
    requests = random_requests(native.model_config.vocab_size, 8, seed=1)
    got = check_against_alone(native, engine, requests)
    for rid, prompt, _, _ in requests:
        last = got[rid][3]
        eos = 1 if got[rid][2] == "stop" else 0  # generated, never text (no stop strings here)
        assert last.prompt_tokens == len(prompt)
        assert last.completion_tokens == len(got[rid][0]) + eos


def test_preemption_under_a_tiny_kv_budget(native):
    engine = Engine(native, EngineLimits(num_pages=12, page_size=4, max_num_batched_tokens=64))
    requests = random_requests(native.model_config.vocab_size, 6, seed=2, max_prompt=14)
    requests = [(rid, p, SamplingParams(temperature=0, max_new_tokens=16), 0)
                for rid, p, _, _ in requests]  # fmt: skip
    check_against_alone(native, engine, requests)
    assert engine.scheduler.preemptions > 0


def test_cancel_mid_stream_frees_its_pages(native):
    engine = Engine(native, EngineLimits(num_pages=32, page_size=4))
    short = SamplingParams(temperature=0, max_new_tokens=6)
    engine.add("a", list(range(3, 20)), SamplingParams(temperature=0, max_new_tokens=40))
    engine.add("b", list(range(5, 9)), short)
    b_tokens = []
    for _ in range(3):
        b_tokens += [t for out in engine.step() if out.request_id == "b" for t in out.token_ids]
    held = engine.pool.used_pages
    out = engine.abort("a")
    assert out is not None and out.finish_reason == "abort"
    assert engine.pool.used_pages < held and engine.abort("a") is None
    while engine.has_work:
        b_tokens += [t for out in engine.step() for t in out.token_ids]
    assert b_tokens == alone(native, list(range(5, 9)), short)[0]
    assert engine.pool.used_pages == 0 and engine.streams == {}


def test_prefix_reuse_computes_only_the_new_tokens(native):
    engine = Engine(native, EngineLimits(num_pages=64, page_size=4))
    turn1 = list(range(3, 26))  # 23 tokens
    first = run(engine, {0: [("t1", turn1, SamplingParams(temperature=0, max_new_tokens=5))]})
    before = engine.runner.positions_run
    turn2 = turn1 + first["t1"][0] + [7, 8, 9]
    params = SamplingParams(temperature=0, max_new_tokens=4)
    second = run(engine, {0: [("t2", turn2, params)]})
    cached = second["t2"][3].cached_tokens
    assert cached == 24  # turn 1's 27 computed positions: 6 full pages of 4
    computed = engine.runner.positions_run - before
    assert computed == len(turn2) - cached + len(second["t2"][0]) - 1
    assert second["t2"][0] == alone(native, turn2, params)[0]
    assert engine.pool.stats.hit_tokens == cached


def test_seeded_sampling_does_not_depend_on_the_batch(native):
    vocab = native.model_config.vocab_size
    prompt = list(range(3, 12))
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=123)
    lone = run(
        Engine(native, EngineLimits(num_pages=64, page_size=4)), {0: [("s", prompt, params)]}
    )
    crowd = Engine(native, EngineLimits(num_pages=64, page_size=4, max_num_batched_tokens=8))
    others = [(f"o{i}", [5 + i] * (3 + i), SamplingParams(temperature=1.0, max_new_tokens=8))
              for i in range(4)]  # fmt: skip
    shared = run(crowd, {0: others[:2], 1: [("s", prompt, params)], 2: others[2:]})
    assert shared["s"][0] == lone["s"][0]
    assert len(set(lone["s"][0])) > 1 and all(0 <= t < vocab for t in lone["s"][0])


def test_stop_strings_and_text_match_the_generator(native):
    prompt = list(range(3, 10))
    full = Generator(native).generate(prompt, SamplingParams(temperature=0, max_new_tokens=12))
    assert len(full.text) >= 4, "the fixed tiny model's answer has text to cut"
    stop = full.text[2:4]
    params = SamplingParams(temperature=0, max_new_tokens=12, stop=(stop,))
    want = Generator(native).generate(prompt, params)
    engine = Engine(native, EngineLimits(num_pages=32, page_size=4))
    got = run(engine, {0: [("a", prompt, params)]})["a"]
    assert got[1] == want.text and got[2] == "stop" == want.finish_reason
    assert engine.pool.used_pages == 0


def test_context_length_is_refused_with_a_clear_error(native):
    engine = Engine(native, EngineLimits(num_pages=8, page_size=4))  # 32 positions
    with pytest.raises(ContextLengthError, match="KV cache"):
        engine.add("x", list(range(3, 30)), SamplingParams(temperature=0), max_tokens=10)
    with pytest.raises(ValueError, match="empty"):
        engine.add("y", [], GREEDY)
    vocab = native.model_config.vocab_size  # (an embedding lookup past it: a CUDA assert)
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is not in this model's vocab"):
            engine.add("z", [3, bad, 4], GREEDY)
    assert not engine.has_work and torch.is_tensor(engine.runner.cache)


def test_bad_sampling_settings_are_refused_and_a_failed_row_ends_alone(native):
    """A seed, temperature or logit_bias sampling cannot take is a ValueError at add; a row
    whose sampling still fails (its grammar matcher raises) ends its request with "error" and
    leaves the others as they would be alone."""
    engine = Engine(native, EngineLimits(num_pages=32, page_size=4))
    with pytest.raises(ValueError, match="seed"):
        engine.add("s", [3, 4], SamplingParams(seed=2**64))
    with pytest.raises(ValueError, match="temperature"):
        engine.add("t", [3, 4], SamplingParams(temperature=1e-40))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add("b", [3, 4], SamplingParams(logit_bias=((10**6, 1.0),)))

    class Broken:
        def matcher(self, kind, spec):
            return self

        def fill_next_token_bitmask(self, bitmask, index):
            raise RuntimeError("matcher state lost")

    engine.grammars = Broken()
    good = SamplingParams(temperature=0, max_new_tokens=6)
    bad = SamplingParams(temperature=0, grammar=("regex", "a+"))
    got = run(engine, {0: [("bad", [3, 4, 5], bad), ("good", [6, 7], good)]})
    assert got["bad"][2] == "error" and got["bad"][0] == []
    assert got["good"][0] == alone(native, [6, 7], good)[0]
    assert engine.pool.used_pages == 0 and engine.streams == {} and engine.requests == {}


def test_default_max_tokens_fits_the_kv_cache(native):
    """No max_tokens from the client: the default is capped by what the context and the KV
    cache leave, not refused."""
    engine = Engine(native, EngineLimits(num_pages=8, page_size=4))  # 32 positions
    request = engine.add("a", list(range(3, 23)), SamplingParams(max_new_tokens=256))
    assert request.max_tokens == 12


def test_a_stop_string_on_the_last_token_is_a_stop(native):
    # the first prompt whose 6-token answer is whole text (no partial UTF-8 to hold back)
    generator, greedy = Generator(native), SamplingParams(temperature=0, max_new_tokens=6)
    for start in range(3, 60):
        prompt = list(range(start, start + 7))
        full = generator.generate(prompt, greedy)
        if len(full.token_ids) == 6 and len(full.text) >= 2 and "\ufffd" not in full.text:
            break
    else:
        raise AssertionError("no prompt of the fixed tiny model gives a whole-text answer")
    text = full.text
    # the shortest end of the text seen nowhere before: it completes with the last token
    k = next(k for k in range(1, len(text) + 1) if text.find(text[-k:]) == len(text) - k)
    params = SamplingParams(temperature=0, max_new_tokens=6, stop=(text[-k:],))
    want = Generator(native).generate(prompt, params)
    got = run(Engine(native, EngineLimits(num_pages=32, page_size=4)), {0: [("a", prompt, params)]})
    assert got["a"][1] == want.text == text[:-k]
    assert got["a"][2] == "stop" == want.finish_reason
    assert got["a"][3].completion_tokens == 6  # it stopped on the last allowed token


def test_the_transformers_path_serves_concurrent_requests(tiny):
    """Without a native model file the engine runs the transformers class, each request its own
    DynamicCache (no prefix cache): the same tokens as each request alone, chunked prefill and
    preemption included."""
    loaded = load_model(
        tiny.store("qwen3_moe"), EngineConfig(native=False, device="cpu", dtype="float32")
    )
    engine = Engine(loaded, EngineLimits(num_pages=7, page_size=4, max_num_batched_tokens=8))
    assert type(engine.runner).__name__ == "TransformersRunner" and not engine.pool.prefix_caching
    requests = random_requests(loaded.model_config.vocab_size, 6, seed=4, max_prompt=14)
    requests = [(rid, p, SamplingParams(temperature=0, max_new_tokens=10), at % 3)
                for rid, p, _, at in requests]  # fmt: skip
    check_against_alone(loaded, engine, requests)
    assert engine.scheduler.preemptions > 0 and engine.runner.caches == {}


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "glm_moe_dsa"])
def test_batched_greedy_equals_alone_on_cuda(tiny, model_type):
    """On CUDA decode rows read their pages in the decode kernels (GQA's and MLA's, steps
    replayed from CUDA graphs, padding rows on the scratch page; glm_moe_dsa's indexer keeps
    gathered pages and eager steps) and packed steps run SDPA over gathered pages; fp32, each
    request against the Generator alone (static cache)."""
    loaded = load_model(
        tiny.store(model_type), EngineConfig(device="cuda", dtype="float32", native=True)
    )
    engine = Engine(loaded, EngineLimits(num_pages=48, page_size=16, max_num_batched_tokens=16))
    check_against_alone(loaded, engine, random_requests(loaded.model_config.vocab_size, 8, 3))
    graphed = model_type == "qwen3_moe" or (model_type == "deepseek_v3" and MLA_DECODE_KERNEL)
    if graphed:  # decode steps replayed from graphs per batch bucket
        assert engine.runner.use_graphs and engine.runner.graphs
        assert not engine.runner.gather_decode_keys
        assert engine.runner.ahead_taken > 0  # steps launched ahead of the host, and used


def _looking_ahead(native, limits: EngineLimits) -> Engine:
    """An engine whose runner launches each steady decode step ahead (the CUDA-graph default;
    on CPU the eager step runs ahead: the same bookkeeping)."""
    engine = Engine(native, limits)
    engine.runner.lookahead = True
    return engine


def test_steps_launched_ahead_equal_each_request_alone(native):
    """Staggered arrivals, finishes at different steps (the launched step then has a row
    too many), page boundaries (page_size 4), chunked prefill: tokens as each alone."""
    engine = _looking_ahead(
        native, EngineLimits(num_pages=64, page_size=4, max_num_batched_tokens=8)
    )
    requests = random_requests(native.model_config.vocab_size, 8, seed=5, max_new=20)
    check_against_alone(native, engine, requests)
    runner = engine.runner
    assert runner.ahead_launched > 0 and 0 < runner.ahead_taken <= runner.ahead_launched


def test_steps_launched_ahead_under_preemption_and_abort(native):
    engine = _looking_ahead(native, EngineLimits(num_pages=12, page_size=4))
    requests = random_requests(native.model_config.vocab_size, 6, seed=2, max_prompt=14)
    requests = [(rid, p, SamplingParams(temperature=0, max_new_tokens=16), 0)
                for rid, p, _, _ in requests]  # fmt: skip
    check_against_alone(native, engine, requests)
    assert engine.scheduler.preemptions > 0 and engine.runner.ahead_taken > 0
    engine.add("a", list(range(3, 20)), SamplingParams(temperature=0, max_new_tokens=30))
    engine.add("b", list(range(5, 9)), SamplingParams(temperature=0, max_new_tokens=12))
    b_tokens = []
    for _ in range(4):
        b_tokens += [t for out in engine.step() if out.request_id == "b" for t in out.token_ids]
    engine.abort("a")  # a step launched ahead still has a's row: b's must be taken from it
    taken = engine.runner.ahead_taken
    while engine.has_work:
        b_tokens += [t for out in engine.step() for t in out.token_ids]
    assert engine.runner.ahead_taken > taken
    short = SamplingParams(temperature=0, max_new_tokens=12)
    assert b_tokens == alone(native, list(range(5, 9)), short)[0]
    assert engine.pool.used_pages == 0


def test_seeded_sampling_with_steps_launched_ahead(native):
    """A launched step draws nothing: seeded rows sample as without it, whatever the batch."""
    prompt = list(range(3, 12))
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=123)
    limits = EngineLimits(num_pages=64, page_size=4)
    lone = run(Engine(native, limits), {0: [("s", prompt, params)]})
    others = [(f"o{i}", [5 + i] * (3 + i), SamplingParams(temperature=1.0, max_new_tokens=8))
              for i in range(4)]  # fmt: skip
    engine = _looking_ahead(native, limits)
    shared = run(engine, {0: others[:2], 1: [("s", prompt, params)], 3: others[2:]})
    assert shared["s"][0] == lone["s"][0] and engine.runner.ahead_taken > 0
