"""Runs the scheduler's steps (engine/scheduler.py) on a model: `run(step)` computes the step's
positions and returns the token sampled for each item that samples.

`PagedRunner` (native model files): a step whose items are all one-token decodes runs as decode
rows [R, 1], each row reading its pages through its page table (the decode kernel on CUDA for
GQA); on CUDA with every expert pinned, such steps replay a CUDA graph captured per batch bucket
(1, 2, 4 ... 64 rows; padding rows write to a scratch page). Any other step packs every item's
tokens into one row [1, N] (prefill chunks and decodes mixed; models/attention_batch.py), and
only the positions whose next token is sampled go through the LM head. `TransformersRunner`
(the transformers model class): each request its own DynamicCache, its items run one after
another; no prefix cache (its KV is not in pages).
Sampling the step's rows is engine/step_sampler.py's (both runners derive from StepSampler).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from moetier.engine.scheduler import Scheduled, Step
from moetier.engine.step_sampler import StepSampler
from moetier.loader.hf_model import cache_argument
from moetier.loader.loaded_model import LoadedModel
from moetier.models.attention_batch import AttentionBatch
from moetier.models.layers import Attention

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # decode rows a CUDA graph is captured for


class PagedRunner(StepSampler):
    """A native model, its KV cache of `num_pages` pages of `page_size` positions (plus one
    scratch page for padding rows), and the per-request sampling generators."""

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
        self.scratch_page = num_pages  # padding rows of a graphed step write here
        self.cache: torch.Tensor = model.new_cache(
            num_pages + 1, page_size, loaded.dtype, self.device
        )
        first_attention = model.model.layers[0].self_attn
        gqa = isinstance(first_attention, Attention)
        # the decode kernel reads pages itself; SDPA (CPU, MLA) needs them gathered
        self.gather_decode_keys = not (self.device.type == "cuda" and gqa)
        context = int(model.config.max_position_embeddings)
        self.table_width = min(num_pages, -(-context // page_size))
        self.graphs: dict[int, _DecodeGraph] = {}
        self._pool: Any = None
        self.use_graphs = (
            self.device.type == "cuda"
            and loaded.engine_config.cuda_graph
            and gqa
            and self._pin_experts()
        )

    def _pin_experts(self) -> bool:
        """Every expert in a GPU slot for good (fixed slot tables): what a captured step needs.
        False (eager decode steps) when they do not fit."""
        runtime = self.loaded.runtime
        if runtime.pinned:
            return True
        try:
            runtime.pin_all()
        except ValueError as exc:
            print(f"moetier: decode steps without CUDA graphs ({exc})", file=sys.stderr)
            return False
        runtime.residency.host = None  # every blob is on the GPU: free the pinned host copies
        return True

    @torch.inference_mode()
    def run(self, step: Step) -> dict[str, int]:
        """Compute the step's positions; -> the token sampled for each item that samples."""
        items = step.items
        if not items:
            return {}
        self.positions_run += step.num_tokens
        self.loaded.runtime.count_pinned(step.num_tokens)  # no-op unless every expert is pinned
        sampling = [i for i, item in enumerate(items) if item.samples]
        if all(item.count == 1 for item in items):
            logits = self._decode_logits(items)  # [R, V]
            if not sampling:
                return {}
            picked = logits.index_select(0, torch.tensor(sampling, device=self.device))
            return self._sample(picked, [items[i] for i in sampling])
        hidden = self._packed(items)  # [N, H]
        if not sampling:
            return {}
        ends = torch.tensor([item.count for item in items], device=self.device).cumsum(0) - 1
        rows = ends.index_select(0, torch.tensor(sampling, device=self.device))
        logits = self.model.lm_head(hidden.index_select(0, rows))  # [S, V]
        return self._sample(logits, [items[i] for i in sampling])

    def _decode_logits(self, items: list[Scheduled]) -> torch.Tensor:
        rows = len(items)
        bucket = next((b for b in GRAPH_BUCKETS if b >= rows), None)
        if not self.use_graphs or bucket is None:
            ids, positions, table = self._decode_inputs(items, rows, None)
            batch = AttentionBatch.decode(
                positions, table, self.page_size, with_keys=self.gather_decode_keys
            )
            return self.model.lm_head(self.model.model(ids, positions, self.cache, batch)[:, 0])
        graph = self.graphs.get(bucket)
        fresh = graph is None
        if graph is None:
            graph = _DecodeGraph(bucket, self.table_width, self.device)
        ids, positions, table = self._decode_inputs(items, bucket, self.table_width)
        graph.ids.copy_(ids)
        graph.positions.copy_(positions)
        graph.table.copy_(table)
        if fresh:
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            try:
                graph.capture(self._graph_step, self._pool)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                print(f"moetier: decode steps without CUDA graphs ({exc})", file=sys.stderr)
                self.use_graphs = False  # eager from now on; this step too
                return self._decode_logits(items)
            self.graphs[bucket] = graph
        return graph.replay()[:rows]

    def _graph_step(self, ids: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> Any:
        batch = AttentionBatch.decode(positions, table, self.page_size, with_keys=False)
        return self.model.lm_head(self.model.model(ids, positions, self.cache, batch)[:, 0])

    def _decode_inputs(
        self, items: list[Scheduled], rows: int, width: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[rows, 1] ids and positions and the [rows, width] page table of decode rows; rows past
        the items (padding) read and write the scratch page at position 0."""
        width = width or max(len(item.request.pages) for item in items)
        pad = self.scratch_page
        table = [item.request.pages + [pad] * (width - len(item.request.pages)) for item in items]
        table += [[pad] * width] * (rows - len(items))
        positions = [[item.start] for item in items] + [[0]] * (rows - len(items))
        ids = [[item.request.tokens[item.start]] for item in items] + [[0]] * (rows - len(items))
        device = self.device
        return (
            torch.tensor(ids, device=device),
            torch.tensor(positions, device=device),
            torch.tensor(table, dtype=torch.int32, device=device),
        )

    def _packed(self, items: list[Scheduled]) -> torch.Tensor:
        spans = [(item.start, item.count, item.request.pages) for item in items]
        batch = AttentionBatch.packed(spans, self.page_size, self.device)
        tokens = [t for item in items for t in item.request.tokens[item.start :][: item.count]]
        ids = torch.tensor([tokens], device=self.device)
        return self.model.model(ids, batch.positions, self.cache, batch)[0]


class _DecodeGraph:
    """One batch bucket's captured decode step: static inputs, the graph, its logits."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.ids = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.graph: Any = None
        self.logits: torch.Tensor | None = None

    def capture(self, step: Callable[..., torch.Tensor], pool: Any) -> None:
        """Warm up on a side stream (the same entries the replays write), then capture."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(self.ids, self.positions, self.table)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = step(self.ids, self.positions, self.table)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        assert self.logits is not None
        return self.logits


class TransformersRunner(StepSampler):
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
        self.cache_arg = cache_argument(self.model)

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

    def forget_kv(self, request_id: str) -> None:
        self.caches.pop(request_id, None)
