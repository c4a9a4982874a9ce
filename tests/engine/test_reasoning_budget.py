"""The reasoning budget (engine/reasoning_budget.py): the matcher's bitmask rows step by step,
and through the engine on a tiny model: the first `budget` tokens are the unconstrained greedy
answer's, then the end marker, whatever the model would have written."""

from __future__ import annotations

import pytest
import torch

from moetier.config import EngineConfig
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.reasoning_budget import ReasoningBudget
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model

WIDTH = 4  # words: tokens 0..127


def allowed(matcher: ReasoningBudget) -> list[int] | str:
    """The tokens the matcher's next row allows ("all" when every bit is set)."""
    bitmask = torch.zeros(1, WIDTH, dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    if bool((bitmask == -1).all()):
        return "all"
    bits = [(int(w) >> b) & 1 for w in bitmask[0].tolist() for b in range(32)]
    return [t for t, bit in enumerate(bits) if bit]


def test_the_marker_is_forced_after_the_budget():
    m = ReasoningBudget(3, (70, 99))
    for token in (1, 2, 3):
        assert allowed(m) == "all" and m.accept_token(token)
    assert allowed(m) == [70]
    assert not ReasoningBudget(1, (70, 99)).is_terminated()
    assert m.accept_token(70) and allowed(m) == [99]
    assert m.accept_token(99) and allowed(m) == "all"  # the answer: no budget
    assert m.accept_token(5) and allowed(m) == "all"


def test_a_marker_the_model_writes_closes_the_budget():
    m = ReasoningBudget(4, (70, 99))
    for token in (1, 70, 99):
        assert m.accept_token(token)
    for token in (4, 5, 6, 7):
        assert allowed(m) == "all" and m.accept_token(token)


def test_a_marker_begun_at_the_budget_is_finished_not_repeated():
    m = ReasoningBudget(3, (70, 99))
    for token in (1, 2, 70):
        m.accept_token(token)
    assert allowed(m) == [99]
    assert not m.accept_token(5)  # a token the mask refused


def test_with_a_start_marker_only_an_answer_that_opens_reasoning_has_a_budget():
    """A prompt that does not leave the model in reasoning: the budget is the start marker's
    (a hybrid model opens `<think>` itself); a plain answer is never forced."""
    m = ReasoningBudget(3, (70, 99), start_ids=(60,))
    for token in (5, 6, 7, 8, 9):
        assert allowed(m) == "all" and m.accept_token(token)
    m = ReasoningBudget(3, (70, 99), start_ids=(60,))
    for token in (60, 1, 2):
        assert allowed(m) == "all" and m.accept_token(token)
    assert allowed(m) == [70]
    # a start marker longer than the budget is finished first, then the end marker forced
    m = ReasoningBudget(1, (70,), start_ids=(60, 61))
    assert m.accept_token(60) and allowed(m) == "all"
    assert m.accept_token(61) and allowed(m) == [70]
    # a marker begun but not finished is not reasoning either
    m = ReasoningBudget(1, (70,), start_ids=(60, 61))
    assert m.accept_token(60) and m.accept_token(5)
    assert allowed(m) == "all"


def test_bit_31_of_a_word_is_set_right():
    m = ReasoningBudget(1, (63,))
    m.accept_token(1)
    assert allowed(m) == [63]


def test_through_the_engine_greedy_then_the_marker(tiny):
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", dtype="float32"))
    engine = Engine(loaded, EngineLimits(num_pages=32, page_size=4))
    prompt = [5, 17, 33, 2, 90]

    def run(params: SamplingParams) -> list[int]:
        request = engine.add(f"r{len(engine.requests)}-{id(params)}", prompt, params,
                             max_tokens=9, ignore_eos=True)  # fmt: skip
        while engine.has_work:
            engine.step()
        return list(request.output)

    free = run(SamplingParams(temperature=0, max_new_tokens=9))
    marker = tuple([t for t in range(200, 220) if t not in free[:6]][:2])  # not the model's own
    out = run(SamplingParams(temperature=0, max_new_tokens=9, reasoning_budget=(4, marker)))
    assert out[:4] == free[:4] and tuple(out[4:6]) == marker and len(out) == 9
    with pytest.raises(ValueError, match="reasoning budget"):
        SamplingParams(reasoning_budget=(0, marker))
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(reasoning_budget=(4, marker), grammar=("json_object", ""))
