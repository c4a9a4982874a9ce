"""API keys: where a request carries one (`Authorization: Bearer KEY`, as the `openai` client
and Claude Code's ANTHROPIC_AUTH_TOKEN send it, or `x-api-key: KEY`, as the `anthropic` client
and ANTHROPIC_API_KEY do), whether it is one of the server's, and which paths need none."""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping

ENV_VAR = "MOETIER_API_KEY"  # one key, or several separated by commas
OPEN_PATHS = frozenset({"/health"})  # answered without a key (load balancers, probes)


def keys_from(
    flags: Iterable[str] | None, environ: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """The server's keys: the `--api-key` flags, else the MOETIER_API_KEY variable (empty: no
    key, every request is served)."""
    keys = [k for k in (flags or ()) if k]
    if not keys:
        env = (os.environ if environ is None else environ).get(ENV_VAR, "")
        keys = [k.strip() for k in env.split(",") if k.strip()]
    return tuple(keys)


def presented(headers: Mapping[str, str]) -> list[str]:
    """The keys a request carries (header names lower-case)."""
    found = []
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        found.append(token.strip())
    if headers.get("x-api-key", "").strip():
        found.append(headers["x-api-key"].strip())
    return found


def authorized(headers: Mapping[str, str], keys: tuple[str, ...]) -> bool:
    """Whether the request may be served: no keys configured, or it carries one of them
    (compared in constant time)."""
    if not keys:
        return True
    return any(
        hmac.compare_digest(given.encode(), key.encode())
        for given in presented(headers)
        for key in keys
    )
