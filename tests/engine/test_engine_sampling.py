"""The serving engine's sampling features end to end (float32, tiny models of both attention
kinds and the transformers path): logprobs and prompt logprobs against log_softmax of an
independent HF transformers forward of the checkpoint; greedy penalties and logit_bias against
the formulas applied to that forward's logits; n > 1 (its sequences share the prompt's pages,
seeded ones reproducible whatever shares their batch, abort ends them all); the grammar hook
with a hand-written matcher."""

from __future__ import annotations

import asyncio

import pytest
import torch

from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model

FP32 = EngineConfig(device="cpu", dtype="float32", native=True)
PROMPT = [5, 17, 33, 2, 90, 41, 41, 8, 250, 12, 77, 3, 19]


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "transformers"])
def setup(request, tiny):
    """(loaded model, the HF transformers model of the same checkpoint)."""
    from transformers import AutoModelForCausalLM

    family = "qwen3_moe" if request.param == "transformers" else request.param
    config = (
        EngineConfig(native=False, device="cpu", dtype="float32")
        if request.param == "transformers"
        else FP32
    )
    loaded = load_model(tiny.store(family), config)
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint(family), dtype=torch.float32, experts_implementation="eager"
    ).eval()
    return loaded, hf


@pytest.fixture(scope="module")
def native(tiny):
    return load_model(tiny.store("qwen3_moe"), FP32)


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: row p is log_softmax of the logits after tokens[: p + 1]."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def drain(engine: Engine, arrivals: dict[int, list[tuple]]) -> dict[tuple[str, int], dict]:
    """arrivals: step -> [(id, prompt, params, kwargs)] -> (id, index) -> what it produced."""
    got: dict[tuple[str, int], dict] = {}
    for t in range(10_000):
        for rid, prompt, params, kwargs in arrivals.get(t, []):
            engine.add(rid, prompt, params, **kwargs)
        if not engine.has_work and t > max(arrivals):
            return got
        for out in engine.step():
            entry = got.setdefault(
                (out.request_id, out.index),
                {"tokens": [], "logprobs": [], "finish": None, "prompt_logprobs": None, "n": 0},
            )
            entry["tokens"] += out.token_ids
            entry["logprobs"] += out.logprobs or []
            entry["finish"] = out.finish_reason
            entry["n"] += 1
            if out.prompt_logprobs is not None:
                assert entry["prompt_logprobs"] is None  # on the first output only
                assert entry["n"] == 1
                entry["prompt_logprobs"] = out.prompt_logprobs
    raise AssertionError("did not finish")


def test_logprobs_and_prompt_logprobs_equal_the_hf_forward(setup):
    loaded, hf = setup
    engine = Engine(loaded, EngineLimits(num_pages=64, page_size=4, max_num_batched_tokens=5))
    params = SamplingParams(
        temperature=1.0, seed=7, max_new_tokens=8, logprobs=5, prompt_logprobs=3
    )
    # a first request caches the prompt's pages: the second still computes (and reports)
    # every prompt position's logprob
    greedy = SamplingParams(temperature=0, max_new_tokens=2)
    drain(engine, {0: [("warm", PROMPT, greedy, {})]})
    got = drain(engine, {0: [("a", PROMPT, params, {"ignore_eos": True})]})[("a", 0)]
    tokens = got["tokens"]
    assert len(tokens) == 8 and len(got["logprobs"]) == 8
    ref = hf_logprobs(hf, PROMPT + tokens)
    for j, (token, lp) in enumerate(zip(tokens, got["logprobs"], strict=True)):
        row = ref[len(PROMPT) - 1 + j]
        assert lp.token == token
        assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
        top = row.topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    prompt_lps = got["prompt_logprobs"]
    assert prompt_lps is not None and len(prompt_lps) == len(PROMPT) and prompt_lps[0] is None
    for i in range(1, len(PROMPT)):
        lp, row = prompt_lps[i], ref[i - 1]
        assert lp.token == PROMPT[i]
        assert lp.logprob == pytest.approx(float(row[PROMPT[i]]), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    assert engine.pool.used_pages == 0 and engine.requests == {} and engine.streams == {}


def test_prompt_logprobs_from_one_position_chunks_beside_decodes(setup):
    """A step budget of 2 beside a decoding request: the prompt goes one position a step, in
    decode-row steps (each position's logits from the decode rows)."""
    loaded, hf = setup
    engine = Engine(loaded, EngineLimits(num_pages=64, page_size=4, max_num_batched_tokens=2))
    background = SamplingParams(temperature=0, max_new_tokens=40)
    params = SamplingParams(temperature=0, max_new_tokens=2, prompt_logprobs=2)
    got = drain(
        engine,
        {0: [("bg", [9, 8, 7], background, {"ignore_eos": True})], 3: [("a", PROMPT, params, {})]},
    )
    ref = hf_logprobs(hf, PROMPT)
    prompt_lps = got[("a", 0)]["prompt_logprobs"]
    assert len(prompt_lps) == len(PROMPT) and prompt_lps[0] is None
    for i in range(1, len(PROMPT)):
        assert prompt_lps[i].logprob == pytest.approx(float(ref[i - 1, PROMPT[i]]), abs=1e-4)
        assert [t for t, _ in prompt_lps[i].top] == ref[i - 1].topk(2).indices.tolist()


def penalized_greedy(hf, prompt: list[int], p: SamplingParams, new: int) -> list[int]:
    """Greedy decoding of the HF model with bias and penalties applied by their formulas."""
    out: list[int] = []
    for _ in range(new):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].double()
        for token, bias in p.logit_bias:
            logits[token] += bias
        for v in set(prompt) | set(out):
            r = p.repetition_penalty
            logits[v] = logits[v] / r if logits[v] > 0 else logits[v] * r
        for v in set(out):
            logits[v] -= p.frequency_penalty * out.count(v) + p.presence_penalty
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, repetition_penalty=0.4),
        SamplingParams(temperature=0, frequency_penalty=-1.5, presence_penalty=1.0),
        SamplingParams(temperature=0, logit_bias=((PROMPT[3], 4.0), (300, -100.0))),
    ],
    ids=["repetition", "frequency+presence", "logit_bias"],
)
def test_greedy_penalties_and_bias_follow_the_formulas(setup, params):
    loaded, hf = setup
    params = SamplingParams(**{**params.__dict__, "max_new_tokens": 10})
    engine = Engine(loaded, EngineLimits(num_pages=64, page_size=4, max_num_batched_tokens=6))
    got = drain(engine, {0: [("p", PROMPT, params, {"ignore_eos": True})]})[("p", 0)]
    assert got["tokens"] == penalized_greedy(hf, PROMPT, params, 10)
    plain = drain(
        engine, {0: [("g", PROMPT, SamplingParams(temperature=0, max_new_tokens=10),
                      {"ignore_eos": True})]}
    )[("g", 0)]  # fmt: skip
    assert plain["tokens"] != got["tokens"]  # the setting changed the answer


def test_n_sequences_share_the_prompt_pages(native):
    engine = Engine(native, EngineLimits(num_pages=64, page_size=4))
    prompt = list(range(3, 26))  # 23 tokens: 5 full pages usable from the prefix cache
    params = SamplingParams(temperature=0, max_new_tokens=5)
    shared: list[int] = []

    def on_step() -> None:
        running = engine.scheduler.running
        if len(running) == 3 and not shared:
            first = running[0].pages[:5]
            shared.extend(engine.pool.refs(p) for p in first)

    got: dict = {}
    engine.add("r", prompt, params, n=3, ignore_eos=True)
    while engine.has_work:
        for out in engine.step():
            got.setdefault(out.index, []).extend(out.token_ids)
            assert out.request_id == "r" and out.prompt_tokens == len(prompt)
        on_step()
    assert shared == [3] * 5  # the three sequences held the prompt's first 5 pages together
    # the prompt once, 3 positions (its last partial page) per sibling, 4 decodes each
    assert engine.runner.positions_run == 23 + 2 * 3 + 3 * 4
    assert got[0] == got[1] == got[2] and len(got[0]) == 5  # greedy: the same answer
    assert engine.pool.used_pages == 0 and engine.requests == {} and engine.streams == {}


def test_seeded_n_is_reproducible_whatever_shares_the_batch(native):
    prompt = PROMPT
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8, seed=99)
    limits = EngineLimits(num_pages=96, page_size=4, max_num_batched_tokens=8)
    lone = drain(Engine(native, limits), {0: [("s", prompt, params, {"n": 3})]})
    others = [
        (f"o{i}", [7 + i] * (4 + i), SamplingParams(temperature=0.9, max_new_tokens=6), {"n": 2})
        for i in range(3)
    ]
    crowd = drain(Engine(native, limits), {0: others[:1], 1: [("s", prompt, params, {"n": 3})],
                                          3: others[1:]})  # fmt: skip
    answers = [lone[("s", i)]["tokens"] for i in range(3)]
    assert answers == [crowd[("s", i)]["tokens"] for i in range(3)]
    assert len({tuple(a) for a in answers}) == 3  # each sequence its own draws
    single = drain(Engine(native, limits), {0: [("one", prompt, params, {})]})
    assert single[("one", 0)]["tokens"] == answers[0]  # sequence 0 draws as n = 1 does


def test_preemption_keeps_seeded_draws_logprobs_and_prompt_logprobs(native):
    """Under a KV budget too small for all of them, sequences are preempted and recomputed:
    each still draws what it draws with room to spare, with the same logprobs."""
    params = SamplingParams(
        temperature=1.0, seed=11, max_new_tokens=12, logprobs=2, prompt_logprobs=1,
        presence_penalty=0.5,
    )  # fmt: skip
    arrivals = {0: [("p", PROMPT, params, {"n": 3, "ignore_eos": True})]}
    roomy = drain(Engine(native, EngineLimits(num_pages=96, page_size=4)), arrivals)
    tight_engine = Engine(native, EngineLimits(num_pages=9, page_size=4))
    tight = drain(tight_engine, arrivals)
    assert tight_engine.scheduler.preemptions > 0
    for index in range(3):
        a, b = roomy[("p", index)], tight[("p", index)]
        assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 12
        assert [lp.token for lp in b["logprobs"]] == b["tokens"]
        assert [lp.logprob for lp in a["logprobs"]] == pytest.approx(
            [lp.logprob for lp in b["logprobs"]], abs=1e-5
        )
    first = [lp.logprob for lp in roomy[("p", 0)]["prompt_logprobs"][1:]]
    assert first == pytest.approx([lp.logprob for lp in tight[("p", 0)]["prompt_logprobs"][1:]])
    assert tight_engine.pool.used_pages == 0


def test_abort_ends_every_sequence(native):
    engine = Engine(native, EngineLimits(num_pages=64, page_size=4))
    engine.add("r", PROMPT, SamplingParams(temperature=1.0, max_new_tokens=50), n=4)
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.running) == 4
    out = engine.abort("r")
    assert out is not None and out.finish_reason == "abort"
    assert not engine.has_work and engine.pool.used_pages == 0
    assert engine.requests == {} and engine.streams == {} and engine.abort("r") is None


class OnlyTokens:
    """A matcher that allows one fixed token sequence, then terminates."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.at = tokens, 0

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = 0
        t = self.tokens[self.at]
        word = 1 << (t % 32)
        bitmask[index, t // 32] = word - 2**32 if word >= 2**31 else word

    def accept_token(self, token: int) -> bool:
        ok = token == self.tokens[self.at]
        self.at += ok
        return ok

    def is_terminated(self) -> bool:
        return self.at == len(self.tokens)


class FixedGrammars:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.specs: list[tuple[str, str]] = []

    def matcher(self, kind: str, spec: str) -> OnlyTokens:
        if spec == "bad":
            raise ValueError("invalid regex grammar: bad")
        self.specs.append((kind, spec))
        return OnlyTokens(self.tokens)


def test_a_grammar_constrains_the_tokens_and_its_end_stops(setup):
    loaded, hf = setup
    engine = Engine(loaded, EngineLimits(num_pages=64, page_size=4))
    forced = [200, 201, 7, 99]
    engine.grammars = FixedGrammars(forced)
    with pytest.raises(ValueError, match="invalid"):
        engine.add("bad", PROMPT, SamplingParams(grammar=("regex", "bad")))
    assert not engine.has_work and engine.requests == {}
    params = SamplingParams(
        temperature=1.0, seed=3, max_new_tokens=20, logprobs=0, grammar=("regex", "x")
    )
    got = drain(engine, {0: [("g", PROMPT, params, {"n": 2}), ("free", PROMPT,
                             SamplingParams(temperature=0, max_new_tokens=4), {})]})  # fmt: skip
    assert engine.grammars.specs == [("regex", "x")] * 2  # one matcher per sequence
    ref = hf_logprobs(hf, PROMPT + forced)
    for index in (0, 1):
        entry = got[("g", index)]
        assert entry["tokens"] == forced and entry["finish"] == "stop"
        # logprobs of the raw distribution, not the masked one
        for j, lp in enumerate(entry["logprobs"]):
            assert lp.logprob == pytest.approx(float(ref[len(PROMPT) - 1 + j, forced[j]]), abs=1e-4)
    assert got[("free", 0)]["tokens"] != forced[:4]
    assert engine.pool.used_pages == 0 and engine.runner.matchers == {}


def test_a_grammar_ends_at_a_chat_end_token_outside_chat(native):
    """The grammar's end tokens end a document even in a plain (non-chat) request, and are not
    text."""
    engine = Engine(native, EngineLimits(num_pages=64, page_size=4))
    im_end = native.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in engine.chat_end_ids and im_end not in engine.eos_ids
    engine.grammars = FixedGrammars([200, 201, im_end, 5])
    params = SamplingParams(temperature=0, max_new_tokens=10, grammar=("json_object", ""))
    got = drain(engine, {0: [("g", PROMPT, params, {})]})[("g", 0)]
    assert got["tokens"] == [200, 201] and got["finish"] == "stop"


def test_async_engine_streams_n_sequences(native):
    engine = AsyncEngine(Engine(native, EngineLimits(num_pages=64, page_size=4)))
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=6)

    async def collect() -> dict[int, list]:
        seen: dict[int, list] = {}
        async for out in engine.generate(PROMPT, params, n=3, ignore_eos=True):
            seen.setdefault(out.index, []).append(out)
        return seen

    try:
        seen = asyncio.run(collect())
        assert sorted(seen) == [0, 1, 2]
        for outs in seen.values():
            assert [o.finish_reason for o in outs][-1] == "length"
            assert sum(len(o.token_ids) for o in outs) <= 6
        assert engine.wait_idle(5)
        assert engine.engine.pool.used_pages == 0

        async def leave_early() -> None:  # a client gone after its first output
            many = SamplingParams(temperature=1.0, max_new_tokens=200)
            async for _ in engine.generate(PROMPT, many, n=3, ignore_eos=True):
                break

        asyncio.run(leave_early())
        assert engine.wait_idle(5)
        assert engine.engine.pool.used_pages == 0 and engine.engine.requests == {}
    finally:
        engine.close()


@pytest.mark.gpu
def test_logprobs_and_seeded_n_on_cuda(tiny):
    """On CUDA (decode steps replayed from graphs): logprobs and prompt logprobs against the HF
    forward on the same card, and seeded n = 2 the same alone and in a crowd."""
    from transformers import AutoModelForCausalLM

    loaded = load_model(
        tiny.store("qwen3_moe"), EngineConfig(device="cuda", dtype="float32", native=True)
    )
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint("qwen3_moe"), dtype=torch.float32, experts_implementation="eager"
    )
    hf = hf.to("cuda").eval()
    limits = EngineLimits(num_pages=96, page_size=16, max_num_batched_tokens=16)
    params = SamplingParams(
        temperature=1.0, seed=7, max_new_tokens=8, logprobs=5, prompt_logprobs=3
    )
    engine = Engine(loaded, limits)
    lone = drain(engine, {0: [("a", PROMPT, params, {"ignore_eos": True, "n": 2})]})
    assert engine.runner.use_graphs
    for index in (0, 1):
        got = lone[("a", index)]
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + got["tokens"]], device="cuda")).logits[0]
        ref = torch.log_softmax(logits.double(), dim=-1).cpu()
        for j, lp in enumerate(got["logprobs"]):
            assert lp.logprob == pytest.approx(float(ref[len(PROMPT) - 1 + j, lp.token]), abs=1e-4)
            assert [t for t, _ in lp.top] == ref[len(PROMPT) - 1 + j].topk(5).indices.tolist()
        if index == 0:
            for i in range(1, len(PROMPT)):
                lp = got["prompt_logprobs"][i]
                assert lp.logprob == pytest.approx(float(ref[i - 1, PROMPT[i]]), abs=1e-4)
    others = [
        (f"o{i}", [7 + i] * (4 + i), SamplingParams(temperature=0.9, max_new_tokens=6), {"n": 2})
        for i in range(3)
    ]
    crowd = drain(
        Engine(loaded, limits),
        {0: others[:1], 1: [("a", PROMPT, params, {"ignore_eos": True, "n": 2})], 3: others[1:]},
    )
    for index in (0, 1):
        assert crowd[("a", index)]["tokens"] == lone[("a", index)]["tokens"]
