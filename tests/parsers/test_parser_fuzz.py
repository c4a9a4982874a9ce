"""Any output, however garbled (random runs of a family's markers, syntax pieces and text): the
parser never raises, streaming in any split equals parsing the whole, and every tool call's
arguments are a JSON object."""

from __future__ import annotations

import codecs
import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parser_cases import TOOLS

from moetier.server.parsers import FAMILIES, Message, make_parser

PIECES = [
    "a", "é✓", " ", "\n", "{", "}", "[", "]", '"', ":", ",", "1", "true", "<", ">", "=", "/",
    '"name": ', '"arguments": ', '"get_weather"', '"city"', '"days"', "get_weather", "list_files",
    "days", "city", "3", '{"city": "Oslo"}', "```json\n", "```", 'name="', 'string="false"', '">',
    "functions.get_weather:0", "to=functions.get_weather", " json", "analysis", "final",
    "commentary", "<function=", "<parameter=", "</parameter>", "</function>",
]  # fmt: skip


def _whole(family: str, text: str, starts: bool) -> Message:
    counter = itertools.count()
    parser = make_parser(
        family, tools=TOOLS, starts_in_reasoning=starts, new_id=lambda: f"id{next(counter)}"
    )
    return parser.parse(text)


def _streamed(family: str, text: str, starts: bool, cuts: list[int]) -> Message:
    counter = itertools.count()
    parser = make_parser(
        family, tools=TOOLS, starts_in_reasoning=starts, new_id=lambda: f"id{next(counter)}"
    )
    data = text.encode()
    decoder = codecs.getincrementaldecoder("utf-8")()
    message = Message()
    for a, b in itertools.pairwise([0, *sorted(set(cuts)), len(data)]):
        message.apply(parser.feed(decoder.decode(data[a:b])))
    message.apply(parser.finish())
    message.warnings = parser.warnings
    return message


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_garbled_output_is_split_invariant_and_calls_are_objects(family):
    cls = FAMILIES[family]
    markers = sorted(
        {*cls.markers, *cls.call_markers, getattr(cls, "think_start", "<think>"),
         getattr(cls, "think_end", "</think>"), "<|call|>", "<|return|>", "<|message|>",
         "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<｜tool▁sep｜>",
         "<｜tool▁call▁end｜>", "[ARGS]", "[CALL_ID]", "<arg_key>", "</arg_key>", "<arg_value>",
         "</arg_value>", "<invoke name=\"", "</invoke>", "<parameter name=\"",
         "<｜DSML｜invoke name=\"", "<｜DSML｜parameter name=\"", "</｜DSML｜parameter>",
         "</｜DSML｜invoke>"}
    )  # fmt: skip

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.sampled_from(PIECES + markers), max_size=40), st.booleans(), st.data())
    def run(pieces, starts, data):
        text = "".join(pieces)
        whole = _whole(family, text, starts)
        cuts = data.draw(st.lists(st.integers(0, len(text.encode())), max_size=25))
        assert _streamed(family, text, starts, cuts) == whole
        for call in whole.tool_calls:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)

    run()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mutated_real_outputs_are_split_invariant(family):
    """Near-valid outputs reach the deep states: a real case with a slice cut out, a piece put
    in, or cut short."""
    from parser_cases import CASES

    raws = [c.raw for c in CASES if c.family == family]

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.sampled_from(raws), st.sampled_from(PIECES), st.booleans(), st.data())
    def run(raw, piece, starts, data):
        a = data.draw(st.integers(0, len(raw)))
        b = data.draw(st.integers(a, min(len(raw), a + 12)))
        text = data.draw(st.sampled_from([raw[:a] + raw[b:], raw[:a] + piece + raw[a:], raw[:a]]))
        whole = _whole(family, text, starts)
        cuts = data.draw(st.lists(st.integers(0, len(text.encode())), max_size=25))
        assert _streamed(family, text, starts, cuts) == whole
        for call in whole.tool_calls:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)

    run()
