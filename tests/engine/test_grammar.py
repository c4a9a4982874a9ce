"""Grammar-constrained sampling (moetier/engine/grammar.py) over the demo model's tokenizer: the
matcher accepts exactly the token sequences of documents that the independent references
(json / jsonschema / re) accept, every token its bitmask allows is accepted, end tokens close a
complete document, and random logits masked by it always give a valid document; so does a tiny
random model through the serving engine."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from moetier.config import EngineConfig
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.grammar import (
    GrammarBackend,
    Matcher,
    apply_bitmask,
    check_grammar,
    closed_objects,
    tool_call_grammar,
)
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model

DEMO = Path(__file__).resolve().parents[2] / "moetier" / "assets" / "demo-moe-10m"
VOCAB = 4100  # the logits' width in these tests: 4 ids past the tokenizer's 4096
WORDS = -(-VOCAB // 32)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def backend(tokenizer) -> GrammarBackend:
    return GrammarBackend(tokenizer, VOCAB)


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    bits = [(int(bitmask[row, t // 32]) >> (t % 32)) & 1 for t in range(VOCAB)]
    return {t for t, b in enumerate(bits) if b}


def bitmask() -> torch.Tensor:
    return torch.full((2, WORDS), -1, dtype=torch.int32)


def run(matcher: Matcher, ids: list[int], mask: torch.Tensor | None = None) -> bool:
    """Feeds ids; True if every one is accepted. With `mask`, each token the bitmask filled
    just before allows must be accepted (the mask may leave out a non-canonical spelling of
    forced text, which accept_token still takes)."""
    for t in ids:
        if mask is not None:
            matcher.fill_next_token_bitmask(mask, 1)
            allowed = (int(mask[1, t // 32]) >> (t % 32)) & 1
        ok = matcher.accept_token(t)
        if mask is not None:
            assert ok or not allowed, f"token {t}: the mask allows it, accept_token refuses it"
        if not ok:
            return False
    return True


def verdict(backend: GrammarBackend, tokenizer, kind: str, spec: str, text: str) -> bool:
    """Does the matcher take `text` as a whole document (its tokens, then an end token)?"""
    m = backend.matcher(kind, spec)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return run(m, ids, bitmask()) and run(m, [tokenizer.eos_token_id]) and m.is_terminated()


def schema_valid(schema: dict, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 200)
    | st.text('abcxyz é"\\', max_size=8)
    | st.sampled_from([1.5, -0.25]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["name", "age", "admin", "tags", "x"]), inner, max_size=4)
    ),
    max_leaves=6,
)
person_like = st.fixed_dictionaries(
    {"name": st.text("abcé", max_size=8), "age": st.integers(-3, 160)},
    optional={
        "admin": st.booleans() | st.none(),
        "tags": st.lists(st.sampled_from(["a", "b", "c"]), max_size=4),
        "x": st.integers(0, 3),
    },
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(value=person_like | json_values)
def test_json_schema_matcher_accepts_exactly_the_valid_documents(backend, tokenizer, value):
    if isinstance(value, dict):  # properties come in the schema's order (as OpenAI's do)
        order = list(PERSON["properties"]) + ["x"]
        value = dict(sorted(value.items(), key=lambda kv: order.index(kv[0])))
    text = json.dumps(value, ensure_ascii=False)  # json.dumps whitespace; é not \\u00e9
    spec = json.dumps(PERSON)
    assert verdict(backend, tokenizer, "json_schema", spec, text) == schema_valid(PERSON, text)


@pytest.mark.parametrize(
    "text, ok",
    [
        ('{"name": "ab", "age": 3}', True),
        ('{"name": "ab", "age": 3, "tags": ["a", "b"]}', True),
        ('{"name": "ab"}', False),  # age is required
        ('{"name": "ab", "age": "3"}', False),  # not an integer
        ('{"name": "ab", "age": 151}', False),  # over the maximum
        ('{"name": "abcdefg", "age": 3}', False),  # longer than maxLength
        ('{"name": "ab", "age": 3, "zzz": 1}', False),  # additionalProperties
        ('{"name": "ab", "age": 3}}', False),  # trailing text
        ('{"name":"ab","age":3}', False),  # whitespace other than json.dumps's
    ],
)
def test_json_schema_documents(backend, tokenizer, text, ok):
    assert verdict(backend, tokenizer, "json_schema", json.dumps(PERSON), text) == ok


@pytest.mark.parametrize(
    "text, ok",
    [("{}", True), ('{"a": [1, {"b": null}]}', True), ("[1]", False), ('"x"', False)],
)
def test_json_object(backend, tokenizer, text, ok):
    assert verdict(backend, tokenizer, "json_object", "", text) == ok


def test_end_tokens_only_close_a_complete_document(backend, tokenizer):
    m = backend.matcher("json_object", "")
    mask = bitmask()
    ends = backend.end_ids
    assert tokenizer.eos_token_id in ends and tokenizer.convert_tokens_to_ids("<|im_end|>") in ends
    for t in tokenizer.encode('{"a": 1', add_special_tokens=False):
        m.fill_next_token_bitmask(mask, 0)
        assert not allowed_ids(mask) & ends  # an incomplete document cannot end
        assert max(allowed_ids(mask)) < 4096  # ids past the tokenizer's never
        assert m.accept_token(t)
    assert m.accept_token(tokenizer.encode("}", add_special_tokens=False)[0])
    m.fill_next_token_bitmask(mask, 0)
    assert allowed_ids(mask) == set(ends)  # complete: only the end tokens
    assert not m.is_terminated()
    assert m.accept_token(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert m.is_terminated()
    m.fill_next_token_bitmask(mask, 0)
    assert allowed_ids(mask) == set(ends)


def test_a_refused_token_leaves_only_end_tokens(backend, tokenizer):
    m = backend.matcher("json_object", "")
    assert not m.accept_token(tokenizer.encode("x", add_special_tokens=False)[0])
    mask = bitmask()
    m.fill_next_token_bitmask(mask, 0)
    assert allowed_ids(mask) == set(backend.end_ids)  # the row never goes all -inf


@pytest.mark.parametrize("words", [WORDS - 1, WORDS + 1])
def test_a_bitmask_of_the_wrong_width_is_refused(backend, words):
    with pytest.raises(ValueError, match=f"ceil\\(vocab/32\\) = {WORDS}"):
        backend.matcher("json_object", "").fill_next_token_bitmask(
            torch.full((1, words), -1, dtype=torch.int32), 0
        )


@pytest.mark.parametrize("seed", range(3))
def test_random_logits_masked_give_schema_valid_json(backend, tokenizer, seed):
    """Random weights are the hard case: the grammar alone makes the document valid."""
    gen = torch.Generator().manual_seed(seed)
    m = backend.matcher("json_schema", json.dumps(PERSON))
    mask = torch.empty((1, WORDS), dtype=torch.int32)
    ids: list[int] = []
    while not m.is_terminated():
        assert len(ids) < 200
        logits = torch.randn(1, VOCAB, generator=gen) * 5
        m.fill_next_token_bitmask(mask, 0)
        apply_bitmask(logits, mask)
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        assert m.accept_token(token)
        ids.append(token)
    assert ids[-1] in backend.end_ids
    jsonschema.validate(json.loads(tokenizer.decode(ids[:-1])), PERSON)


@pytest.mark.parametrize("text", ["123-abc", "999-z", "12-ab", "123-", "123-abc1", "abc"])
def test_regex(backend, tokenizer, text):
    pattern = r"\d{3}-[a-z]+"
    ok = re.fullmatch(pattern, text) is not None
    assert verdict(backend, tokenizer, "regex", pattern, text) == ok


@pytest.mark.parametrize(
    "grammar",
    ['root ::= "yes" | "no" | [0-9]+', 'start: "yes" | "no" | /[0-9]+/'],  # GBNF, Lark
)
@pytest.mark.parametrize("text, ok", [("yes", True), ("no", True), ("42", True), ("maybe", False)])
def test_ebnf(backend, tokenizer, grammar, text, ok):
    assert verdict(backend, tokenizer, "ebnf", grammar, text) == ok


def test_structural_tag(backend, tokenizer):
    spec = json.dumps(
        {
            "type": "structural_tag",
            "structures": [
                {
                    "begin": "<fn=add>",
                    "schema": {
                        "type": "object",
                        "properties": {"a": {"type": "integer"}},
                        "required": ["a"],
                        "additionalProperties": False,
                    },
                    "end": "</fn>",
                }  # noqa: E501
            ],
            "triggers": ["<fn="],
        }
    )
    assert verdict(backend, tokenizer, "structural_tag", spec, "free text")
    assert verdict(backend, tokenizer, "structural_tag", spec, 'hi <fn=add>{"a": 1}</fn> bye')
    assert not verdict(backend, tokenizer, "structural_tag", spec, 'hi <fn=add>{"a": "1"}</fn>')


@pytest.mark.parametrize(
    "kind, spec, message",
    [
        ("json_schema", '{"type": "objectx"}', "objectx"),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", "[1]", "must be an object"),
        ("json_schema", '{"$ref": "#/$defs/missing"}', "missing"),
        ("regex", "a(b", "unclosed group"),
        ("ebnf", 'start: "a" undefined_rule', "undefined_rule"),
        ("structural_tag", '{"structures": []}', "structures"),
        ("xml", "", "unknown grammar kind"),
    ],
)
def test_invalid_specs_raise_value_error(backend, kind, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_grammar(kind, spec)
    with pytest.raises(ValueError, match=re.escape(message)):
        backend.matcher(kind, spec)


def test_special_tokens_are_checked_against_the_tokenizer(backend):
    check_grammar("ebnf", 'start: <no_such_token> "x"')  # fine without a tokenizer
    with pytest.raises(ValueError, match="no_such_token"):
        backend.check("ebnf", 'start: <no_such_token> "x"')


def test_apply_bitmask_matches_a_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31, (3, WORDS), dtype=torch.int64, generator=gen)
    mask = words.to(torch.int32)
    mask[2] = -1  # a row without a grammar: everything allowed
    logits = torch.randn(3, VOCAB, generator=gen)
    expected = logits.clone()
    for r in range(3):
        for t in range(VOCAB):
            if not (int(mask[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    apply_bitmask(logits, mask)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[2]).all()


@pytest.mark.gpu
def test_apply_bitmask_cuda_equals_cpu():
    gen = torch.Generator().manual_seed(1)
    vocab = 151_936
    mask = torch.randint(-(2**31), 2**31, (8, -(-vocab // 32)), generator=gen).to(torch.int32)
    logits = torch.randn(8, vocab, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    on_gpu = logits.cuda()
    apply_bitmask(logits, mask)
    apply_bitmask(on_gpu, mask.pin_memory())  # from pinned host memory, as the engine's
    apply_bitmask(on_gpu, mask.cuda())  # already on the device: the same again
    assert torch.equal(on_gpu.cpu(), logits)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
CLOCK = {"name": "now", "input_schema": {"type": "object", "properties": {}}}  # Anthropic's
TOOLS = [WEATHER, CLOCK]
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
NOW = '{"name": "now", "arguments": {}}'


def test_closed_objects_closes_declared_objects_only():
    """Objects that list properties and say nothing of others get additionalProperties false,
    at any depth (items, anyOf, $defs, a property's own schema); a property *named* like a
    keyword is a name, not a keyword; a free-form object and an explicit choice stay as they
    are; the input is not changed."""
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {}}},
            "meta": {"type": "object"},  # free-form: stays open
            "extra": {"type": "object", "properties": {}, "additionalProperties": True},
            "either": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
        },
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
    }
    before = json.dumps(schema)
    closed = closed_objects(schema)
    assert json.dumps(schema) == before
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["properties"]["properties"]  # names, not a schema
    assert props["tags"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in props["meta"]
    assert props["extra"]["additionalProperties"] is True
    assert closed["$defs"]["point"]["additionalProperties"] is False


@pytest.mark.parametrize(
    "text, ok",
    [
        ('{"city": "Oslo"}', True),
        ('{"city": "Oslo", "mood": "grey"}', False),  # a key the schema does not declare
        ('{"city": "Oslo", "meta": {"any": [1]}}', True),  # a free-form object takes any key
    ],
)
def test_json_schema_objects_take_only_their_declared_keys(backend, tokenizer, text, ok):
    """A schema that does not say additionalProperties (JSON Schema's default: anything) is
    held to its declared keys, as vLLM's default backend and OpenAI's strict mode hold it."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "meta": {"type": "object"}},
        "required": ["city"],
    }
    assert verdict(backend, tokenizer, "json_schema", json.dumps(schema), text) == ok


@pytest.mark.parametrize(
    "choice, text, ok",
    [
        ("required", '{"name": "now", "arguments": {"when": "today"}}', False),
        (
            "required",
            '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "x": 1}}',
            False,
        ),  # fmt: skip
        ("required", CALL, True),
        ("required", NOW, True),
        ({"type": "any"}, NOW, True),
        ({"type": "function", "function": {"name": "get_weather"}}, CALL, True),
        ({"type": "function", "function": {"name": "get_weather"}}, NOW, False),
        ({"type": "tool", "name": "now"}, NOW, True),
        ("required", '{"name": "get_weather", "arguments": {"city": "Oslo"}}', False),
        ("required", '{"name": "get_weather", "arguments": {"city": 1, "days": 2}}', False),
        ("required", '{"name": "nope", "arguments": {}}', False),
        ("required", "plain text", False),
    ],
)
def test_forced_tool_call(backend, tokenizer, choice, text, ok):
    kind, spec = tool_call_grammar(TOOLS, choice)
    assert verdict(backend, tokenizer, kind, spec, text) == ok


def test_forced_call_in_a_family_syntax_takes_only_declared_arguments(backend, tokenizer):
    """The server's forced call (parsers/forced.py, here the Hermes family's own syntax): a
    tool whose schema does not close its object still gets only the keys it declares."""
    from moetier.server.parsers.forced import forced_call_grammar

    tool = {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}  # fmt: skip
    (kind, spec), _ = forced_call_grammar("hermes", [tool], "required", False, tokenizer)
    call = '<tool_call>\n{{"name": "now", "arguments": {}}}\n</tool_call>'
    assert verdict(backend, tokenizer, kind, spec, call.format('{"zone": "UTC"}'))
    assert not verdict(backend, tokenizer, kind, spec, call.format('{"zone": "UTC", "x": 1}'))


def test_forced_tool_call_in_family_markers(backend, tokenizer):
    """Hermes/Qwen markers: <tool_call> is a token of the demo tokenizer, so the call must open
    with that token, not the text "<tool_call>" spelled in other tokens."""
    kind, spec = tool_call_grammar(
        TOOLS, "required", "<tool_call>\n", "\n</tool_call>", parallel=True, tokenizer=tokenizer
    )
    one = f"<tool_call>\n{CALL}\n</tool_call>"
    two = f"{one}\n<tool_call>\n{NOW}\n</tool_call>"
    assert verdict(backend, tokenizer, kind, spec, one)
    assert verdict(backend, tokenizer, kind, spec, two)
    assert not verdict(backend, tokenizer, kind, spec, CALL)  # markers required
    spelled = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "<tool_call>"]
    assert not run(backend.matcher(kind, spec), spelled)
    kind, spec = tool_call_grammar(
        TOOLS, "required", "<tool_call>\n", "\n</tool_call>", tokenizer=tokenizer
    )
    assert verdict(backend, tokenizer, kind, spec, one)
    assert not verdict(backend, tokenizer, kind, spec, two)  # one call unless parallel


def test_forced_tool_call_in_text_markers(backend, tokenizer):
    kind, spec = tool_call_grammar(TOOLS, "required", "[[call]] ", " [[end]]", parallel=True)
    one = f"[[call]] {CALL} [[end]]"
    assert verdict(backend, tokenizer, kind, spec, one)
    assert verdict(backend, tokenizer, kind, spec, f"{one}\n{one}")
    assert not verdict(backend, tokenizer, kind, spec, f"[[call]] {CALL}")


def test_random_logits_give_a_valid_forced_call(backend, tokenizer):
    kind, spec = tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "now"}})
    schema = {"const": json.loads(NOW)}
    gen = torch.Generator().manual_seed(0)
    m = backend.matcher(kind, spec)
    mask = torch.empty((1, WORDS), dtype=torch.int32)
    ids: list[int] = []
    while not m.is_terminated():
        assert len(ids) < 100
        logits = torch.randn(1, VOCAB, generator=gen)
        m.fill_next_token_bitmask(mask, 0)
        apply_bitmask(logits, mask)
        ids.append(int(logits.argmax()))
        assert m.accept_token(ids[-1])
    jsonschema.validate(json.loads(tokenizer.decode(ids[:-1])), schema)


@pytest.mark.parametrize("choice", [None, "auto", "none", {"type": "auto"}])
def test_unforced_tool_choice_gives_no_grammar(choice):
    assert tool_call_grammar(TOOLS, choice) is None


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        (TOOLS, {"type": "function", "function": {"name": "missing"}}, "not among the tools"),
        ([], "required", "no tools"),
        (TOOLS, "sometimes", "tool_choice"),
    ],
)
def test_tool_choice_errors(tools, choice, message):
    with pytest.raises(ValueError, match=message):
        tool_call_grammar(tools, choice)


def test_compiled_grammars_are_shared_and_matchers_independent(backend, tokenizer):
    spec = json.dumps(PERSON)
    a, b = backend.matcher("json_schema", spec), backend.matcher("json_schema", spec)
    assert run(a, tokenizer.encode('{"name"', add_special_tokens=False))
    assert run(b, tokenizer.encode("{", add_special_tokens=False))  # b is still at the start
    assert not run(a, tokenizer.encode("{", add_special_tokens=False))


@pytest.mark.parametrize(
    "kind, spec, text",
    [
        ("json_schema", json.dumps(PERSON), '{"name": "ab", "age": 3, "tags": ["a"]}'),
        ("json_object", "", '{"k": [1, 2.5, "é"], "n": null}'),
    ],
)
def test_every_token_the_mask_allows_is_accepted(backend, tokenizer, kind, spec, text):
    """At each step along a document, a sample of the tokens the mask allows: each one is
    accepted from that state (a fresh replay of the prefix), and none is past the tokenizer."""
    rng = random.Random(0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    mask = bitmask()
    for i in range(len(ids) + 1):
        m = backend.matcher(kind, spec)
        assert run(m, ids[:i])
        m.fill_next_token_bitmask(mask, 0)
        allowed = allowed_ids(mask)
        assert allowed and max(allowed) < 4096
        for t in rng.sample(sorted(allowed), min(20, len(allowed))):
            replay = backend.matcher(kind, spec)
            assert run(replay, ids[:i]) and replay.accept_token(t), (i, t)


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    loaded = load_model(
        tiny.store("qwen3_moe"), EngineConfig(native=False, device="cpu", dtype="float32")
    )
    return Engine(loaded, EngineLimits(num_pages=64, page_size=16))


def generate(engine, params) -> tuple[str, str | None]:
    rid = f"g{random.random()}"
    engine.add(rid, engine.tokenizer.encode("hello world"), params)
    text, finish = "", None
    while engine.has_work:
        for out in engine.step():
            text, finish = text + out.text, out.finish_reason or finish
    assert engine.pool.used_pages == 0
    return text, finish


@pytest.mark.parametrize("temperature, seed", [(0, None), (1.0, 1), (1.0, 2)])
def test_engine_random_model_writes_schema_valid_json(tiny_engine, temperature, seed):
    """A tiny random model through the serving engine: the grammar alone makes its output a
    complete document valid against the schema, greedy and sampled."""
    params = SamplingParams(
        temperature=temperature,
        seed=seed,
        max_new_tokens=200,
        grammar=("json_schema", json.dumps(PERSON)),
    )
    text, finish = generate(tiny_engine, params)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_engine_json_object(tiny_engine):
    params = SamplingParams(
        temperature=1.0, seed=3, max_new_tokens=200, grammar=("json_object", "")
    )
    text, finish = generate(tiny_engine, params)
    assert finish == "stop" and isinstance(json.loads(text), dict)


FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,  # else a random model may add keys until max_tokens
        },
    },
}


@pytest.mark.parametrize("temperature, seed", [(0, None), (1.0, 5)])
def test_engine_random_model_makes_the_forced_call(tiny_engine, temperature, seed):
    choice = {"type": "function", "function": {"name": "forecast"}}
    grammar = tool_call_grammar(
        [WEATHER, FORECAST],
        choice,
        "<tool_call>\n",
        "\n</tool_call>",
        tokenizer=tiny_engine.tokenizer,
    )
    params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=200, grammar=grammar)
    text, finish = generate(tiny_engine, params)
    assert finish == "stop"
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "forecast"
    jsonschema.validate(call["arguments"], FORECAST["function"]["parameters"])
