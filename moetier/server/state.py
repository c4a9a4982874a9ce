"""What the API modules share: the engine (or how its loading goes), the server's defaults,
model names and options; work that stops when its client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from moetier.engine.async_engine import AsyncEngine
from moetier.engine.engine import Output
from moetier.engine.sampler import SamplingParams
from moetier.server.errors import openai_error
from moetier.server.options import ServerOptions
from moetier.server.parsers.serving import ParserChoice

T = TypeVar("T")

__all__ = ["ServerState", "all_outputs", "not_ready", "openai_error", "unless_disconnected"]


@dataclass
class ServerState:
    model_name: str
    defaults: SamplingParams = field(default_factory=SamplingParams)
    engine: AsyncEngine | None = None
    load_error: str | None = None  # why loading failed, if it did
    options: ServerOptions = field(default_factory=ServerOptions)
    generating: int = 0  # generating requests in flight (admitted, not yet answered)
    # answers by (route, HTTP status), and streams that ended in an error event, by route
    responses: Counter[tuple[str, int]] = field(default_factory=Counter)
    stream_errors: Counter[str] = field(default_factory=Counter)
    parser: ParserChoice | None = None  # the reasoning / tool-call parser, once the model is ready
    template_defaults: dict[str, Any] = field(default_factory=dict)  # chat template variables

    def serves(self, name: str) -> bool:
        """Whether a request's `model` names this server's model (its name or an alias)."""
        return name == self.model_name or any(
            fnmatch.fnmatchcase(name, alias) for alias in self.options.served_model_name
        )

    def listed_names(self) -> list[str]:
        """The names /v1/models lists: the model's, then each alias that is not a pattern."""
        aliases = [a for a in self.options.served_model_name if not set(a) & set("*?[")]
        return [self.model_name] + [a for a in aliases if a != self.model_name]


def not_ready(state: ServerState) -> tuple[int, str]:
    """(status, message) of a request that came before the engine is ready."""
    if state.load_error is not None:
        return 503, f"the model failed to load: {state.load_error}"
    return 503, "the model is still loading: retry shortly"


async def unless_disconnected(http: Request, work: Awaitable[T]) -> T | None:
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


async def all_outputs(http: Request, outputs: AsyncIterator[Output]) -> list[Output] | None:
    """Every output of a request (a whole answer), or None once its client has disconnected
    (the request is aborted); RuntimeError if the engine fails it."""

    async def collect() -> list[Output]:
        return [out async for out in outputs]

    return await unless_disconnected(http, collect())
