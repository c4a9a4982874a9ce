"""The Anthropic surface: `POST /v1/messages` (streaming and not) and
`POST /v1/messages/count_tokens`, with Anthropic-shaped errors.

Messages become the chat template's messages: `system` (a string or text blocks) first, a
message's text blocks joined by newlines (as vLLM joins them: Claude Code sends several), an
assistant's `tool_use` blocks as its `tool_calls`, a user's `tool_result`
blocks as `tool` messages, thinking blocks of the history as `reasoning_content` (for the
templates that keep it); image blocks are refused with a 400. `tools` reach the chat
template (Anthropic's own tools, of a versioned type, are left out: hosted_tools.py);
the model's parser (server/parsers) turns its reasoning and tool calls into `thinking` and
`tool_use` blocks (streamed as thinking_delta and input_json_delta; stop_reason tool_use);
`tool_choice` any or tool forces a call by a grammar; `thinking` enabled / disabled sets the
hybrid templates' `enable_thinking` / `thinking`.
Streams send the documented events in order (message_start, content_block_start, ping,
content_block_delta, content_block_stop, message_delta, message_stop), no `[DONE]`.
`usage.input_tokens` counts the prompt tokens not read from the prefix cache;
`cache_read_input_tokens` those that were; message_start waits for the request's first output
(the prefix match is made when the engine admits it), so its usage has the final usage's input
accounting, and a request that fails before then gets an `error` event and no message_start.
Claude Code's per-request billing line is dropped from `system` (BILLING_LINE), so its prompts
share their prefix in the prefix cache.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from moetier.engine.engine import Output
from moetier.engine.sampler import SamplingParams
from moetier.engine.scheduler import ContextLengthError
from moetier.server.errors import ANTHROPIC_PREFIX, anthropic_error, stream_error_event
from moetier.server.hosted_tools import leave_out
from moetier.server.parsers.registry import FAMILIES
from moetier.server.parsers.serving import (
    AnthropicStream,
    ChatParsing,
    anthropic_blocks,
    anthropic_thinking,
    prepare_chat,
    template_kwargs,
)
from moetier.server.state import ServerState, all_outputs, not_ready

PREFIX = ANTHROPIC_PREFIX
# while a tool call is held back (AnthropicStream), a ping at least this often keeps the stream
# from looking dead to a client or a proxy
HELD_PING_S = 5.0
# Claude Code's per-request attribution line at the start of its system prompt
# ("x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=...;"): it changes with
# every request, so left in it would make every prompt differ from its first tokens on
BILLING_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*(\n|$)", re.MULTILINE)


# the block types a request's messages may hold here (documented in the schema as an enum;
# another type is still parsed and answered with a 400 that names it and says what to send)
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _documented_non_empty(schema: dict[str, Any]) -> None:
    """The schema of a `str | list` field documented as non-empty (Anthropic's rule, checked by
    chat_messages: the final assistant message alone may be empty, which a schema cannot say)."""
    for branch in schema.get("anyOf", []):
        if branch.get("type") == "string":
            branch["minLength"] = 1
        elif branch.get("type") == "array":
            branch["minItems"] = 1


class Block(BaseModel):
    """A content block; which fields apply depends on `type`."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(json_schema_extra={"enum": list(BLOCK_TYPES)})
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block] = Field(json_schema_extra=_documented_non_empty)


class MessagesRequest(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)  # NaN: "a finite number" (sampling_fields)

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[dict[str, Any]] | None = None


def error(status: int, message: str, kind: str | None = None) -> JSONResponse:
    """An error in Anthropic's shape (its type follows the status unless `kind` is given)."""
    return anthropic_error(status, message, kind)


def chat_messages(
    system: str | list[Block] | None, messages: list[Message]
) -> list[dict[str, Any]]:
    """Anthropic messages as the chat template's messages; ValueError for what cannot be sent."""
    out: list[dict[str, Any]] = []
    system_text = _system_text(system)
    if system_text:
        out.append({"role": "system", "content": system_text})
    for n, message in enumerate(messages):
        if message.content in ([], "") and not (
            n == len(messages) - 1 and message.role == "assistant"
        ):
            # Anthropic's rule (and its words); dropped, the turn would vanish unnoticed
            raise ValueError(
                f"messages.{n}: all messages must have non-empty content except for the "
                "optional final assistant message"
            )
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        thinking: list[str] = []
        for block in message.content:
            if block.type == "text":
                texts.append(block.text or "")
            elif block.type == "tool_use" and message.role == "assistant":
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": json.dumps(block.input)},
                    }
                )
            elif block.type == "tool_result" and message.role == "user":
                content = block.content if block.content is not None else ""
                result = _text(content, "tool_result")
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
            elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
                # the history's reasoning, for templates that keep it (interleaved thinking)
                thinking.append(str(getattr(block, "thinking", None) or ""))
            elif block.type in ("image", "document"):
                raise ValueError(
                    f"{block.type} content blocks are not supported by this model: send text"
                )
            else:
                article = "an" if message.role == "assistant" else "a"
                raise ValueError(
                    f"a {block.type!r} block cannot be in {article} {message.role} message"
                )
        if texts or calls or message.role == "assistant":
            entry: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            if any(thinking):
                entry["reasoning_content"] = "\n".join(t for t in thinking if t)
            out.append(entry)
    return out


def _system_text(system: str | list[Block] | None) -> str:
    """The system prompt's text, its blocks joined by newlines, without Claude Code's billing
    line (in any of its blocks; a block that was only that line is left out, not an empty
    line)."""
    if not system:
        return ""
    blocks = [system] if isinstance(system, str) else system
    parts = []
    for block in blocks:
        text = block if isinstance(block, str) else _text([block], "system")
        kept = BILLING_LINE.sub("", text)
        if kept or kept == text:
            parts.append(kept)
    return "\n".join(parts)


def _text(content: str | list[Block], where: str) -> str:
    """Text blocks' text joined by newlines; ValueError for a block of another type."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if block.type != "text":
            raise ValueError(f"{where}: only text blocks are supported here, not {block.type!r}")
        parts.append(block.text or "")
    return "\n".join(parts)


# Anthropic's own tools: a versioned type (web_search_20250305, bash_20250124,
# text_editor_20250124, code_execution_20250825, ...) and no input_schema, their definitions
# built into Anthropic's models: left out of the prompt, not refused (hosted_tools.py)
ANTHROPIC_TOOL = re.compile(r"[a-z][a-z0-9_]*_\d{8}")


def _tools(
    tools: list[dict[str, Any]] | None, tool_choice: dict[str, Any] | None = None
) -> list[dict[str, Any]] | None:
    """Anthropic tool definitions (`custom`, or no type, with an input_schema) as the chat
    template's (OpenAI-style functions); Anthropic's own tools (ANTHROPIC_TOOL) left out, said
    once in the log. ValueError for another type, and for a `tool_choice` that names a tool left
    out or forces a call when every tool was."""
    out = []
    left_out: dict[str, str] = {}  # name -> type
    for n, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if isinstance(kind, str) and ANTHROPIC_TOOL.fullmatch(kind):
            leave_out(kind, "Anthropic")
            left_out[str(tool.get("name"))] = kind
            continue
        if kind not in (None, "custom"):
            raise ValueError(
                f"tools.{n}: type {kind!r} is not a tool type here: send a tool with a name and "
                'an input_schema (type "custom" or no type)'
            )
        name, schema = tool.get("name"), tool.get("input_schema", {"type": "object"})
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools.{n}.name: a custom tool needs a name (a non-empty string)")
        if not isinstance(schema, dict):
            raise ValueError(
                f"tools.{n}.input_schema: must be a JSON schema object such as "
                f'{{"type": "object", "properties": {{...}}}}, not {type(schema).__name__}'
            )
        function = {"name": name, "description": tool.get("description", ""), "parameters": schema}
        out.append({"type": "function", "function": function})
    choice = tool_choice or {}
    named = choice.get("name") if choice.get("type") == "tool" else None
    if isinstance(named, str) and named in left_out:
        raise ValueError(
            f"tool_choice names {named!r}, Anthropic's own {left_out[named]} tool, which this "
            "server leaves out (this model does not have it): name one of the request's custom "
            "tools, or use auto"
        )
    if choice.get("type") == "any" and left_out and not out:
        raise ValueError(
            f"tool_choice any forces a call, but the request's only tools are Anthropic's own "
            f"({', '.join(sorted(left_out.values()))}), which this server leaves out (this "
            "model does not have them): add a custom tool, or use auto"
        )
    return out or None


def _tool_choice(choice: dict[str, Any] | None) -> Any:
    """Anthropic's `tool_choice` as prepare_chat takes it: auto and none by name, any and a
    named tool as they are (they force a call); ValueError in Anthropic's terms for another
    (forced.py's own message names OpenAI's)."""
    if not choice:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "tool" and not (isinstance(choice.get("name"), str) and choice["name"]):
        raise ValueError(
            'tool_choice: type tool needs the tool\'s name: {"type": "tool", "name": N}'
        )
    if kind not in ("any", "tool"):
        raise ValueError(
            f"tool_choice {choice!r}: use type auto, any, tool (with the tool's name) or none"
        )
    return choice


def _prompt_ids(state: ServerState, req: CountTokensRequest) -> list[int]:
    """The request's prompt as /v1/messages renders it; ValueError if it cannot be."""
    messages = chat_messages(req.system, req.messages)
    relaxed = state.options.relaxed_chat_template
    ids, _, _ = prepare_chat(
        state.engine, state.parser, messages, SamplingParams(), _tools(req.tools), relaxed=relaxed
    )
    return ids


def _reasoning_budget(
    state: ServerState,
    tokenizer: Any,
    thinking: dict[str, Any] | None,
    params: SamplingParams,
    in_reasoning: bool,
) -> SamplingParams:
    """`thinking: {type: enabled, budget_tokens: N}`: at most N tokens before the family's
    end-of-reasoning marker (forced after that: engine/reasoning_budget.py). `in_reasoning`: the
    prompt leaves the output in reasoning; otherwise the budget holds only for an answer that
    opens with the family's start marker (a hybrid model that thinks), never forcing the end
    marker into a plain answer. Families without such markers (harmony's channels), a forced
    tool call (its grammar), or no budget: as is."""
    if not thinking or thinking.get("type") != "enabled" or "budget_tokens" not in thinking:
        return params
    budget = thinking["budget_tokens"]
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"thinking.budget_tokens = {budget!r}: use a whole number of tokens >= 1")
    name = state.parser.family if state.parser is not None else None
    family = FAMILIES.get(name) if name is not None else None
    marker = getattr(family, "think_end", None)
    if not marker or params.grammar is not None:
        return params
    end_ids = tuple(tokenizer.encode(marker, add_special_tokens=False))
    if in_reasoning:
        return replace(params, reasoning_budget=(budget, end_ids))
    start = getattr(family, "think_start", None)
    if not start:
        return params
    start_ids = tuple(tokenizer.encode(start, add_special_tokens=False))
    return replace(params, reasoning_budget=(budget, end_ids, start_ids))


def context_error(err: ContextLengthError) -> str:
    """A request past the context in Anthropic's words, which clients parse: Claude Code
    retries `input length and `max_tokens` exceed context limit: I + O > N` with a max_tokens
    that fits (its default, 32000, fits no small context) and takes `prompt is too long: I
    tokens > N maximum` as a context to compact. Our own account and what to do follow."""
    prompt, new, limit = err.prompt, err.new, err.limit
    if prompt > limit:
        return f"prompt is too long: {prompt} tokens > {limit} maximum ({err})"
    room = limit - prompt
    hint = (  # Claude Code asks for 32,000 tokens (its default) whatever is left
        f"; the prompt leaves room for {room}: Claude Code asks for "
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS tokens, 32000 unless set lower"
        if room > 0 else ""
    )  # fmt: skip
    return (
        f"input length and `max_tokens` exceed context limit: {prompt} + {new} > {limit}, "
        f"decrease input length or `max_tokens` and try again ({err}{hint})"
    )


def stop_reason(out: Output) -> str | None:
    if out.finish_reason == "length":
        return "max_tokens"
    if out.finish_reason == "stop":
        return "stop_sequence" if out.stop_sequence is not None else "end_turn"
    return None if out.finish_reason is None else "end_turn"


def usage(out: Output) -> dict[str, int]:
    return {
        "input_tokens": out.prompt_tokens - out.cached_tokens,
        "cache_read_input_tokens": out.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": out.completion_tokens,
    }


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post(PREFIX, response_model=None)
    async def messages(
        req: MessagesRequest, http: Request
    ) -> JSONResponse | StreamingResponse | dict[str, Any]:
        engine = state.engine
        if engine is None:
            return error(*not_ready(state), "overloaded_error")
        try:
            defaults = state.defaults
            params = SamplingParams(
                max_new_tokens=req.max_tokens,
                temperature=req.temperature if req.temperature is not None else 1.0,
                top_p=req.top_p if req.top_p is not None else 1.0,
                top_k=req.top_k if req.top_k is not None else defaults.top_k,
                stop=tuple(req.stop_sequences or ()),
            )
            choice = req.tool_choice or {}
            # rendering and tokenizing a long conversation takes a while: off the event loop
            prompt_ids, params, parsing = await asyncio.to_thread(
                prepare_chat,
                engine,
                state.parser,
                chat_messages(req.system, req.messages),
                params,
                _tools(req.tools, req.tool_choice),
                _tool_choice(req.tool_choice),
                not choice.get("disable_parallel_tool_use", False),
                template_kwargs(state.template_defaults, anthropic_thinking(req.thinking)),
                state.options.relaxed_chat_template,
            )
            params = _reasoning_budget(
                state, engine.tokenizer, req.thinking, params, parsing.starts_in_reasoning
            )
            engine.check(prompt_ids, params, req.max_tokens)
        except ContextLengthError as err:
            return error(400, context_error(err))
        except ValueError as err:
            return error(400, str(err))
        message_id = f"msg_{uuid.uuid4().hex}"
        outputs = engine.generate(prompt_ids, params, chat=True, max_tokens=req.max_tokens)
        if req.stream:
            return StreamingResponse(
                _events(outputs, message_id, state.model_name, parsing),
                media_type="text/event-stream",
            )

        try:
            done = await all_outputs(http, outputs)
        except ValueError as err:  # a request the engine refused when it came to add it
            return error(400, str(err))
        except RuntimeError as err:
            return error(503, str(err), "overloaded_error")
        if done is None:
            return error(499, "client closed the request", "api_error")
        last = done[-1]
        for out in done:
            parsing.push(out)
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": state.model_name,
            "content": anthropic_blocks(parsing.message),  # thinking, text, tool_use
            "stop_reason": parsing.stop_reason(stop_reason(last)),
            "stop_sequence": last.stop_sequence,
            "usage": usage(last),
        }

    @app.post(PREFIX + "/count_tokens", response_model=None)
    async def count_tokens(req: CountTokensRequest) -> JSONResponse | dict[str, int]:
        if state.engine is None:
            return error(*not_ready(state), "overloaded_error")
        try:  # a whole conversation rendered and tokenized: off the event loop
            return {"input_tokens": len(await asyncio.to_thread(_prompt_ids, state, req))}
        except ValueError as err:
            return error(400, str(err))


async def _events(
    outputs: AsyncIterator[Output],
    message_id: str,
    model: str,
    parsing: ChatParsing,
) -> AsyncIterator[str]:
    """The stream's server-sent events, in the documented order; closed early (the client
    went away), the request is aborted by `outputs`' own cleanup.

    message_start is sent with the request's first output: only once the engine has admitted
    the request is its prefix-cache hit known, and Anthropic's message_start carries the same
    input accounting as the final usage (Claude Code reads the context's size from it). Until
    then the stream sends keep-alive comments (sse.py). A request refused or failed before its
    first output gets only an `error` event."""

    def event(name: str, data: dict[str, Any]) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

    blocks = AnthropicStream()  # thinking, text and tool_use blocks as the parser finds them
    pinged = False
    quiet_since = time.monotonic()  # the last block event sent
    last = None
    try:
        async for out in outputs:
            if last is None:
                start: dict[str, Any] = {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": usage(out),  # input as final; output tokens so far
                }
                yield event("message_start", {"message": start})
            last = out
            sent = False
            for name, data in blocks.events(parsing.push(out)):
                yield event(name, data)
                sent = True
                if not pinged:  # after the first block starts, as before
                    pinged = True
                    yield event("ping", {})
            now = time.monotonic()
            if sent:
                quiet_since = now
            elif blocks.holding and now - quiet_since > HELD_PING_S:  # a long call held back
                quiet_since = now
                yield event("ping", {})
    except ValueError as err:
        if last is not None:  # not the engine's refusal: a bug (sse.py's error event)
            raise
        # refused when the engine took the request (a grammar it cannot compile, too long)
        yield stream_error_event(PREFIX, str(err), 400).decode()
        return
    except RuntimeError as err:  # the engine failed or is shutting down
        yield stream_error_event(PREFIX, str(err)).decode()
        return
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    if last is None:  # never happens: a request's outputs end with its finish or raise
        yield stream_error_event(PREFIX, "the request ended without an output", 500).decode()
        return
    for name, data in blocks.close():
        yield event(name, data)
        if not pinged:
            pinged = True
            yield event("ping", {})
    reason = parsing.stop_reason(stop_reason(last))
    end = {"stop_reason": reason, "stop_sequence": last.stop_sequence}
    yield event("message_delta", {"delta": end, "usage": usage(last)})
    yield event("message_stop", {})
