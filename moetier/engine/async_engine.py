"""The engine behind an async interface: one engine loop on its own thread, a queue per request.

`AsyncEngine.generate(...)` is an async iterator of a request's `Output`s, usable from any
asyncio loop (the server's). Requests and aborts reach the loop thread as commands; each step's
outputs go back to each request's queue on its own event loop. Closing the iterator early (a
client gone: the server cancels its task) aborts the request and frees its KV pages at once.
Nothing holds a lock across a step, so a new request, an abort or `/health` never waits for one.
`close()` ends every open request ("abort") and stops the loop within one step.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from moetier.engine.engine import Engine, Output
from moetier.engine.quality_meter import MeterStats
from moetier.engine.sampler import SamplingParams
from moetier.engine.speculative import SpecStats

_IDS = itertools.count()


@dataclass
class EngineStats:
    """What /metrics shows of the engine (read from any thread; values of the last step)."""

    running: int = 0
    waiting: int = 0
    pages_used: int = 0
    pages_free: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    aborted: int = 0
    meter: MeterStats | None = None  # the quality meter's totals (--quality-meter), if on
    spec: SpecStats | None = None  # speculative decoding's drafts (--speculative-tokens), if on


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stats = EngineStats(pages_free=engine.pool.free_pages)
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._open: dict[str, int] = {}  # request id -> its sequences not finished yet
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()  # the streams table and the idle flag, together
        self._thread = threading.Thread(target=self._loop, name="moetier-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def check(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int | None = None,
        n: int = 1,
    ) -> int:
        """Engine.check: a ValueError now for a request that can never run."""
        return self.engine.check(prompt_ids, params, max_tokens, n)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        chat: bool = False,
        max_tokens: int | None = None,
        ignore_eos: bool = False,
        request_id: str | None = None,
        n: int = 1,
    ) -> AsyncIterator[Output]:
        """The request's outputs as they come, those of its `n` sequences interleaved (each
        carries its `index`); it ends after the last sequence's finish_reason. Closing the
        iterator before then aborts the request (all its sequences). A grammar the engine
        cannot compile arrives as a ValueError."""
        self.check(prompt_ids, params, max_tokens, n)
        request_id = request_id or f"req-{next(_IDS)}"
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError("the server is shutting down")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = (asyncio.get_running_loop(), inbox)
            self._open[request_id] = n
            self._idle.clear()
        self._commands.put(
            ("add", request_id, list(prompt_ids), params, chat, max_tokens, ignore_eos, n)
        )
        finished = False
        left = n
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    left -= 1
                    finished = left == 0
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(("abort", request_id))

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is queued or running (tests)."""
        return self._idle.wait(timeout)

    def shutdown(self) -> None:
        """Begin stopping without waiting: the loop thread ends every open request (its
        iterator raises RuntimeError "the server is shutting down") after the step it is in,
        and later requests are refused. The server calls it when a signal asks it to stop,
        so that open requests end with their API's error while their connections are still
        open (uvicorn's graceful window), not cut."""
        with self._lock:
            self._stop.set()
        self._commands.put(("wake",))

    def close(self, timeout: float = 5.0) -> None:
        """End every open request (its iterator raises RuntimeError) and stop the loop thread."""
        self.shutdown()
        self._thread.join(timeout)

    # -- the loop thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._take_commands(block=not engine.has_work)
            if self._stop.is_set():
                break
            stepped = engine.has_work
            if stepped:
                try:
                    outputs = engine.step()
                except Exception as exc:  # a failed step fails its requests, not the server
                    print(f"moetier: engine step failed: {exc!r}", file=sys.stderr)
                    for request_id in list(engine.requests):
                        engine.abort(request_id)
                        self._deliver(request_id, RuntimeError(f"generation failed: {exc}"))
                    outputs = []
                for out in outputs:
                    self._deliver(out.request_id, out)
            self._update_stats(stepped)
        for request_id in list(engine.requests):  # shutting down: end every open request
            engine.abort(request_id)
        with self._lock:
            open_ids = list(self._streams)
        for request_id in open_ids:
            self._deliver(request_id, RuntimeError("the server is shutting down"))
        self._update_stats(False)

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self, command: tuple[Any, ...]) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_ids, params, chat, max_tokens, ignore_eos, n = command
            with self._lock:
                gone = request_id not in self._streams
            if gone:
                return  # its client left before it was queued
            try:
                self.engine.add(
                    request_id,
                    prompt_ids,
                    params,
                    chat=chat,
                    max_tokens=max_tokens,
                    ignore_eos=ignore_eos,
                    n=n,
                )
            except ValueError as exc:
                self._deliver(request_id, exc)
        elif kind == "abort":
            _, request_id = command
            self.engine.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)
                self._open.pop(request_id, None)

    def _deliver(self, request_id: str, item: Any) -> None:
        """Hand an output (or an exception) to its request's queue on the request's loop; an
        output that ends in "error" arrives as a RuntimeError. The last sequence's finish (or
        an exception) is the request's last item."""
        if isinstance(item, Output) and item.finish_reason == "error":
            item = RuntimeError("generation failed for this request (see the server's log)")
        with self._lock:
            final = isinstance(item, BaseException)
            if not final and item.finish_reason is not None:
                left = self._open.get(request_id, 1) - 1
                self._open[request_id] = left
                final = left <= 0
            if final:
                self._open.pop(request_id, None)
                stream = self._streams.pop(request_id, None)
            else:
                stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, inbox = stream
        try:
            loop.call_soon_threadsafe(inbox.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening
            self.engine.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)
                self._open.pop(request_id, None)

    def _update_stats(self, stepped: bool) -> None:
        engine = self.engine
        pool, scheduler = engine.pool, engine.scheduler
        meter = engine.meter
        twins = (lambda r: meter.is_twin(r.id)) if meter is not None else (lambda r: False)
        self.stats = EngineStats(  # the quality meter's twins are no client's requests
            running=sum(1 for r in scheduler.running if not twins(r)),
            waiting=sum(1 for r in scheduler.waiting if not twins(r)),
            pages_used=pool.used_pages,
            pages_free=pool.free_pages,
            prefix_queried_tokens=pool.stats.queried_tokens,
            prefix_hit_tokens=pool.stats.hit_tokens,
            steps=self.stats.steps + int(stepped),
            preemptions=scheduler.preemptions,
            aborted=engine.aborted,
            meter=replace(engine.meter.stats) if engine.meter is not None else None,
            spec=engine.spec_stats(),
        )
        with self._lock:
            if not engine.has_work and not self._streams and self._commands.empty():
                self._idle.set()
