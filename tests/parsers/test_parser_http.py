"""Reasoning and tool calls through the real server (uvicorn, a tiny random qwen3_moe model whose
family is hermes) with the official clients: tool_choice named and required make the grammar
force a call whose arguments validate against the tool's schema, in OpenAI's streamed delta shape
and as Anthropic tool_use blocks; short agent loops with two tool round trips on both APIs; the
parser shown in /v1/models and chosen by --tool-parser."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from uvicorn_thread import serving  # noqa: E402

from moetier.config import EngineConfig  # noqa: E402
from moetier.engine.async_engine import AsyncEngine  # noqa: E402
from moetier.engine.engine import Engine  # noqa: E402
from moetier.loader.load import load_model  # noqa: E402
from moetier.server.app import create_app  # noqa: E402
from moetier.server.options import ServerOptions  # noqa: E402

MODEL = "tiny"
WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "metric": {"type": "boolean"}},
    "required": ["unit", "metric"],
    "additionalProperties": False,
}
EMPTY = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "list_files", "parameters": EMPTY}},
]
CLAUDE_TOOLS = [
    {"name": "get_weather", "description": "weather", "input_schema": WEATHER},
    {"name": "list_files", "description": "files", "input_schema": EMPTY},
]
SCHEMAS = {"get_weather": WEATHER, "list_files": EMPTY}
USER = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def loaded(tiny):
    return load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))


@pytest.fixture(scope="module")
def server(loaded):
    with serving(create_app(AsyncEngine(Engine(loaded)), MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)


def _valid(name: str, arguments: str | dict) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_models_shows_the_parser(server):
    [entry] = httpx.get(server + "/v1/models").json()["data"]
    assert entry["tool_parser"] == entry["reasoning_parser"] == "hermes"  # model_type qwen3_moe


def test_named_tool_choice_gives_a_valid_call(oai):
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=160,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    _valid("get_weather", call.function.arguments)
    assert choice.message.content is None


def test_named_tool_choice_streams_openai_deltas(oai):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=160,
        temperature=0.8,
        seed=3,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:  # the first delta of a call: id, type and name
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = {"name": piece.function.name, "arguments": ""}
            else:  # later ones: argument fragments only
                assert piece.id is None and piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    _valid("get_weather", calls[0]["arguments"])


def test_required_with_parallel_calls_off_gives_one_call(oai):
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=160,
        temperature=0,
    )
    [call] = reply.choices[0].message.tool_calls
    _valid(call.function.name, call.function.arguments)


def test_openai_agent_loop_two_round_trips(oai):
    messages: list[dict] = [*USER]
    for name in ("get_weather", "list_files"):
        reply = oai.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": name}},
            max_tokens=160,
            temperature=0,
        )
        message = reply.choices[0].message
        [call] = message.tool_calls
        assert call.function.name == name
        _valid(name, call.function.arguments)
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "done"})
    reply = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content is not None
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_anthropic_agent_loop_two_round_trips(claude):
    messages: list[dict] = [*USER]
    for name in ("get_weather", "list_files"):
        reply = claude.messages.create(
            model=MODEL,
            max_tokens=160,
            messages=messages,
            tools=CLAUDE_TOOLS,
            tool_choice={"type": "tool", "name": name},
        )
        assert reply.stop_reason == "tool_use"
        [block] = [b for b in reply.content if b.type == "tool_use"]
        assert block.name == name
        _valid(name, block.input)
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        messages.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "done"}],
            }  # fmt: skip
        )
    reply = claude.messages.create(
        model=MODEL, max_tokens=8, messages=messages, tools=CLAUDE_TOOLS,
        tool_choice={"type": "none"},
    )  # fmt: skip
    assert [b.type for b in reply.content] == ["text"]
    assert reply.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_stream_tool_use_accumulates(claude):
    with claude.messages.stream(
        model=MODEL,
        max_tokens=160,
        messages=USER,
        tools=CLAUDE_TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in events
    [block] = final.content
    assert block.type == "tool_use"
    _valid(block.name, block.input)
    assert final.stop_reason == "tool_use"


def test_tool_parser_flag_overrides_and_unknown_is_refused(loaded):
    app = create_app(AsyncEngine(Engine(loaded)), MODEL, options=ServerOptions(tool_parser="none"))
    with serving(app) as url:
        [entry] = httpx.get(url + "/v1/models").json()["data"]
        assert entry["tool_parser"] is None
    with pytest.raises(ValueError, match="unknown parser family 'qwen9'"):
        create_app(AsyncEngine(Engine(loaded)), MODEL, options=ServerOptions(tool_parser="qwen9"))


def test_chat_template_kwargs_pass_and_bad_defaults_are_refused(oai, loaded):
    reply = oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert reply.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="may not set tools"):
        oai.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2,
            extra_body={"chat_template_kwargs": {"tools": []}},
        )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="reasoning_history 'all'"):
        oai.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2,
            extra_body={"chat_template_kwargs": {"reasoning_history": "all"}},
        )  # fmt: skip
    dropped = oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2,
        extra_body={"chat_template_kwargs": {"reasoning_history": "drop"}},
    )  # fmt: skip
    assert dropped.choices[0].message.content is not None
    bad = ServerOptions(default_chat_template_kwargs="{not json")
    with pytest.raises(ValueError, match="default-chat-template-kwargs"):
        create_app(AsyncEngine(Engine(loaded)), MODEL, options=bad)


def test_responses_take_the_template_kwargs_and_the_server_defaults(server, loaded):
    """/v1/responses renders with the request's chat_template_kwargs over the server's
    --default-chat-template-kwargs, as chat completions do (a value the server checks shows
    that each reached the rendering)."""
    body = {"model": MODEL, "input": "What is the weather?", "max_output_tokens": 2}
    ok = httpx.post(server + "/v1/responses", json=body)
    assert ok.status_code == 200
    asked = {**body, "chat_template_kwargs": {"reasoning_history": "all"}}
    bad = httpx.post(server + "/v1/responses", json=asked)
    assert bad.status_code == 400 and "reasoning_history 'all'" in bad.text
    options = ServerOptions(default_chat_template_kwargs='{"reasoning_history": "all"}')
    with serving(create_app(AsyncEngine(Engine(loaded)), MODEL, options=options)) as url:
        by_default = httpx.post(url + "/v1/responses", json=body)
        assert by_default.status_code == 400 and "reasoning_history 'all'" in by_default.text
        mine = {**body, "chat_template_kwargs": {"reasoning_history": "drop"}}
        assert httpx.post(url + "/v1/responses", json=mine).status_code == 200  # request wins


def test_prefilled_think_is_continued_as_reasoning_under_the_chosen_field(server, loaded):
    """An assistant message ending in <think> is continued as reasoning, cut by max_tokens it
    stays reasoning (c5), and --reasoning-field names where it goes."""
    body = {
        "model": MODEL,
        "messages": [*USER, {"role": "assistant", "content": "<think>"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    plain_app = create_app(
        AsyncEngine(Engine(loaded)), MODEL, options=ServerOptions(tool_parser="none")
    )
    with serving(plain_app) as url:
        plain = httpx.post(url + "/v1/chat/completions", json=body).json()
    raw = plain["choices"][0]["message"]["content"]
    assert raw.strip()  # the tiny model said something
    reply = httpx.post(server + "/v1/chat/completions", json=body).json()["choices"][0]
    assert reply["finish_reason"] == "length"
    assert reply["message"]["reasoning_content"] == raw.lstrip()
    assert reply["message"]["content"] == ""
    both_app = create_app(
        AsyncEngine(Engine(loaded)), MODEL, options=ServerOptions(reasoning_field="both")
    )
    with serving(both_app) as url:
        message = httpx.post(url + "/v1/chat/completions", json=body).json()["choices"][0]
        chunks = []
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"])
    assert message["message"]["reasoning"] == message["message"]["reasoning_content"]
    streamed = "".join(c[0]["delta"].get("reasoning", "") for c in chunks if c)
    assert streamed == message["message"]["reasoning"]
    with pytest.raises(ValueError, match="reasoning-field"):
        create_app(AsyncEngine(Engine(loaded)), MODEL, options=ServerOptions(reasoning_field="x"))


def test_usage_counts_the_reasoning_tokens(server, oai):
    """usage's reasoning tokens (Responses `output_tokens_details`, chat
    `completion_tokens_details`) count the tokens generated in reasoning: all of an answer
    continued after `<think>` and cut by max_tokens while it reasons, none of a plain one."""
    thinking = [*USER, {"role": "assistant", "content": "<think>"}]
    args = {"model": MODEL, "max_tokens": 12, "temperature": 0}
    reply = oai.chat.completions.create(messages=thinking, **args)
    assert reply.choices[0].finish_reason == "length" and not reply.choices[0].message.content
    assert reply.usage.completion_tokens == 12
    assert reply.usage.completion_tokens_details.reasoning_tokens == 12
    stream_usage = [
        chunk.usage
        for chunk in oai.chat.completions.create(
            messages=thinking, stream=True, stream_options={"include_usage": True}, **args
        )
        if chunk.usage is not None
    ]
    assert stream_usage[-1].completion_tokens_details.reasoning_tokens == 12
    plain = oai.chat.completions.create(messages=USER, **args)
    assert plain.choices[0].message.model_extra.get("reasoning_content") is None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    response = oai.responses.create(
        model=MODEL, input=thinking, max_output_tokens=12, temperature=0
    )
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.usage.output_tokens_details.reasoning_tokens == 12
    events = list(
        oai.responses.create(
            model=MODEL, input=thinking, max_output_tokens=12, temperature=0, stream=True
        )
    )
    final = events[-1].response  # response.incomplete: cut by max_output_tokens
    assert final.usage.output_tokens_details.reasoning_tokens == 12


@pytest.mark.parametrize(
    "family", ["deepseek_v3", "deepseek_v31", "kimi_k2", "harmony", "mistral", "glm47"]
)
def test_forced_call_in_each_family_syntax(loaded, family):
    """tool_choice named forces the call in the family's own syntax (forced.py; XML-style
    families in the Hermes form) and the family's parser reads a call valid against the
    schema (a call in another syntax would not be a call to that parser)."""
    from moetier.server.parsers.forced import NATIVE

    app = create_app(AsyncEngine(Engine(loaded)), MODEL, options=ServerOptions(tool_parser=family))
    body = {
        "model": MODEL,
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 200,
        "temperature": 0,
    }
    with serving(app) as url:
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    _valid("get_weather", call["function"]["arguments"])
    if family == "kimi_k2":
        assert call["id"] == "functions.get_weather:0"
    if family not in NATIVE:
        assert call["id"].startswith("call_")
