"""Generation timing: the prefill ends where the first tokens are out, the decode runs from
there to the last; token counts are summed over the rows."""

from __future__ import annotations

import math

import pytest

from moetier.engine import timing as timing_module
from moetier.engine.timing import GenerationTiming, TokenClock


def test_clock_splits_prefill_and_decode(monkeypatch):
    now = iter([10.0, 10.5, 10.6, 10.8, 11.1])  # start, then four steps' tokens out
    monkeypatch.setattr(timing_module.time, "perf_counter", lambda: next(now))
    clock = TokenClock(rows=2, prompt_tokens=20)
    for _ in range(4):
        clock.tokens_out()
    t = clock.timing
    assert (t.steps, t.new_tokens, t.decode_tokens) == (4, 8, 6)
    assert t.prefill_seconds == pytest.approx(0.5)
    assert t.decode_seconds == pytest.approx(0.6)
    assert t.prefill_tok_s == pytest.approx(40.0)  # 20 prompt tokens in 0.5 s
    assert t.decode_tok_s == pytest.approx(10.0)  # 3 steps x 2 rows in 0.6 s
    assert t.summary() == (
        "20 prompt tokens, 8 new tokens in 2 rows; prefill 40.0 tok/s (first token after "
        "500.0 ms), decode 10.0 tok/s"
    )


def test_a_single_token_has_no_decode_speed():
    t = GenerationTiming(rows=1, prompt_tokens=3, new_tokens=1, steps=1, prefill_seconds=0.1)
    assert t.decode_tokens == 0 and math.isnan(t.decode_tok_s)
    assert t.summary().endswith("; no decode step")
