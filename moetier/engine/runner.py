"""Runs the scheduler's steps (engine/scheduler.py) on a model: `run(step)` computes the step's
positions and returns the token sampled for each item that samples.

`PagedRunner` (native model files): a step whose items are all one-token decodes runs as decode
rows [R, 1], each row reading its pages through its page table (the decode kernel on CUDA for
GQA); any other step packs every item's tokens into one row [1, N] (prefill chunks and decodes
mixed; models/attention_batch.py). Only the positions whose next token is sampled go through
the LM head. `TransformersRunner` (the transformers model class): each request its own
DynamicCache, its items run one after another; no prefix cache (its KV is not in pages).
Each request samples with its own generator (seeded from its SamplingParams), so what it draws
does not depend on which requests share its steps.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from moetier.engine.sampler import SamplingParams, sample
from moetier.engine.scheduler import Scheduled, Step
from moetier.loader.loaded_model import LoadedModel
from moetier.models.attention_batch import AttentionBatch
from moetier.models.layers import Attention


class _Sampling:
    """Per-request generators and the sampling of one step's rows."""

    device: torch.device

    def __init__(self) -> None:
        self.generators: dict[str, torch.Generator] = {}
        self.positions_run = 0  # positions computed over the runner's life (tests, metrics)

    def release(self, request_id: str) -> None:
        """Forget a finished or preempted-for-good request's state."""
        self.generators.pop(request_id, None)

    def _sample(self, logits: torch.Tensor, items: list[Scheduled]) -> dict[str, int]:
        """logits [S, V], one row per item (in order) -> request id -> token."""
        out = {}
        for row, item in enumerate(items):
            request = item.request
            params = request.params if request.params is not None else SamplingParams()
            generator = self._generator(request.id, getattr(params, "seed", None))
            out[request.id] = int(sample(logits[row : row + 1], params, generator)[0])
        return out

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if request_id not in self.generators:
            self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[request_id]


class PagedRunner(_Sampling):
    """A native model, its KV cache of `num_pages` pages of `page_size` positions, and the
    per-request sampling generators."""

    def __init__(self, loaded: LoadedModel, num_pages: int, page_size: int) -> None:
        model = loaded.model
        if not hasattr(model, "new_cache"):
            raise ValueError(
                "the paged engine runs native model files (--native); this store's family has none"
            )
        super().__init__()
        self.loaded = loaded
        self.model = model
        self.device = loaded.device
        self.page_size = page_size
        self.cache: torch.Tensor = model.new_cache(num_pages, page_size, loaded.dtype, self.device)
        first_attention = model.model.layers[0].self_attn
        # the decode kernel reads pages itself; SDPA (CPU, MLA) needs them gathered
        self.gather_decode_keys = not (
            self.device.type == "cuda" and isinstance(first_attention, Attention)
        )

    @torch.inference_mode()
    def run(self, step: Step) -> dict[str, int]:
        """Compute the step's positions; -> the token sampled for each item that samples."""
        items = step.items
        if not items:
            return {}
        if all(item.count == 1 for item in items):
            hidden = self._decode_rows(items)  # [R, H]
            last = list(range(len(items)))
        else:
            hidden = self._packed(items)  # [N, H]
            ends, total = [], 0
            for item in items:
                total += item.count
                ends.append(total - 1)
            last = ends
        self.positions_run += step.num_tokens
        self.loaded.runtime.count_pinned(step.num_tokens)  # no-op unless every expert is pinned
        sampling = [(i, item) for i, item in enumerate(items) if item.samples]
        if not sampling:
            return {}
        rows = torch.tensor([last[i] for i, _ in sampling], device=self.device)
        logits = self.model.lm_head(hidden.index_select(0, rows))  # [S, V]
        return self._sample(logits, [item for _, item in sampling])

    def _decode_rows(self, items: list[Scheduled]) -> torch.Tensor:
        device = self.device
        width = max(len(item.request.pages) for item in items)
        table = torch.tensor(
            [item.request.pages + [0] * (width - len(item.request.pages)) for item in items],
            dtype=torch.int32,
            device=device,
        )
        positions = torch.tensor([[item.start] for item in items], device=device)
        ids = torch.tensor([[item.request.tokens[item.start]] for item in items], device=device)
        batch = AttentionBatch.decode(
            positions, table, self.page_size, with_keys=self.gather_decode_keys
        )
        return self.model.model(ids, positions, self.cache, batch)[:, 0]

    def _packed(self, items: list[Scheduled]) -> torch.Tensor:
        spans = [(item.start, item.count, item.request.pages) for item in items]
        batch = AttentionBatch.packed(spans, self.page_size, self.device)
        tokens = [t for item in items for t in item.request.tokens[item.start :][: item.count]]
        ids = torch.tensor([tokens], device=self.device)
        return self.model.model(ids, batch.positions, self.cache, batch)[0]


class TransformersRunner(_Sampling):
    """The transformers model class, a DynamicCache per request; a step's items run one after
    another (batched only in the scheduler's sense). Needs the page pool without prefix caching:
    a request's KV is in its own cache, not in pages."""

    prefix_caching = False

    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__()
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.caches: dict[str, Any] = {}
        # transformers 5.24 names the forward's cache `cache`, earlier ones `past_key_values`
        params = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def run(self, step: Step) -> dict[str, int]:
        from transformers import DynamicCache

        sampling: list[Scheduled] = []
        logits = []
        for item in step.items:
            request = item.request
            if item.start == 0:  # a new request, or one preempted and recomputed
                self.caches[request.id] = DynamicCache(config=self.model.config)
            cache = self.caches.get(request.id)
            if cache is None:
                raise RuntimeError(f"request {request.id} resumes at {item.start} with no cache")
            ids = request.tokens[item.start : item.start + item.count]
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_arg: cache},
            )
            if item.samples:
                sampling.append(item)
                logits.append(out.logits[0, -1])
        self.positions_run += step.num_tokens
        if not sampling:
            return {}
        return self._sample(torch.stack(logits), sampling)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.caches.pop(request_id, None)
