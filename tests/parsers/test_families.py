"""Each family's parser on outputs written from its real template format (cases.py): content,
reasoning, calls with arguments that are JSON objects of the schema's types, ids, warnings."""

from __future__ import annotations

import json
import re

import pytest
from parser_cases import CASES, FILE, TOOLS, Case

from moetier.server.parsers import FAMILIES, make_parser


def parse(case: Case):
    parser = make_parser(
        case.family,
        tools=TOOLS,
        starts_in_reasoning=case.starts_in_reasoning,
        parallel_tool_calls=case.parallel_tool_calls,
        call_offset=case.call_offset,
    )
    return parser.parse(case.raw)


def test_every_family_has_cases():
    assert {c.family for c in CASES} == set(FAMILIES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_case(case: Case):
    message = parse(case)
    assert message.content == case.content
    assert message.reasoning_content == case.reasoning
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls
    ]
    assert calls == case.calls
    # exact types, not only equality (True == 1 in Python)
    for (_, got), (_, want) in zip(calls, case.calls, strict=True):
        assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}
    for call in message.tool_calls:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
        assert call["type"] == "function"
    ids = [c["id"] for c in message.tool_calls]
    if case.ids is not None:
        assert ids == case.ids
    elif case.family == "mistral":
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    elif case.family == "kimi_k2":
        assert all(re.fullmatch(r"functions\.\w+:\d+", i) for i in ids)
    else:
        assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert bool(message.warnings) == case.warns


# cut inside reasoning that talks about tool syntax: it stays reasoning
PROSE = {"glm47-c5-cut-in-reasoning": "<tool_call>", "deepseek_v4-c5-cut-in-reasoning": "｜"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_no_markup_leaks(case: Case):
    """c10: none of the format's markers reach content or reasoning."""
    message = parse(case)
    text = (message.content or "") + (message.reasoning_content or "")
    if case.warns:
        return  # passed on as content on purpose
    for marker in (
        "<tool_call>",
        "</tool_call>",
        "<think>",
        "</think>",
        "｜",
        "<|",
        "[TOOL_CALLS]",
        "<minimax:",
        "<arg_key>",
        "<function=",
        "[THINK]",
    ):
        if PROSE.get(case.id) == marker:
            continue  # prose about tool syntax inside reasoning stays reasoning
        assert marker not in text, marker


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plain_text_passes_through(family):
    text = " \n Hello — ünïcödé < > & { } [ ] ✓ \n"  # whitespace at both ends kept too
    message = make_parser(family).parse(text)
    assert message.content == text
    assert message.reasoning_content is None and message.tool_calls == []


def test_prose_about_tools_inside_reasoning_stays_reasoning():
    """The opposite of c1 (LM Studio #1592): families that do not open calls inside reasoning
    keep tool syntax there as reasoning."""
    raw = "I could write <minimax:tool_call> here.</think>Done."
    message = make_parser("minimax_m2", starts_in_reasoning=True).parse(raw)
    assert message.reasoning_content == "I could write <minimax:tool_call> here."
    assert message.content == "Done." and message.tool_calls == []


def test_string_arguments_stream_before_the_call_ends():
    """c2: a string argument arrives as it is generated, not when its parameter or call ends."""
    checked = set()
    for case in CASES:
        for value in ("São Paulo", FILE):
            if value not in case.raw or not case.calls:
                continue
            cut = case.raw.index(value) + len(value) // 2
            parser = make_parser(
                case.family, tools=TOOLS, starts_in_reasoning=case.starts_in_reasoning
            )
            streamed = "".join(c.arguments for c in parser.feed(case.raw[:cut]).tool_calls)
            assert json.dumps(value[: len(value) // 2], ensure_ascii=False)[1:-1] in streamed, (
                case.id
            )
            checked.add(case.family)
    assert checked == set(FAMILIES)


def test_parallel_tool_calls_false_drops_later_calls_for_every_family():
    for case in CASES:
        if len(case.calls) < 2:
            continue
        parser = make_parser(
            case.family,
            tools=TOOLS,
            starts_in_reasoning=case.starts_in_reasoning,
            parallel_tool_calls=False,
        )
        message = parser.parse(case.raw)
        assert [c["function"]["name"] for c in message.tool_calls] == [case.calls[0][0]], case.id


def test_deepseek_v4_by_model_type():
    """DeepSeek-V4 ships no chat template (DeepSeek's encoding_dsv4.py renders it): the store's
    model_type picks its parser; a V3.2 template (DSML `function_calls`) still picks V3.2's."""
    from moetier.server.parsers import choose_family

    assert choose_family("deepseek_v4", None)[0] == "deepseek_v4"
    assert choose_family("deepseek_v4", "{{ '<｜DSML｜' }}function_calls")[0] == "deepseek_v32"
