"""Errors and limits on a real uvicorn server, read by the official `openai` and `anthropic`
clients (their exception classes follow the status, their parsers the body's shape): 400 (not
422) naming the field, unknown models and routes 404, wrong methods 405, bodies over the limit
413, a full queue 429 and a loading model 503 with Retry-After, known-but-unsupported fields 400,
lone surrogates served as U+FFFD, a failure mid-stream an error event, keep-alive comments on a
silent stream."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from uvicorn_thread import serving

from moetier.config import EngineConfig
from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.generate import Generator
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model
from moetier.server.app import create_app
from moetier.server.options import ServerOptions
from moetier.server.unsupported import UNSUPPORTED

MODEL = "tiny-qwen3"
USER = [{"role": "user", "content": "Hello there"}]
OPTIONS = ServerOptions(
    served_model_name=("alias-name", "claude-*"), max_body_mb=0.05, max_request_tokens=1000
)


@pytest.fixture(scope="module")
def loaded(tiny):
    return load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))


@pytest.fixture(scope="module")
def server(loaded):
    engine = AsyncEngine(Engine(loaded, EngineLimits(num_pages=256)))
    with serving(create_app(engine, MODEL, options=OPTIONS)) as url:
        yield url, engine, Generator(loaded)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0)


def openai_shaped(body: dict) -> dict:
    """The error object, after checking the envelope is OpenAI's."""
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


def anthropic_shaped(body: dict) -> dict:
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"]
    return body["error"]


def greedy(generator: Generator, messages: list[dict], max_tokens: int) -> str:
    ids = generator.chat_prompt_ids(messages)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0)
    return generator.generate(ids, params, chat=True).text


def test_unknown_routes_and_methods(server, oai, claude):
    with pytest.raises(openai.NotFoundError) as info:
        oai.post("/nowhere", body={}, cast_to=object)
    assert openai_shaped(info.value.response.json())["type"] == "not_found_error"
    reply = httpx.get(server[0] + "/v1/nowhere")
    assert reply.status_code == 404
    assert openai_shaped(reply.json())["type"] == "not_found_error"
    reply = httpx.get(server[0] + "/v1/chat/completions")
    assert reply.status_code == 405
    assert openai_shaped(reply.json())["code"] == "method_not_allowed"
    with pytest.raises(openai.APIStatusError) as info:
        oai.get("/chat/completions", cast_to=object)
    assert info.value.status_code == 405
    # under /v1/messages: Anthropic's shape
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.post("/v1/messages/nowhere", body={}, cast_to=object)
    assert anthropic_shaped(info.value.response.json())["type"] == "not_found_error"
    reply = httpx.get(server[0] + "/v1/messages")
    assert reply.status_code == 405 and anthropic_shaped(reply.json())


def test_model_names(server, oai, claude):
    assert [m.id for m in oai.models.list().data] == [MODEL, "alias-name"]
    with pytest.raises(openai.NotFoundError, match="not served") as info:
        oai.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=2)
    error = openai_shaped(info.value.response.json())
    assert error["code"] == "model_not_found" and error["param"] == "model"
    for name in (MODEL, "alias-name"):
        reply = oai.chat.completions.create(model=name, messages=USER, max_tokens=2)
        assert reply.model == MODEL
    # a pattern alias: the names Claude Code sends
    reply = claude.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=USER)
    assert reply.content[0].type == "text"
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="gpt-4o", max_tokens=2, messages=USER)
    assert anthropic_shaped(info.value.response.json())["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="other", messages=USER)


def test_retrieve_a_model_in_each_apis_shape(server, oai, claude):
    """`GET /v1/models/{id}` (both SDKs' `models.retrieve`): OpenAI's model object, or
    Anthropic's ModelInfo for a client that sends `anthropic-version`, for every name a request
    may give (an alias, a pattern's match, a name with a slash); an unknown id is a 404 in the
    client's API's error shape."""
    listed = oai.models.list().data[0]
    model = oai.models.retrieve(MODEL)
    assert model.model_dump() == listed.model_dump()
    assert model.object == "model" and model.owned_by == "moetier" and model.created > 0
    info = claude.models.retrieve("claude-sonnet-4-5")  # a `claude-*` pattern alias
    assert info.type == "model" and info.id == info.display_name == "claude-sonnet-4-5"
    assert info.created_at.timestamp() == model.created and info.created_at.tzinfo is not None
    assert info.max_input_tokens == model.max_model_len  # type: ignore[attr-defined]
    assert claude.models.retrieve(MODEL).id == MODEL
    page = claude.models.list()  # Anthropic's list shape: one page of ModelInfo
    assert [m.id for m in page.data] == [m.id for m in oai.models.list().data]
    assert page.has_more is False and page.first_id == MODEL and page.last_id == "alias-name"
    assert page.data[0].model_dump() == claude.models.retrieve(MODEL).model_dump()
    assert oai.models.retrieve("alias-name").id == "alias-name"
    with pytest.raises(openai.NotFoundError, match="not served") as error:
        oai.models.retrieve("org/unknown-model")  # its slash is sent as %2F
    assert openai_shaped(error.value.response.json()) == {
        "message": "the model 'org/unknown-model' is not served here (served: "
        f"{MODEL}, alias-name)",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }
    with pytest.raises(anthropic.NotFoundError, match="not served") as error:
        claude.models.retrieve("gpt-4o")
    assert anthropic_shaped(error.value.response.json())["type"] == "not_found_error"


def test_validation_errors_are_400_naming_the_field(server, oai, claude):
    with pytest.raises(openai.BadRequestError, match="temperature") as info:
        oai.chat.completions.create(model=MODEL, messages=USER, temperature="hot")
    assert openai_shaped(info.value.response.json())["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match=r"messages\.0\.role"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="seed"):
        oai.chat.completions.create(model=MODEL, messages=USER, seed=2**64)
    with pytest.raises(openai.BadRequestError, match="seed"):
        oai.chat.completions.create(model=MODEL, messages=USER, seed=-1)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens") as info:
        claude.post("/v1/messages", body={"model": MODEL, "messages": USER}, cast_to=object)
    assert anthropic_shaped(info.value.response.json())["type"] == "invalid_request_error"
    for raw in (b"{not json", b"\xff\xfe", b"[" * 5000 + b"]" * 5000, b""):
        reply = httpx.post(
            server[0] + "/v1/chat/completions",
            content=raw,
            headers={"content-type": "application/json"},
        )
        assert reply.status_code == 400, raw[:10]
        openai_shaped(reply.json())
    reply = httpx.post(server[0] + "/v1/messages", content=b"{not json")
    assert reply.status_code == 400 and anthropic_shaped(reply.json())


def test_400s_say_what_to_send(server):
    """An audit's confusing 400s: NaN or Infinity (JSON's NaN, Infinity) said "should be less
    than or equal to 2" (NaN fails every bound); a history call whose function is not an object
    gave Python's "dictionary update sequence element #0 ..."; a value that fits no member of a
    union (content a string or parts) was named by the member's type, "content.str"."""
    nan = [
        ("/v1/chat/completions", "messages", "temperature", "NaN"),
        ("/v1/chat/completions", "messages", "top_p", "Infinity"),
        ("/v1/chat/completions", "messages", "repetition_penalty", "Infinity"),
        ("/v1/responses", "input", "temperature", "NaN"),
        ("/v1/messages", "messages", "temperature", "NaN"),
    ]
    for path, field, name, value in nan:
        body = f'"{field}": {json.dumps(USER)}' if field == "messages" else '"input": "Hi"'
        raw = f'{{"model": "{MODEL}", "max_tokens": 2, {body}, "{name}": {value}}}'
        reply = httpx.post(server[0] + path, content=raw.encode())
        assert reply.status_code == 400, (path, name)
        error = reply.json()["error"]
        assert error["message"] == f"{name}: Input should be a finite number", error
    shape = 'use an object {"name": NAME, "arguments": "the arguments as JSON text"}'
    for function, kind in (("get_weather", "a string"), (["get_weather"], "an array")):
        call = {"id": "c1", "type": "function", "function": function}
        messages = [*USER, {"role": "assistant", "content": "", "tool_calls": [call]}]
        body = {"model": MODEL, "max_tokens": 2, "messages": messages}
        error = httpx.post(server[0] + "/v1/chat/completions", json=body).json()["error"]
        assert error["param"] == "messages.1.tool_calls.0.function"
        assert error["message"] == f"messages.1.tool_calls.0.function: {shape}, not {kind}"
    messages = [{"role": "user", "content": [{"type": "text", "text": 5}]}]
    body = {"model": MODEL, "max_tokens": 2, "messages": messages}
    error = httpx.post(server[0] + "/v1/chat/completions", json=body).json()["error"]
    assert error["message"] == "messages.0.content.0.text: Input should be a valid string"
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"a": 1}}
    body = {"model": MODEL, "input": [call]}
    error = httpx.post(server[0] + "/v1/responses", json=body).json()["error"]
    assert error["param"] == "input.0.arguments"


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/chat/completions", "messages"),
        ("/v1/messages", "model, messages and max_tokens"),
        ("/v1/completions", "prompt"),
        ("/v1/responses", "input"),
    ],
)
def test_an_empty_body_is_a_400_saying_so(server, path, fields):
    """No body is a 400 saying the body is empty and naming the route's required fields, in its
    API's shape (not "None: a required field is missing"); a body that is JSON but not an
    object, likewise."""
    for raw, what in ((b"", "empty"), (b"null", "not a JSON object"), (b"[]", "not a JSON object")):
        reply = httpx.post(
            server[0] + path, content=raw, headers={"content-type": "application/json"}
        )
        assert reply.status_code == 400, raw
        body = reply.json()
        error = anthropic_shaped(body) if path == "/v1/messages" else openai_shaped(body)
        assert error["message"] == f"the request body is {what}: send a JSON object with {fields}"
        if path != "/v1/messages":
            assert error["param"] is None


@pytest.mark.parametrize("choice", [None, "required"])
def test_chat_tools_in_another_shape_are_400s_naming_the_field(server, choice):
    """A chat tool is `{"type": "function", "function": {"name": ...}}` (OpenAI and vLLM answer
    400 for any other shape): a bare `{"name"}` or the Responses API's flat shape is refused,
    naming the tool's index and field, never served (nor forced by tool_choice required)."""
    good = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
    cases = [
        ([{"name": "x"}], "tools.0.type"),
        ([good, {"type": "function", "name": "x"}], "tools.1.function"),  # the Responses shape
        ([{"type": "custom", "function": {"name": "x"}}], "tools.0.type"),
        ([{"type": "function", "function": {"description": "no name"}}], "tools.0.function.name"),
        ([{"type": "function", "function": {"name": ""}}], "tools.0.function.name"),
        ([{"type": "function", "function": {"name": "x", "parameters": "{}"}}],
         "tools.0.function.parameters"),
    ]  # fmt: skip
    extra = {} if choice is None else {"tool_choice": choice}
    for tools, where in cases:
        body = {"model": MODEL, "messages": USER, "max_tokens": 2, "tools": tools, **extra}
        reply = httpx.post(server[0] + "/v1/chat/completions", json=body)
        assert reply.status_code == 400, (tools, reply.text)
        error = openai_shaped(reply.json())
        assert error["param"] == where and error["message"].startswith(where), error
        assert error["type"] == "invalid_request_error"
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "tools": [good], **extra}
    assert httpx.post(server[0] + "/v1/chat/completions", json=body).status_code == 200


def test_context_length_is_a_400_with_its_code(server, oai):
    with pytest.raises(openai.BadRequestError, match="context") as info:
        oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=10**9)
    assert openai_shaped(info.value.response.json())["code"] == "context_length_exceeded"


def test_a_forced_call_whose_schema_cannot_be_enforced_is_a_400(server, oai, claude):
    """tool_choice required / named (Anthropic any / tool) compiles the tools' parameters into
    the call's grammar: a schema the grammar engine refuses (a bad type, a keyword it does not
    implement) is the client's error, a 400 naming the tool on every API and streamed or not, as
    the same schema in response_format is, never a 500 from the engine."""
    bad = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": bad}}]
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="'pick'.*uniqueItems") as info:
                oai.chat.completions.create(
                    model=MODEL,
                    messages=USER,
                    tools=tools,
                    tool_choice=choice,
                    max_tokens=4,
                    stream=stream,
                )
            assert openai_shaped(info.value.response.json())["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="'pick'"):
        oai.responses.create(
            model=MODEL,
            input="Hello",
            tools=[{"type": "function", "name": "pick", "parameters": bad, "strict": False}],
            tool_choice="required",
            max_output_tokens=4,
        )
    with pytest.raises(anthropic.BadRequestError, match="'pick'") as info:
        claude.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=USER,
            tools=[{"name": "pick", "input_schema": {"type": "objectx"}}],
            tool_choice={"type": "any"},
        )
    assert anthropic_shaped(info.value.response.json())["type"] == "invalid_request_error"
    # tool_choice auto compiles nothing: the same tools are served
    reply = oai.chat.completions.create(model=MODEL, messages=USER, tools=tools, max_tokens=2)
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")


# a value other than the harmless default for each known-but-unsupported field
SAMPLES = {
    "logprobs": True,
    "top_logprobs": 3,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.2,
    "logit_bias": {"5": 1},
    "min_p": 0.1,
    "n": 2,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "functions": [{"name": "f"}],
    "function_call": {"name": "f"},
    "response_format": {"type": "json_object"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {"search_context_size": "low"},
}


@pytest.mark.parametrize("field", sorted(UNSUPPORTED["/v1/chat/completions"]))
def test_known_unsupported_fields_are_400s_naming_them(server, oai, field):
    value = SAMPLES.get(field, {"some": "value"})
    with pytest.raises(openai.BadRequestError, match=f"^Error code: 400 - .*{field}") as info:
        oai.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2, extra_body={field: value}
        )
    assert openai_shaped(info.value.response.json())["param"] == field


def test_harmless_defaults_and_unknown_fields_are_accepted(server, oai, claude):
    defaults = {"logprobs": False, "n": 1, "presence_penalty": 0, "logit_bias": {}, "tools": []}
    extra = {k: v for k, v in defaults.items() if k in UNSUPPORTED["/v1/chat/completions"]}
    extra |= {"some_future_field": {"x": 1}, "user": "me", "store": False}
    reply = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, extra_body=extra)
    assert reply.choices[0].message.content is not None
    reply = claude.messages.create(
        model=MODEL, max_tokens=2, messages=USER, extra_body={"some_future_field": 1}
    )
    assert reply.content
    with pytest.raises(anthropic.BadRequestError, match="mcp_servers"):
        claude.messages.create(
            model=MODEL, max_tokens=2, messages=USER, extra_body={"mcp_servers": [{"x": 1}]}
        )


def test_n_times_max_tokens_cap(server):
    """n x max_tokens over --max-request-tokens is refused before anything else looks at n."""
    body = {"model": MODEL, "messages": USER, "n": 4, "max_tokens": 300}
    reply = httpx.post(server[0] + "/v1/chat/completions", json=body)
    assert reply.status_code == 400
    error = openai_shaped(reply.json())
    assert "max-request-tokens" in error["message"] and error["param"] == "max_tokens"


def test_body_over_the_limit_is_413(server, oai, claude):
    big = "word " * 20_000  # 100 kB against a 0.05 MiB limit
    with pytest.raises(openai.APIStatusError) as info:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": big}])
    assert info.value.status_code == 413
    assert openai_shaped(info.value.response.json())["code"] == "request_too_large"
    with pytest.raises(anthropic.APIStatusError) as info:
        claude.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": big}]
        )
    assert info.value.status_code == 413
    assert anthropic_shaped(info.value.response.json())["type"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}]}'

    reply = httpx.post(server[0] + "/v1/chat/completions", content=chunks())
    assert reply.status_code == 413 and openai_shaped(reply.json())


def test_lone_surrogates_are_replaced(server):
    """A lone surrogate (not a character: no tokenizer can encode it) anywhere in a request is
    served as U+FFFD, and the connection stays usable."""
    url, engine, generator = server
    want = greedy(generator, [{"role": "user", "content": "Hi \ufffd there"}], 4)
    raw = (
        '{"model": "tiny-qwen3", "max_tokens": 4, "temperature": 0, "user": "\\udfff",'
        ' "messages": [{"role": "user", "content": "Hi \\ud800 there"}]}'
    )
    with httpx.Client(base_url=url) as http:  # one keep-alive connection
        for _ in range(2):
            reply = http.post(
                "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == want
        anthropic_raw = (
            '{"model": "tiny-qwen3", "max_tokens": 4, "system": "\\udc00",'
            ' "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}'
        )
        reply = http.post("/v1/messages", content=anthropic_raw)
        assert reply.status_code == 200, reply.text
        count = http.post("/v1/messages/count_tokens", content=anthropic_raw)
        assert count.status_code == 200
        # a proper pair is a character, kept as it is
        paired = raw.replace("\\ud800", "\\ud83d\\ude00")
        want = greedy(generator, [{"role": "user", "content": "Hi \U0001f600 there"}], 4)
        reply = http.post("/v1/chat/completions", content=paired)
        assert reply.json()["choices"][0]["message"]["content"] == want


def hold_streams(url: str, count: int) -> list:
    """`count` long streaming requests, each left open after its first event."""
    held = []
    for _ in range(count):
        body = {"model": MODEL, "messages": USER, "max_tokens": 150, "stream": True,
                "ignore_eos": True}  # fmt: skip
        cm = httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60)
        reply = cm.__enter__()
        assert reply.status_code == 200
        lines = reply.iter_lines()
        next(lines)
        held.append((cm, lines))  # (a dropped line iterator closes its stream)
    return held


def slow_steps(engine: AsyncEngine, seconds: float, monkeypatch) -> None:
    """Each engine step held `seconds` (a big model's pace, so requests stay in flight)."""
    inner = engine.engine
    real = inner.step

    def step():
        time.sleep(seconds)
        return real()

    monkeypatch.setattr(inner, "step", step)


def test_full_queue_is_429_with_retry_after(loaded, monkeypatch):
    engine = AsyncEngine(Engine(loaded, EngineLimits(num_pages=256, max_num_seqs=1)))
    slow_steps(engine, 0.05, monkeypatch)
    options = ServerOptions(max_queued_requests=1)
    with serving(create_app(engine, MODEL, options=options)) as url:
        held = hold_streams(url, 2)  # one running, one queued
        try:
            oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError) as info:
                oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
            assert info.value.response.headers["retry-after"] == "1"
            assert openai_shaped(info.value.response.json())["type"] == "rate_limit_error"
            claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
            with pytest.raises(anthropic.RateLimitError) as info:
                claude.messages.create(model=MODEL, max_tokens=2, messages=USER)
            assert anthropic_shaped(info.value.response.json())["type"] == "rate_limit_error"
            # counting tokens runs no model: not queued
            assert claude.messages.count_tokens(model=MODEL, messages=USER).input_tokens > 0
        finally:
            for cm, _ in held:
                cm.__exit__(None, None, None)
        assert engine.wait_idle(timeout=20)
        deadline = time.time() + 10
        while True:  # the held requests' handlers finish as their aborts land
            try:
                reply = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
                break
            except openai.RateLimitError:
                assert time.time() < deadline
                time.sleep(0.05)
        assert reply.choices[0].message.content is not None


def test_loading_is_503_with_retry_after(loaded):
    release = threading.Event()

    def factory() -> AsyncEngine:
        release.wait(timeout=30)
        return AsyncEngine(Engine(loaded, EngineLimits(num_pages=64)))

    with serving(create_app(factory, MODEL)) as url:
        try:
            oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.InternalServerError, match="loading") as info:
                oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
            assert info.value.status_code == 503
            assert info.value.response.headers["retry-after"] == "5"
            openai_shaped(info.value.response.json())
            claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
            with pytest.raises(anthropic.InternalServerError) as info:
                claude.messages.create(model=MODEL, max_tokens=2, messages=USER)
            assert anthropic_shaped(info.value.response.json())["type"] == "overloaded_error"
        finally:
            release.set()


def test_a_failed_load_is_503_without_retry_after():
    def factory() -> AsyncEngine:
        raise OSError("no such store")

    with serving(create_app(factory, MODEL)) as url:
        deadline = time.time() + 10
        while httpx.get(url + "/health").json()["status"] == "loading":
            assert time.time() < deadline
            time.sleep(0.02)
        assert httpx.get(url + "/health").json() == {"status": "failed"}
        body = {"model": MODEL, "messages": USER}
        reply = httpx.post(url + "/v1/chat/completions", json=body)
        assert reply.status_code == 503 and "retry-after" not in reply.headers
        assert "no such store" in openai_shaped(reply.json())["message"]


def fail_steps_after(engine: AsyncEngine, good: int, monkeypatch) -> None:
    """The engine's steps raise after `good` of them (its loop fails the open requests)."""
    inner = engine.engine
    real = inner.step
    count = {"n": 0}

    def step():
        count["n"] += 1
        if count["n"] > good:
            raise RuntimeError("injected failure")
        return real()

    monkeypatch.setattr(inner, "step", step)


def test_a_failure_mid_stream_ends_it_with_an_error_event(loaded, monkeypatch):
    engine = AsyncEngine(Engine(loaded, EngineLimits(num_pages=64)))
    with serving(create_app(engine, MODEL)) as url:
        oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        fail_steps_after(engine, 3, monkeypatch)
        stream = oai.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=50, stream=True, extra_body={"ignore_eos": True}
        )
        with pytest.raises(openai.APIError, match="generation failed"):
            for _ in stream:
                pass
        fail_steps_after(engine, 3, monkeypatch)
        with pytest.raises(anthropic.APIStatusError, match="generation failed"):
            with claude.messages.stream(model=MODEL, max_tokens=50, messages=USER) as events:
                for _ in events:
                    pass
        monkeypatch.undo()
        # on the wire: the error event, then [DONE]
        fail_steps_after(engine, 3, monkeypatch)
        body = {
            "model": MODEL,
            "messages": USER,
            "max_tokens": 50,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as reply:
            lines = [line for line in reply.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert openai_shaped(json.loads(lines[-2][6:]))["type"] == "server_error"
        monkeypatch.undo()
        assert engine.wait_idle(timeout=20)
        # counted: such streams were answered 200, so the server counts them apart
        failed = {
            s.labels["route"]: s.value
            for family in text_string_to_metric_families(httpx.get(url + "/metrics").text)
            for s in family.samples
            if s.name == "moetier_http_stream_errors_total"
        }
        assert failed == {"/v1/chat/completions": 2, "/v1/messages": 1}


def test_a_bug_mid_stream_ends_it_with_an_error_event(server, oai, claude, monkeypatch):
    """Not the engine's failure but an unexpected exception in the request's stream (a bug):
    the app's stream guard (sse.py) ends every API's stream in that API's error event, and the
    request is aborted."""
    url, engine, _ = server
    real_generate = engine.generate

    def broken_generate(*args, **kwargs):
        async def outputs():
            inner = real_generate(*args, **kwargs)
            try:
                async for out in inner:
                    yield out
                    raise ZeroDivisionError("a bug")
            finally:
                await inner.aclose()

        return outputs()

    monkeypatch.setattr(engine, "generate", broken_generate)
    extra = {"ignore_eos": True}
    stream = oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, stream=True, extra_body=extra
    )
    with pytest.raises(openai.APIError, match="ZeroDivisionError"):
        for _ in stream:
            pass
    with pytest.raises(anthropic.APIStatusError, match="ZeroDivisionError"):
        with claude.messages.stream(model=MODEL, max_tokens=6, messages=USER) as events:
            for _ in events:
                pass
    events = list(oai.responses.create(model=MODEL, input="Hello", stream=True))
    assert events[-1].type == "error" and "ZeroDivisionError" in events[-1].message
    monkeypatch.undo()
    assert engine.wait_idle(timeout=20)
    assert engine.engine.pool.used_pages == 0


def test_a_request_the_engine_refuses_when_it_takes_it_is_a_400(server, oai, claude, monkeypatch):
    """A ValueError from the engine when it takes the request (after the route's own checks: a
    grammar it cannot compile, say) is a 400 in the API's shape on chat completions, streamed
    (one error event after the role chunk, then [DONE]) and not, and on /v1/messages sent
    whole, as on the other routes; it was a 500 ("internal error (ValueError)")."""

    def refuse(self, request_id, *args, **kwargs):
        raise ValueError("the engine refuses this request")

    monkeypatch.setattr(Engine, "add", refuse)
    with pytest.raises(openai.BadRequestError, match="the engine refuses") as info:
        oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert openai_shaped(info.value.response.json())["type"] == "invalid_request_error"
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body) as raw:
        assert raw.status_code == 200
        data = [line[6:] for line in raw.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    error = openai_shaped(json.loads(data[-2]))
    assert error["type"] == "invalid_request_error"
    assert error["message"] == "the engine refuses this request"
    with pytest.raises(openai.APIError, match="the engine refuses"):
        list(oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, stream=True))
    with pytest.raises(anthropic.BadRequestError, match="the engine refuses") as info:
        claude.messages.create(model=MODEL, messages=USER, max_tokens=2)
    assert anthropic_shaped(info.value.response.json())["type"] == "invalid_request_error"
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 16, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/responses", json=body) as raw:
        events = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "error", events[-1]
    assert events[-1]["code"] == "invalid_request_error"  # was server_error
    assert events[-1]["message"] == "the engine refuses this request"


def test_keep_alive_comments_while_a_stream_is_silent(loaded, monkeypatch):
    """A slow prefill (each step held 0.3 s) under a 0.1 s keep-alive: comments arrive before
    the first token, and both official clients still read the whole answer."""
    engine = AsyncEngine(Engine(loaded, EngineLimits(num_pages=64, max_num_batched_tokens=8)))
    slow_steps(engine, 0.3, monkeypatch)
    generator = Generator(loaded)
    want = greedy(generator, USER, 3)
    with serving(create_app(engine, MODEL, options=ServerOptions(keep_alive_s=0.1))) as url:
        body = {"model": MODEL, "messages": USER, "max_tokens": 3, "temperature": 0,
                "stream": True}  # fmt: skip
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as reply:
            lines = [line for line in reply.iter_lines() if line]
        first_token = next(
            i
            for i, line in enumerate(lines)
            if line.startswith("data: {")
            and json.loads(line[6:])["choices"][0]["delta"].get("content")
        )
        assert ": keep-alive" in lines[:first_token]
        assert lines[-1] == "data: [DONE]"
        oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        chunks = oai.chat.completions.create(**{k: v for k, v in body.items()})
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want
        claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        with claude.messages.stream(
            model=MODEL, max_tokens=3, messages=USER, extra_body={"temperature": 0}
        ) as events:
            message = events.get_final_message()
        assert message.content[0].text == want
        with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}) as reply:
            raw = [line for line in reply.iter_lines() if line]
        assert ": keep-alive" in raw
        monkeypatch.undo()
    assert engine.wait_idle(timeout=20)


def test_openapi_documents_the_errors_it_answers(server):
    """The schema (what schemathesis and client generators read) says 400, not FastAPI's 422,
    with each API's error body."""
    schema = httpx.get(server[0] + "/openapi.json").json()
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (method, path)
            if method == "post":
                ref = operation["responses"]["400"]["content"]["application/json"]["schema"]
                kind = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
                assert ref == {"$ref": f"#/components/schemas/{kind}"}, path
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_docs_list_the_unsupported_fields_as_the_table_has_them():
    """docs/serving.md's table of known-but-unsupported fields is unsupported.py's, row for row
    (when support lands, both lose the entry)."""
    doc = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    section = doc[doc.index("## Known fields not supported yet") :]
    rows = set(re.findall(r"^\| `(/[^`]+)` \| `([^`]+)` \|", section, re.MULTILINE))
    table = {(path, field) for path, fields in UNSUPPORTED.items() for field in fields}
    assert rows == table, (sorted(rows - table), sorted(table - rows))
