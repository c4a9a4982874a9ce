"""HTTP server: OpenAI-compatible `/v1/chat/completions` (streaming and not), `/v1/models`,
`/health`, and `/metrics` (Prometheus text: the engine's queues, pages and prefix hits, and the
residency counters when given a telemetry source).

Requests go to the engine's loop through `AsyncEngine` (engine/async_engine.py): no lock, many
requests at once. A client that goes away (mid-stream, before its first token, or during its
prompt's prefill) has its request aborted and its KV pages freed. Given a factory instead of an
engine, the app loads the model in the background after it starts: `/health` answers 503 until
it is ready. Shutting down ends every open request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from moetier.engine.async_engine import AsyncEngine, EngineStats
from moetier.engine.engine import Output
from moetier.engine.prompts import chat_prompt_ids
from moetier.engine.sampler import SamplingParams
from moetier.residency.telemetry import CONTENT_TYPE, ResidencyTelemetry, render_prometheus

T = TypeVar("T")


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
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens through end tokens


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": None, "code": None}},
    )


class _Holder:
    """The engine, or how its loading went (a factory runs on a thread after startup)."""

    def __init__(self, engine: AsyncEngine | None) -> None:
        self.engine = engine
        self.error: str | None = None


def create_app(
    engine: AsyncEngine | Callable[[], AsyncEngine],
    model_name: str,
    defaults: SamplingParams | None = None,
    telemetry: Callable[[], ResidencyTelemetry] | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` (or what the factory builds, loaded in the background)
    under the model id `model_name`; `telemetry` returns the residency counters `/metrics` shows
    (default: the engine's model's slot pool)."""
    defaults = defaults or SamplingParams()
    holder = _Holder(engine if isinstance(engine, AsyncEngine) else None)
    factory = None if isinstance(engine, AsyncEngine) else engine
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if factory is not None:

            def load() -> None:
                try:
                    holder.engine = factory()
                except Exception as exc:  # reported by /health and every request
                    holder.error = f"{type(exc).__name__}: {exc}"
                    print(f"moetier serve: loading failed: {holder.error}", file=sys.stderr)

            threading.Thread(target=load, name="moetier-load", daemon=True).start()
        yield
        if holder.engine is not None:
            holder.engine.close()

    app = FastAPI(title="moetier", lifespan=lifespan)

    def ready() -> AsyncEngine | JSONResponse:
        if holder.engine is not None:
            return holder.engine
        if holder.error is not None:
            return _error(503, f"the model failed to load: {holder.error}", "server_error")
        return _error(503, "the model is still loading: retry shortly", "server_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}")

    @app.get("/health", response_model=None)
    async def health() -> dict[str, str] | JSONResponse:
        if holder.engine is not None:
            return {"status": "ok"}
        status = "failed" if holder.error else "loading"
        return JSONResponse(status_code=503, content={"status": status})

    @app.get("/metrics")
    async def metrics() -> Response:
        labels = {"model": model_name}
        text = ""
        if holder.engine is not None:
            text += _engine_metrics(holder.engine.stats, labels)
        counters = telemetry() if telemetry is not None else None
        if counters is None and holder.engine is not None:  # the model's own slot pool
            counters = holder.engine.engine.loaded.runtime.telemetry()
        if counters is not None:
            text += render_prometheus(counters, labels=labels)
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": model_name, "object": "model", "created": created, "owned_by": "moetier"}
            ],
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        req: ChatCompletionRequest, http: Request
    ) -> JSONResponse | StreamingResponse | dict[str, Any]:
        engine = ready()
        if isinstance(engine, JSONResponse):
            return engine
        try:
            messages = [
                {"role": m.role if m.role != "developer" else "system", "content": m.text()}
                for m in req.messages
            ]
            try:
                prompt_ids = chat_prompt_ids(engine.tokenizer, messages)
            except ValueError:
                raise
            except Exception as exc:  # the chat template refused the messages (jinja2 errors)
                raise ValueError(
                    f"the model's chat template refused these messages: {exc}"
                ) from exc
            stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
            max_tokens = (
                req.max_completion_tokens
                if req.max_completion_tokens is not None
                else req.max_tokens
            )
            params = SamplingParams(
                max_new_tokens=defaults.max_new_tokens,
                temperature=req.temperature
                if req.temperature is not None
                else defaults.temperature,
                top_p=req.top_p if req.top_p is not None else defaults.top_p,
                top_k=req.top_k if req.top_k is not None else defaults.top_k,
                seed=req.seed,
                stop=stop,
            )
            engine.check(prompt_ids, params, max_tokens)
        except ValueError as err:
            return _error(400, str(err))
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        outputs = engine.generate(
            prompt_ids, params, chat=True, max_tokens=max_tokens, ignore_eos=req.ignore_eos
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _sse(outputs, completion_id, now, model_name, include_usage),
                media_type="text/event-stream",
            )

        async def collect() -> list[Output]:
            return [out async for out in outputs]

        try:
            done = await _unless_disconnected(http, collect())
        except RuntimeError as err:
            return _error(503, str(err), "server_error")
        if done is None:  # the client left: its request is aborted
            return _error(499, "client closed the request")
        last = done[-1]
        return {
            "id": completion_id,
            "object": "chat.completion",
            "created": now,
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(o.text for o in done)},
                    "finish_reason": _finish(last.finish_reason),
                    "logprobs": None,
                }
            ],
            "usage": _usage(last),
        }

    return app


async def _unless_disconnected(http: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None (work cancelled) once the client has disconnected."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.05)
            if done:
                return task.result()
            if await http.is_disconnected():
                break
    except asyncio.CancelledError:  # this handler itself cancelled (shutdown): the work too
        task.cancel()
        raise
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


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
            if out.text or out.finish_reason:
                finish = _finish(out.finish_reason)
                yield chunk({"content": out.text} if out.text else {}, finish)
    except RuntimeError as err:  # the engine failed or is shutting down
        body = {"error": {"message": str(err), "type": "server_error"}}
        yield f"data: {json.dumps(body)}\n\n"
        return
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    if include_usage and last is not None:
        yield chunk({}, None, _usage(last))
    yield "data: [DONE]\n\n"


def _engine_metrics(stats: EngineStats, labels: dict[str, str]) -> str:
    """The engine's gauges and counters in Prometheus text format."""
    extra = ",".join(f'{k}="{v}"' for k, v in labels.items())
    families = [
        ("running_requests", "gauge", "requests being computed", stats.running),
        ("waiting_requests", "gauge", "requests waiting for KV pages or a slot", stats.waiting),
        ("kv_pages_used", "gauge", "KV cache pages held by requests", stats.pages_used),
        ("kv_pages_free", "gauge", "KV cache pages free (cached ones too)", stats.pages_free),
        ("prefix_queried_tokens_total", "counter", "prompt tokens looked up in the prefix cache",
         stats.prefix_queried_tokens),
        ("prefix_hit_tokens_total", "counter", "prompt tokens found in the prefix cache",
         stats.prefix_hit_tokens),
        ("steps_total", "counter", "engine steps run", stats.steps),
        ("preemptions_total", "counter", "requests preempted for KV pages", stats.preemptions),
        ("aborted_total", "counter", "requests ended early (client gone, shutdown)", stats.aborted),
    ]  # fmt: skip
    lines = []
    for name, kind, help_text, value in families:
        full = f"moetier_engine_{name}"
        lines += [
            f"# HELP {full} {help_text}",
            f"# TYPE {full} {kind}",
            f"{full}{{{extra}}} {value}",
        ]
    return "\n".join(lines) + "\n"
