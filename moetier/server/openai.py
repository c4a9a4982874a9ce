"""The OpenAI surface: `POST /v1/chat/completions`, streaming (server-sent
`chat.completion.chunk` events ending with `[DONE]`; a failure ends it with an error event)
and not, OpenAI-shaped errors (the checks every route shares are admission.py's). `tools`,
`tool_choice` and `parallel_tool_calls` as OpenAI's; the model's parser (server/parsers) splits
its output into `reasoning_content`, `content` and `tool_calls` (finish_reason tool_calls)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from moetier.engine.engine import Output
from moetier.engine.sampler import MAX_LOGPROBS
from moetier.engine.scheduler import ContextLengthError
from moetier.server.errors import openai_error, stream_error_event
from moetier.server.parsers.base import Message
from moetier.server.parsers.serving import (
    ChatParsing,
    prepare_chat,
    reasoning_fields,
    template_kwargs,
)
from moetier.server.sampling_fields import SamplingFields
from moetier.server.state import ServerState, all_outputs, not_ready


class ContentPart(BaseModel):
    type: str
    text: str | None = None


_JSON_KINDS = {str: "a string", list: "an array", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}  # fmt: skip


class CalledFunction(BaseModel):
    """The function of a history tool call, as OpenAI sends it back: its name and arguments (the
    JSON text of an object; the object itself is taken too)."""

    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] | None = None


class HistoryToolCall(BaseModel):
    """An assistant message's tool call: `{"id", "type": "function", "function": {"name",
    "arguments"}}`; another shape of `function` is a 400 that says this one."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: str | None = None
    function: CalledFunction

    @field_validator("function", mode="before")
    @classmethod
    def _an_object(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            kind = _JSON_KINDS.get(type(value), type(value).__name__)
            raise ValueError(
                'use an object {"name": NAME, "arguments": "the arguments as JSON text"}, '
                f"not {kind}"
            )
        return value


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    # tool calls and reasoning of the history (server/parsers/serving.py shapes them)
    tool_calls: list[HistoryToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template gets it."""
        out: dict[str, Any] = {
            "role": self.role if self.role != "developer" else "system",
            "content": self.text(),
        }
        if self.tool_calls is not None:  # as sent (fields not given stay out)
            out["tool_calls"] = [call.model_dump(exclude_unset=True) for call in self.tool_calls]
        for key in ("tool_call_id", "name", "reasoning_content", "reasoning"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        """The content as one string: text parts joined by a newline (as vLLM joins them: the
        parts are separate texts, and joined with nothing their words would run together)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content part type {part.type!r} is not supported (text only)")
            parts.append(part.text or "")
        return "\n".join(parts)


class FunctionDefinition(BaseModel):
    """A chat tool's function: a name required (as OpenAI and vLLM require it); its other
    fields reach the chat template as sent."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    """A tool in the chat API's shape, `{"type": "function", "function": {"name": ...}}`; any
    other shape is a 400 naming the tool's index and field, as on OpenAI and vLLM (the
    Responses API's flat `{"type": "function", "name": ...}` lacks `function`)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: enable_thinking, thinking, ...
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def asked_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them: as the client sent them."""
        if self.tools is None:
            return None
        return [tool.model_dump(exclude_unset=True) for tool in self.tools]


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        req: ChatCompletionRequest, http: Request
    ) -> JSONResponse | StreamingResponse | dict[str, Any]:
        engine = state.engine
        if engine is None:
            return openai_error(*not_ready(state), "server_error")
        defaults, model_name = state.defaults, state.model_name
        try:
            messages = [m.template_message() for m in req.messages]
            max_tokens = req.asked_max_tokens()
            if req.top_logprobs and not req.logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            # rendering and tokenizing a long conversation takes a while: off the event loop
            prompt_ids, params, parsing = await asyncio.to_thread(
                prepare_chat,
                engine,
                state.parser,
                messages,
                req.sampling_params(defaults),
                req.template_tools(),
                req.tool_choice,
                req.parallel_tool_calls is not False,
                template_kwargs(state.template_defaults, req.chat_template_kwargs),
                state.options.relaxed_chat_template,
            )
            if req.logprobs:
                params = replace(params, logprobs=req.top_logprobs or 0)
            engine.check(prompt_ids, params, max_tokens, req.n)
        except ContextLengthError as err:
            return openai_error(400, str(err), param="messages", code="context_length_exceeded")
        except ValueError as err:
            return openai_error(400, str(err))
        fields = reasoning_fields(state.options.reasoning_field)  # reasoning_content / reasoning
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        outputs = engine.generate(
            prompt_ids,
            params,
            chat=True,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            n=req.n,
        )
        # one parser and one logprobs list per sequence
        choices = [_Choice(parsing if i == 0 else _fresh(parsing)) for i in range(req.n)]
        tokenizer = engine.tokenizer if req.logprobs else None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _sse(
                    outputs,
                    completion_id,
                    now,
                    model_name,
                    include_usage,
                    choices,
                    fields,
                    tokenizer,
                ),  # fmt: skip
                media_type="text/event-stream",
            )

        try:
            done = await all_outputs(http, outputs)
        except ValueError as err:  # a request the engine refused when it came to add it
            return openai_error(400, str(err))
        except RuntimeError as err:
            return openai_error(503, str(err), "server_error")
        if done is None:  # the client left: its request is aborted
            return openai_error(499, "client closed the request")
        for out in done:
            choice = choices[out.index]
            choice.parsing.push(out)
            choice.last = out
            if tokenizer is not None:
                choice.logprobs += chat_logprobs(tokenizer, out)
        return {
            "id": completion_id,
            "object": "chat.completion",
            "created": now,
            "model": model_name,
            "choices": [
                {
                    "index": i,
                    "message": c.parsing.openai_message(fields),
                    "finish_reason": c.parsing.finish_reason(_finish(c.finish_reason)),
                    "logprobs": None if tokenizer is None else {"content": c.logprobs},
                }
                for i, c in enumerate(choices)
            ],
            "usage": _usage(choices),
        }


def _fresh(parsing: ChatParsing) -> ChatParsing:
    """Another sequence's parsing of the same request (its own parser and message)."""
    return replace(parsing, message=Message())


@dataclass
class _Choice:
    """One of a request's n sequences as the answer builds it."""

    parsing: ChatParsing
    last: Output | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        return None if self.last is None else self.last.finish_reason


def chat_logprobs(tokenizer: Any, out: Output) -> list[dict[str, Any]]:
    """An output's tokens' logprobs in the chat shape: token text, logprob, the token's bytes,
    and the top alternatives. A token alone may be part of a multi-byte character: its text is
    then the replacement character, and its `bytes` (token_bytes) are what the client rebuilds
    the character from, as OpenAI's are."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(token_bytes(tokenizer, token))}

    content = []
    for item in out.logprobs or []:
        if item is None:
            continue
        top = [entry(t, lp) for t, lp in item.top]
        content.append({**entry(item.token, item.logprob), "top_logprobs": top})
    return content


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes `token` stands for, whole even where they are part of a UTF-8 character: a
    byte-level BPE token's string (GPT-2 style: Qwen, DeepSeek, Llama 3) through the inverse of
    the byte-to-unicode table, a SentencePiece byte-fallback token `<0xHH>` the byte itself;
    otherwise (an added token, another tokenizer) the UTF-8 of its decoded text."""
    byte_decoder, added = _byte_tables(tokenizer)
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str) and token not in added:
        if byte_decoder is not None and all(c in byte_decoder for c in piece):
            return bytes(byte_decoder[c] for c in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
    return str(tokenizer.decode([token], skip_special_tokens=False)).encode("utf-8")


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# tokenizer -> (its byte-level decoder or None, its added tokens' ids): read once, not per token
_TABLES: weakref.WeakKeyDictionary[Any, tuple[dict[str, int] | None, frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)


def _byte_tables(tokenizer: Any) -> tuple[dict[str, int] | None, frozenset[int]]:
    """(character -> byte where `tokenizer` is a byte-level BPE, else None; the ids of its added
    tokens, which are stored as their text, not byte-mapped)."""
    try:
        return _TABLES[tokenizer]
    except (KeyError, TypeError):
        pass
    byte_decoder = getattr(tokenizer, "byte_decoder", None)  # transformers' slow GPT-2 class
    if not isinstance(byte_decoder, dict):
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        state = json.loads(decoder.__getstate__()) if decoder is not None else {}
        byte_decoder = _unicode_to_bytes() if _has_byte_level(state) else None
    added = frozenset(getattr(tokenizer, "added_tokens_decoder", None) or ())
    tables = (byte_decoder, added)
    with contextlib.suppress(TypeError):  # (an object a weak reference cannot hold)
        _TABLES[tokenizer] = tables
    return tables


def _has_byte_level(decoder: dict[str, Any]) -> bool:
    """Whether a `tokenizers` decoder (its JSON state) is, or has in its sequence, ByteLevel."""
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(d) for d in decoder.get("decoders") or () if isinstance(d, dict))


def _unicode_to_bytes() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table: the printable bytes stand for themselves,
    the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in printable]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def _finish(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def _usage(choices: list[_Choice]) -> dict[str, Any]:
    """The prompt counted once; the completion tokens of every sequence."""
    last = [c.last for c in choices if c.last is not None]
    if not last:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    prompt = last[0].prompt_tokens
    completion = sum(out.completion_tokens for out in last)
    reasoning = sum(c.parsing.reasoning_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": last[0].cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


async def _sse(
    outputs: AsyncIterator[Output],
    completion_id: str,
    created: int,
    model_name: str,
    include_usage: bool,
    choices: list[_Choice],
    fields: tuple[str, ...] = ("reasoning_content",),
    tokenizer: Any = None,
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chat.completion.chunk shape, ending with [DONE]; each
    chunk carries one sequence's delta (its `index`). Closed early (the client went away), the
    request is aborted by `outputs`' own cleanup."""

    def chunk(
        index: int,
        delta: dict[str, Any],
        finish: str | None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> str:
        body: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model_name,
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "finish_reason": finish,
                    "logprobs": None if logprobs is None else {"content": logprobs},
                }
            ],
        }
        return f"data: {json.dumps(body)}\n\n"

    for index in range(len(choices)):
        yield chunk(index, {"role": "assistant", "content": ""}, None)
    try:
        async for out in outputs:
            choice = choices[out.index]
            choice.last = out
            delta = choice.parsing.push(out).openai(fields)  # reasoning, content, tool calls
            logprobs = None if tokenizer is None else chat_logprobs(tokenizer, out)
            if delta or out.finish_reason or logprobs:
                finish = choice.parsing.finish_reason(_finish(out.finish_reason))
                yield chunk(out.index, delta, finish, logprobs)
    except ValueError as err:
        if any(c.last is not None for c in choices):  # not the engine's refusal: a bug (sse.py)
            raise
        # refused when the engine took the request (a grammar it cannot compile, too long)
        yield stream_error_event("/v1/chat/completions", str(err), 400).decode()
        return
    except RuntimeError as err:  # the engine failed or is shutting down
        yield stream_error_event("/v1/chat/completions", str(err)).decode()
        return
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    if include_usage and any(c.last is not None for c in choices):
        body = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model_name,
            "choices": [],
            "usage": _usage(choices),
        }
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"
