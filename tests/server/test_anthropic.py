"""`/v1/messages` and `/v1/messages/count_tokens` against the official `anthropic` client on a
real uvicorn server: answers equal the Generator's for the same chat messages, the stream's
events come in the documented order and accumulate to the same message, stop reasons and usage
as the API defines them, errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from uvicorn_thread import serving

from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine
from moetier.engine.generate import Generator
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model
from moetier.server.app import create_app

MODEL = "tiny-qwen3"
SYSTEM = "Be brief."
USER = "Hello there"


@pytest.fixture(scope="module")
def server(tiny):
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))
    with serving(create_app(AsyncEngine(Engine(loaded)), MODEL)) as url:
        yield url, Generator(loaded)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0)


def alone(generator, max_tokens: int, stop: tuple[str, ...] = (), system: str = SYSTEM):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": USER}]
    ids = generator.chat_prompt_ids(messages)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0, stop=stop)
    return ids, generator.generate(ids, params, chat=True)


def test_message(server, client):
    ids, want = alone(server[1], 8)
    reply = client.messages.create(
        model=MODEL,
        max_tokens=8,
        system=SYSTEM,
        messages=[{"role": "user", "content": USER}],
        extra_body={"temperature": 0},  # this SDK has no temperature argument
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == want.text
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.finish_reason]
    assert reply.stop_sequence is None
    generated = len(want.token_ids) + (want.finish_reason == "stop")
    assert reply.usage.output_tokens == generated
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == len(ids)


def test_stream_events_and_accumulated_message(server, client):
    _, want = alone(server[1], 10)
    kwargs = dict(
        model=MODEL,
        max_tokens=10,
        system=[{"type": "text", "text": SYSTEM}],  # blocks: the same prompt as the string
        messages=[{"role": "user", "content": [{"type": "text", "text": USER}]}],
        extra_body={"temperature": 0},  # this SDK has no temperature argument
    )
    with httpx.stream("POST", server[0] + "/v1/messages", json={**kwargs, "stream": True,
                      "temperature": 0}) as raw:  # fmt: skip
        wire = [line[7:] for line in raw.iter_lines() if line.startswith("event: ")]
    assert wire[:3] == ["message_start", "content_block_start", "ping"]  # the SDK hides pings
    assert wire[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(wire[3:-3]) == {"content_block_delta"}
    events = list(client.messages.create(stream=True, **kwargs))
    assert [event.type for event in events] == [name for name in wire if name != "ping"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == want.text
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == want.text == final.content[0].text
    assert final.stop_reason in ("max_tokens", "end_turn")
    assert final.usage.output_tokens == events[-2].usage.output_tokens > 0


def test_stop_sequence(server, client):
    _, full = alone(server[1], 12)
    stop = full.text[2:4]
    assert len(stop) == 2 and "\ufffd" not in stop, "the fixed tiny model's answer can be cut"
    _, want = alone(server[1], 12, stop=(stop,))
    reply = client.messages.create(
        model=MODEL,
        max_tokens=12,
        system=SYSTEM,
        messages=[{"role": "user", "content": USER}],
        extra_body={"temperature": 0},  # this SDK has no temperature argument
        stop_sequences=[stop],
    )
    assert reply.content[0].text == want.text
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop


def test_count_tokens(server, client):
    ids, _ = alone(server[1], 1)
    counted = client.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": USER}]
    )
    assert counted.input_tokens == len(ids)


def test_tool_history_is_accepted(server, client):
    reply = client.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=[
            {"role": "user", "content": "What is the weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "use the tool", "signature": "x"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "X"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"}],
            },
        ],
        tools=[{"name": "weather", "description": "weather", "input_schema": {"type": "object"}}],
        extra_body={"temperature": 0},  # this SDK has no temperature argument
    )
    assert reply.content[0].type == "text" and reply.usage.output_tokens >= 1


def test_errors_in_anthropics_shape(server, client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError, match="image content blocks"):
        client.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    raw = httpx.post(server[0] + "/v1/messages", json={"model": MODEL, "messages": []})
    assert raw.status_code == 400
    body = raw.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    too_long = httpx.post(
        server[0] + "/v1/messages",
        json={"model": MODEL, "max_tokens": 10**6, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert too_long.status_code == 400 and "context length" in too_long.json()["error"]["message"]
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS" in too_long.json()["error"]["message"]  # what to do


def test_context_errors_in_anthropics_words(server, client):
    """A request past the context is refused in Anthropic's own words, with its numbers, which
    clients parse: Claude Code retries `input length and `max_tokens` exceed context limit: I + O
    > N` with a smaller max_tokens (its default 32000 fits no small context), and reads `prompt
    is too long: I tokens > N maximum` as a context to compact. Streamed or not alike."""
    context = client.models.retrieve(MODEL).max_input_tokens
    user = [{"role": "user", "content": USER}]
    prompt = client.messages.count_tokens(model=MODEL, messages=user).input_tokens
    for stream in (False, True):
        too_long = httpx.post(
            server[0] + "/v1/messages",
            json={"model": MODEL, "max_tokens": 32000, "messages": user, "stream": stream},
        )
        assert too_long.status_code == 400
        message = too_long.json()["error"]["message"]
        assert message.startswith(
            f"input length and `max_tokens` exceed context limit: {prompt} + 32000 > {context}, "
            "decrease input length or `max_tokens` and try again"
        )
        assert f"the prompt leaves room for {context - prompt}" in message  # what to do
    long = [{"role": "user", "content": "hello " * context}]
    prompt = client.messages.count_tokens(model=MODEL, messages=long).input_tokens
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=1, messages=long)
    message = info.value.body["error"]["message"]
    assert message.startswith(f"prompt is too long: {prompt} tokens > {context} maximum")


def test_anthropic_wording_of_the_requests_errors(server, client):
    """Errors name Anthropic's terms: tool_choice's types (auto, any, tool, none), not OpenAI's;
    "an assistant message"; an empty content list is a 400 naming the message (Anthropic's
    words), except on a final assistant message (a prefill), not a turn silently dropped."""
    tools = [{"name": "weather", "input_schema": {"type": "object"}}]
    user = [{"role": "user", "content": USER}]
    for choice in ({"type": "required"}, {"type": "function", "function": {"name": "weather"}}):
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(
                model=MODEL, max_tokens=2, messages=user, tools=tools, tool_choice=choice
            )
        message = info.value.body["error"]["message"]
        assert "auto, any, tool" in message and "required" not in message.split(":")[-1]
    with pytest.raises(anthropic.BadRequestError, match="type tool needs the tool's name"):
        client.messages.create(
            model=MODEL, max_tokens=2, messages=user, tools=tools, tool_choice={"type": "tool"}
        )
    server_tool = {"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {}}
    with pytest.raises(anthropic.BadRequestError, match="cannot be in an assistant message"):
        client.messages.create(
            model=MODEL,
            max_tokens=2,
            messages=[*user, {"role": "assistant", "content": [server_tool]}, *user],
        )
    empty_cases = [
        [{"role": "user", "content": []}],
        [*user, {"role": "assistant", "content": []}, *user],
        [{"role": "user", "content": []}, {"role": "assistant", "content": "Hi"}, *user],
        [{"role": "user", "content": ""}],  # an empty string likewise
        [*user, {"role": "assistant", "content": ""}, *user],
    ]
    for messages in empty_cases:
        n = next(i for i, m in enumerate(messages) if m["content"] in ([], ""))
        want = f"messages.{n}: all messages must have non-empty content"
        with pytest.raises(anthropic.BadRequestError, match=want):
            client.messages.create(model=MODEL, max_tokens=2, messages=messages)
        with pytest.raises(anthropic.BadRequestError, match=want):
            client.messages.count_tokens(model=MODEL, messages=messages)
    # a final assistant message may be empty: the answer starts the assistant turn
    prefill = [*user, {"role": "assistant", "content": []}]
    reply = client.messages.create(model=MODEL, max_tokens=2, messages=prefill)
    assert reply.usage.output_tokens >= 1


def billing_line(cch: str) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.77.a1b; cc_entrypoint=cli; cch={cch};"


CLAUDE_SYSTEM = "You are an agent for software engineering tasks. " * 2


def test_billing_line_does_not_defeat_the_prefix_cache(server, client):
    """Claude Code starts its system prompt with a billing line that changes every request (as
    its own block, or as the first line of the text): it is dropped before the chat template, so
    two requests differing only in it share the whole prompt's cached pages."""
    page = 16  # the engine's default page size
    as_block, as_line = CLAUDE_SYSTEM, CLAUDE_SYSTEM.replace("agent", "aide.")
    for text, system_of in (
        (as_block, lambda cch: [{"type": "text", "text": billing_line(cch)},
                                {"type": "text", "text": as_block}]),
        (as_line, lambda cch: billing_line(cch) + "\n" + as_line),
    ):  # fmt: skip
        ids, _ = alone(server[1], 2, system=text)
        first, second = (
            client.messages.create(
                model=MODEL, max_tokens=2, system=system_of(cch),
                messages=[{"role": "user", "content": USER}],
            )
            for cch in ("0a1b2", "9f8e7")
        )  # fmt: skip
        total = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
        assert total == len(ids)  # the prompt without the line
        assert first.usage.cache_read_input_tokens == 0
        # every whole page of the prompt but the last position's came from the cache
        assert second.usage.cache_read_input_tokens == (len(ids) - 1) // page * page > 0
        counted = client.messages.count_tokens(
            model=MODEL, system=system_of("x"), messages=[{"role": "user", "content": USER}]
        )
        assert counted.input_tokens == len(ids)


def test_message_start_usage_agrees_with_the_final_usage(server, client):
    """The same long prompt streamed twice: message_start's usage carries the final usage's input
    accounting (uncached input, cache reads, cache creation), so on the second turn it already
    reports the prefix-cache hit, as Anthropic's API does (Claude Code reads the context's size
    from message_start); input_tokens + cache_read_input_tokens is the prompt in every event,
    and the non-streamed answer counts the same."""
    page = 16  # the engine's default page size
    system = "You are a careful assistant who reads every file before changing it. " * 2
    ids, _ = alone(server[1], 3, system=system)
    assert len(ids) > 4 * page
    kwargs = dict(
        model=MODEL,
        max_tokens=3,
        system=system,
        messages=[{"role": "user", "content": USER}],
        extra_body={"temperature": 0},  # this SDK has no temperature argument
    )
    turns = []
    for _ in range(2):
        events = list(client.messages.create(stream=True, **kwargs))
        assert events[0].type == "message_start"
        assert [e.type for e in events].count("message_start") == 1
        (delta,) = [e for e in events if e.type == "message_delta"]
        start, end = events[0].message.usage, delta.usage
        for usage in (start, end):
            assert usage.input_tokens + usage.cache_read_input_tokens == len(ids)
            assert usage.cache_creation_input_tokens == 0
        assert start.input_tokens == end.input_tokens
        assert start.cache_read_input_tokens == end.cache_read_input_tokens
        assert 1 <= start.output_tokens <= end.output_tokens
        turns.append(start)
    first, second = turns
    assert first.cache_read_input_tokens == 0  # a prompt no earlier test sent
    # every whole page of the prompt but the last position's came from the cache
    assert second.cache_read_input_tokens == (len(ids) - 1) // page * page > 0
    with client.messages.stream(**kwargs) as stream:  # the SDK's accumulated message
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens == second.cache_read_input_tokens
    assert final.usage.input_tokens == second.input_tokens
    reply = client.messages.create(**kwargs)
    assert reply.usage.cache_read_input_tokens == second.cache_read_input_tokens
    assert reply.usage.input_tokens == second.input_tokens


def test_a_stream_refused_by_the_engine_is_one_error_event(server, client, monkeypatch):
    """A request the engine refuses when it takes it (before admission: no prefix match, no
    output) gets an `error` event in Anthropic's shape and no message_start (whose usage could
    not be known), and the official client raises it."""

    def refuse(self, request_id, *args, **kwargs):
        raise ValueError("the engine refuses this request")

    monkeypatch.setattr(Engine, "add", refuse)
    kwargs = dict(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": USER}])
    with httpx.stream("POST", server[0] + "/v1/messages", json={**kwargs, "stream": True}) as raw:
        assert raw.status_code == 200
        lines = [line for line in raw.iter_lines() if line and not line.startswith(":")]
    assert lines[0] == "event: error" and len(lines) == 2
    error = json.loads(lines[1].removeprefix("data: "))
    assert error == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "the engine refuses this request"},
    }
    with pytest.raises(anthropic.APIStatusError, match="the engine refuses this request"):
        list(client.messages.create(stream=True, **kwargs))


def test_thinking_budget_reaches_the_engine_as_a_reasoning_budget(server, client, monkeypatch):
    """`thinking: {type: enabled, budget_tokens: N}` asks the engine for at most N tokens before
    the family's end-of-reasoning marker (`</think>` for the tiny model's hermes parser, as its
    tokenizer splits it); a budget that is not a whole number >= 1 is a 400."""
    seen = []
    real = AsyncEngine.generate

    def spy(self, prompt_ids, params, **kwargs):
        seen.append(params)
        return real(self, prompt_ids, params, **kwargs)

    monkeypatch.setattr(AsyncEngine, "generate", spy)
    reply = client.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=[{"role": "user", "content": "Hello"}],
        thinking={"type": "enabled", "budget_tokens": 3},
    )
    assert reply.usage.output_tokens > 0
    tokenizer = server[1].tokenizer
    assert seen[-1].reasoning_budget == (  # the prompt does not open reasoning: the model must
        3,
        tuple(tokenizer.encode("</think>", add_special_tokens=False)),
        tuple(tokenizer.encode("<think>", add_special_tokens=False)),
    )
    client.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
    )
    assert seen[-1].reasoning_budget is None
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=[{"role": "user", "content": "Hello"}],
            thinking={"type": "enabled", "budget_tokens": 0},
        )


def test_a_thinking_budget_forces_nothing_into_an_answer_that_does_not_reason(server, client):
    """The tiny model's prompt does not open `<think>` and its greedy answer does not either: a
    budget smaller than the answer leaves it exactly the Generator's greedy answer (no
    `</think>` forced into plain text, which would change every token after it)."""
    ids, want = alone(server[1], 12)
    assert not want.text.lstrip().startswith("<think>")
    reply = client.messages.create(
        model=MODEL,
        max_tokens=12,
        system=SYSTEM,
        messages=[{"role": "user", "content": USER}],
        thinking={"type": "enabled", "budget_tokens": 2},
        extra_body={"temperature": 0},  # this SDK has no temperature argument
    )
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == want.text
    assert reply.usage.output_tokens == len(want.token_ids) + (want.finish_reason == "stop")


def test_anthropics_own_tools_are_left_out(server, client, caplog, monkeypatch):
    """Anthropic's own tools (a versioned type, no input_schema: web_search_20250305,
    bash_20250124, ...) are not functions this model has: they are left out of the chat
    template's tools, said once in the log, and the request is answered (Claude Code offers
    web_search); a custom tool beside them reaches the template as without them. tool_choice
    naming one, or `any` with no other tool, is a 400 that says so; another type: 400."""
    from moetier.server import anthropic as route

    offered = []
    real = route.prepare_chat

    def spy(engine, parser, messages, params, tools=None, *args, **kwargs):
        offered.append(tools)
        return real(engine, parser, messages, params, tools, *args, **kwargs)

    monkeypatch.setattr(route, "prepare_chat", spy)
    weather = {"name": "weather", "input_schema": {"type": "object"}}
    function = {"name": "weather", "description": "", "parameters": {"type": "object"}}
    own = [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
        {"type": "bash_20250124", "name": "bash"},
        {"type": "text_editor_20250124", "name": "str_replace_based_edit_tool"},
    ]
    user = [{"role": "user", "content": USER}]
    with caplog.at_level("WARNING", logger="moetier.server"):
        for _ in range(2):
            client.messages.count_tokens(
                model=MODEL, messages=user, tools=[*own, {**weather, "type": "custom"}]
            )
            assert offered[-1] == [{"type": "function", "function": function}]
            reply = client.messages.create(model=MODEL, max_tokens=2, messages=user, tools=own)
            assert reply.usage.output_tokens >= 1
            assert offered[-1] is None
    said = [r.getMessage() for r in caplog.records if "web_search_20250305" in r.getMessage()]
    assert len(said) == 1 and "left out" in said[0]
    refused = [
        ({"type": "tool", "name": "web_search"}, [*own, weather], "web_search_20250305"),
        ({"type": "any"}, own, "only tools are Anthropic's own"),
    ]
    for choice, tools, match in refused:
        with pytest.raises(anthropic.BadRequestError, match=match):
            client.messages.create(
                model=MODEL, max_tokens=2, messages=user, tools=tools, tool_choice=choice
            )
    forced = client.messages.create(
        model=MODEL, max_tokens=30, messages=user, tools=[*own, weather],
        tool_choice={"type": "tool", "name": "weather"},
    )  # fmt: skip
    assert forced.stop_reason in ("tool_use", "max_tokens")
    with pytest.raises(anthropic.BadRequestError, match="tools.0: type 'function'"):
        client.messages.count_tokens(
            model=MODEL, messages=user, tools=[{"type": "function", "name": "f"}]
        )
    malformed = [
        ({"name": "f", "input_schema": "object"}, "tools.0.input_schema: must be a JSON schema"),
        ({"input_schema": {"type": "object"}}, "tools.0.name: a custom tool needs a name"),
        ({"name": "", "type": "custom"}, "tools.0.name"),
    ]
    for tool, match in malformed:  # a 400 naming the field, not a template's 500
        with pytest.raises(anthropic.BadRequestError, match=match):
            client.messages.count_tokens(model=MODEL, messages=user, tools=[tool])
        with pytest.raises(anthropic.BadRequestError, match=match):
            client.messages.create(model=MODEL, max_tokens=2, messages=user, tools=[tool])


def test_streamed_thinking_has_the_whole_answers_fields(server, client):
    """A thinking block streams as Anthropic streams it: content_block_start with an empty
    thinking and signature, thinking_delta events, then a signature_delta just before its
    content_block_stop; the official SDK's accumulated message then has the same blocks, field
    for field, as the answer sent whole (the tiny model, its prompt ending in `<think>`, is
    cut by max_tokens while it reasons: all of its answer is thinking)."""
    kwargs = dict(
        model=MODEL,
        max_tokens=8,
        messages=[
            {"role": "user", "content": USER},
            {"role": "assistant", "content": "<think>"},  # continued as reasoning
        ],
        extra_body={"temperature": 0},  # this SDK has no temperature argument
    )
    whole = client.messages.create(**kwargs)
    assert [block.type for block in whole.content] == ["thinking"]
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    body = {**kwargs, **kwargs["extra_body"], "stream": True}
    del body["extra_body"]
    with httpx.stream("POST", server[0] + "/v1/messages", json=body) as raw:
        events = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: ")]
    blocks = [e for e in events if e["type"].startswith("content_block")]
    assert blocks[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    deltas = [e["delta"]["type"] for e in blocks if e["type"] == "content_block_delta"]
    assert set(deltas[:-1]) == {"thinking_delta"} and deltas[-1] == "signature_delta"
    assert blocks[-2]["delta"] == {"type": "signature_delta", "signature": ""}
    assert blocks[-1] == {"type": "content_block_stop", "index": 0}

    # a thinking block that another block follows gets its signature before its stop too
    from moetier.server.parsers.base import Delta
    from moetier.server.parsers.serving import AnthropicStream

    stream_ = AnthropicStream()
    delta = Delta()
    delta.add("reasoning", "hm")
    delta.add("content", "Hi")
    names = [(name, data.get("delta", {}).get("type")) for name, data in stream_.events(delta)]
    names += [(name, None) for name, _ in stream_.close()]
    assert names == [
        ("content_block_start", None),
        ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", None),
        ("content_block_delta", "text_delta"),
        ("content_block_stop", None),
    ]
