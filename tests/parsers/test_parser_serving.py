"""The server's side of the parsers (server/parsers/serving.py): the family chosen at start-up,
the history in the shapes templates read, one request's engine outputs (token ids, special
markers included) turned into deltas, and those deltas as Anthropic stream events, checked with
the anthropic SDK's own stream accumulation."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from parser_cases import CASES, TOOLS
from pydantic import TypeAdapter
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moetier.server.parsers import make_parser
from moetier.server.parsers.serving import (
    AnthropicStream,
    ChatParsing,
    ParserChoice,
    anthropic_blocks,
    choose_parser,
    count_calls,
    template_history,
)

KIMI_SPECIALS = [
    "<|im_end|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|media_pad|>",  # a special token no parser reads
]


def test_choose_parser_overrides_template_and_model_type(caplog):
    with caplog.at_level(logging.INFO, logger="moetier.parsers"):
        assert choose_parser("qwen3_moe", None).family == "hermes"
        assert choose_parser(None, "{{ '<minimax:tool_call>' }}").family == "minimax_m2"
        assert choose_parser("qwen3_moe", "x", tool_parser="kimi").family == "kimi_k2"
        assert choose_parser("qwen3_moe", "x", reasoning_parser="none").family is None
        assert choose_parser("qwen3_moe", "x", "glm47", "glm5").family == "glm47"
    assert "reasoning and tool-call parser: hermes (model_type qwen3_moe)" in caplog.text
    with pytest.raises(ValueError, match="different families"):
        choose_parser(None, None, "hermes", "kimi_k2")
    with pytest.raises(ValueError, match="unknown parser family"):
        choose_parser(None, None, "nope")


def test_unknown_model_serves_plain_text_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="moetier.parsers"):
        choice = choose_parser("llama", "{{ messages }}")
    assert choice.family is None
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "--tool-parser" in caplog.records[0].getMessage()
    assert choice.describe() == {"tool_parser": None, "reasoning_parser": None}


def test_template_history_gives_each_template_its_argument_shape():
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "think",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": {"y": 2}}},
            ],
        },
    ]
    mapped = template_history(history, "qwen3_coder")
    assert [c["function"]["arguments"] for c in mapped[1]["tool_calls"]] == [{"x": 1}, {"y": 2}]
    assert mapped[1]["reasoning_content"] == "think"
    strings = template_history(history, "deepseek_v31")
    assert [c["function"]["arguments"] for c in strings[1]["tool_calls"]] == [
        '{"x": 1}',
        '{"y": 2}',
    ]
    assert template_history(history, "harmony")[1]["thinking"] == "think"
    assert history[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # not changed
    assert count_calls(history) == 2


@pytest.fixture(scope="module")
def kimi_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=KIMI_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([c.raw for c in CASES if c.family == "kimi_k2"] * 3, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", additional_special_tokens=KIMI_SPECIALS[1:]
    )


def _outputs(tokenizer, raw: str, per: int = 3):
    ids = tokenizer.encode(raw, add_special_tokens=False) + [tokenizer.eos_token_id]
    chunks = [ids[i : i + per] for i in range(0, len(ids), per)]
    for n, chunk in enumerate(chunks):
        last = n == len(chunks) - 1
        yield SimpleNamespace(
            text="(engine text: special tokens dropped)",
            token_ids=[t for t in chunk if t != tokenizer.eos_token_id],
            finish_reason="stop" if last else None,
        )


@pytest.mark.parametrize("case", [c for c in CASES if c.family == "kimi_k2"], ids=lambda c: c.id)
def test_chat_parsing_reads_special_tokens_from_token_ids(kimi_tokenizer, case):
    parsing = ChatParsing(
        ParserChoice("kimi_k2", "test"),
        kimi_tokenizer,
        kimi_tokenizer.encode("<|im_end|>assistant"),
        tools=TOOLS,
        call_offset=case.call_offset,
        end_ids=frozenset({kimi_tokenizer.eos_token_id}),
    )
    for out in _outputs(kimi_tokenizer, case.raw):
        parsing.push(out)
    want = make_parser("kimi_k2", tools=TOOLS, call_offset=case.call_offset).parse(case.raw)
    assert parsing.message.tool_calls == want.tool_calls
    assert parsing.message.content == want.content
    assert parsing.message.reasoning_content == want.reasoning_content
    assert parsing.finish_reason("stop") == "tool_calls"
    assert parsing.finish_reason("length") == "length"


def test_tools_absent_leave_call_markup_in_content(kimi_tokenizer):
    raw = "<|tool_calls_section_begin|>x<|tool_calls_section_end|>"
    parsing = ChatParsing(ParserChoice("kimi_k2", "t"), kimi_tokenizer, [0], tools=None)
    for out in _outputs(kimi_tokenizer, raw):
        parsing.push(out)
    assert parsing.message.content == raw and parsing.message.tool_calls == []
    assert parsing.finish_reason("stop") == "stop"


def test_plain_text_passes_engine_text_unchanged(kimi_tokenizer):
    parsing = ChatParsing(ParserChoice(None, "t"), kimi_tokenizer, [0], tools=TOOLS)
    outs = [
        SimpleNamespace(text=" a <think>b", token_ids=[1], finish_reason=None),
        SimpleNamespace(text="</think> ", token_ids=[2], finish_reason="stop"),
    ]
    assert [parsing.push(o).content for o in outs] == [" a <think>b", "</think> "]
    assert not parsing.active


def test_forced_tool_choice_reads_the_grammar_form(kimi_tokenizer):
    """tool_choice required / named: the grammar writes <tool_call>{"name", "arguments"}
    </tool_call> whatever the family; the request parses that form."""
    raw = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    parsing = ChatParsing(
        ParserChoice("kimi_k2", "t"),
        kimi_tokenizer,
        [0],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    for out in _outputs(kimi_tokenizer, raw):
        parsing.push(out)
    [call] = parsing.message.tool_calls
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("case", [c for c in CASES if c.calls or c.reasoning], ids=lambda c: c.id)
def test_anthropic_events_accumulate_to_the_message(case):
    """The SDK's own accumulation of our events gives the blocks of the whole message."""
    parser = make_parser(
        case.family,
        tools=TOOLS,
        starts_in_reasoning=case.starts_in_reasoning,
        call_offset=case.call_offset,
    )
    stream = AnthropicStream()
    events: list[tuple[str, dict]] = [
        (
            "message_start",
            {
                "message": {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "model": "m",
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": 1, "output_tokens": 0},
                }
            },
        )
    ]
    for i in range(0, len(case.raw), 7):
        events += stream.events(parser.feed(case.raw[i : i + 7]))
    events += stream.events(parser.finish())
    events += stream.close()
    adapter = TypeAdapter(RawMessageStreamEvent)
    snapshot, bufs = None, {}
    for name, data in events:
        event = adapter.validate_python({"type": name, **data})
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    whole = make_parser(
        case.family,
        tools=TOOLS,
        starts_in_reasoning=case.starts_in_reasoning,
        call_offset=case.call_offset,
    )
    message = whole.parse(case.raw)
    got = [b.model_dump(exclude_none=True) for b in snapshot.content]
    want = anthropic_blocks(message)
    for block in got + want:
        if block["type"] == "tool_use":
            block["id"] = "x"
        block.pop("citations", None)
    # a call found broken (cut, not JSON) was held back and never sent: the SDK has no
    # tool_use for it, and its markup comes as text, as in the message
    assert got == want


def _sdk_blocks(events: list[tuple[str, dict]]) -> list[dict]:
    """The content blocks Anthropic's SDK accumulates from our stream events."""
    start = {"message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                         "content": [], "stop_reason": None, "stop_sequence": None,
                         "usage": {"input_tokens": 1, "output_tokens": 0}}}  # fmt: skip
    adapter = TypeAdapter(RawMessageStreamEvent)
    snapshot, bufs = None, {}
    for name, data in [("message_start", start), *events]:
        event = adapter.validate_python({"type": name, **data})
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    return [b.model_dump(exclude_none=True) for b in snapshot.content]


@pytest.mark.parametrize(
    "family, raw",
    [
        ("hermes", 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
            'get_weather\n```json\n{"city": "Oslo", "da',
        ),  # fmt: skip
    ],
)
def test_a_call_cut_by_max_tokens_never_reaches_the_sdk_as_a_tool_use(family, raw):
    """Cut mid-arguments (max_tokens): Anthropic's SDK reads partial JSON leniently, so a
    streamed tool_use would be a call with made-up input; the block is held until the call is
    whole, and a cut one arrives as its markup in text, as the answer sent whole has it."""
    parser, whole = make_parser(family, tools=TOOLS), make_parser(family, tools=TOOLS)
    stream = AnthropicStream()
    events = []
    for i in range(0, len(raw), 5):
        events += stream.events(parser.feed(raw[i : i + 5]))
        if '"city"' in raw[: i + 5]:
            assert stream.holding  # (the parser has announced the call by now)
    events += stream.events(parser.finish())
    events += stream.close()
    blocks = _sdk_blocks(events)
    assert [b["type"] for b in blocks] == ["text"]
    assert blocks == anthropic_blocks(whole.parse(raw)) and raw.endswith(blocks[0]["text"][-5:])


def test_special_tokens_other_than_the_markers_stay_out(kimi_tokenizer):
    parsing = ChatParsing(ParserChoice("kimi_k2", "t"), kimi_tokenizer, [0], tools=TOOLS)
    for out in _outputs(kimi_tokenizer, "On<|media_pad|> it."):
        parsing.push(out)
    assert parsing.message.content == "On it."


def test_markers_name_what_each_family_reads():
    from moetier.server.parsers import FAMILIES

    for cls in FAMILIES.values():
        think = [getattr(cls, "think_start", None), getattr(cls, "think_end", None)]
        for marker in [*cls.call_markers, *(t for t in think if t)]:
            assert marker in cls.markers, (cls.family, marker)


QWEN35_PROMPT = (  # Qwen3.5's generation prompt (chat-templates/qwen3.5.jinja)
    "{% for m in messages %}<|im_end|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_end|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": True}, {"enable_thinking": False}])
def test_template_kwargs_set_the_reasoning_state(kimi_tokenizer, kwargs):
    """c5: enable_thinking reaches the template, and the rendered prompt decides whether the
    output begins as reasoning."""
    from moetier.engine.sampler import SamplingParams
    from moetier.server.parsers.serving import prepare_chat

    kimi_tokenizer.chat_template = QWEN35_PROMPT
    engine = SimpleNamespace(
        tokenizer=kimi_tokenizer,
        engine=SimpleNamespace(chat_end_ids={kimi_tokenizer.eos_token_id}),
    )
    _, _, parsing = prepare_chat(
        engine,
        ParserChoice("qwen3_coder", "t"),
        [{"role": "user", "content": "hi"}],
        SamplingParams(),
        template_kwargs=kwargs,
    )
    for out in _outputs(kimi_tokenizer, "Four.</think>4"):
        parsing.push(out)
    thinking = kwargs is None or kwargs["enable_thinking"]
    if thinking:
        assert (parsing.message.reasoning_content, parsing.message.content) == ("Four.", "4")
    else:  # the stray </think> is dropped, never shown
        assert (parsing.message.reasoning_content, parsing.message.content) == (None, "Four.4")
    with pytest.raises(ValueError, match="may not set tools"):
        prepare_chat(engine, None, [], SamplingParams(), template_kwargs={"tools": []})


def test_template_kwargs_defaults_and_anthropic_thinking():
    from moetier.server.parsers.serving import (
        anthropic_thinking,
        parse_template_kwargs,
        template_kwargs,
    )

    defaults = parse_template_kwargs('{"enable_thinking": false, "x": 1}')
    assert template_kwargs(defaults, {"enable_thinking": True}) == {"enable_thinking": True, "x": 1}
    assert anthropic_thinking({"type": "disabled"}) == {"enable_thinking": False, "thinking": False}
    assert anthropic_thinking(None) == {}
    with pytest.raises(ValueError, match="JSON object"):
        parse_template_kwargs("[1]")


@pytest.mark.parametrize(
    ("prefill", "reasoning", "content"),
    [
        ("<think>\nI should", " add.", None),  # open reasoning: the continuation is reasoning
        ("<think>Sum.</think>The answer", None, " is 4."),  # closed: content (ds4 #897)
        ("The answer", None, " is 4."),  # no markers: as the template left it (content)
    ],
)
def test_assistant_prefill_is_continued_in_its_state(kimi_tokenizer, prefill, reasoning, content):
    from moetier.server.parsers.serving import prepare_chat

    kimi_tokenizer.chat_template = QWEN35_PROMPT
    engine = SimpleNamespace(
        tokenizer=kimi_tokenizer,
        engine=SimpleNamespace(chat_end_ids={kimi_tokenizer.eos_token_id}),
    )
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": prefill}]
    ids, _, parsing = prepare_chat(engine, ParserChoice("qwen3_coder", "t"), messages, _params())
    rendered = kimi_tokenizer.decode(ids)
    assert rendered.endswith(prefill) and "assistant\n<think>" not in rendered  # no new turn
    raw = " add.</think>4" if reasoning else " is 4."
    for out in _outputs(kimi_tokenizer, raw):
        parsing.push(out)
    assert parsing.message.reasoning_content == reasoning  # " add.": it goes on mid-sentence
    assert parsing.message.content == ("4" if reasoning else content)


def _params():
    from moetier.engine.sampler import SamplingParams

    return SamplingParams()


def test_template_type_errors_are_request_errors(kimi_tokenizer):
    """c6: a template that fails on what it is given (`'…' + none`) is a 400, not a 500."""
    from moetier.server.parsers.serving import prepare_chat

    kimi_tokenizer.chat_template = "{{ '<|im_end|>' + messages[0]['content'] }}"
    engine = SimpleNamespace(tokenizer=kimi_tokenizer, engine=SimpleNamespace(chat_end_ids=set()))
    with pytest.raises(ValueError, match="chat template refused"):
        prepare_chat(engine, None, [{"role": "user", "content": None}], _params())


STRICT_SYSTEM = (  # as Qwen3.5's and Mistral's templates insist (llama.cpp #20733)
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|im_end|>{{ m.role }}:{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_end|>assistant:{% endif %}"
)


def test_relaxed_template_moves_system_messages_first(kimi_tokenizer):
    """c6: a template's raise_exception is a 400 with its message; --relaxed-chat-template
    retries with the system messages joined at the front."""
    from moetier.server.parsers.serving import prepare_chat

    kimi_tokenizer.chat_template = STRICT_SYSTEM
    engine = SimpleNamespace(tokenizer=kimi_tokenizer, engine=SimpleNamespace(chat_end_ids=set()))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Reminder."},
    ]
    with pytest.raises(ValueError, match="System message must be at the beginning"):
        prepare_chat(engine, None, messages, _params())
    ids, _, _ = prepare_chat(engine, None, messages, _params(), relaxed=True)
    text = kimi_tokenizer.decode(ids)
    assert text == "<|im_end|>system:Be brief.\n\nReminder.<|im_end|>user:Hi<|im_end|>assistant:"


@pytest.mark.parametrize(
    "tool_choice",
    ["sometimes", {"type": "function"}, {"type": "function", "function": {"name": 3}},
     {"type": "function", "function": {"name": "nope"}}, ["required"]],
)  # fmt: skip
@pytest.mark.parametrize("family", ["kimi_k2", "glm47", None])
def test_bad_tool_choice_is_a_request_error(tool_choice, family):
    from moetier.server.parsers.forced import forced_call_grammar

    with pytest.raises(ValueError, match="tool_choice"):
        forced_call_grammar(family, TOOLS, tool_choice, False, None)


@pytest.mark.parametrize("case", [c for c in CASES if c.withdrawn], ids=lambda c: c.id)
def test_a_call_broken_after_it_streamed(case):
    """#44: a call found broken after its first delta went out. The accumulated message (the
    non-streamed answer) has no such call, only its markup as content; the OpenAI stream has
    its header and the fragments up to the break, no closing fragment (so no client runs it
    with cut values) and then the markup as content; Responses' output items drop it."""
    from moetier.server.responses import OutputItems

    parser = make_parser(case.family, tools=TOOLS, starts_in_reasoning=case.starts_in_reasoning)
    deltas = [parser.feed(case.raw[i : i + 5]) for i in range(0, len(case.raw), 5)]
    deltas.append(parser.finish())
    wire: dict[int, str] = {}
    names: dict[int, str] = {}
    content = ""
    items = OutputItems()
    for delta in deltas:
        chunk = delta.openai()
        content += chunk.get("content", "")
        for piece in chunk.get("tool_calls", []):
            if "id" in piece:
                names[piece["index"]] = piece["function"]["name"]
                wire[piece["index"]] = ""
            wire[piece["index"]] += piece["function"]["arguments"]
        items.push(delta)
    items.close("stop")
    whole = make_parser(case.family, tools=TOOLS, starts_in_reasoning=case.starts_in_reasoning)
    message = whole.parse(case.raw)
    assert message.content == case.content and content == case.content
    assert len(wire) == len(case.calls) + case.withdrawn
    broken = [i for i, args in wire.items() if not _is_json(args)]
    assert len(broken) == case.withdrawn
    kept = [(names[i], json.loads(wire[i])) for i in sorted(wire) if i not in broken]
    assert kept == case.calls
    calls = [i for i in items.items if i["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == case.calls
    texts = [i["content"][0]["text"] for i in items.items if i["type"] == "message"]
    assert "".join(texts) == case.content


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("per", [1, 3, 100])
def test_reasoning_tokens_are_counted_exactly(kimi_tokenizer, per):
    """ChatParsing counts the generated tokens read in reasoning: from the first (the prompt
    opened `<think>`) through the token that completes `</think>`, none after, however the
    engine's outputs split the tokens."""
    raw = "The user asks about the weather.</think>It is sunny."
    ids = kimi_tokenizer.encode(raw, add_special_tokens=False)
    closes = next(k for k in range(len(ids)) if "</think>" in kimi_tokenizer.decode(ids[: k + 1]))
    assert 0 < closes < len(ids) - 1  # reasoning tokens, then content tokens
    parsing = ChatParsing(
        ParserChoice("kimi_k2", "test"),
        kimi_tokenizer,
        kimi_tokenizer.encode("<|im_end|>assistant<think>"),
        end_ids=frozenset({kimi_tokenizer.eos_token_id}),
    )
    assert parsing.starts_in_reasoning
    for out in _outputs(kimi_tokenizer, raw, per):
        parsing.push(out)
    assert parsing.message.reasoning_content == "The user asks about the weather."
    assert parsing.message.content == "It is sunny."
    assert parsing.reasoning_tokens == closes + 1
    plain = ChatParsing(
        ParserChoice("kimi_k2", "test"), kimi_tokenizer, kimi_tokenizer.encode("assistant")
    )
    for out in _outputs(kimi_tokenizer, "It is sunny.", per):
        plain.push(out)
    assert plain.reasoning_tokens == 0
