"""Samples a step's rows: one row of logits per sequence that samples in the step -> its next
token, its logprobs, and the prompt logprobs of prompt positions computed in the step.

All rows are sampled together on the device (engine/sampler.py: grammar bitmask, logit bias,
penalties, temperature, min-p, top-k, top-p, greedy rows by argmax) and come back to the host
in one copy: tokens and logprobs packed into one tensor. Each seeded sequence draws its noise
from its own generator, so what it samples does not depend on which sequences share its steps.
A sequence with a grammar has a matcher (`matchers`, set by the engine): its row's allowed
tokens are filled into one bitmask for the step, and the sampled token is fed back to it. The
runners (engine/runner.py) derive from StepSampler.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from moetier.engine.gate_rows import GateRows
from moetier.engine.sampler import (
    SamplingParams,
    TokenLogprob,
    apply_bitmask_ref,
    apply_penalties,
    bitmask_words,
    sample_rows,
    sampling_tensors,
    to_device,
    token_counts,
)
from moetier.engine.scheduler import Request, Scheduled

DEFAULT_PARAMS = SamplingParams()


@dataclass
class Sampled:
    """What a step sampled: the next token of each sampling sequence (by request id), the
    logprobs of those whose params ask, and prompt logprobs (request id -> prompt position ->
    the logprob of the prompt token there, given the tokens before it)."""

    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, dict[int, TokenLogprob]] = field(default_factory=dict)
    # the raw logits [V] (float32, on the device) of the rows of `StepSampler.keep_logits`
    kept: dict[str, torch.Tensor] = field(default_factory=dict)
    # speculative decoding: the drafts kept (before `tokens[id]`), by request id
    accepted: dict[str, list[int]] = field(default_factory=dict)


class _HostCopy:
    """A tensor's copy to the host, under way: `get()` waits for it alone (an event after the
    copy), not for work queued on the stream since."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor

    def get(self) -> list[Any]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass
class PendingSample:
    """A step's sampling whose device work is queued (`_sample_start`): the tokens on the
    device [S] (in the items' order) and the copy coming back (the tokens alone, or with
    `width` > 0 or prompt spans the [rows, 3 + 2 * width] table of `_logprob_rows`)."""

    items: list[Scheduled]
    spans: list[PromptSpan]
    params: list[SamplingParams]
    tokens: torch.Tensor
    copy: _HostCopy
    failed: set[int]
    width: int
    table: bool = False  # the copy is the logprob table, not the tokens alone
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # Sampled.kept

    def host(self) -> list[Any]:
        return self.copy.get()


@dataclass(frozen=True)
class PromptSpan:
    """Positions [start, start + count) of `request` (the step's item number `item`) whose
    logits give the logprobs of its prompt tokens start + 1 ... start + count."""

    item: int
    request: Request
    start: int
    count: int


class StepSampler:
    """Per-sequence generators, grammar matchers and prompt masks; the sampling of one step's
    rows."""

    device: torch.device

    def __init__(self) -> None:
        self.generators: dict[str, torch.Generator] = {}
        self.matchers: dict[str, Any] = {}  # request id -> grammar matcher (set by the engine)
        self.prompt_masks: dict[str, torch.Tensor] = {}  # [V] bool: tokens in the prompt
        self.positions_run = 0  # positions computed over the runner's life (tests, metrics)
        # the confidence gate's row inputs (engine/gate_rows.py), where the model has a gate
        self.gate_rows: GateRows | None = None
        # requests whose rows' raw logits a step hands back (Sampled.kept: the quality meter)
        self.keep_logits: set[str] = set()

    def release(self, request_id: str) -> None:
        """Forget a finished or preempted-for-good request's state."""
        self.generators.pop(request_id, None)
        self.matchers.pop(request_id, None)
        self.prompt_masks.pop(request_id, None)
        self.keep_logits.discard(request_id)
        if self.gate_rows is not None:
            self.gate_rows.release(request_id)

    def forget_kv(self, request_id: str) -> None:
        """A preempted request's KV outside the page pool, if any, is dropped (it is
        recomputed when it runs again). The paged cache holds none."""

    @staticmethod
    def prompt_spans(items: list[Scheduled]) -> list[PromptSpan]:
        """The positions of the step whose logits give prompt logprobs: those of requests that
        ask for them (SamplingParams.prompt_logprobs) and whose next token is in the prompt."""
        spans = []
        for i, item in enumerate(items):
            params = item.request.params
            if params is None or params.prompt_logprobs is None:
                continue
            end = min(item.start + item.count, len(item.request.prompt) - 1)
            if end > item.start:
                spans.append(PromptSpan(i, item.request, item.start, end - item.start))
        return spans

    def _sample(
        self,
        logits: torch.Tensor,
        items: list[Scheduled],
        prompt_logits: torch.Tensor | None = None,
        spans: list[PromptSpan] | None = None,
    ) -> Sampled:
        """logits [S, V], one row per sampling item (in order); prompt_logits [P, V], the rows
        of `spans`' positions in order -> what the step sampled. A row whose sampling fails
        (its grammar matcher raised) is left out: the engine ends that request alone."""
        return self._sample_finish(self._sample_start(logits, items, prompt_logits, spans))

    def _sample_start(
        self,
        logits: torch.Tensor,
        items: list[Scheduled],
        prompt_logits: torch.Tensor | None = None,
        spans: list[PromptSpan] | None = None,
    ) -> PendingSample:
        """The device half of `_sample`: every read of `logits` queued, the rows' tokens on
        the device (`PendingSample.tokens`) and their copy to the host under way. Work queued
        after this (the next step launched ahead) does not delay `_sample_finish`."""
        spans = spans or []
        params = [item.request.params or DEFAULT_PARAMS for item in items]
        if self.gate_rows is not None:  # each row's top probability, for its next step
            self.gate_rows.observe(logits, items)
        kept = {}
        if self.keep_logits:
            for row, item in enumerate(items):
                if item.request.id in self.keep_logits:
                    kept[item.request.id] = logits[row].float().clone()
        if not spans and all(p.plain_greedy for p in params):
            # the common path: one argmax and one device-to-host copy for every row
            chosen = logits.argmax(dim=-1)  # [S]
            copy = _HostCopy(chosen)
            return PendingSample(items, spans, params, chosen, copy, set(), 0, kept=kept)
        failed: set[int] = set()
        raw = logits.float()
        chosen, ok = self._choose(raw, items, params, failed)
        # what comes back: [token, ok, logprob, top ids..., top logprobs...] per row, one copy
        width = max(
            [p.logprobs or 0 for p in params]
            + [s.request.params.prompt_logprobs or 0 for s in spans]
        )
        want_logprobs = any(p.logprobs is not None for p in params)
        blocks = []
        if items:
            blocks.append(_logprob_rows(raw, chosen, ok, width, want_logprobs))
        if spans:
            assert prompt_logits is not None
            targets = [
                t for s in spans for t in s.request.tokens[s.start + 1 : s.start + 1 + s.count]
            ]
            target_ids = to_device(targets, prompt_logits.device, torch.int64)
            blocks.append(_logprob_rows(prompt_logits.float(), target_ids, None, width, True))
        table = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        copy = _HostCopy(table)
        return PendingSample(
            items, spans, params, chosen, copy, failed, width, table=True, kept=kept
        )

    def _sample_finish(self, pending: PendingSample) -> Sampled:
        """The host half of `_sample`: wait for the copy, feed grammars, -> what was sampled."""
        items, params = pending.items, pending.params
        host = pending.host()
        if not pending.table:
            tokens = {item.request.id: t for item, t in zip(items, host, strict=True)}
            return Sampled(tokens, kept=pending.kept)
        out = Sampled(kept=pending.kept)
        width = pending.width
        for row, item in enumerate(items):
            if row in pending.failed:
                continue
            request_id, p = item.request.id, params[row]
            values = host[row]
            token = int(values[0])
            if not values[1]:
                note = "its logits are not finite, or its settings allow no token"
                print(f"moetier: sampling failed for {request_id}: {note}", file=sys.stderr)
                continue
            matcher = self.matchers.get(request_id)
            if matcher is not None and not _accepts(matcher, token, request_id):
                continue
            out.tokens[request_id] = token
            if p.logprobs is not None:
                out.logprobs[request_id] = _token_logprob(values, p.logprobs, width)
        row = len(items)
        for s in pending.spans:
            wanted = s.request.params.prompt_logprobs
            mine = out.prompt_logprobs.setdefault(s.request.id, {})
            for position in range(s.start + 1, s.start + 1 + s.count):
                mine[position] = _token_logprob(host[row], wanted, width)
                row += 1
        return out

    def _choose(
        self,
        raw: torch.Tensor,
        items: list[Scheduled],
        params: list[SamplingParams],
        failed: set[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The token of each row [S] int64, on the device: grammar, bias, penalties, then
        greedy rows by argmax and the others drawn (sampler.py's order); and whether the row
        could sample [S] bool (finite logits, some token allowed)."""
        if not items:
            return raw.new_zeros(0, dtype=torch.int64), raw.new_zeros(0, dtype=torch.bool)
        work = self._processed(raw, items, params, failed)
        ok = torch.isfinite(raw).all(dim=-1) & (work.amax(dim=-1) > float("-inf"))
        if all(p.temperature == 0 for p in params):
            return work.argmax(dim=-1), ok
        noise = torch.empty_like(work).exponential_()
        for row, (item, p) in enumerate(zip(items, params, strict=True)):
            if p.temperature > 0 and p.seed is not None:  # its own stream, whatever the batch
                noise[row].exponential_(generator=self._generator(item.request.id, p.seed))
        sort = any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params)
        settings = sampling_tensors(params, raw.device)
        tokens = sample_rows(work, *settings, None, noise=noise, sort=sort)
        return tokens, ok

    def _processed(
        self,
        raw: torch.Tensor,
        items: list[Scheduled],
        params: list[SamplingParams],
        failed: set[int],
    ) -> torch.Tensor:
        """raw [S, V] fp32 (not written) -> the logits after the grammars' bitmask, the logit
        bias and the penalties (raw itself where no row has any)."""
        work = raw
        device, vocab = raw.device, raw.shape[-1]
        constrained = [i for i, item in enumerate(items) if item.request.id in self.matchers]
        if constrained:
            bitmask = torch.full((len(items), bitmask_words(vocab)), -1, dtype=torch.int32)
            for row in constrained:
                request_id = items[row].request.id
                try:
                    self.matchers[request_id].fill_next_token_bitmask(bitmask, row)
                except Exception as exc:  # a broken matcher ends its request alone
                    print(f"moetier: grammar failed for {request_id}: {exc}", file=sys.stderr)
                    failed.add(row)
            work = raw.clone()
            if device.type == "cuda":
                bitmask = bitmask.pin_memory().to(device, non_blocking=True)
            _apply_bitmask(work, bitmask)
        bias = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias if t < vocab]
        if bias:
            work = work.clone() if work is raw else work
            rows, tokens, values = zip(*bias, strict=True)
            at = (to_device(list(rows), device), to_device(list(tokens), device))
            work.index_put_(at, to_device(list(values), device, torch.float32), accumulate=True)
        penalized = [row for row, p in enumerate(params) if p.penalized]
        if penalized:
            work = work.clone() if work is raw else work
            outputs = [items[row].request.output for row in penalized]
            counts = token_counts(outputs, vocab, device)
            seen = (counts > 0) | torch.stack(
                [self._prompt_mask(items[row].request, vocab, device) for row in penalized]
            )
            settings = to_device(
                [
                    [p.presence_penalty, p.frequency_penalty, p.repetition_penalty]
                    for p in (params[r] for r in penalized)
                ],
                device,
                torch.float32,
            )
            index = to_device(penalized, device)
            work[index] = apply_penalties(work[index], counts, seen, *settings.float().unbind(1))
        return work

    def _prompt_mask(self, request: Any, vocab: int, device: torch.device) -> torch.Tensor:
        mask = self.prompt_masks.get(request.id)
        if mask is None:
            mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt = [t for t in request.prompt if t < vocab]
            mask[to_device(prompt, device, torch.int64)] = True
            self.prompt_masks[request.id] = mask
        return mask

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        if request_id not in self.generators:
            self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[request_id]


def _logprob_rows(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    ok: torch.Tensor | None,
    width: int,
    with_logprobs: bool,
) -> torch.Tensor:
    """[R, 3 + 2 * width] float64: each row's token, `ok` (1 where None), the token's logprob
    and the `width` most likely (ids, then logprobs); zeros for the logprobs without
    `with_logprobs`."""
    rows = logits.shape[0]
    out = torch.zeros(rows, 3 + 2 * width, dtype=torch.float64, device=logits.device)
    out[:, 0] = tokens
    out[:, 1] = 1 if ok is None else ok
    if with_logprobs:
        logprobs = torch.log_softmax(logits, dim=-1)
        out[:, 2] = logprobs.gather(-1, tokens[:, None].long())[:, 0]
        if width:
            top = logprobs.topk(min(width, logprobs.shape[-1]), dim=-1)
            out[:, 3 : 3 + top.indices.shape[-1]] = top.indices
            out[:, 3 + width : 3 + width + top.values.shape[-1]] = top.values
    return out


def _token_logprob(values: list[float], top: int, width: int) -> TokenLogprob:
    ids, logprobs = values[3 : 3 + top], values[3 + width : 3 + width + top]
    return TokenLogprob(
        int(values[0]), values[2], [(int(t), lp) for t, lp in zip(ids, logprobs, strict=True)]
    )


def _accepts(matcher: Any, token: int, request_id: str) -> bool:
    try:
        if matcher.accept_token(token):
            return True
        print(f"moetier: grammar refused token {token} for {request_id}", file=sys.stderr)
    except Exception as exc:
        print(f"moetier: grammar failed for {request_id}: {exc}", file=sys.stderr)
    return False


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The grammar module's kernel where it is installed, the torch reference otherwise."""
    try:
        from moetier.engine.grammar import apply_bitmask
    except ImportError:
        apply_bitmask_ref(logits, bitmask)
        return
    apply_bitmask(logits, bitmask)
