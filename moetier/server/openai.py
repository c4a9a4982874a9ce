"""The OpenAI surface: `POST /v1/chat/completions`, streaming (server-sent
`chat.completion.chunk` events ending with `[DONE]`; a failure ends it with an error event)
and not, OpenAI-shaped errors (the checks every route shares are admission.py's). `tools`,
`tool_choice` and `parallel_tool_calls` as OpenAI's; the model's parser (server/parsers) splits
its output into `reasoning_content`, `content` and `tool_calls` (finish_reason tool_calls)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from moetier.engine.engine import Output
from moetier.engine.scheduler import ContextLengthError
from moetier.server.errors import openai_error, stream_error_event
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


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    # tool calls and reasoning of the history (server/parsers/serving.py shapes them)
    tool_calls: list[dict[str, Any]] | None = None
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
        for key in ("tool_calls", "tool_call_id", "name", "reasoning_content", "reasoning"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content part type {part.type!r} is not supported (text only)")
            parts.append(part.text or "")
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: enable_thinking, thinking, ...

    def asked_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


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
            prompt_ids, params, parsing = prepare_chat(
                engine,
                state.parser,
                messages,
                req.sampling_params(defaults),
                req.tools,
                req.tool_choice,
                req.parallel_tool_calls is not False,
                template_kwargs(state.template_defaults, req.chat_template_kwargs),
                state.options.relaxed_chat_template,
            )
            engine.check(prompt_ids, params, max_tokens)
        except ContextLengthError as err:
            return openai_error(400, str(err), param="messages", code="context_length_exceeded")
        except ValueError as err:
            return openai_error(400, str(err))
        fields = reasoning_fields(state.options.reasoning_field)  # reasoning_content / reasoning
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        outputs = engine.generate(
            prompt_ids, params, chat=True, max_tokens=max_tokens, ignore_eos=req.ignore_eos
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _sse(outputs, completion_id, now, model_name, include_usage, parsing, fields),
                media_type="text/event-stream",
            )

        try:
            done = await all_outputs(http, outputs)
        except RuntimeError as err:
            return openai_error(503, str(err), "server_error")
        if done is None:  # the client left: its request is aborted
            return openai_error(499, "client closed the request")
        last = done[-1]
        for out in done:
            parsing.push(out)
        return {
            "id": completion_id,
            "object": "chat.completion",
            "created": now,
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "message": parsing.openai_message(fields),
                    "finish_reason": parsing.finish_reason(_finish(last.finish_reason)),
                    "logprobs": None,
                }
            ],
            "usage": _usage(last),
        }


def _finish(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def _usage(last: Output) -> dict[str, Any]:
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "total_tokens": last.prompt_tokens + last.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": last.cached_tokens},
    }


async def _sse(
    outputs: AsyncIterator[Output],
    completion_id: str,
    created: int,
    model_name: str,
    include_usage: bool,
    parsing: ChatParsing,
    fields: tuple[str, ...] = ("reasoning_content",),
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chat.completion.chunk shape, ending with [DONE]. Closed
    early (the client went away), the request is aborted by `outputs`' own cleanup."""

    def chunk(
        delta: dict[str, Any], finish: str | None, usage: dict[str, Any] | None = None
    ) -> str:
        body: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model_name,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
            if usage is None
            else [],
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    yield chunk({"role": "assistant", "content": ""}, None)
    last = None
    try:
        async for out in outputs:
            last = out
            delta = parsing.push(out).openai(fields)  # reasoning, content and tool-call deltas
            if delta or out.finish_reason:
                yield chunk(delta, parsing.finish_reason(_finish(out.finish_reason)))
    except RuntimeError as err:  # the engine failed or is shutting down
        yield stream_error_event("/v1/chat/completions", str(err)).decode()
        return
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    if include_usage and last is not None:
        yield chunk({}, None, _usage(last))
    yield "data: [DONE]\n\n"
