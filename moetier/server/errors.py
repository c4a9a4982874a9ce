"""Error bodies in each API's shape, and the app's handlers that put every error into them.

OpenAI routes: `{"error": {"message", "type", "param", "code"}}`; the Anthropic routes (under
`/v1/messages`): `{"type": "error", "error": {"type", "message"}}`. A request that fails
validation is a 400 (not FastAPI's 422) naming the field; an unknown path a 404 and a wrong
method a 405 in the shape of the path's API; an unexpected exception a 500 in that shape (a bug:
nothing a client sends should reach it). The status decides the error's type."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

ANTHROPIC_PREFIX = "/v1/messages"
RESPONSES_PATH = "/v1/responses"  # its streams are typed events, errors too

# status -> (OpenAI type, OpenAI code, Anthropic type)
_KINDS: dict[int, tuple[str, str | None, str]] = {
    400: ("invalid_request_error", None, "invalid_request_error"),
    401: ("authentication_error", "invalid_api_key", "authentication_error"),
    403: ("permission_error", None, "permission_error"),
    404: ("not_found_error", None, "not_found_error"),
    405: ("invalid_request_error", "method_not_allowed", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large", "request_too_large"),
    429: ("rate_limit_error", None, "rate_limit_error"),
    499: ("invalid_request_error", "client_closed_request", "invalid_request_error"),
    500: ("server_error", None, "api_error"),
    503: ("server_error", None, "overloaded_error"),
}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_body(
    path: str,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    kind: str | None = None,
) -> dict[str, Any]:
    """The error object of `path`'s API for an HTTP `status` (`kind`: another type than the
    status's)."""
    openai_kind, default_code, anthropic_kind = _KINDS.get(
        status, _KINDS[500 if status >= 500 else 400]
    )
    if is_anthropic(path):
        return {"type": "error", "error": {"type": kind or anthropic_kind, "message": message}}
    return {
        "error": {
            "message": message,
            "type": kind or openai_kind,
            "param": param,
            "code": code or default_code,
        }
    }


def error_response(
    path: str,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
    kind: str | None = None,
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content=error_body(path, status, message, param, code, kind),
        headers=dict(headers) if headers else None,
    )


def openai_error(
    status: int,
    message: str,
    kind: str | None = None,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """An error in OpenAI's shape; its type follows the status unless `kind` is given."""
    return error_response("/v1", status, message, param, code, headers, kind)


def anthropic_error(
    status: int,
    message: str,
    kind: str | None = None,
    *,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """An error in Anthropic's shape; its type follows the status unless `kind` is given."""
    return error_response(ANTHROPIC_PREFIX, status, message, headers=headers, kind=kind)


def stream_error_event(path: str, message: str, status: int = 503) -> bytes:
    """The event that ends a failed stream in `path`'s API: OpenAI's `data: {"error": ...}`
    then `[DONE]`, Anthropic's `event: error`, the Responses API's typed `error` event."""
    body = error_body(path, status, message)
    if is_anthropic(path):
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    if path == RESPONSES_PATH:
        typed = {"type": "error", "code": body["error"]["type"], "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(typed)}\n\n".encode()
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def validation_message(
    exc: RequestValidationError, required: list[str] | None = None
) -> tuple[str, str | None]:
    """(message, the field's dotted path) of a request's first validation error; `required`:
    the fields the route's body must have, named when the body is missing altogether."""
    errors = exc.errors()
    first = _most_specific(errors) if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_union_tag(p)]
    where = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {msg}", None
    if where is None and errors:  # the body itself: none at all, or not an object
        fields = f" with {_listed(required)}" if required else ""
        if first.get("type") == "missing":
            return f"the request body is empty: send a JSON object{fields}", None
        return f"the request body is not a JSON object: send a JSON object{fields}", None
    if first.get("type") == "missing":
        return f"{where}: a required field is missing", where
    return (f"{where}: {msg}" if where else msg), where


# pydantic's names for a union's members in an error's location (`str | list[Part]`: "str",
# "list[Part]"): not fields, so never shown
_SCALAR_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "any"})


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or part in _SCALAR_TAGS)


def _most_specific(errors: Sequence[Any]) -> dict[str, Any]:
    """The first error, or where it is one member of a union failing (each member gives its own
    error: `content` as a string fails on a list), the member's error that goes deepest: the
    member whose shape the value has, failing on one of its fields (`messages.0.content.0.text`,
    not "messages.0.content: Input should be a valid string")."""
    first: dict[str, Any] = errors[0]
    loc = tuple(first.get("loc", ()))
    at = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if at is None:
        return first
    rivals = [
        e
        for e in errors
        if len(e.get("loc", ())) > at
        and tuple(e["loc"][:at]) == loc[:at]
        and _is_union_tag(e["loc"][at])
    ]
    return max(rivals, key=lambda e: len(e["loc"]))  # the first of the deepest


def required_fields(request: Request) -> list[str]:
    """The fields the body of the request's route requires (none known: empty)."""
    body = getattr(request.scope.get("route"), "body_field", None)
    model = getattr(getattr(body, "field_info", None), "annotation", None)
    fields = getattr(model, "model_fields", None)
    if not isinstance(fields, dict):
        return []
    return [name for name, info in fields.items() if info.is_required()]


def _listed(names: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def install(app: FastAPI) -> None:
    """The handlers that shape every error of `app` by its path's API."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc, required_fields(request))
        return error_response(request.url.path, 400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        path = request.url.path
        if exc.status_code == 404:
            message = f"no route {request.method} {path}"
        elif exc.status_code == 405:
            message = f"{path} does not accept {request.method}"
        else:
            message = str(exc.detail)
        return error_response(path, exc.status_code, message, headers=exc.headers)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        traceback.print_exception(exc, file=sys.stderr)
        message = f"internal error ({type(exc).__name__}); see the server's log"
        return error_response(request.url.path, 500, message)


_NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
ERROR_SCHEMAS: dict[str, dict[str, Any]] = {
    "OpenAIError": {
        "type": "object",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "additionalProperties": False,
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": _NULLABLE_STRING,
                    "code": _NULLABLE_STRING,
                },
            }
        },
    },
    "AnthropicError": {
        "type": "object",
        "required": ["type", "error"],
        "additionalProperties": False,
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "additionalProperties": False,
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
}
# the errors a route may answer, by method (GET routes read no body)
_DOCUMENTED = {
    "post": {
        400: "invalid request (never 422)",
        401: "missing or wrong API key",
        404: "model not served",
        413: "body over --max-body-mb",
        429: "queue full (Retry-After)",
        503: "model loading or failed (Retry-After)",
    },
    "get": {401: "missing or wrong API key"},
}


def document(app: FastAPI, open_paths: frozenset[str]) -> None:
    """Make `app`'s OpenAPI schema say what the handlers do: no 422, the error statuses each
    route may answer, with its API's error body (`open_paths` need no key)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        components.update(ERROR_SCHEMAS)
        for path, operations in schema.get("paths", {}).items():
            ref = "AnthropicError" if is_anthropic(path) else "OpenAIError"
            body = {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                for status, description in _DOCUMENTED.get(method, {}).items():
                    if status == 401 and path in open_paths:
                        continue
                    responses[str(status)] = {"description": description, "content": body}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
