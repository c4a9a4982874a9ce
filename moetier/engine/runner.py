"""Runs the scheduler's steps (engine/scheduler.py) on a native model over a paged KV cache.

A step whose items are all one-token decodes runs as decode rows [R, 1], each row reading its
pages through its page table (the decode kernel on CUDA for GQA); any other step packs every
item's tokens into one row [1, N] (prefill chunks and decodes mixed; models/attention_batch.py).
Only the positions whose next token is sampled go through the LM head. Each request samples
with its own generator (seeded from its SamplingParams), so what it draws does not depend on
which requests share its steps.
"""

from __future__ import annotations

import torch

from moetier.engine.sampler import SamplingParams, sample
from moetier.engine.scheduler import Scheduled, Step
from moetier.loader.loaded_model import LoadedModel
from moetier.models.attention_batch import AttentionBatch
from moetier.models.layers import Attention


class PagedRunner:
    """A native model, its KV cache of `num_pages` pages of `page_size` positions, and the
    per-request sampling generators."""

    def __init__(self, loaded: LoadedModel, num_pages: int, page_size: int) -> None:
        model = loaded.model
        if not hasattr(model, "new_cache"):
            raise ValueError(
                "the paged engine runs native model files (--native); this store's family has none"
            )
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
        self.generators: dict[str, torch.Generator] = {}
        self.positions_run = 0  # positions computed over the runner's life (tests, metrics)

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
        out = {}
        for row, (_, item) in enumerate(sampling):
            request = item.request
            params = request.params if request.params is not None else SamplingParams()
            out[request.id] = int(sample(logits[row : row + 1], params, self._generator(item))[0])
        return out

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self.generators.pop(request_id, None)

    def _generator(self, item: Scheduled) -> torch.Generator | None:
        request = item.request
        seed = getattr(request.params, "seed", None)
        if seed is None:
            return None
        if request.id not in self.generators:
            self.generators[request.id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[request.id]

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
