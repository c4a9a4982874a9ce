"""The legacy OpenAI text completions: `POST /v1/completions`, streaming (server-sent
`text_completion` chunks ending with `[DONE]`) and not.

`prompt` is a string, a list of strings, a list of token ids or a list of token-id lists; each
prompt is its own request to the engine, its choices indexed in prompt order. No chat template:
the text is tokenized as it is (the tokenizer's special tokens added), the model's
end-of-sequence tokens end it. `echo` puts the prompt's text before the completion's; `max_tokens`
defaults to 16 as OpenAI's does (null: the server's default), either capped by what the context
leaves; 0, with `echo`, answers the prompt alone (to score it: its logprobs). `suffix`
(insertion) is refused with a 400. With `n`, prompt i's sequences are choices i*n ... i*n + n-1.

`logprobs` N gives OpenAI's legacy shape per choice: `tokens` (each token's text),
`token_logprobs`, `top_logprobs` (a dict of the N most likely tokens' texts, the chosen token
always among them) and `text_offset` (where each token starts in the choice's text). With
`echo` the prompt's tokens come first, the first with null logprobs: lm-eval's loglikelihood
requests (`echo`, `logprobs`, `max_tokens` 1) read the prompt's logprobs from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from moetier.engine.engine import Output
from moetier.engine.sampler import MAX_LOGPROBS, TokenLogprob
from moetier.engine.scheduler import ContextLengthError
from moetier.server.errors import openai_error, stream_error_event
from moetier.server.sampling_fields import SamplingFields
from moetier.server.state import ServerState, not_ready, unless_disconnected
from moetier.server.tokenize import check_ids

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for a completion


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0: the prompt alone (with echo); left out: DEFAULT_MAX_TOKENS, null: the server's
    # --max-new-tokens, either capped by what the context leaves
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    user: str | None = None


@dataclass
class Prompt:
    """One prompt of a request: its token ids and its text (what `echo` sends back)."""

    ids: list[int]
    text: str


def prompts(tokenizer: Any, prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """The request's prompts as token ids (and text); ValueError for an empty prompt or a token
    id the tokenizer does not have."""
    items: list[str] | list[list[int]]
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):  # one prompt of token ids
        items = [[int(p) for p in prompt]]  # type: ignore[arg-type]
    else:
        items = prompt  # type: ignore[assignment]
    if not items:
        raise ValueError("prompt: the prompt is empty")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(Prompt(tokenizer.encode(item), item))
        else:
            check_ids(tokenizer, item, "prompt")
            out.append(Prompt(list(item), tokenizer.decode(item)))
        if not out[-1].ids:
            raise ValueError("prompt: the prompt is empty")
    return out


def prompt_only(out: Output) -> Output:
    """An output with what was generated taken out (max_tokens 0: the engine generates one
    token, the answer is the echoed prompt alone, cut by its length)."""
    return replace(
        out,
        text="",
        token_ids=[],
        logprobs=None if out.logprobs is None else [],
        end_logprob=None,
        completion_tokens=0,
        finish_reason=None if out.finish_reason is None else "length",
    )


def finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def usage(lasts: list[list[Output]]) -> dict[str, Any]:
    """The usage of a request's prompts together: each prompt's sequences' last outputs (the
    prompt counted once, every sequence's tokens)."""
    prompt_tokens = sum(seqs[0].prompt_tokens for seqs in lasts)
    completion_tokens = sum(o.completion_tokens for seqs in lasts for o in seqs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(seqs[0].cached_tokens for seqs in lasts)},
    }


class LegacyLogprobs:
    """One choice's logprobs in OpenAI's legacy completion shape, built piece by piece as its
    tokens come (`text_offset` runs on across pieces)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.offset = 0  # where the next token starts in the choice's text

    def text(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))

    def piece(self, ids: list[int], entries: list[TokenLogprob | None]) -> dict[str, list[Any]]:
        """The logprobs of `ids` (entries aligned with them; None, or none left: unknown, as
        the first prompt token's)."""
        entries = entries + [None] * (len(ids) - len(entries))
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token, entry in zip(ids, entries, strict=False):
            text = self.text(token)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top = {self.text(t): logprob for t, logprob in entry.top}
            top.setdefault(text, entry.logprob)  # the chosen token is always listed
            out["token_logprobs"].append(entry.logprob)
            out["top_logprobs"].append(top)
        return out

    def prompt(
        self, prompt: Prompt, entries: list[TokenLogprob | None] | None
    ) -> dict[str, list[Any]]:
        """The echoed prompt's logprobs (the request's Output.prompt_logprobs; None: unknown);
        the completion's offsets then start after the prompt's text."""
        out = self.piece(prompt.ids, entries or [None] * len(prompt.ids))
        self.offset = len(prompt.text)
        return out

    def output(self, out: Output) -> dict[str, list[Any]]:
        """An output's tokens' logprobs, and the end-of-sequence token's that ended it (as
        OpenAI lists it: a token of no text)."""
        ids, entries = list(out.token_ids), list[TokenLogprob | None](out.logprobs or [])
        if out.end_logprob is not None:
            ids.append(out.end_logprob.token)
            entries.append(out.end_logprob)
        offset = self.offset
        piece = self.piece(ids, entries)
        if out.end_logprob is not None:
            self.offset = offset + sum(len(t) for t in piece["tokens"][:-1])
        return piece


def joined(pieces: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [v for piece in pieces for v in piece[k]] for k in keys}


def _choice(
    req: CompletionRequest,
    prompt: Prompt,
    outputs: list[Output],
    prompt_logprobs: list[TokenLogprob | None] | None,
    tokenizer: Any,
) -> dict[str, Any]:
    """One sequence's whole answer as a choice (index left to the caller)."""
    text = "".join(o.text for o in outputs)
    logprobs = None
    if req.logprobs is not None:
        legacy = LegacyLogprobs(tokenizer)
        pieces = [legacy.prompt(prompt, prompt_logprobs)] if req.echo else []
        logprobs = joined(pieces + [legacy.output(o) for o in outputs])
    return {
        "text": (prompt.text if req.echo else "") + text,
        "logprobs": logprobs,
        "finish_reason": finish_reason(outputs[-1].finish_reason),
    }


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(
        req: CompletionRequest, http: Request
    ) -> JSONResponse | StreamingResponse | dict[str, Any]:
        engine = state.engine
        if engine is None:
            return openai_error(*not_ready(state), "server_error")
        try:
            if req.suffix:
                raise ValueError("suffix: inserting text (suffix) is not supported; leave it out")
            if req.best_of is not None and req.best_of != req.n:
                raise ValueError("best_of: only best_of equal to n (or left out) is supported")
            # tokenizing a long prompt takes a while: off the event loop
            asked = await asyncio.to_thread(prompts, engine.tokenizer, req.prompt)
            params = req.sampling_params(state.defaults)
            if "max_tokens" not in req.model_fields_set:
                # OpenAI's default, capped by what the context leaves (as chat's default is):
                # a prompt near the context is answered, not refused; an explicit max_tokens
                # past the context stays a 400
                params = replace(params, max_new_tokens=DEFAULT_MAX_TOKENS)
            if req.logprobs is not None:
                echoed = req.logprobs if req.echo else None
                params = replace(params, logprobs=req.logprobs, prompt_logprobs=echoed)
            max_tokens = req.asked_max_tokens()
            if max_tokens == 0:
                if not req.echo:
                    raise ValueError("max_tokens: 0 needs echo (it answers the prompt alone)")
                max_tokens = 1  # the engine generates at least one token: left out below
            for p in asked:
                engine.check(p.ids, params, max_tokens, req.n)
        except ContextLengthError as err:
            return openai_error(400, str(err), param="prompt", code="context_length_exceeded")
        except ValueError as err:
            return openai_error(400, str(err))
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        streams = [
            engine.generate(
                p.ids, params, max_tokens=max_tokens, ignore_eos=req.ignore_eos, n=req.n
            )
            for p in asked
        ]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = _sse(
                streams, asked, req, engine.tokenizer, completion_id, now, state.model_name,
                include_usage,
            )  # fmt: skip
            return StreamingResponse(chunks, media_type="text/event-stream")

        try:
            done = await unless_disconnected(http, _collect_all(streams))
        except ValueError as err:  # a request the engine refused when it came to add it
            return openai_error(400, str(err))
        except RuntimeError as err:
            return openai_error(503, str(err), "server_error")
        if done is None:  # the client left: its requests are aborted
            return openai_error(499, "client closed the request")
        choices, lasts = [], []
        for i, (p, outputs) in enumerate(zip(asked, done, strict=True)):
            if req.max_tokens == 0:
                outputs = [prompt_only(o) for o in outputs]
            sequences = [[o for o in outputs if o.index == j] for j in range(req.n)]
            lasts.append([seq[-1] for seq in sequences])
            prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), None)
            for j, seq in enumerate(sequences):
                choice = _choice(req, p, seq, prompt_logprobs, engine.tokenizer)
                choices.append({"index": i * req.n + j, **choice})
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": now,
            "model": state.model_name,
            "choices": choices,
            "usage": usage(lasts),
        }


async def _collect_all(streams: list[AsyncIterator[Output]]) -> list[list[Output]]:
    """Every output of each stream, the streams run together; one failing (or this being
    cancelled) cancels the others, which aborts their requests."""

    async def collect(stream: AsyncIterator[Output]) -> list[Output]:
        return [out async for out in stream]

    tasks = [asyncio.ensure_future(collect(s)) for s in streams]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


_END = object()


async def _merged(streams: list[AsyncIterator[Output]]) -> AsyncIterator[tuple[int, Output]]:
    """(prompt index, output) of several streams as they come. Closed early, every stream is
    closed (its request aborted); a stream's error (RuntimeError: the engine failed or shuts
    down; ValueError: it refused the request) is raised here."""
    inbox: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Output]) -> None:
        try:
            async for out in stream:
                await inbox.put((i, out))
        except Exception as err:  # raised by the consumer, not lost with this task
            await inbox.put((i, err))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        await inbox.put((i, _END))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            i, item = await inbox.get()
            if item is _END:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _sse(
    streams: list[AsyncIterator[Output]],
    asked: list[Prompt],
    req: CompletionRequest,
    tokenizer: Any,
    completion_id: str,
    created: int,
    model_name: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's text_completion chunk shape, ending with [DONE]; with
    `echo`, a choice's first chunk starts with its prompt's text (and logprobs)."""

    def chunk(choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage_
        return f"data: {json.dumps(body)}\n\n"

    legacy: dict[int, LegacyLogprobs] = {}  # by choice index
    prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}  # by prompt (sequence 0's)
    lasts: dict[int, Output] = {}
    merged = _merged(streams)
    try:
        async for i, out in merged:
            if req.max_tokens == 0:
                out = prompt_only(out)
            index = i * req.n + out.index
            text, pieces = out.text, []
            if out.prompt_logprobs:
                prompt_logprobs[i] = out.prompt_logprobs
            first = index not in legacy
            if first:
                legacy[index] = LegacyLogprobs(tokenizer)
            if req.echo and first:
                text = asked[i].text + text
                if req.logprobs is not None:
                    pieces.append(legacy[index].prompt(asked[i], prompt_logprobs.get(i)))
            if out.finish_reason is not None:
                lasts[index] = out
            if not (text or out.token_ids or out.finish_reason):
                continue
            logprobs = None
            if req.logprobs is not None:
                logprobs = joined([*pieces, legacy[index].output(out)])
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason(out.finish_reason),
            }
            yield chunk([choice])
    except (RuntimeError, ValueError) as err:  # the engine failed, shuts down or refused
        yield stream_error_event("/v1/completions", str(err)).decode()
        return
    finally:
        await merged.aclose()  # type: ignore[attr-defined]
    if include_usage:
        by_prompt = [[lasts[i * req.n + j] for j in range(req.n)] for i in range(len(asked))]
        yield chunk([], usage(by_prompt))
    yield "data: [DONE]\n\n"
