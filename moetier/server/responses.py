"""OpenAI's Responses API, stateless: `POST /v1/responses`, streaming (typed server-sent events
with `sequence_number`s, no `[DONE]`) and not.

`input` (a string, or items: messages with text parts, joined by newlines, and the history's
`function_call` and `function_call_output` items) and `instructions` become the chat template's
messages; function `tools` reach the template, `tool_choice` required or a named function
forces a call by a grammar. Nothing is stored: `previous_response_id` and `conversation` are
refused with a 400 (send the whole history in `input`), `store` is accepted and answered
`false`. `text.format` is enforced as `response_format` is. The model's parser (server/parsers)
splits the answer into output items, in order: `reasoning`, `message` (one output_text part) and
`function_call` (`OutputItems`, the same for streamed and whole answers).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from moetier.engine.engine import Output
from moetier.engine.scheduler import ContextLengthError
from moetier.server.errors import openai_error
from moetier.server.hosted_tools import leave_out
from moetier.server.parsers.base import Delta
from moetier.server.parsers.serving import ChatParsing, prepare_chat, template_kwargs
from moetier.server.sampling_fields import JsonSchemaFormat, ResponseFormat, SamplingFields
from moetier.server.state import ServerState, all_outputs, not_ready

TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(BaseModel):
    """An input item; which fields apply depends on `type` (a message when it has none)."""

    model_config = ConfigDict(extra="allow")

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class TextFormat(BaseModel):
    """`text.format`: the Responses API's response_format, its json_schema fields flat."""

    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        fields = {"name": self.name, "description": self.description, "strict": self.strict}
        schema = JsonSchemaFormat.model_validate({**fields, "schema": self.json_schema})
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None


class ResponsesRequest(SamplingFields):
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    store: bool | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    text: TextOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension, as on chat

    @model_validator(mode="after")
    def _text_format(self) -> ResponsesRequest:
        """`text.format` is this API's response_format (enforced alike)."""
        if self.text is not None and self.text.format is not None:
            self.response_format = self.text.format.response_format()
        return self

    def asked_max_tokens(self) -> int | None:
        return self.max_output_tokens if self.max_output_tokens is not None else self.max_tokens


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    """A message's (or a call output's) text: its text parts joined by newlines (as vLLM joins
    them: joined with nothing, the words of two parts would run together); ValueError for a
    part that is not text."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type not in TEXT_PARTS:
            raise ValueError(f"{where}: {part.type!r} content is not supported (text only)")
        parts.append(part.text if part.text is not None else part.refusal or "")
    return "\n".join(parts)


def chat_messages(instructions: str | None, items: str | list[InputItem]) -> list[dict[str, Any]]:
    """The request's instructions and input as the chat template's messages: a function call
    joins the assistant message before it (or starts one), a call's output is a `tool` message,
    a reasoning item's text is the `reasoning_content` of the assistant message it comes with
    (templates that keep the history's reasoning render it); ValueError for an item that
    cannot be sent."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not items:
        raise ValueError("input: the input is empty: send a string or at least one item")
    reasoning: list[str] = []  # reasoning items' text, for the assistant message that follows

    def assistant(entry: dict[str, Any]) -> None:
        if reasoning:
            entry["reasoning_content"] = "\n".join(
                t for t in (entry.get("reasoning_content", ""), *reasoning) if t
            )
            reasoning.clear()

    for n, item in enumerate(items):
        where = f"input.{n}"
        if item.type == "message":
            if item.role is None:
                raise ValueError(f"{where}: a message needs a role")
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content, where)})
            if role == "assistant":
                assistant(out[-1])
        elif item.type == "function_call":
            if item.name is None or item.call_id is None:
                raise ValueError(f"{where}: a function_call needs name and call_id")
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments or "{}"},
            }
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
            assistant(out[-1])
        elif item.type == "function_call_output":
            if item.call_id is None:
                raise ValueError(f"{where}: a function_call_output needs call_id")
            content = _text(item.output, where)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
        elif item.type == "reasoning":
            reasoning.append(_reasoning_text(item))
        else:
            raise ValueError(f"{where}: {item.type!r} items are not supported by this server")
    return out


def _reasoning_text(item: InputItem) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary's text (an
    encrypted_content alone, which only OpenAI can read, gives none)."""
    if isinstance(item.content, list) and item.content:
        return "\n".join(part.text or "" for part in item.content)
    summary = (item.model_extra or {}).get("summary") or []
    return "\n".join(str(p.get("text", "")) for p in summary if isinstance(p, dict))


# tools that OpenAI's servers run themselves (no call reaches the client): left out of the
# prompt, not refused (hosted_tools.py)
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "file_search", "code_interpreter",
                          "image_generation", "computer_use_preview", "mcp"})  # fmt: skip


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as the chat template's; hosted tools (HOSTED_TOOLS) left out,
    said once per type in the log; ValueError for other tool types."""
    out = []
    for n, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind in HOSTED_TOOLS:
            leave_out(kind, "OpenAI")
            continue
        if kind != "function" or not tool.get("name"):
            raise ValueError(
                f"tools.{n}: only function tools with a name are supported, not "
                f"{tool.get('type')!r}"
            )
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise ValueError(
                f"tools.{n}.parameters: must be a JSON schema object such as "
                f'{{"type": "object", "properties": {{...}}}}, not '
                f"{type(tool['parameters']).__name__}"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out or None


Event = tuple[str, dict[str, Any]]  # a stream event's name and fields (less type, sequence)


class OutputItems:
    """The answer's output items, built from the parser's deltas in order: reasoning text as a
    `reasoning` item, content as a `message` item with one `output_text` part, each tool call as
    a `function_call` item. `push` returns the stream events a delta makes (an item's added,
    content part and delta events); `close` ends the last item (incomplete when
    max_output_tokens cut it) and returns its done events; `items` is the output so far."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""  # the open item's text (a call's arguments)
        self.call = -1  # the open function_call's tool-call index
        # the open item's output_index: items announced before it, a withdrawn call's too (its
        # index was sent and is never given to another item)
        self.index = -1

    def push(self, delta: Delta) -> list[Event]:
        events: list[Event] = []
        for kind, value in delta.parts:
            if kind == "tool_call" and value.withdrawn:
                self._withdraw(value.index)
                continue
            if kind == "tool_call":
                same_call = self._kind() == "function_call" and value.index == self.call
                if value.id is not None or not same_call:
                    events += self._end("completed")
                    events += self._begin_call(value.id, value.name, value.index)
                events += self._grow(value.arguments)
                continue
            wanted = "reasoning" if kind == "reasoning" else "message"
            if self._kind() != wanted:
                events += self._end("completed")
                events += self._begin(wanted)
            events += self._grow(value)
        return events

    def close(self, finish_reason: str | None) -> list[Event]:
        """End the last item; an answer of no item at all gets an empty message."""
        events = [] if self.items else self._begin("message")
        return events + self._end("incomplete" if finish_reason == "length" else "completed")

    def _withdraw(self, index: int) -> None:
        """The parser found the open call broken (its markup follows as text): the item leaves
        the output; its events were sent and stay sent (a stream cannot take them back), so
        the items after it keep counting from its output_index (never reused)."""
        if self._kind() == "function_call" and self.call == index and self.open is not None:
            self.items.remove(self.open)
            self.open, self.text, self.call = None, "", -1

    def _kind(self) -> str | None:
        return None if self.open is None else str(self.open["type"])

    def _where(self, content: bool = True) -> dict[str, Any]:
        assert self.open is not None
        where = {"item_id": self.open["id"], "output_index": self.index}
        return {**where, "content_index": 0} if content else where

    def _begin(self, kind: str) -> list[Event]:
        if kind == "reasoning":
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": []}
            item.update(content=[], status="in_progress")
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = _message(f"msg_{uuid.uuid4().hex}", None, "in_progress")
            part = _text_part("")
        added = self._announce(item)
        return [added, ("response.content_part.added", {**self._where(), "part": part})]

    def _begin_call(self, call_id: str | None, name: str | None, index: int) -> list[Event]:
        item = {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "call_id": call_id or f"call_{uuid.uuid4().hex[:24]}",
            "name": name or "",
            "arguments": "",
            "status": "in_progress",
        }
        added = self._announce(item)
        self.call = index
        return [added]

    def _announce(self, item: dict[str, Any]) -> Event:
        """`item` opened at the next output_index, and its output_item.added event."""
        self.open, self.text = item, ""
        self.items.append(item)
        self.index += 1
        added = {"output_index": self.index, "item": dict(item)}  # as it is now
        return ("response.output_item.added", added)

    def _grow(self, piece: str) -> list[Event]:
        if not piece or self.open is None:
            return []
        self.text += piece
        kind = self.open["type"]
        if kind == "function_call":
            call_delta = {**self._where(False), "delta": piece}
            return [("response.function_call_arguments.delta", call_delta)]
        if kind == "reasoning":
            return [("response.reasoning_text.delta", {**self._where(), "delta": piece})]
        text_delta = {**self._where(), "delta": piece, "logprobs": []}
        return [("response.output_text.delta", text_delta)]

    def _end(self, status: str) -> list[Event]:
        item = self.open
        if item is None:
            return []
        kind, text = item["type"], self.text
        events: list[Event] = []
        if kind == "function_call":
            item.update(arguments=text, status=status)
            done = {**self._where(False), "name": item["name"], "arguments": text}
            events.append(("response.function_call_arguments.done", done))
        else:
            if kind == "reasoning":
                part: dict[str, Any] = {"type": "reasoning_text", "text": text}
                events.append(("response.reasoning_text.done", {**self._where(), "text": text}))
            else:
                part = _text_part(text)
                done = {**self._where(), "text": text, "logprobs": []}
                events.append(("response.output_text.done", done))
            events.append(("response.content_part.done", {**self._where(), "part": part}))
            item.update(content=[part], status=status)
        events.append(("response.output_item.done", {"output_index": self.index, "item": item}))
        self.open = None
        return events


def _message(message_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(last: Output, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": last.prompt_tokens,
        "input_tokens_details": {"cached_tokens": last.cached_tokens},
        "output_tokens": last.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": last.prompt_tokens + last.completion_tokens,
    }


def _text_format(req: ResponsesRequest) -> dict[str, Any]:
    if req.text is None or req.text.format is None:
        return {"type": "text"}
    return req.text.format.model_dump(by_alias=True, exclude_none=True)


class _Envelope:
    """What a response object carries besides its output, status and usage."""

    def __init__(self, req: ResponsesRequest, model: str, max_tokens: int | None) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.fields: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "instructions": req.instructions,
            "max_output_tokens": max_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": req.reasoning,
            "store": False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": _text_format(req)},
            "tool_choice": req.tool_choice,
            "tools": req.tools or [],
            "truncation": "disabled",
            "user": req.user,
            "background": False,
            "error": None,
        }

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        last: Output | None = None,
        reasoning_tokens: int = 0,
    ) -> dict[str, Any]:
        incomplete = None
        if last is not None and last.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        return {
            **self.fields,
            "status": status,
            "incomplete_details": incomplete,
            "output": output,
            "usage": _usage(last, reasoning_tokens) if last is not None else None,
        }


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/responses", response_model=None)
    async def responses(
        req: ResponsesRequest, http: Request
    ) -> JSONResponse | StreamingResponse | dict[str, Any]:
        engine = state.engine
        if engine is None:
            return openai_error(*not_ready(state), "server_error")
        try:
            if req.previous_response_id is not None or req.conversation is not None:
                field = "previous_response_id" if req.previous_response_id else "conversation"
                raise ValueError(
                    f"{field}: this server is stateless and keeps no responses: send the whole "
                    "conversation in input"
                )
            if req.background:
                raise ValueError("background: background responses are not supported")
            messages = chat_messages(req.instructions, req.input)
            # rendering and tokenizing a long conversation takes a while: off the event loop
            prompt_ids, params, parsing = await asyncio.to_thread(
                prepare_chat,
                engine,
                state.parser,
                messages,
                req.sampling_params(state.defaults),
                template_tools(req.tools),
                req.tool_choice,
                req.parallel_tool_calls,
                template_kwargs(state.template_defaults, req.chat_template_kwargs),
                state.options.relaxed_chat_template,
            )
            max_tokens = req.asked_max_tokens()
            engine.check(prompt_ids, params, max_tokens)
        except ContextLengthError as err:
            return openai_error(400, str(err), param="input", code="context_length_exceeded")
        except ValueError as err:
            return openai_error(400, str(err))
        envelope = _Envelope(req, state.model_name, max_tokens)
        outputs = engine.generate(
            prompt_ids, params, chat=True, max_tokens=max_tokens, ignore_eos=req.ignore_eos
        )
        if req.stream:
            events = _events(outputs, envelope, parsing)
            return StreamingResponse(events, media_type="text/event-stream")

        try:
            done = await all_outputs(http, outputs)
        except ValueError as err:  # a request the engine refused when it came to add it
            return openai_error(400, str(err))
        except RuntimeError as err:
            return openai_error(503, str(err), "server_error")
        if done is None:  # the client left: its request is aborted
            return openai_error(499, "client closed the request")
        items = OutputItems()
        for out in done:
            items.push(parsing.push(out))
        items.close(done[-1].finish_reason)
        return envelope.response("completed", items.items, done[-1], parsing.reasoning_tokens)


async def _events(
    outputs: AsyncIterator[Output], envelope: _Envelope, parsing: ChatParsing
) -> AsyncIterator[str]:
    """The documented event sequence: response.created, response.in_progress, each output
    item's events (OutputItems), then response.completed (response.incomplete when
    max_output_tokens cut it short). Closed early (the client went away), the request is
    aborted by `outputs`' own cleanup."""
    sequence = 0

    def event(name: str, data: dict[str, Any]) -> str:
        nonlocal sequence
        body = {"type": name, "sequence_number": sequence, **data}
        sequence += 1
        return f"event: {name}\ndata: {json.dumps(body)}\n\n"

    yield event("response.created", {"response": envelope.response("in_progress", [])})
    yield event("response.in_progress", {"response": envelope.response("in_progress", [])})
    items, last = OutputItems(), None
    try:
        async for out in outputs:
            last = out
            for name, data in items.push(parsing.push(out)):
                yield event(name, data)
    except (RuntimeError, ValueError) as err:  # the engine failed, shuts down or refused
        # refused when the engine took it (nothing generated yet): the request's fault, as
        # the other routes answer it; else the server's
        refused = isinstance(err, ValueError) and last is None
        code = "invalid_request_error" if refused else "server_error"
        yield event("error", {"code": code, "message": str(err), "param": None})
        return
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    assert last is not None  # a finished request has a last output
    for name, data in items.close(last.finish_reason):
        yield event(name, data)
    final = envelope.response("completed", items.items, last, parsing.reasoning_tokens)
    name = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield event(name, {"response": final})
