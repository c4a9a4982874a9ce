"""What every server-sent event stream of the app gets (an ASGI middleware over all routes):

- an SSE comment `: keep-alive` whenever the stream has sent nothing for `keep_alive_s` seconds
  (a long prompt's prefill), which clients skip and proxies count as traffic;
- an end in the API's error event (errors.stream_error_event) if the route fails after the stream
  began, instead of a connection cut mid-body.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import traceback
from collections.abc import Callable

from moetier.server.admission import ASGIApp, Message, Receive, Scope, Send
from moetier.server.errors import stream_error_event

KEEP_ALIVE = b": keep-alive\n\n"


class EventStreams:
    def __init__(
        self, app: ASGIApp, keep_alive_s: float, on_error: Callable[[str], None] | None = None
    ) -> None:
        self.app = app
        self.keep_alive_s = keep_alive_s
        self.on_error = on_error  # told the path of each stream that ends in an error event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lock = asyncio.Lock()
        started = streaming = ended = False
        last_sent = time.monotonic()
        ticker: asyncio.Task[None] | None = None

        async def keep_alive() -> None:
            nonlocal last_sent
            while True:
                wait = last_sent + self.keep_alive_s - time.monotonic()
                await asyncio.sleep(max(wait, 0.01))
                async with lock:
                    if ended:
                        return
                    if time.monotonic() - last_sent >= self.keep_alive_s:
                        await send(
                            {"type": "http.response.body", "body": KEEP_ALIVE, "more_body": True}
                        )
                        last_sent = time.monotonic()

        async def guarded(message: Message) -> None:
            nonlocal started, streaming, ended, last_sent, ticker
            async with lock:
                if ended:
                    return
                if message["type"] == "http.response.start":
                    started = True
                    content_type = dict(message.get("headers", ())).get(b"content-type", b"")
                    streaming = content_type.startswith(b"text/event-stream")
                    if streaming and self.keep_alive_s > 0:
                        ticker = asyncio.ensure_future(keep_alive())
                elif message["type"] == "http.response.body":
                    if streaming and _is_error_event(message.get("body", b"")):
                        self._failed(scope["path"])
                    ended = not message.get("more_body", False)
                await send(message)
                last_sent = time.monotonic()

        try:
            await self.app(scope, receive, guarded)
        except Exception as exc:
            if not (started and streaming) or ended:
                raise
            traceback.print_exception(exc, file=sys.stderr)
            self._failed(scope["path"])
            async with lock:
                ended = True
                message = f"the stream failed ({type(exc).__name__}); see the server's log"
                with contextlib.suppress(Exception):  # the client may be gone too
                    await send(
                        {
                            "type": "http.response.body",
                            "body": stream_error_event(scope["path"], message, 500),
                            "more_body": False,
                        }
                    )
        finally:
            if ticker is not None:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await ticker

    def _failed(self, path: str) -> None:
        if self.on_error is not None:
            self.on_error(path)


def _is_error_event(chunk: bytes) -> bool:
    """Whether a body chunk is an error event (OpenAI's `data: {"error": ...}`, Anthropic's and
    the Responses API's `event: error`)."""
    return chunk.startswith((b'data: {"error"', b"event: error\n"))
