"""The HTTP server: the FastAPI app over the serving engine, with `/health`, `/v1/models`,
`/v1/models/{id}` (OpenAI's model object, or Anthropic's for a client sending
`anthropic-version`) and `/metrics` (prometheus_client: the engine's queues, pages and prefix
hits, and the residency counters); the API surfaces are their own modules (openai.py:
`/v1/chat/completions`; anthropic.py: `/v1/messages`).

Every route, whichever module adds it, passes the same gate (admission.py: API key, body size,
model name, unsupported fields, queue room), answers errors in its API's shape (errors.py),
and, when it streams, gets keep-alive comments and an error event if it fails (sse.py); CORS
is on only for `options.allowed_origins`.

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
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from moetier.engine.async_engine import AsyncEngine
from moetier.engine.sampler import SamplingParams
from moetier.residency.telemetry import ResidencyTelemetry
from moetier.server import anthropic, completions, errors, openai, responses, tokenize
from moetier.server.admission import Admission
from moetier.server.auth import OPEN_PATHS
from moetier.server.metrics import ServerCollector, exposition, registry_of
from moetier.server.options import ServerOptions
from moetier.server.parsers.serving import (
    check_parser_flags,
    parse_template_kwargs,
    parser_for_engine,
)
from moetier.server.sse import EventStreams
from moetier.server.state import ServerState


def _warm_up_said(engine: AsyncEngine) -> str:
    """ ", of which N s compiling and capturing the steps" where the engine did (the decode
    steps' graphs, the compiled prefill)."""
    seconds = getattr(getattr(engine.engine, "runner", None), "warm_up_seconds", 0.0)
    return f", of which {seconds:.1f} s compiling and capturing the steps" if seconds else ""


def create_app(
    engine: AsyncEngine | Callable[[], AsyncEngine],
    model_name: str,
    defaults: SamplingParams | None = None,
    telemetry: Callable[[], ResidencyTelemetry] | None = None,
    options: ServerOptions | None = None,
    on_load_failure: Callable[[], None] | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` (or what the factory builds, loaded in the background)
    under the model id `model_name`; `telemetry` returns the residency counters `/metrics` shows
    (default: the engine's model's slot pool); `options`: keys, aliases, CORS, limits.
    A factory that fails leaves /health at 503 "failed" and every request a 503 saying why;
    `on_load_failure` is then called (`moetier serve` stops the server: exit status 1)."""
    options = options or ServerOptions()
    check_parser_flags(options.tool_parser, options.reasoning_parser, options.reasoning_field)
    state = ServerState(model_name, defaults or SamplingParams(), options=options)
    state.template_defaults = parse_template_kwargs(options.default_chat_template_kwargs)
    factory = None
    if isinstance(engine, AsyncEngine):
        state.engine = engine
        state.parser = parser_for_engine(engine, options.tool_parser, options.reasoning_parser)
    else:
        factory = engine
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if factory is not None:

            def load() -> None:
                began = time.perf_counter()
                try:
                    loaded = factory()
                    state.parser = parser_for_engine(
                        loaded, options.tool_parser, options.reasoning_parser
                    )
                    state.engine = loaded
                except Exception as exc:  # reported by /health and every request
                    state.load_error = f"{type(exc).__name__}: {exc}"
                    print(f"moetier serve: loading failed: {state.load_error}", file=sys.stderr)
                    if on_load_failure is not None:
                        on_load_failure()
                    return
                print(f"moetier serve: {model_name} ready in {time.perf_counter() - began:.1f} s"
                      f"{_warm_up_said(loaded)}", flush=True)  # fmt: skip

            threading.Thread(target=load, name="moetier-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.close()

    app = FastAPI(title="moetier", lifespan=lifespan)
    app.state.server = state
    errors.install(app)

    # HEAD too: load balancers and healthchecks ask with it (FastAPI adds HEAD to no route;
    # two routes, as one route of both methods gives both one OpenAPI operation id)
    @app.get("/health", response_model=None)
    @app.head("/health", response_model=None)
    async def health() -> dict[str, str] | JSONResponse:
        if state.engine is not None:
            return {"status": "ok"}
        status = "failed" if state.load_error else "loading"
        return JSONResponse(status_code=503, content={"status": status})

    def residency() -> ResidencyTelemetry | None:
        if telemetry is not None:
            return telemetry()
        if state.engine is not None:  # the model's own slot pool
            return state.engine.engine.loaded.runtime.telemetry()
        return None

    registry = registry_of(
        ServerCollector(
            model_name, lambda: state.engine.stats if state.engine else None, residency, state
        )
    )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = exposition(registry, request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    def context() -> int | None:
        """The most tokens a request holds (None while loading): the model's context, or the
        KV cache's where it is smaller (as a longer request is refused)."""
        if state.engine is None:
            return None
        return int(state.engine.engine.scheduler.context_limit)

    def openai_model(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "moetier",
            "root": model_name,
            "max_model_len": context(),
            **(state.parser.describe() if state.parser else {}),
        }

    def anthropic_model(name: str) -> dict[str, Any]:
        return {
            "type": "model",
            "id": name,
            "display_name": name,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
            "lifecycle": "active",
            "max_input_tokens": context(),
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        """The served names: OpenAI's list, or Anthropic's page (one page: `has_more` false)
        for a client that sends `anthropic-version`."""
        names = state.listed_names()
        if "anthropic-version" in request.headers:
            return {
                "data": [anthropic_model(name) for name in names],
                "has_more": False,
                "first_id": names[0],  # (the model's own name is always listed)
                "last_id": names[-1],
            }
        return {"object": "list", "data": [openai_model(name) for name in names]}

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=None,
        responses={404: {"description": "model not served"}},
    )
    async def model(model_id: str, request: Request) -> dict[str, Any] | JSONResponse:
        """One model in the shape of the client's API: Anthropic's (`ModelInfo`) for a client
        that sends `anthropic-version` (the `anthropic` SDK does on every request), else
        OpenAI's; any name a request's `model` may give (an alias, a pattern's match)."""
        anthropic_client = "anthropic-version" in request.headers
        if not state.serves(model_id):
            served = ", ".join(state.listed_names())
            message = f"the model {model_id!r} is not served here (served: {served})"
            if anthropic_client:
                return errors.anthropic_error(404, message)
            return errors.openai_error(404, message, param="model", code="model_not_found")
        return anthropic_model(model_id) if anthropic_client else openai_model(model_id)

    openai.add_routes(app, state)
    anthropic.add_routes(app, state)
    completions.add_routes(app, state)
    responses.add_routes(app, state)
    tokenize.add_routes(app, state)

    errors.document(app, OPEN_PATHS)

    # outermost last: CORS answers preflights before the gate asks for a key
    def stream_failed(path: str) -> None:
        state.stream_errors[path] += 1

    app.add_middleware(EventStreams, keep_alive_s=options.keep_alive_s, on_error=stream_failed)
    app.add_middleware(Admission, fastapi_app=app, state=state)
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app
