"""`/v1/responses` against the official `openai` client on a real uvicorn over a tiny model:
answers equal the Generator's greedy answer for the same chat messages, the streamed events in
the documented order with their sequence numbers, the SDK's own stream accumulation, input
items with tool history, and the stateless server's 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
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
# renders tools, an assistant's reasoning and tool calls (arguments a JSON string or a mapping,
# as real templates take them) and a tool message's call id: the tiny model's own template
# renders none of them, and a real one's tool preamble outgrows its 256-token context
TOOL_TEMPLATE = (
    "{%- for t in tools or [] %}{{ t.function.name }}{{ t.function.parameters | tojson }}\n"
    "{%- endfor %}{%- for m in messages %}{{ m.role }}: "
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{%- endif %}"
    "{{ m.content }}"
    "{%- for c in m.tool_calls or [] %} [{{ c.id }} {{ c.function.name }} "
    "{%- if c.function.arguments is string %}{{ c.function.arguments }}"
    "{%- else %}{{ c.function.arguments | tojson }}{%- endif %}]{%- endfor %}"
    "{%- if m.tool_call_id %} ({{ m.tool_call_id }}){%- endif %}\n{%- endfor %}"
    "{%- if add_generation_prompt %}assistant:{%- endif %}"
)
# the fixed tiny qwen3_moe ends its greedy answer to this prompt by itself (44 tokens)
STOPS = "Say yes"
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
# a call the grammar writes to its end within a few tokens, whatever the random model wants
SHORT_TOOL = {
    **TOOL,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tiny):
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu"))
    generator = Generator(loaded)
    app = create_app(AsyncEngine(Engine(loaded)), MODEL)
    with serving(app) as url:
        yield url, generator


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def greedy(generator: Generator, messages, max_tokens: int, tools=None):
    ids = generator.chat_prompt_ids(messages, tools)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0)
    return generator.generate(ids, params, chat=True)


def generated(expected) -> int:
    """Tokens generated: the text's, plus the end-of-turn token it stopped on, if any."""
    return len(expected.token_ids) + (expected.finish_reason == "stop")


def test_response_equals_the_generator(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = greedy(server[1], messages, 8)
    assert want.finish_reason == "length"  # the fixed tiny model: cut by max_output_tokens
    resp = client.responses.create(
        model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert resp.object == "response"
    assert resp.id.startswith("resp_")
    assert resp.output_text == want.text
    [item] = resp.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "incomplete")
    assert [part.type for part in item.content] == ["output_text"]
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.input_tokens == want.prompt_tokens
    assert resp.usage.output_tokens == generated(want)
    assert resp.usage.total_tokens == want.prompt_tokens + generated(want)
    assert resp.instructions == "Be brief."
    assert resp.max_output_tokens == 8
    assert resp.store is False


def test_a_natural_end_is_completed(server, client):
    want = greedy(server[1], [{"role": "user", "content": STOPS}], 64)
    assert want.finish_reason == "stop"
    resp = client.responses.create(model=MODEL, input=STOPS, max_output_tokens=64, temperature=0)
    assert resp.output_text == want.text
    assert (resp.status, resp.incomplete_details) == ("completed", None)
    assert resp.output[0].status == "completed"
    assert resp.usage.output_tokens == generated(want)


def test_input_items_with_tool_history(server, client):
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Say"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    }
    messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call],
            "reasoning_content": "Look it up.",
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Say"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    template_tool = {
        "type": "function",
        "function": {k: TOOL[k] for k in ("name", "description", "parameters")},
    }
    generator = server[1]
    tokenizer = generator.tokenizer
    tiny_template = tokenizer.chat_template
    tokenizer.chat_template = TOOL_TEMPLATE
    try:
        rendered = tokenizer.decode(generator.chat_prompt_ids(messages, [template_tool]))
        parts = ("get_weather", "call_1 get_weather", '{"city": "Rome"}', "sunny, 21 C")
        for part in (*parts, "<think>Look it up.</think>", "<think>Say</think>It is sunny."):
            assert part in rendered
        want = greedy(generator, messages, 6, [template_tool])
        resp = client.responses.create(
            model=MODEL, input=items, tools=[TOOL], max_output_tokens=6, temperature=0
        )
        # tool_choice "none": the template gets no tools
        bare = client.responses.create(
            model=MODEL, input=items, tools=[TOOL], tool_choice="none", max_output_tokens=1
        )
        without_tools = len(generator.chat_prompt_ids(messages))
    finally:
        tokenizer.chat_template = tiny_template
    assert resp.output_text == want.text
    assert resp.usage.input_tokens == want.prompt_tokens
    assert resp.tools[0].name == "get_weather"
    assert bare.usage.input_tokens == without_tools < resp.usage.input_tokens


def test_stream_events_in_the_documented_order(client):
    whole = client.responses.create(model=MODEL, input="Hi", max_output_tokens=10, temperature=0)
    events = list(
        client.responses.create(
            model=MODEL, input="Hi", max_output_tokens=10, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # cut by max_output_tokens, as OpenAI ends such a stream
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress"
    ids = {events[0].response.id, events[-1].response.id}
    assert len(ids) == 1
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {events[2].item.id}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-4].text == text
    assert events[-2].item.content[0].text == text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.status == "incomplete"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_the_sdk_accumulates_a_completed_stream(client):
    whole = client.responses.create(model=MODEL, input=STOPS, max_output_tokens=64, temperature=0)
    with client.responses.stream(
        model=MODEL, input=STOPS, max_output_tokens=64, temperature=0
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed"
    assert final.output_text == whole.output_text
    assert final.status == "completed"


def test_stream_wire_has_event_names_and_no_done(server):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/responses", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line and not line.startswith(":")]
    assert lines[0] == "event: response.created"
    assert len(lines) % 2 == 0
    names, datas = lines[0::2], lines[1::2]
    assert all(n.startswith("event: ") for n in names)
    assert all(d.startswith("data: ") for d in datas)
    assert "[DONE]" not in "".join(lines)


def test_stateless_and_unsupported_input_are_400s(client):
    cases = [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "function tools"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "nope"),
        ({"tools": [{**TOOL, "parameters": "object"}]}, "tools.0.parameters: must be a JSON"),
        ({"tools": [{**TOOL, "parameters": []}]}, "tools.0.parameters"),
        ({"input": [{"type": "message", "role": "user",
                     "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
         "input_image"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "web_search_call"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
        ({"input": []}, "empty"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 10**6}, "context length"),
    ]  # fmt: skip
    for extra, match in cases:
        body = {"model": MODEL, "input": "Hi", **extra}
        with pytest.raises(openai.BadRequestError, match=match) as info:
            client.responses.create(**body)
        assert info.value.body["type"] == "invalid_request_error"
        if match == "context length":
            assert info.value.code == "context_length_exceeded"


def test_hosted_tools_are_left_out_once_said(client, caplog):
    """Tools OpenAI's servers run (web_search, file_search, ...) have no call for a client to
    run: beside function tools they are left out of the prompt, said once in the log, and the
    request is answered (a client such as Codex offers web_search)."""
    from moetier.server.responses import template_tools

    hosted = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": []}]
    assert template_tools([*hosted, TOOL]) == template_tools([TOOL])
    assert template_tools(hosted) is None
    with caplog.at_level("WARNING", logger="moetier.server"):
        for _ in range(2):
            reply = client.responses.create(
                model=MODEL, input="Hi", max_output_tokens=2, tools=[{"type": "web_search"}, TOOL]
            )
            assert reply.status in ("completed", "incomplete")
    said = [r.getMessage() for r in caplog.records if "web_search" in r.getMessage()]
    assert len(said) <= 1  # once a process (template_tools above may have said it already)


PET = {
    "type": "object",
    "properties": {"kind": {"type": "string", "maxLength": 5}, "legs": {"type": "integer"}},
    "required": ["kind", "legs"],
    "additionalProperties": False,
}


def test_text_format_json_schema_is_enforced(client):
    fmt = {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}
    resp = client.responses.create(
        model=MODEL,
        input="A pet as JSON",
        max_output_tokens=120,
        temperature=0,
        text={"format": fmt},
    )
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), PET)
    assert resp.text.format.type == "json_schema"
    obj = client.responses.create(
        model=MODEL,
        input="JSON",
        max_output_tokens=200,
        temperature=0,
        text={"format": {"type": "json_object"}},
    )
    assert obj.status == "completed"
    assert isinstance(json.loads(obj.output_text), dict)
    for bad in ({"type": "json_schema", "schema": {"type": 5}}, {"type": "json_schema",
                "name": "no spaces", "schema": PET}, {"type": "grammar"}):  # fmt: skip
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model=MODEL, input="x", text={"format": bad})


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_forced_call_is_a_function_call_item(client, tool_choice):
    args = {
        "model": MODEL,
        "input": "Rome?",
        "tools": [SHORT_TOOL],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,  # one call, then the answer ends
    }
    resp = client.responses.create(**args, max_output_tokens=100, temperature=0)
    assert resp.status == "completed"
    [call] = [item for item in resp.output if item.type == "function_call"]
    assert (call.name, call.status) == ("get_weather", "completed")
    assert call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), SHORT_TOOL["parameters"])
    events = list(
        client.responses.create(**args, max_output_tokens=100, temperature=0, stream=True)
    )
    final = events[-1].response
    assert events[-1].type == "response.completed"

    def shape(output):  # what greedy makes the same each time (ids are fresh per response)
        return [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in output]

    assert shape(final.output) == shape(resp.output)
    for index, item in enumerate(final.output):
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        assert mine[0].type == "response.output_item.added"
        assert mine[-1].type == "response.output_item.done"
        if item.type == "function_call":
            deltas = [e.delta for e in mine if e.type == "response.function_call_arguments.delta"]
            [done] = [e for e in mine if e.type == "response.function_call_arguments.done"]
            assert "".join(deltas) == done.arguments == item.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with client.responses.stream(**args, max_output_tokens=100, temperature=0) as stream:
        accumulated = stream.get_final_response()
    assert shape(accumulated.output) == shape(resp.output)


def test_reasoning_is_a_reasoning_item(server, client):
    """A prompt that opens the model's reasoning (as Qwen3's thinking templates end): the
    hermes parser the tiny qwen3_moe gets reads the answer as reasoning, a `reasoning` item."""
    generator = server[1]
    tokenizer = generator.tokenizer
    tiny_template = tokenizer.chat_template
    tokenizer.chat_template = tiny_template.replace("assistant\\n", "assistant\\n<think>\\n")
    assert tokenizer.chat_template != tiny_template
    try:
        want = greedy(generator, [{"role": "user", "content": "Hi"}], 8)
        args = {"model": MODEL, "input": "Hi", "max_output_tokens": 8, "temperature": 0}
        resp = client.responses.create(**args)
        events = list(client.responses.create(**args, stream=True))
    finally:
        tokenizer.chat_template = tiny_template
    [item] = resp.output
    assert (item.type, item.status) == ("reasoning", "incomplete")
    assert item.content[0].type == "reasoning_text"
    assert item.content[0].text == want.text
    assert resp.output_text == ""
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == want.text
    assert [e.type for e in events if e.type.endswith(".done")] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert events[-1].response.output[0].content[0].text == want.text


def test_output_items_from_parser_deltas():
    """Every kind of part in one delta, then a call's arguments in pieces and a second call:
    the items in order, each event as the item was then, the arguments joined."""
    from moetier.server.parsers.base import Delta, ToolCallDelta
    from moetier.server.responses import OutputItems

    items = OutputItems()
    first = Delta(
        [
            ("reasoning", "think"),
            ("content", "Hello"),
            ("tool_call", ToolCallDelta(0, "call_a", "f", '{"x"')),
        ]
    )
    events = items.push(first)
    events += items.push(Delta([("tool_call", ToolCallDelta(0, arguments=": 1}"))]))
    events += items.push(Delta([("tool_call", ToolCallDelta(1, "call_b", "g", "{}"))]))
    events += items.close("stop")
    assert [(i["type"], i["status"]) for i in items.items] == [
        ("reasoning", "completed"),
        ("message", "completed"),
        ("function_call", "completed"),
        ("function_call", "completed"),
    ]
    assert items.items[0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert items.items[1]["content"][0]["text"] == "Hello"
    assert [(c["call_id"], c["name"], c["arguments"]) for c in items.items[2:]] == [
        ("call_a", "f", '{"x": 1}'),
        ("call_b", "g", "{}"),
    ]
    added = [data["item"] for name, data in events if name == "response.output_item.added"]
    assert [a["status"] for a in added] == ["in_progress"] * 4
    assert all(a.get("content", []) == [] and a.get("arguments", "") == "" for a in added)
    by_item: dict[int, list[str]] = {}
    for name, data in events:
        by_item.setdefault(data["output_index"], []).append(name)
    assert by_item[0] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert by_item[2] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    cut = OutputItems()
    cut.push(Delta([("content", "Hel")]))
    cut.close("length")
    assert cut.items[0]["status"] == "incomplete"
    empty = OutputItems()
    assert [name for name, _ in empty.close("stop")][-1] == "response.output_item.done"
    assert empty.items[0]["content"][0]["text"] == ""


def test_a_call_withdrawn_midstream_leaves_its_output_index_to_no_other_item(client):
    """A forced call cut by max_output_tokens was announced (output_item.added, arguments
    streamed) and then found broken: its markup follows as a message item. That item takes a
    new output_index: the official SDK's stream accumulator raised 'Duplicate response output
    index 0.' when it reused the withdrawn call's, and clients that key items by index would
    have mixed the two."""
    args = {"model": MODEL, "input": "Rome?", "tools": [TOOL], "tool_choice": "required"}
    for cap in range(40, 80):  # the first cap that cuts the call inside its arguments
        events = list(client.responses.create(**args, max_output_tokens=cap, temperature=0,
                                              stream=True))  # fmt: skip
        added = [e for e in events if e.type == "response.output_item.added"]
        final = events[-1].response
        if [a.item.type for a in added] == ["function_call", "message"] and not [
            i for i in final.output if i.type == "function_call"
        ]:
            break
    else:
        pytest.fail("no max_output_tokens cut the forced call midway")
    assert events[-1].type == "response.incomplete"
    assert len({a.output_index for a in added}) == len(added)
    [message] = final.output
    mine = [e for e in events if getattr(e, "item_id", None) == message.id]
    assert {e.output_index for e in mine} == {added[1].output_index}
    with client.responses.stream(**args, max_output_tokens=cap, temperature=0) as stream:
        streamed = list(stream)  # the SDK accumulates every event
    assert streamed[-1].type == "response.incomplete"


def test_the_left_out_tool_types_named_are_bounded(caplog, monkeypatch):
    """Tool types come from clients (any `name_20250101` is one of Anthropic's own): the log
    names each once, and stops naming new ones after SAID_AT_MOST, so a client sending a new
    type with every request grows neither the log nor the process."""
    from moetier.server import hosted_tools

    monkeypatch.setattr(hosted_tools, "_said", set())
    with caplog.at_level("WARNING", logger="moetier.server"):
        for n in range(3 * hosted_tools.SAID_AT_MOST):
            hosted_tools.leave_out(f"tool{n}_20250101", "Anthropic")
    assert len(hosted_tools._said) == hosted_tools.SAID_AT_MOST
    said = [r for r in caplog.records if "_20250101" in r.getMessage()]
    assert len(said) == hosted_tools.SAID_AT_MOST
