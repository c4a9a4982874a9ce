"""The serving engine: requests in, text deltas out, many requests per step.

`Engine.add` queues a request (its prompt tokens and SamplingParams); each `Engine.step`
schedules one batch (engine/scheduler.py), runs it (engine/runner.py: a native model over the
paged KV cache, or the transformers model class one request after another) and returns what
each request produced: its new tokens, their text (streamed:
incomplete UTF-8 and the possible start of a stop string held back) and, at the end, the
finish reason. A stop string, `abort` or the end-of-sequence tokens end a request and free its
KV pages at once. Synchronous and single-threaded: the server drives it from one loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetier.engine.detokenizer import StreamingDetokenizer, end_token_ids
from moetier.engine.kv_pages import PagePool
from moetier.engine.runner import PagedRunner, TransformersRunner
from moetier.engine.sampler import SamplingParams
from moetier.engine.scheduler import Request, Scheduler
from moetier.loader.loaded_model import LoadedModel

DEFAULT_PAGE_SIZE = 16
# the smallest temperature above 0 (greedy): logits divided by less overflow to inf in fp32
MIN_TEMPERATURE = 1e-5


@dataclass
class Output:
    """What one request produced in one step."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" on its last output
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    completion_tokens: int = 0  # so far
    stop_sequence: str | None = None  # the stop string that ended it, if one did


@dataclass
class _Stream:
    request: Request
    detok: StreamingDetokenizer
    end_ids: frozenset[int]
    sent: int = 0  # output tokens already handed out
    unsent: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class EngineLimits:
    """KV pages and the scheduler's limits; each field is a flag of `moetier serve`."""

    num_pages: int = field(
        default=1024, metadata={"help": "KV cache pages (each --page-size positions)"}
    )
    page_size: int = field(default=DEFAULT_PAGE_SIZE, metadata={"help": "positions a KV page"})
    max_num_seqs: int = field(default=64, metadata={"help": "requests computed together"})
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "positions a step computes (decodes + prompt chunks)"}
    )
    prefix_caching: bool = field(
        default=True, metadata={"help": "reuse the KV pages of a cached prompt prefix"}
    )


class Engine:
    def __init__(self, loaded: LoadedModel, limits: EngineLimits | None = None) -> None:
        limits = limits or EngineLimits()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        paged = hasattr(loaded.model, "new_cache")  # a native model file
        self.runner: PagedRunner | TransformersRunner = (
            PagedRunner(loaded, limits.num_pages, limits.page_size, limits.max_num_seqs)
            if paged
            else TransformersRunner(loaded)
        )
        self.pool = PagePool(limits.num_pages, limits.page_size, limits.prefix_caching and paged)
        context = int(loaded.model.config.max_position_embeddings)
        self.scheduler = Scheduler(
            self.pool, context, limits.max_num_seqs, limits.max_num_batched_tokens
        )
        eos, chat_end = end_token_ids(loaded)
        self.eos_ids, self.chat_end_ids = frozenset(eos), frozenset(chat_end)
        self.streams: dict[str, _Stream] = {}
        self.aborted = 0  # requests ended by `abort` (clients gone)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        chat: bool = False,
        max_tokens: int | None = None,
        ignore_eos: bool = False,
    ) -> Request:
        """Queue a request; ContextLengthError (a ValueError) if it can never fit. max_tokens:
        None takes params.max_new_tokens capped by what the context leaves; ignore_eos: run to
        max_tokens through end-of-sequence tokens (benchmarks)."""
        limit = self.check(prompt_ids, params, max_tokens)
        end_ids = self.chat_end_ids if chat else self.eos_ids
        request = Request(request_id, list(prompt_ids), limit, params, end_ids, ignore_eos)
        self.scheduler.add(request)
        detok = StreamingDetokenizer(self.tokenizer, params.stop)
        self.streams[request_id] = _Stream(request, detok, end_ids)
        return request

    def check(
        self, prompt_ids: list[int], params: SamplingParams, max_tokens: int | None = None
    ) -> int:
        """The tokens a request may generate; ValueError (ContextLengthError) if it can never
        run. Reads only fixed limits: safe from any thread."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if params.seed is not None and not 0 <= params.seed < 2**63:
            raise ValueError(f"seed {params.seed}: use an integer in [0, 2**63)")
        if 0 < params.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {params.temperature}: use 0 (greedy) or at least {MIN_TEMPERATURE}"
            )
        limit = max_tokens
        if limit is None:  # the server's default, capped by what the context and pages leave
            limit = max(1, min(params.max_new_tokens, self.scheduler.room(len(prompt_ids))))
        return self.scheduler.check(len(prompt_ids), limit)

    def abort(self, request_id: str) -> Output | None:
        """End a request now (its client went away); its pages are freed at once."""
        request = self.scheduler.finish(request_id, "abort")
        stream = self.streams.pop(request_id, None)
        self.runner.release(request_id)
        if request is None or stream is None:
            return None
        self.aborted += 1
        return self._output(stream, "", [], "abort")

    def step(self) -> list[Output]:
        """Schedule and run one batch; -> an Output for every request that produced a token or
        finished in it."""
        step = self.scheduler.schedule()
        for request in step.preempted:
            self.runner.forget_kv(request.id)
        sampled = [item.request.id for item in step.items if item.samples]  # before update
        tokens = self.runner.run(step)
        outputs = []
        for request_id in [rid for rid in sampled if rid not in tokens]:  # its sampling failed
            self.scheduler.finish(request_id, "error")
            stream = self.streams.pop(request_id, None)
            self.runner.release(request_id)
            if stream is not None:
                outputs.append(self._output(stream, "", [], "error"))
        finished = {r.id for r in self.scheduler.update(step, tokens)}
        for request_id in sampled:
            stream = self.streams.get(request_id)
            if stream is not None:
                outputs.append(self._advance(stream, request_id in finished))
        return outputs

    def _advance(self, stream: _Stream, finished: bool) -> Output:
        request = stream.request
        new = request.output[stream.sent :]
        stream.sent = len(request.output)
        text, stopped = "", False
        for token in new:
            if token in stream.end_ids and not request.ignore_eos:
                break  # an end-of-sequence token is never text
            stream.unsent.append(token)
            piece, stopped = stream.detok.push(token)
            text += piece
            if stopped:
                break
        if stopped:  # a stop string: "stop" even on the last allowed token
            if not finished:
                self.scheduler.finish(request.id, "stop")
            request.finish_reason = "stop"
            finished = True
        if not finished:
            if not text:
                return self._output(stream, "", [], None)
            tokens, stream.unsent = stream.unsent, []
            return self._output(stream, text, tokens, None)
        if not stopped:
            text += stream.detok.flush()
        self.streams.pop(request.id, None)
        self.runner.release(request.id)
        tokens, stream.unsent = stream.unsent, []
        return self._output(stream, text, tokens, request.finish_reason)

    def _output(self, stream: _Stream, text: str, tokens: list[int], finish: str | None) -> Output:
        request = stream.request
        return Output(
            request.id,
            text,
            tokens,
            finish,
            len(request.prompt),
            request.cached_tokens,
            len(request.output),
            stream.detok.matched if finish is not None else None,
        )
