"""HTTP server: OpenAI-compatible `/v1/chat/completions` (streaming and not), `/v1/models`,
`/health`, and `/metrics` (Prometheus text) when given a residency telemetry source. One
request generates at a time (a lock); continuous batching is a later issue."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from moetier.engine.generate import Generator
from moetier.engine.sampler import SamplingParams
from moetier.residency.telemetry import CONTENT_TYPE, ResidencyTelemetry, render_prometheus


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content part type {part.type!r} is not supported (text only)")
            parts.append(part.text or "")
        return "".join(parts)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": None, "code": None}},
    )


def create_app(
    generator: Generator,
    model_name: str,
    defaults: SamplingParams | None = None,
    telemetry: Callable[[], ResidencyTelemetry] | None = None,
) -> FastAPI:
    """The FastAPI app serving `generator` under the model id `model_name`; `telemetry`
    returns the current residency counters for `/metrics` (no such route without it)."""
    app = FastAPI(title="moetier")
    defaults = defaults or SamplingParams()
    lock = threading.Lock()
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    if telemetry is not None:

        @app.get("/metrics")
        def metrics() -> Response:
            text = render_prometheus(telemetry(), labels={"model": model_name})
            return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": model_name, "object": "model", "created": created, "owned_by": "moetier"}
            ],
        }

    @app.post("/v1/chat/completions", response_model=None)
    def chat_completions(
        req: ChatCompletionRequest,
    ) -> JSONResponse | StreamingResponse | dict[str, Any]:
        try:
            messages = [
                {"role": m.role if m.role != "developer" else "system", "content": m.text()}
                for m in req.messages
            ]
            prompt_ids = generator.chat_prompt_ids(messages)
            generator.check_prompt(prompt_ids)
            stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
            max_tokens = (
                req.max_completion_tokens
                if req.max_completion_tokens is not None
                else req.max_tokens
            )
            params = SamplingParams(
                max_new_tokens=max_tokens if max_tokens is not None else defaults.max_new_tokens,
                temperature=req.temperature
                if req.temperature is not None
                else defaults.temperature,
                top_p=req.top_p if req.top_p is not None else defaults.top_p,
                top_k=req.top_k if req.top_k is not None else defaults.top_k,
                seed=req.seed,
                stop=stop,
            )
        except ValueError as err:
            return _error(400, str(err))
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _stream(
                    generator,
                    lock,
                    prompt_ids,
                    params,
                    completion_id,
                    now,
                    model_name,
                    include_usage,
                ),
                media_type="text/event-stream",
            )
        with lock:
            result = generator.generate(prompt_ids, params, chat=True)
        return {
            "id": completion_id,
            "object": "chat.completion",
            "created": now,
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.text},
                    "finish_reason": result.finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": _usage(result.prompt_tokens, len(result.token_ids)),
        }

    return app


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _stream(
    generator: Generator,
    lock: threading.Lock,
    prompt_ids: list[int],
    params: SamplingParams,
    completion_id: str,
    created: int,
    model_name: str,
    include_usage: bool,
) -> Iterator[str]:
    """Server-sent events in OpenAI's chat.completion.chunk shape, ending with [DONE]."""

    def chunk(
        delta: dict[str, Any], finish: str | None, usage: dict[str, int] | None = None
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

    with lock:
        yield chunk({"role": "assistant", "content": ""}, None)
        n_tokens = 0
        for delta in generator.stream(prompt_ids, params, chat=True):
            n_tokens += len(delta.token_ids)
            if delta.text or delta.finish_reason:
                yield chunk({"content": delta.text} if delta.text else {}, delta.finish_reason)
        if include_usage:
            yield chunk({}, None, _usage(len(prompt_ids), n_tokens))
    yield "data: [DONE]\n\n"
