"""The generation loop: prefill, then one token at a time with a KV cache; streaming text out.

One sequence (or `stream_rows`' fixed batch) at a time; many requests over a paged cache are
engine/engine.py's. Runs the transformers model with a DynamicCache, or a native model
(`--native`) with its static KV cache. Stops at an end-of-sequence token, a stop string (never
emitted), or `max_new_tokens`. `stream_rows` decodes several sequences together for a fixed
number of tokens (what `moetier bench` times). Each stream times itself (`Generator.timing`,
engine/timing.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from moetier.engine.detokenizer import StreamingDetokenizer, end_token_ids
from moetier.engine.graph_placement import ZeroCopyRebalance, place_for_graphs
from moetier.engine.prompts import chat_prompt_ids
from moetier.engine.sampler import SamplingParams, sample
from moetier.engine.static_decode import StaticDecoder
from moetier.engine.timing import GenerationTiming, TokenClock
from moetier.loader.hf_model import cache_argument
from moetier.loader.loaded_model import LoadedModel

# CUDA-graph decode: context-length buckets are powers of two from this size; the decoders
# (each with its own KV cache) of this many buckets are kept between requests.
GRAPH_MIN_BUCKET = 256
GRAPH_BUCKETS_KEPT = 2


@dataclass(frozen=True)
class Delta:
    """A piece of streamed output. The last one carries finish_reason ("stop" or "length")."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int


class Generator:
    """Generates text from a loaded model."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.eos_ids, self.chat_end_ids = end_token_ids(loaded)
        self.max_context: int | None = getattr(self.model.config, "max_position_embeddings", None)
        # CUDA-graph decode (native models on CUDA with every expert pinned): one StaticDecoder
        # and graph per (rows, context-length bucket), kept for the next request
        self.graphs = self._can_graph()
        self._decoders: dict[
            tuple[int, int], tuple[StaticDecoder, Callable[[], torch.Tensor] | None]
        ] = {}
        self._busy = False  # a graphed stream is running (its decoder's cache is in use)
        self._rebalance = ZeroCopyRebalance(loaded.runtime)
        self.timing = GenerationTiming(rows=1, prompt_tokens=0)  # the last stream's, as it runs

    def _can_graph(self) -> bool:
        engine = self.loaded.engine_config
        if not (engine.cuda_graph and self.loaded.device.type == "cuda"):
            return False
        return hasattr(self.model, "new_cache") and place_for_graphs(self.loaded)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise ValueError for a prompt the model cannot take (empty, or no room to generate)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if self.max_context is not None and len(prompt_ids) >= self.max_context:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                f"{self.max_context} tokens: shorten it"
            )

    def chat_prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages, tools)

    def prompt_ids(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    @torch.inference_mode()
    def stream(
        self, prompt_ids: list[int], params: SamplingParams, *, chat: bool = False
    ) -> Iterator[Delta]:
        """Yield text deltas as tokens are generated; the last delta has a finish_reason."""
        self.check_prompt(prompt_ids)
        device = self.loaded.device
        stop_ids = self.chat_end_ids if chat else self.eos_ids
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        detok = StreamingDetokenizer(self.tokenizer, params.stop)
        unsent: list[int] = []  # tokens whose text is not out yet (partial UTF-8, held back)
        finish = "length"
        budget = params.max_new_tokens
        if self.max_context is not None:
            budget = min(
                budget, self.max_context - len(prompt_ids)
            )  # stop when the context is full
        clock = TokenClock(1, len(prompt_ids))
        self.timing = clock.timing
        forward = self._forward_fn(len(prompt_ids) + budget)
        self._busy = self.graphs
        try:
            input_ids = prompt_ids
            for _ in range(budget):
                token = int(sample(forward([input_ids]), params, generator)[0])
                clock.tokens_out()
                self._after_step(len(input_ids), len(input_ids))
                if token in stop_ids:
                    finish = "stop"
                    break
                unsent.append(token)
                text, stopped = detok.push(token)
                if text:
                    yield Delta(text, tuple(unsent))
                    unsent = []
                if stopped:
                    finish = "stop"
                    break
                input_ids = [token]
            yield Delta("" if detok.stopped else detok.flush(), tuple(unsent), finish)
        finally:  # also when the consumer closes the stream early
            self._busy = False

    @torch.inference_mode()
    def stream_rows(self, prompts: list[list[int]], new_tokens: int) -> Iterator[list[int]]:
        """Greedy decode of `prompts` as one batch (one forward per step for all rows) for
        exactly `new_tokens` tokens a row, end-of-sequence tokens included (a benchmark's fixed
        length): yields each step's tokens, one per row; `timing` as `stream`'s. Prompts of
        different lengths need a native model (right-padded prefill)."""
        if not prompts or new_tokens < 1:
            raise ValueError("stream_rows takes at least one prompt and one new token")
        for prompt_ids in prompts:
            self.check_prompt(prompt_ids)
        longest = max(len(p) for p in prompts)
        if self.max_context is not None and longest + new_tokens > self.max_context:
            raise ValueError(
                f"{longest} prompt tokens + {new_tokens} new tokens exceed this model's context "
                f"of {self.max_context} tokens: ask for fewer"
            )
        greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0)
        clock = TokenClock(len(prompts), sum(len(p) for p in prompts))
        self.timing = clock.timing
        forward = self._forward_fn(longest + new_tokens, len(prompts))
        self._busy = self.graphs
        try:
            rows = prompts
            for _ in range(new_tokens):
                tokens = sample(forward(rows), greedy, None).tolist()
                clock.tokens_out()
                self._after_step(sum(len(r) for r in rows), longest if rows is prompts else 1)
                yield tokens
                rows = [[token] for token in tokens]
        finally:
            self._busy = False

    def _after_step(self, tokens: int, tokens_per_row: int) -> None:
        """Bookkeeping after a forward of `tokens` tokens in all (graph_placement.py): the
        pinned path's pairs and, in graphed zero-copy decode, the moves of the hot set."""
        self._rebalance.step(tokens, prefill=tokens_per_row > 1)

    def _forward_fn(self, max_len: int, rows: int = 1) -> Callable[[list[list[int]]], torch.Tensor]:
        """A function that takes each row's prompt, then one token per row per call -> logits
        [rows, V] of each row's last token: the native model's static cache (models/layers.py)
        or a transformers DynamicCache (prompts of one length)."""
        device = self.loaded.device
        if self.graphs:
            return self._graphed_fn(max_len, rows)
        if hasattr(self.model, "new_cache"):  # a native model file
            decoder = StaticDecoder(self.model, rows, max_len, self.loaded.dtype, device)

            def native(ids: list[list[int]]) -> torch.Tensor:
                if decoder.cache_used:
                    return decoder.step(torch.tensor(ids, device=device)[:, 0])
                return decoder.prefill(ids)

            return native
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        cache_arg = cache_argument(self.model)

        def hf(ids: list[list[int]]) -> torch.Tensor:
            if len({len(row) for row in ids}) > 1:
                raise ValueError(
                    "the transformers model class decodes rows together only from prompts of "
                    "one length: use --native for prompts of different lengths"
                )
            out = self.model(
                input_ids=torch.tensor(ids, device=device),
                use_cache=True,
                logits_to_keep=1,
                **{cache_arg: cache},
            )
            return out.logits[:, -1]

        return hf

    def _graphed_fn(self, max_len: int, rows: int = 1) -> Callable[[list[list[int]]], torch.Tensor]:
        """Like the native path of `_forward_fn`, each decode step replayed from the CUDA graph
        of `rows` rows and the smallest bucket (a power of two >= 256 positions) that holds
        `max_len`."""
        if self._busy:
            raise RuntimeError(
                "another generation is still running on this Generator (its KV caches are "
                "shared): finish or close that stream first (the server serialises requests)"
            )
        bucket = max(GRAPH_MIN_BUCKET, 1 << (max_len - 1).bit_length())
        if self.max_context is not None:
            bucket = max(max_len, min(bucket, self.max_context))  # no cache past the context
        key = (rows, bucket)
        if key in self._decoders:
            self._decoders[key] = self._decoders.pop(key)  # most recently used last
        else:
            while len(self._decoders) >= GRAPH_BUCKETS_KEPT:  # free the least recently used
                del self._decoders[next(iter(self._decoders))]
            decoder = StaticDecoder(
                self.model, rows, bucket, self.loaded.dtype, self.loaded.device,
                compile_step=self.loaded.engine_config.compile_decode,
            )  # fmt: skip
            self._decoders[key] = (decoder, None)
        decoder, replay = self._decoders[key]
        decoder.cache_used = False  # a new request: prefill overwrites the cache from 0
        device = self.loaded.device

        def graphed(ids: list[list[int]]) -> torch.Tensor:
            nonlocal replay
            if not decoder.cache_used:
                return decoder.prefill(ids)
            decoder.input_ids.copy_(torch.tensor(ids, device=device))  # [rows, 1]
            if replay is None:
                replay = decoder.capture()
                self._decoders[key] = (decoder, replay)
            return replay()

        return graphed

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, chat: bool = False
    ) -> Completion:
        pieces: list[str] = []
        ids: list[int] = []
        finish = "length"
        for delta in self.stream(prompt_ids, params, chat=chat):
            pieces.append(delta.text)
            ids.extend(delta.token_ids)
            finish = delta.finish_reason or finish
        return Completion("".join(pieces), ids, finish, len(prompt_ids))
