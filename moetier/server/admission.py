"""What every request passes before its route (an ASGI middleware, so every route of the app,
whichever module registers it, gets the same checks):

1. the API key (auth.py), unless the path is open (`/health`);
2. for a POST: the body's size (413 over `--max-body-mb`), that it is JSON (400; read as JSON
   whatever its content type says), lone UTF-16
   surrogates replaced with U+FFFD (a tokenizer cannot encode them), the `model` one this server
   serves (404), no known-but-unsupported field (unsupported.py, 400), `n` x `max_tokens` (for
   n > 1) within `--max-request-tokens` (400);
3. for a generating route: the model loaded (503 with Retry-After) and room in the queue: at most
   `--max-num-seqs` + `--max-queued-requests` generating requests in flight (429 with
   Retry-After).

Errors are in the shape of the path's API (errors.py). The body, read once here, is handed on to
the route unchanged (or with its surrogates replaced)."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI

from moetier.server.auth import OPEN_PATHS, authorized
from moetier.server.errors import ANTHROPIC_PREFIX, error_response
from moetier.server.state import ServerState, not_ready
from moetier.server.unsupported import unsupported_field

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# the routes that run the model; the queue limit counts their requests in flight
GENERATING = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
RETRY_QUEUE_S = 1
RETRY_LOADING_S = 5

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class _TooLarge(Exception):
    pass


class Admission:
    def __init__(self, app: ASGIApp, fastapi_app: FastAPI, state: ServerState) -> None:
        self.app = app
        self.fastapi_app = fastapi_app
        self.state = state
        self._post_paths: frozenset[str] | None = None
        self._route_paths: frozenset[str] | None = None

    def post_paths(self) -> frozenset[str]:
        """The paths with a POST route (read once, after every module registered its routes)."""
        if self._post_paths is None:
            self._post_paths = frozenset(
                getattr(route, "path", "")
                for route in self.fastapi_app.routes
                if "POST" in (getattr(route, "methods", None) or ())
            )
        return self._post_paths

    def route_paths(self) -> frozenset[str]:
        """Every path with a route (the label of /metrics' response counts; others: "other")."""
        if self._route_paths is None:
            self._route_paths = frozenset(
                getattr(route, "path", "") for route in self.fastapi_app.routes
            )
        return self._route_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._admit(scope, receive, counted)
        finally:
            # the matched route's template (`/v1/models/{model_id:path}`, not each id's path)
            route = getattr(scope.get("route"), "path", None) or scope["path"]
            route = route if route in self.route_paths() else "other"
            self.state.responses[(route, status or 500)] += 1

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        options = self.state.options

        async def reject(
            status: int,
            message: str,
            param: str | None = None,
            code: str | None = None,
            retry_after: int | None = None,
        ) -> None:
            extra = {"Retry-After": str(retry_after)} if retry_after is not None else None
            if status == 401:
                extra = {"WWW-Authenticate": "Bearer"}
            # /v1/models answers an Anthropic client (`anthropic-version`) in its API's shape,
            # and so do its errors
            anthropic_models = path.startswith("/v1/models") and "anthropic-version" in headers
            shape = ANTHROPIC_PREFIX if anthropic_models else path
            response = error_response(shape, status, message, param, code, extra)
            await response(scope, receive, send)

        if path not in OPEN_PATHS and not authorized(headers, options.api_key):
            await reject(
                401,
                "a valid API key is required: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
            )
            return
        if method != "POST" or path not in self.post_paths():
            await self.app(scope, receive, send)
            return

        try:
            body = await _read_body(receive, headers, options.max_body_bytes)
        except _TooLarge:
            await reject(
                413,
                f"the request body is over the server's limit of "
                f"{options.max_body_mb:g} MiB (--max-body-mb)",
            )
            return
        try:
            parsed = json.loads(body) if body.strip() else None
            if parsed is not None and _SURROGATE_ESCAPE.search(body):
                parsed, replaced = _replace_surrogates(parsed)
                if replaced:
                    body = json.dumps(parsed).encode()
        except ValueError as err:
            await reject(400, f"the body is not valid JSON: {err}")
            return
        except RecursionError:
            await reject(400, "the body is nested too deeply")
            return

        if parsed is not None and "json" not in headers.get("content-type", ""):
            # JSON under another content type (curl -d sends form-urlencoded): read as JSON
            kept = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope = {**scope, "headers": [*kept, (b"content-type", b"application/json")]}
        if isinstance(parsed, dict):
            model = parsed.get("model")
            if isinstance(model, str) and not self.state.serves(model):
                names = ", ".join(self.state.listed_names())
                await reject(
                    404,
                    f"the model {model!r} is not served here (served: {names})",
                    "model",
                    "model_not_found",
                )
                return
            asked = _requested_tokens(parsed)
            if asked > options.max_request_tokens:
                await reject(
                    400,
                    f"n x max_tokens = {asked} is over the server's limit of "
                    f"{options.max_request_tokens} (--max-request-tokens)",
                    "max_tokens",
                )
                return

            field = unsupported_field(path, parsed)
            if field is not None:
                name, why = field
                await reject(400, f"{name}: not supported by this server ({why})", name)
                return
        if path not in GENERATING:
            await self.app(scope, _replay(body, receive), send)
            return
        engine = self.state.engine
        if engine is None:
            status, message = not_ready(self.state)
            loading = self.state.load_error is None  # a failed load does not come back
            await reject(status, message, retry_after=RETRY_LOADING_S if loading else None)
            return
        room = engine.engine.scheduler.max_num_seqs + options.max_queued_requests
        if self.state.generating >= room:
            message = f"the queue is full ({self.state.generating} requests in flight): retry"
            await reject(429, message, retry_after=RETRY_QUEUE_S)
            return
        self.state.generating += 1
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.state.generating -= 1


async def _read_body(receive: Receive, headers: dict[str, str], limit: int) -> bytes:
    """The whole request body; _TooLarge once it (or its announced length) is over `limit`."""
    length = headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _TooLarge
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the route `body` first, then the connection's own messages (its
    disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _replace_surrogates(value: Any) -> tuple[Any, bool]:
    """`value` with every lone surrogate in its strings (keys too) replaced by U+FFFD, and
    whether there was one."""
    if isinstance(value, str):
        fixed = _LONE_SURROGATE.sub("\ufffd", value)
        return fixed, fixed != value
    if isinstance(value, list):
        pairs = [_replace_surrogates(v) for v in value]
        return [v for v, _ in pairs], any(r for _, r in pairs)
    if isinstance(value, dict):
        out, any_replaced = {}, False
        for k, v in value.items():
            key, r1 = _replace_surrogates(k)
            val, r2 = _replace_surrogates(v)
            out[key] = val
            any_replaced = any_replaced or r1 or r2
        return out, any_replaced
    return value, False


def _requested_tokens(body: dict[str, Any]) -> int:
    """n x the request's output cap when n > 1 (one sequence's cap is the context check's; 0
    where they are not plain integers: validation's job)."""
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n <= 1:
        return 0
    cap = next(
        (
            body[k]
            for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
            if body.get(k) is not None
        ),
        0,
    )
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (n, cap)):
        return 0
    return int(n) * int(cap)
