"""The HTTP server: the FastAPI app over the serving engine, with `/health`, `/v1/models` and
`/metrics` (Prometheus text: the engine's queues, pages and prefix hits, and the residency
counters); the API surfaces are their own modules (openai.py: `/v1/chat/completions`;
anthropic.py: `/v1/messages`).

Requests go to the engine's loop through `AsyncEngine` (engine/async_engine.py): no lock, many
requests at once. A client that goes away (mid-stream, before its first token, or during its
prompt's prefill) has its request aborted and its KV pages freed. Given a factory instead of an
engine, the app loads the model in the background after it starts: `/health` answers 503 until
it is ready. Shutting down ends every open request."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from moetier.engine.async_engine import AsyncEngine, EngineStats
from moetier.engine.sampler import SamplingParams
from moetier.residency.telemetry import CONTENT_TYPE, ResidencyTelemetry, render_prometheus
from moetier.server import anthropic, completions, openai, tokenize
from moetier.server.state import ServerState, openai_error


def create_app(
    engine: AsyncEngine | Callable[[], AsyncEngine],
    model_name: str,
    defaults: SamplingParams | None = None,
    telemetry: Callable[[], ResidencyTelemetry] | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` (or what the factory builds, loaded in the background)
    under the model id `model_name`; `telemetry` returns the residency counters `/metrics` shows
    (default: the engine's model's slot pool)."""
    state = ServerState(model_name, defaults or SamplingParams())
    factory = None
    if isinstance(engine, AsyncEngine):
        state.engine = engine
    else:
        factory = engine
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if factory is not None:

            def load() -> None:
                try:
                    state.engine = factory()
                except Exception as exc:  # reported by /health and every request
                    state.load_error = f"{type(exc).__name__}: {exc}"
                    print(f"moetier serve: loading failed: {state.load_error}", file=sys.stderr)

            threading.Thread(target=load, name="moetier-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.close()

    app = FastAPI(title="moetier", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}"
        if request.url.path.startswith(anthropic.PREFIX):
            return anthropic.error(400, message)
        return openai_error(400, message)

    @app.get("/health", response_model=None)
    async def health() -> dict[str, str] | JSONResponse:
        if state.engine is not None:
            return {"status": "ok"}
        status = "failed" if state.load_error else "loading"
        return JSONResponse(status_code=503, content={"status": status})

    @app.get("/metrics")
    async def metrics() -> Response:
        labels = {"model": model_name}
        text = ""
        if state.engine is not None:
            text += _engine_metrics(state.engine.stats, labels)
        counters = telemetry() if telemetry is not None else None
        if counters is None and state.engine is not None:  # the model's own slot pool
            counters = state.engine.engine.loaded.runtime.telemetry()
        if counters is not None:
            text += render_prometheus(counters, labels=labels)
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry: dict[str, Any] = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "moetier",
            "max_model_len": tokenize.max_model_len(state.engine) if state.engine else None,
        }
        return {"object": "list", "data": [entry]}

    openai.add_routes(app, state)
    anthropic.add_routes(app, state)
    completions.add_routes(app, state)
    tokenize.add_routes(app, state)
    return app


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
