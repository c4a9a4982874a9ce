"""JsonArgs against Python's json module: a complete object passes through as written, in any
split; cut anywhere, what it hands out is a prefix of the text and closes into valid JSON, and
it is "repaired" exactly where closers alone complete it, "broken" otherwise.
xml_args.coerce: values typed by the tool schema, strings where the schema is ambiguous."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.server.parsers.json_args import JsonArgs
from moetier.server.parsers.xml_args import XmlArgs, coerce, schema_types

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)
objects = st.dictionaries(st.text(max_size=8), values, max_size=5)


@settings(max_examples=300, deadline=None)
@given(objects, st.booleans(), st.data())
def test_complete_objects_pass_through_in_any_split(obj, ascii_only, data):
    text = json.dumps(obj, ensure_ascii=ascii_only, indent=data.draw(st.sampled_from([None, 1])))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=20)))
    args, out = JsonArgs(), ""
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        out += args.push(text[a:b])
    last, status = args.close()
    assert status == "complete" and out + last == text and json.loads(out + last) == obj


def _closes_with_closers_alone(text: str) -> bool:
    """Reference: some run of `]` and `}` after `text` (nothing else) makes valid JSON."""
    if not text.strip():
        return True
    for n in range(9):
        for bits in itertools.product("]}", repeat=n):
            try:
                json.loads(text + "".join(bits))
            except ValueError:
                continue
            return True
    return False


@settings(max_examples=300, deadline=None)
@given(objects, st.data())
def test_cut_objects_repaired_only_where_closers_alone_complete_them(obj, data):
    text = json.dumps(obj, ensure_ascii=False)
    cut = data.draw(st.integers(0, len(text) - 1))
    args = JsonArgs()
    out = args.push(text[:cut])
    assert text.startswith(out)
    last, status = args.close()
    assert status == ("repaired" if _closes_with_closers_alone(text[:cut]) else "broken")
    assert isinstance(json.loads(out + last), dict)  # closed at the last valid point either way


@pytest.mark.parametrize(
    ("text", "status"),
    [
        ("", "repaired"),  # no arguments at all: {}
        ("{", "repaired"),
        ('{"city": "Paris"', "repaired"),  # the closing brace missing at the end
        ('{"days": 12', "repaired"),
        ('{"hours": [6, 12]', "repaired"),
        ('{"city": "Par', "broken"),  # a string cut: its value is not known
        ('{"metric": tr', "broken"),
        ('{"days": 1.', "broken"),
        ('{"city": "Paris",', "broken"),
        ('{"city"', "broken"),
        ("{'city': 'Paris'}", "broken"),
        ('{"city": "Paris"}', "complete"),
    ],
)
def test_status(text, status):
    args = JsonArgs()
    args.push(text)
    assert args.close()[1] == status


def test_committed_after_the_first_bytes_of_an_object():
    args = JsonArgs()
    args.push(" {")
    assert not args.committed
    args.push(' "')
    assert args.committed
    broken = JsonArgs()
    broken.push("{'")
    assert not broken.committed
    empty = JsonArgs()
    empty.push("{}")
    assert empty.committed


def test_broken_json_is_closed_and_rest_kept():
    args = JsonArgs()
    out = args.push('{"a": 1, "b": oops}')
    last, status = args.close()
    assert status == "broken" and json.loads(out + last) == {"a": 1} and args.rest == "oops}"


@pytest.mark.parametrize(
    ("text", "schema", "want"),
    [
        ("10", {"type": "integer"}, 10),
        ("10.0", {"type": "integer"}, 10),
        ("2.5", {"type": "number"}, 2.5),
        ("True", {"type": "boolean"}, True),
        ("false", {"type": "boolean"}, False),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("{'a': 1}", {"type": "object"}, {"a": 1}),  # Qwen3-Coder's template writes str(dict)
        ("null", {"type": "null"}, None),
        ("10", {"type": "string"}, "10"),
        ("10", {"type": ["string", "integer"]}, "10"),  # ambiguous: left a string
        ("10", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 10),
        ("ten", {"type": "integer"}, "ten"),  # does not convert: left a string
        ("10", {}, "10"),  # no type: left a string
    ],
)
def test_coerce(text, schema, want):
    got = coerce(text, schema_types(schema))
    assert got == want and type(got) is type(want)


def test_xml_args_stream_string_values_and_hold_typed_ones():
    args = XmlArgs({"properties": {"s": {"type": "string"}, "n": {"type": "integer"}}})
    out = args.begin("s") + args.chunk('a"b') + args.chunk("\n") + args.end()
    assert out == '{"s": "a\\"b\\n"'
    assert args.begin("n") == "" and args.chunk("4") == "" and args.end() == ', "n": 4'
    assert json.loads(out + ', "n": 4' + args.close()) == {"s": 'a"b\n', "n": 4}


def test_raw_newlines_in_strings_are_escaped():
    args = JsonArgs()
    out = args.push('{"code": "a\n\tb"}')
    last, status = args.close()
    assert status == "complete" and json.loads(out + last) == {"code": "a\n\tb"}
