"""The request fields each endpoint knows but does not support yet: a request that sets one
(to anything but its harmless default) gets a 400 naming the field, instead of an answer that
silently ignores it. Fields nobody knows are ignored, as OpenAI does.

One table per endpoint, here only: when a feature lands, delete its entries (and its rows in
docs/serving.md's table). Each entry is field -> (the values that are harmless, what to do);
null is always harmless."""

from __future__ import annotations

from typing import Any

_TOOLS: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": (([],), "the deprecated `functions` are not supported: use `tools`"),
    "function_call": (("none", "auto"), "the deprecated `function_call` is not supported"),
}

UNSUPPORTED: dict[str, dict[str, tuple[tuple[Any, ...], str]]] = {
    "/v1/chat/completions": {
        **_TOOLS,
        "audio": ((), "audio output is not supported"),
        "modalities": ((["text"],), "only text output is supported"),
        "prediction": ((), "predicted outputs are not supported"),
        "web_search_options": ((), "web search is not supported"),
    },
    "/v1/completions": {
        "suffix": (("",), "suffix (fill in the middle) is not supported"),
        "best_of": ((1,), "only best_of = 1 is supported"),
    },
    "/v1/responses": {
        "previous_response_id": ((), "responses are not stored: send the whole input"),
        "conversation": ((), "conversations are not stored: send the whole input"),
        "background": ((), "background responses are not supported"),
    },
    "/v1/messages": {
        "mcp_servers": ((), "MCP servers are not supported"),
        "container": ((), "containers are not supported"),
    },
}


def unsupported_field(path: str, body: Any) -> tuple[str, str] | None:
    """(field, why) of the first field of `body` that `path` knows but does not support, or
    None."""
    table = UNSUPPORTED.get(path)
    if not table or not isinstance(body, dict):
        return None
    for name, (harmless, why) in table.items():
        if name not in body:
            continue
        value = body[name]
        if value is None or any(_same(value, ok) for ok in harmless):
            continue
        return name, why
    return None


def _same(value: Any, other: Any) -> bool:
    """Equal as JSON values (so `true` is not `1` and `1` is `1.0`)."""
    if isinstance(value, bool) or isinstance(other, bool):
        return isinstance(value, bool) and isinstance(other, bool) and value == other
    if isinstance(other, tuple):
        other = list(other)
    return bool(value == other)
