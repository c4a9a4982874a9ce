"""The serving engine: requests in, text deltas out, many requests per step.

`Engine.add` queues a request (its prompt tokens, SamplingParams and `n`, the sequences it
wants); each `Engine.step` schedules one batch (engine/scheduler.py), runs it
(engine/runner.py: a native model over the paged KV cache, or the transformers model class one
request after another; the step's rows sampled together, engine/step_sampler.py) and returns
what each sequence produced: its new tokens, their text (streamed: incomplete UTF-8 and the
possible start of a stop string held back), their logprobs when asked, the prompt's logprobs
on the request's first output when asked, and, at the end, the finish reason. A stop string,
a grammar's completed document, `abort` or the end-of-sequence tokens end a sequence and free
its KV pages at once. The n sequences of a request: the first runs until it has computed the
prompt, then the others are admitted and take its full pages from the prefix cache (they
compute only the prompt's last, partial page); each has its own generator and grammar
matcher; `abort` ends them all. Synchronous and single-threaded: the server drives it from one
loop.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field, replace
from typing import Any

from moetier.engine.detokenizer import StreamingDetokenizer, end_token_ids
from moetier.engine.kv_pages import PagePool
from moetier.engine.quality_meter import QualityMeter
from moetier.engine.reasoning_budget import ReasoningBudget
from moetier.engine.runner import PagedRunner, TransformersRunner
from moetier.engine.sampler import SamplingParams, TokenLogprob
from moetier.engine.scheduler import Request, Scheduler, State, Step
from moetier.engine.speculative import SpecPolicy, SpecStats
from moetier.loader.loaded_model import LoadedModel

DEFAULT_PAGE_SIZE = 16
# the smallest temperature above 0 (greedy): logits divided by less overflow to inf in fp32
MIN_TEMPERATURE = 1e-5
SIBLING_MARK = "\x1fn"  # sequence i >= 1 of request r is sequence id r + SIBLING_MARK + str(i)


@dataclass
class Output:
    """What one sequence of a request produced in one step. `prompt_tokens` and
    `cached_tokens` are the request's: the same on each of its n sequences (count them once)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" on its last output
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    completion_tokens: int = 0  # so far
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    index: int = 0  # which of the request's n sequences
    # one per token of token_ids, when SamplingParams.logprobs is set (the raw distribution's)
    logprobs: list[TokenLogprob] | None = None
    # on the request's first output, when SamplingParams.prompt_logprobs is set: one per prompt
    # token, None for the first (nothing before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # on its last output, when SamplingParams.logprobs is set and an end-of-sequence token ended
    # it: that token's logprob (the token is never text, so it is not in token_ids)
    end_logprob: TokenLogprob | None = None


@dataclass
class _Stream:
    """One sequence of a request."""

    request: Request
    detok: StreamingDetokenizer
    end_ids: frozenset[int]
    parent: str  # the request's id
    index: int
    sent: int = 0  # output tokens already handed out
    unsent: list[int] = field(default_factory=list)
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token
    started: bool = False  # an output handed out
    end_logprob: TokenLogprob | None = None  # the end-of-sequence token's that ended it


@dataclass
class _Family:
    """A request: its n sequences (ids by index), those held until the first has computed the
    prompt, and its prompt logprobs by position."""

    first: Request
    sequences: list[str]
    held: list[Request] = field(default_factory=list)
    open: set[str] = field(default_factory=set)
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)


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
    speculative_tokens: int = field(
        default=0,
        metadata={
            "help": "speculative decoding with the model's MTP layer (--mtp, --mtp-file): drafts "
            "per step (0 = off); each step verifies a request's last token and its drafts "
            "together, greedy output unchanged, sampled output drawn from the model's own "
            "distribution (requests with penalties, bias, grammars or logprobs: one token a "
            "step; docs/serve.md)"
        },
    )
    speculative_policy: str = field(
        default="auto",
        metadata={
            "help": "when drafts are made: auto (per batch size, whichever of drafting or not "
            "gave more tokens a second in this engine's own measured decode steps) or always"
        },
    )
    quality_meter: float = field(
        default=0.0,
        metadata={
            "help": "the confidence gate's live quality meter: this fraction of requests also "
            "runs with the delta plane everywhere (a twin sequence: twice their compute and "
            "KV), and /metrics shows the gated model's mean KLD and top-token disagreement "
            "against it (needs a store with a delta plane and a --delta rule other than all "
            "or none; docs/gate.md)"
        },
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
        self.streams: dict[str, _Stream] = {}  # by sequence id
        self.requests: dict[str, _Family] = {}  # by request id
        self.aborted = 0  # requests ended by `abort` (clients gone)
        self.vocab_size = int(loaded.model.config.vocab_size)
        self._grammars: Any = None
        self.speculative = limits.speculative_tokens
        if self.speculative < 0:
            raise ValueError(f"--speculative-tokens {self.speculative}: use 0 (off) or more")
        if limits.speculative_policy not in ("auto", "always"):
            raise ValueError(
                f"--speculative-policy {limits.speculative_policy!r}: use auto or always"
            )
        self.spec_policy = SpecPolicy() if limits.speculative_policy == "auto" else None
        if self.speculative:
            if not isinstance(self.runner, PagedRunner):
                raise ValueError("speculative decoding needs a native model file (--native)")
            self.runner.enable_speculative(self.speculative)
            # the MTP layer's KV is in the pages: they are cached once it is written
            self.scheduler.mtp_kv = True
            self.scheduler.on_end = self._mtp_final
        self.meter: QualityMeter | None = None
        if limits.quality_meter > 0:
            if self.runner.gate_rows is None:
                raise ValueError(
                    "--quality-meter compares the gated model with the delta everywhere: it "
                    "needs a store with a delta plane (moetier convert --delta nvfp4) and a "
                    "--delta rule other than all or none (e.g. weight:0.34)"
                )
            self.meter = QualityMeter(limits.quality_meter)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def grammars(self) -> Any:
        """The grammar backend (engine/grammar.py's GrammarBackend), built at first use; a
        test may set its own."""
        if self._grammars is None:
            try:
                from moetier.engine.grammar import GrammarBackend
            except ImportError as exc:
                raise ValueError(f"structured output is not available here ({exc})") from exc
            self._grammars = GrammarBackend(
                self.tokenizer, self.vocab_size, self.eos_ids | self.chat_end_ids
            )
        return self._grammars

    @grammars.setter
    def grammars(self, backend: Any) -> None:
        self._grammars = backend

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        chat: bool = False,
        max_tokens: int | None = None,
        ignore_eos: bool = False,
        n: int = 1,
    ) -> Request:
        """Queue a request of `n` sequences; ValueError (ContextLengthError, a bad grammar) if
        it can never run. max_tokens: None takes params.max_new_tokens capped by what the
        context leaves; ignore_eos: run to max_tokens through end-of-sequence tokens
        (benchmarks). -> the first sequence's scheduler Request.

        Sequences 1.. wait until the first has computed the prompt, then take its full pages
        from the prefix cache (they compute only the prompt's last partial page); each draws
        from its own generator (seeded from params.seed and its index when seeded)."""
        limit = self.check(prompt_ids, params, max_tokens, n)
        ids = [request_id] + [f"{request_id}{SIBLING_MARK}{i}" for i in range(1, n)]
        if request_id in self.requests or any(sid in self.streams for sid in ids):
            raise ValueError(f"request id {request_id!r} is already queued or running")
        matchers: list[Any] = [None] * n
        if params.grammar is not None:
            matchers = [self.grammars.matcher(*params.grammar) for _ in range(n)]
        elif params.reasoning_budget is not None:  # a matcher too: the same hook applies it
            matchers = [ReasoningBudget(*params.reasoning_budget) for _ in range(n)]
        end_ids = self.chat_end_ids if chat else self.eos_ids
        if params.grammar is not None:  # the grammar's document ends at any of its end tokens
            end_ids = self.eos_ids | self.chat_end_ids
        requests = []
        for i, sid in enumerate(ids):
            seq_params = params
            if i > 0:  # its own stream of draws; prompt logprobs are the first's
                seed = None if params.seed is None else sibling_seed(params.seed, i)
                seq_params = replace(params, seed=seed, prompt_logprobs=None)
            request = Request(sid, list(prompt_ids), limit, seq_params, end_ids, ignore_eos)
            # every prompt position's logits are needed: none taken from the prefix cache
            request.prefix_cache = seq_params.prompt_logprobs is None
            # a grammar-constrained output is a structured span: the gate gives it the delta
            request.gate_forced = params.grammar is not None
            requests.append(request)
        self.scheduler.add(requests[0])
        if self.meter is not None and n == 1 and self.meter.pick():
            self._add_twin(requests[0])
        held = requests[1:]
        if not self.pool.prefix_caching:  # nothing to share: no reason to wait
            for request in held:
                self.scheduler.add(request)
            held = []
        family = _Family(requests[0], ids, held=held, open=set(ids))
        self.requests[request_id] = family
        for i, (request, matcher) in enumerate(zip(requests, matchers, strict=True)):
            detok = StreamingDetokenizer(self.tokenizer, params.stop)
            self.streams[request.id] = _Stream(request, detok, end_ids, request_id, i)
            if matcher is not None:
                self.runner.matchers[request.id] = matcher
        return requests[0]

    def _add_twin(self, request: Request) -> None:
        """The quality meter's twin of `request` (engine/quality_meter.py): the same prompt,
        the delta everywhere, its own KV, fed the tokens `request` samples."""
        assert self.meter is not None
        twin = Request(
            self.meter.attach(request.id),
            list(request.prompt),
            request.max_tokens,
            SamplingParams(temperature=0.0),
            ignore_eos=True,
        )
        twin.prefix_cache, twin.private_kv, twin.gate_forced = False, True, True
        self.scheduler.add(twin)
        self.runner.keep_logits |= {request.id, twin.id}

    def _end_twin(self, twin: str) -> None:
        assert self.meter is not None
        self.scheduler.finish(twin, "abort")
        self.runner.release(twin)
        self.meter.end(twin)

    def _sequence_ended(self, request: Request, completed: bool) -> None:
        """A sequence ended: a metered one's twin goes on to compare the rest of its text
        (`completed`) or ends with it."""
        if self.meter is not None:
            twin = self.meter.twin_of.get(request.id)
            twin_request = self.scheduler.requests.get(twin) if twin is not None else None
            if twin_request is not None and len(twin_request.output) >= len(request.output):
                completed = False  # the twin has compared every index already: it ends too
            twin = self.meter.sequence_ended(request.id, request.output, completed)
            if twin is not None:
                self._end_twin(twin)
            self.runner.keep_logits.discard(request.id)

    def check(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int | None = None,
        n: int = 1,
    ) -> int:
        """The tokens a request may generate; ValueError (ContextLengthError) if it can never
        run. Reads only fixed limits: safe from any thread."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            # (an embedding lookup out of range: on CUDA a device assert, fatal)
            outside = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            raise ValueError(
                f"the prompt's token id {outside[0]} is not in this model's vocabulary (ids 0 to "
                f"{self.vocab_size - 1}); where the store's own tokenizer made it, the store's "
                "tokenizer does not match its model: convert the checkpoint again"
            )
        if n < 1:
            raise ValueError(f"n = {n}: ask for at least 1 sequence")
        if params.seed is not None and not 0 <= params.seed < 2**63:
            raise ValueError(f"seed {params.seed}: use an integer in [0, 2**63)")
        if 0 < params.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {params.temperature}: use 0 (greedy) or at least {MIN_TEMPERATURE}"
            )
        for token, _ in params.logit_bias:
            if token >= self.vocab_size:
                raise ValueError(
                    f"logit_bias: token id {token} is not in this model's vocabulary "
                    f"(ids 0 to {self.vocab_size - 1})"
                )
        limit = max_tokens
        if limit is None:  # the server's default, capped by what the context and pages leave
            limit = max(1, min(params.max_new_tokens, self.scheduler.room(len(prompt_ids))))
        return self.scheduler.check(len(prompt_ids), limit)

    def abort(self, request_id: str) -> Output | None:
        """End a request now (its client went away), all its sequences; their pages are freed
        at once. -> the output ending its first open sequence (None if none was open)."""
        outputs = self._end(request_id, "abort")
        if not outputs:
            return None
        self.aborted += 1
        return outputs[0]

    def _end(self, request_id: str, reason: str) -> list[Output]:
        """End every open sequence of a request with `reason`; -> their last outputs."""
        family = self.requests.pop(request_id, None)
        if family is None:
            return []
        outputs = []
        for sid in family.sequences:
            request = self.scheduler.finish(sid, reason)
            self.runner.release(sid)
            if request is not None:
                self._sequence_ended(request, completed=False)
            stream = self.streams.pop(sid, None)
            if stream is not None and sid in family.open:
                outputs.append(self._output(stream, family, "", [], reason))
        return outputs

    def step(self) -> list[Output]:
        """Schedule and run one batch; -> an Output for every sequence that produced a token or
        finished in it."""
        began = time.perf_counter()
        step = self.scheduler.schedule()
        for request in step.preempted:
            self.runner.forget_kv(request.id)
        meter = self.meter
        sampled = [  # before update; the meter's twins are not the client's
            item.request.id
            for item in step.items
            if item.samples and (meter is None or not meter.is_twin(item.request.id))
        ]
        lookahead = self.runner.lookahead and self._steady(step)
        if lookahead:  # the next step's positions in pages already, where pages are free
            self.scheduler.reserve_next(step)
        result = self.runner.run(step, lookahead)
        if meter is not None and result.kept:  # twins take their sequences' tokens
            known = {sid: self.streams[sid].request.output for sid in meter.twin_of
                     if sid in self.streams}  # fmt: skip
            known |= {item.request.id: item.request.output for item in step.items}
            for twin in meter.take(result.kept, result.tokens, known):
                self._end_twin(twin)  # every index compared
        outputs = []
        for sid, by_position in result.prompt_logprobs.items():
            if sid in self.streams:
                self.requests[self.streams[sid].parent].prompt_logprobs.update(by_position)
        failed = {self.streams[sid].parent for sid in sampled if sid not in result.tokens}
        for request_id in failed:  # its sampling failed: the whole request ends
            outputs += self._end(request_id, "error")
        for sid, logprob in result.logprobs.items():
            if sid in self.streams:
                self.streams[sid].logprobs.append(logprob)
        finished = {r.id for r in self.scheduler.update(step, result.tokens, result.accepted)}
        if self.speculative:
            self._draft(step)
            decodes = all(not item.is_prefill for item in step.items)
            if self.spec_policy is not None and step.items and decodes:
                given = sum(len(result.accepted.get(item.request.id, ())) + 1
                            for item in step.items if item.request.id in result.tokens)  # fmt: skip
                drafted = any(item.drafts for item in step.items)
                seconds = time.perf_counter() - began  # (its drafting for the next included)
                self.spec_policy.record(len(step.items), drafted, given, seconds)
        if meter is not None:
            for twin in [sid for sid in finished if meter.is_twin(sid)]:
                self._end_twin(twin)
        for sid in sampled:
            stream = self.streams.get(sid)
            if stream is None:
                continue
            matcher = self.runner.matchers.get(sid)
            if sid not in finished and matcher is not None and matcher.is_terminated():
                self.scheduler.finish(sid, "stop")  # the grammar's document is complete
                finished.add(sid)
            family = self.requests[stream.parent]
            if stream.index == 0 and family.held:  # the prompt is computed: siblings may go
                for request in reversed(family.held):
                    self.scheduler.add(request, front=True)
                family.held = []
        for sid in sampled:
            stream = self.streams.get(sid)
            if stream is not None:
                outputs.append(self._advance(stream, sid in finished))
        return outputs

    def spec_stats(self) -> SpecStats | None:
        """A copy of speculative decoding's counters (None: off)."""
        drafter = getattr(self.runner, "drafter", None)
        if drafter is None:
            return None
        stats = drafter.stats
        return SpecStats(list(stats.drafted), list(stats.accepted), stats.steps)

    def _draft(self, step: Step) -> None:
        """Drafts for the next step of each request of this one that goes on decoding (no
        penalties, bias, grammar, logprobs or quality meter), where pages for them are free.
        Every request (but the quality meter's twins, whose KV is their own) keeps the MTP
        layer's KV written, drafting or not: its pages enter the prefix cache once it is
        (a prompt chunk's at once, decoded positions in batches), so a later request that
        takes them drafts as if it had computed them."""
        assert isinstance(self.runner, PagedRunner) and self.runner.drafter is not None
        ready, behind = [], []
        drafter = self.runner.drafter
        for item in step.items:
            request = item.request
            if request.state is not State.RUNNING:
                continue  # finished (its last MTP KV written by `_mtp_final`) or preempted
            if request.private_kv:
                drafter.forget(request.id)  # its KV enters no cache: none needed
                continue
            params = request.params
            speculable = not (
                params is None
                or not params.speculable
                or request.id in self.runner.matchers
                or request.id in self.runner.keep_logits
                or request.gate_forced
            )
            if (
                speculable
                and request.computed == len(request.tokens) - 1
                and self.scheduler.reserve(request, len(request.tokens) + self.speculative)
            ):
                ready.append(request)
            else:
                behind.append(request)
        prompts = frozenset(item.request.id for item in step.items if item.is_prefill)
        if ready and (self.spec_policy is None or self.spec_policy.choose(len(ready))):
            drafter.draft(ready, self.speculative, self.runner.cache)
        else:  # no drafts this step: the MTP layer's KV still kept up, in batches
            behind += ready
        if behind:
            drafter.catch_up(behind, self.runner.cache, now=prompts)
        for item in step.items:
            self.scheduler.commit(item.request)

    def _mtp_final(self, request: Request) -> None:
        """A request finishing in the scheduler's `update`, its pages not yet freed: the MTP
        layer's KV of its last positions, so that they enter the prefix cache too."""
        assert isinstance(self.runner, PagedRunner) and self.runner.drafter is not None
        if not request.private_kv:
            self.runner.drafter.catch_up([request], self.runner.cache, now=frozenset([request.id]))

    def _steady(self, step: Step) -> bool:
        """Whether the next step is likely this one's rows decoding again: every item a
        decode that samples, none waiting to be admitted, and some row not at its last
        token (the runner then launches that step ahead)."""
        if self.scheduler.waiting or not step.items:
            return False
        if any(item.count != 1 or not item.samples for item in step.items):
            return False
        if self.meter is not None and any(self.meter.is_twin(i.request.id) for i in step.items):
            return False  # a twin's next token is its sequence's, known only on the host
        return any(
            len(item.request.output) + 1 < (item.request.max_tokens or 0) for item in step.items
        )

    def _advance(self, stream: _Stream, finished: bool) -> Output:
        request = stream.request
        family = self.requests[stream.parent]
        start = stream.sent
        new = request.output[start:]
        logprobs = stream.logprobs[start:] if request.params.logprobs is not None else []
        stream.sent = len(request.output)
        text, stopped = "", False
        for k, token in enumerate(new):
            if token in stream.end_ids and not request.ignore_eos:
                if k < len(logprobs):
                    stream.end_logprob = logprobs[k]
                break  # an end-of-sequence token is never text
            stream.unsent.append(token)
            if k < len(logprobs):
                stream.unsent_logprobs.append(logprobs[k])
            piece, stopped = stream.detok.push(token)
            text += piece
            if stopped:
                # a verify step appends several tokens: those after the stop string's are
                # neither sent nor counted
                del request.output[start + k + 1 :]
                stream.sent = len(request.output)
                break
        if stopped:  # a stop string: "stop" even on the last allowed token
            if not finished:
                self.scheduler.finish(request.id, "stop")
            request.finish_reason = "stop"
            finished = True
        if not finished:
            if not text:
                return self._output(stream, family, "", [], None)
            return self._output(stream, family, text, self._take_unsent(stream), None)
        if not stopped:
            text += stream.detok.flush()
        self.streams.pop(request.id, None)
        self.runner.release(request.id)
        self._sequence_ended(request, completed=True)
        out = self._output(stream, family, text, self._take_unsent(stream), request.finish_reason)
        family.open.discard(request.id)
        if not family.open:
            del self.requests[stream.parent]
        return out

    @staticmethod
    def _take_unsent(stream: _Stream) -> list[int]:
        tokens, stream.unsent = stream.unsent, []
        return tokens

    def _output(
        self, stream: _Stream, family: _Family, text: str, tokens: list[int], finish: str | None
    ) -> Output:
        request, params = stream.request, stream.request.params
        logprobs = None
        if params.logprobs is not None:
            logprobs = stream.unsent_logprobs[: len(tokens)] if tokens else []
            stream.unsent_logprobs = stream.unsent_logprobs[len(tokens) :]
        prompt_logprobs = None
        first = family.first
        if stream.index == 0 and not stream.started and params.prompt_logprobs is not None:
            known = family.prompt_logprobs
            if len(known) == len(first.prompt) - 1:  # complete (not an early abort)
                prompt_logprobs = [None, *(known[p] for p in range(1, len(first.prompt)))]
        stream.started = True
        return Output(
            family.first.id,
            text,
            tokens,
            finish,
            len(first.prompt),
            first.cached_tokens,
            len(request.output),
            stream.detok.matched if finish is not None else None,
            stream.index,
            logprobs,
            prompt_logprobs,
            stream.end_logprob if finish is not None else None,
        )


def sibling_seed(seed: int, index: int) -> int:
    """The seed of sequence `index` (>= 1) of a seeded request of n > 1 sequences (the first
    takes the request's seed itself): a hash of both, in [0, 2**63)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
