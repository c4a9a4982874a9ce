"""StepSampler: the batched sampling of a step's rows against direct computations on known
logits (penalties and logit_bias by their formulas, min-p / top-k / top-p, the grammar bitmask,
logprobs as log_softmax), and seeded rows that draw the same whatever shares their batch."""

from __future__ import annotations

import math
import random

import pytest
import torch

from moetier.engine.sampler import SamplingParams, apply_bitmask_ref, bitmask_words
from moetier.engine.scheduler import Request, Scheduled
from moetier.engine.step_sampler import StepSampler

VOCAB = 40


def sampler() -> StepSampler:
    s = StepSampler()
    s.device = torch.device("cpu")
    return s


def item(rid: str, prompt: list[int], output: list[int], params: SamplingParams) -> Scheduled:
    request = Request(rid, prompt, 100, params)
    for t in output:
        request._append(t)
    return Scheduled(request, len(request.tokens) - 1, 1)


def known_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def by_formula(logits: list[float], prompt, output, p: SamplingParams) -> list[float]:
    """The documented order on one row, token by token in plain Python: logit_bias, then
    repetition over prompt + output, then frequency and presence over the output."""
    out = list(logits)
    for token, bias in p.logit_bias:
        out[token] += bias
    for v in range(len(out)):
        if v in prompt or v in output:
            r = p.repetition_penalty
            out[v] = out[v] / r if out[v] > 0 else out[v] * r
        count = output.count(v)
        out[v] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_penalties_and_logit_bias_follow_their_formulas():
    rng = random.Random(0)
    settings = [
        SamplingParams(temperature=0, presence_penalty=0.7),
        SamplingParams(temperature=0, frequency_penalty=0.4),
        SamplingParams(temperature=0, repetition_penalty=1.6),
        SamplingParams(temperature=0, repetition_penalty=0.7, frequency_penalty=-0.5),
        SamplingParams(
            temperature=1.0, presence_penalty=-1.0, frequency_penalty=1.5,
            repetition_penalty=1.3, logit_bias=((3, 5.0), (7, -100.0), (3, 1.0)),
        ),
        SamplingParams(temperature=0),  # untouched
    ]  # fmt: skip
    items = []
    for i, p in enumerate(settings):
        prompt = [rng.randrange(VOCAB) for _ in range(6)]
        output = [rng.randrange(VOCAB) for _ in range(5)] + [prompt[0], 11, 11]
        items.append(item(f"r{i}", prompt, output, p))
    raw = known_logits(len(items))
    before = raw.clone()
    got = sampler()._processed(raw, items, settings, set())
    assert torch.equal(raw, before)  # the raw logits (the logprobs' source) stay as they were
    for row, (it, p) in enumerate(zip(items, settings, strict=True)):
        want = by_formula(raw[row].tolist(), it.request.prompt, it.request.output, p)
        torch.testing.assert_close(got[row], torch.tensor(want), rtol=0, atol=1e-5)


def test_greedy_rows_take_the_argmax_after_bias_and_penalties():
    raw = known_logits(3, seed=1)
    top = raw.argmax(-1).tolist()
    settings = [
        SamplingParams(temperature=0, logit_bias=((5, 100.0),)),
        SamplingParams(temperature=0, logit_bias=((top[1], -100.0),)),
        SamplingParams(temperature=0, frequency_penalty=2.0),
    ]
    items = [
        item("a", [1, 2], [], settings[0]),
        item("b", [1, 2], [], settings[1]),
        item("c", [1, 2], [top[2]] * 10, settings[2]),  # its top token, penalized by 20
    ]
    got = sampler()._sample(raw, items).tokens
    assert got["a"] == 5
    second = raw[1].topk(2).indices.tolist()[1]
    assert got["b"] == second
    penalized = raw[2].clone()
    penalized[top[2]] -= 20.0
    assert got["c"] == int(penalized.argmax()) != top[2]


def test_min_p_top_k_top_p_keep_what_their_definitions_keep():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log()[None]
    torch.manual_seed(0)  # unseeded rows draw from torch's default generator

    def support(**kw) -> set[int]:
        """The tokens 400 rows of these settings draw (each kept token has p >= 0.04)."""
        p = SamplingParams(temperature=1.0, top_p=kw.pop("top_p", 1.0), **kw)
        items = [item(f"x{i}", [1], [], p) for i in range(400)]
        return set(sampler()._sample(logits.expand(400, -1), items).tokens.values())

    # min-p: p >= 0.3 * 0.4 = 0.12 -> the first three
    assert support(min_p=0.3) == {0, 1, 2}
    assert support(top_k=2) == {0, 1}
    assert support(top_p=0.75) == {0, 1, 2}  # 0.4 + 0.25 < 0.75: the third is needed
    # min-p first (keeps 0.4, 0.25, 0.15: renormalized 0.5, 0.3125, 0.1875), then top-p over
    # what is left: 0.5 < 0.75 <= 0.8125, so the third goes (top-p first would keep it)
    assert support(min_p=0.3, top_p=0.75) == {0, 1}


def test_bitmask_reference_masks_exactly_the_cleared_bits():
    rng = random.Random(3)
    vocab = 70  # three words, the last one partial
    bitmask = torch.tensor(
        [[rng.randrange(-(2**31), 2**31) for _ in range(bitmask_words(vocab))] for _ in range(4)],
        dtype=torch.int32,
    )
    logits = torch.randn(4, vocab)
    masked = logits.clone()
    apply_bitmask_ref(masked, bitmask)
    for r in range(4):
        for t in range(vocab):
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF
            allowed = (word >> (t % 32)) & 1
            assert masked[r, t] == (logits[r, t] if allowed else -math.inf)


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
        if token != self.tokens[self.at]:
            return False
        self.at += 1
        return True

    def is_terminated(self) -> bool:
        return self.at == len(self.tokens)


def test_grammar_rows_sample_only_allowed_tokens_and_logprobs_stay_raw():
    s = sampler()
    forced = [31, 2, 17]
    s.matchers["g"] = OnlyTokens(forced)
    p = SamplingParams(temperature=1.0, seed=1, logprobs=3)
    free = SamplingParams(temperature=0)
    for step in range(3):
        raw = known_logits(2, seed=10 + step)
        out = s._sample(raw, [item("g", [1, 2], forced[:step], p), item("f", [1], [], free)])
        assert out.tokens["g"] == forced[step]
        assert out.tokens["f"] == int(raw[1].argmax())
        logprobs = torch.log_softmax(raw[0], -1)
        assert out.logprobs["g"].logprob == pytest.approx(float(logprobs[forced[step]]), abs=1e-6)
        top = logprobs.topk(3)
        assert [t for t, _ in out.logprobs["g"].top] == top.indices.tolist()
    assert s.matchers["g"].is_terminated()


def test_logprobs_are_log_softmax_of_the_raw_logits():
    raw = known_logits(4, seed=5)
    settings = [
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0.8, top_k=3, logprobs=5, presence_penalty=1.0, seed=3),
        SamplingParams(temperature=0),  # no logprobs asked
        SamplingParams(temperature=1.2, logprobs=20, logit_bias=((0, 50.0),)),
    ]
    items = [item(f"r{i}", [1, 2, 3], [4, 4], p) for i, p in enumerate(settings)]
    out = sampler()._sample(raw, items)
    assert set(out.logprobs) == {"r0", "r1", "r3"}
    ref = torch.log_softmax(raw.double(), -1)
    for row, p in enumerate(settings):
        rid = f"r{row}"
        if p.logprobs is None:
            continue
        got = out.logprobs[rid]
        assert got.token == out.tokens[rid]
        assert got.logprob == pytest.approx(float(ref[row, got.token]), abs=1e-5)
        top = ref[row].topk(p.logprobs)
        assert [t for t, _ in got.top] == top.indices.tolist()
        assert [lp for _, lp in got.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out.tokens["r3"] == 0  # the bias moved the draw, not the logprobs


def test_seeded_rows_draw_the_same_whatever_shares_their_batch():
    p = SamplingParams(temperature=1.0, top_p=0.95, min_p=0.01, seed=42)
    other = SamplingParams(temperature=1.3, presence_penalty=0.5)
    alone, crowded = sampler(), sampler()
    a_out: list[int] = []
    c_out: list[int] = []
    for step in range(20):
        raw = known_logits(5, seed=100 + step)
        a_out.append(alone._sample(raw[2:3], [item("s", [1], a_out, p)]).tokens["s"])
        items = [item(f"o{i}", [2], [], other) for i in range(4)]
        items.insert(2, item("s", [1], c_out, p))
        c_out.append(crowded._sample(raw, items).tokens["s"])
    assert a_out == c_out
    assert len(set(a_out)) > 3


class AllowsNothing(OnlyTokens):
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = 0


def test_a_row_that_cannot_sample_is_left_out_alone():
    """Non-finite logits, or a grammar that allows nothing: that row has no token (the engine
    ends its request with "error"); the others sample as usual."""
    s = sampler()
    s.matchers["nothing"] = AllowsNothing([1])
    raw = known_logits(4, seed=9)
    raw[1, 3] = float("nan")
    settings = [
        SamplingParams(temperature=0, logprobs=1),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, seed=2),
    ]
    ids = ["fine", "nan", "nothing", "also fine"]
    items = [item(rid, [1], [], p) for rid, p in zip(ids, settings, strict=True)]
    out = s._sample(raw, items)
    assert set(out.tokens) == {"fine", "also fine"}
    assert out.tokens["fine"] == int(raw[0].argmax())
