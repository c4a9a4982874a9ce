"""Streaming equals non-streaming, per family (serving.md §5, complaint class 2): the raw output
cut into random deltas (inside markers and inside multi-byte characters too: the cuts are made
in the UTF-8 bytes and decoded incrementally, as the detokenizer hands text out) gives parts
that add up to the message of the whole output; the first delta of each call carries its id and
name, the later ones only argument fragments."""

from __future__ import annotations

import codecs
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parser_cases import CASES, TOOLS, Case

from moetier.server.parsers import FAMILIES, Message, make_parser


def _parser(case: Case):
    counter = itertools.count()
    return make_parser(
        case.family,
        tools=TOOLS,
        starts_in_reasoning=case.starts_in_reasoning,
        parallel_tool_calls=case.parallel_tool_calls,
        call_offset=case.call_offset,
        new_id=lambda: f"id{next(counter)}",
    )


def _streamed(case: Case, cuts: list[int]) -> tuple[Message, list]:
    data = case.raw.encode()
    decoder = codecs.getincrementaldecoder("utf-8")()
    parser = _parser(case)
    message, calls = Message(), []
    bounds = [0, *sorted(set(cuts)), len(data)]
    for a, b in itertools.pairwise(bounds):
        delta = parser.feed(decoder.decode(data[a:b]))
        message.apply(delta)
        calls += delta.tool_calls
    delta = parser.finish()
    message.apply(delta)
    calls += delta.tool_calls
    message.warnings = parser.warnings
    return message, calls


def _whole(case: Case) -> Message:
    return _parser(case).parse(case.raw)


def _check(case: Case, cuts: list[int]) -> None:
    message, calls = _streamed(case, cuts)
    assert message == _whole(case)
    seen: set[int] = set()
    for call in calls:  # OpenAI's shape: id and name once, in the first delta of an index
        assert (call.id is not None) == (call.index not in seen)
        assert (call.name is not None) == (call.id is not None)
        seen.add(call.index)
    assert sorted(seen) == list(range(len(seen)))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_random_splits_equal_whole(family):
    cases = [c for c in CASES if c.family == family]

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def run(data):
        case = data.draw(st.sampled_from(cases))
        n = len(case.raw.encode())
        cuts = data.draw(st.lists(st.integers(0, n), max_size=40))
        _check(case, cuts)

    run()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_byte_at_a_time_equals_whole(case):
    _check(case, list(range(len(case.raw.encode()))))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plain_text_streams_unchanged(family):
    text = " \n Plain — ünïcödé ✓ <b> [x] {y} \n\n"
    data = text.encode()
    for cuts in ([], list(range(len(data))), [1, 5, 9, 20]):
        decoder = codecs.getincrementaldecoder("utf-8")()
        parser = make_parser(family)
        message = Message()
        for a, b in itertools.pairwise([0, *cuts, len(data)]):
            message.apply(parser.feed(decoder.decode(data[a:b])))
        message.apply(parser.finish())
        assert message.content == text and message.reasoning_content is None
