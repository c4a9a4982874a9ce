"""Runs the scheduler's steps (engine/scheduler.py) on a model: `run(step)` computes the step's
positions and returns what it sampled (engine/step_sampler.py's `Sampled`: the token of each
item that samples, and the logprobs and prompt logprobs its request asks for).

`PagedRunner` (native model files): a step whose items are all one-token decodes runs as decode
rows [R, 1], each row reading its pages through its page table (the decode kernels on CUDA
where the attention has `pages_in_kernel`: GQA and MLA; the keys gathered from the pages
elsewhere); on CUDA with the experts placed for graphs, such steps replay a CUDA graph captured
per (batch bucket, context bucket) (engine/decode_graphs.py: 1, 2, 4 ... 64 rows, padding rows
on a scratch page; where keys are gathered, a page-table width from a geometric ladder that holds
every row's position, else the whole table). Speculative decoding's steps (a request's last
token and its k drafts) replay the same graphs where a batch bucket holds their tokens: each
token a decode row of its request's page table at its own position, the step's K/V rows all
written before any row attends (each layer writes, then attends), so a draft's row sees the
rows before it (`_rows_step`). Any other step packs every item's tokens into one row [1, N]
(prefill chunks and decodes mixed; models/attention_batch.py), compiled where
engine/prefill_compile.py applies, its attention through the sequences' page tables where
`paged_prefill` (kernels/prefill_attention.py), and only the positions whose next token is
sampled (and those whose prompt logprobs a request asks for) go through the LM head.
`TransformersRunner` (the transformers model class): each request its own DynamicCache, its
items run one after another; no prefix cache (its KV is not in pages).
Sampling the step's rows is engine/step_sampler.py's (both runners derive from StepSampler).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moetier.core.paths import cache_root
from moetier.engine import decode_graphs, prefill_compile
from moetier.engine.decode_graphs import (
    BATCH_BUCKETS,
    DecodeGraph,
    DecodeGraphs,
    bucket_of,
    context_ladder,
)
from moetier.engine.gate_rows import GateRows
from moetier.engine.graph_placement import ZeroCopyRebalance, place_for_graphs
from moetier.engine.prefill_compile import CompiledPrefill
from moetier.engine.sampler import filtered_rows, sampling_tensors, to_device
from moetier.engine.scheduler import Scheduled, Step
from moetier.engine.speculative import (
    MTPDrafter,
    rejection_rows,
    verify_greedy,
    verify_sampled,
)
from moetier.engine.step_sampler import Sampled, StepSampler
from moetier.loader.hf_model import cache_argument
from moetier.loader.loaded_model import LoadedModel
from moetier.models import layers
from moetier.models.attention_batch import AttentionBatch

GRAPH_BUCKETS = BATCH_BUCKETS  # decode rows a CUDA graph is captured for


class PagedRunner(StepSampler):
    """A native model, its KV cache of `num_pages` pages of `page_size` positions (plus one
    scratch page for padding rows), and the per-request sampling generators."""

    def __init__(
        self, loaded: LoadedModel, num_pages: int, page_size: int, max_rows: int = 64
    ) -> None:
        """max_rows: the most decode rows a step has (the scheduler's max_num_seqs): the CUDA
        graphs of the buckets up to it are captured (and compiled) here, at load."""
        model = loaded.model
        if not hasattr(model, "new_cache"):
            raise ValueError(
                "the paged engine runs native model files (--native); this store's family has none"
            )
        super().__init__()
        self.loaded = loaded
        self.model = model
        self.device = loaded.device
        gate = loaded.runtime.gate
        self.gate_rows = GateRows(gate, self.device) if gate is not None else None
        self.page_size = page_size
        self.max_rows = max_rows
        self.scratch_page = num_pages  # padding rows of a graphed step write here
        self.cache: torch.Tensor = model.new_cache(
            num_pages + 1, page_size, loaded.dtype, self.device
        )
        # the decode kernels (GQA's, MLA's) read pages themselves; SDPA (CPU, glm_moe_dsa's
        # indexer, deepseek_v4, gpt_oss) needs them gathered: over a context bucket's width
        in_kernel = all(
            getattr(layer.self_attn, "pages_in_kernel", False) for layer in model.model.layers
        )
        self.gather_decode_keys = not (self.device.type == "cuda" and in_kernel)
        # packed steps read the pages through the sequences' tables (kernels/
        # prefill_attention.py) where every layer's attention can (CPU tests set it: the
        # interpreter), else keys gathered and a mask
        self.paged_prefill = (
            layers.PAGED_PREFILL_KERNEL
            and self.device.type == "cuda"
            and all(getattr(layer.self_attn, "prefill_reads_pages", False)
                    for layer in model.model.layers)
        )  # fmt: skip
        context = int(model.config.max_position_embeddings)
        self.table_width = min(num_pages, -(-context // page_size))
        first = -(-decode_graphs.FIRST_CONTEXT_TOKENS // page_size)
        self._ladder = context_ladder(first, self.table_width)
        self.graphs: DecodeGraphs[DecodeGraph] = DecodeGraphs()
        self._pool: Any = None
        self.use_graphs = (
            self.device.type == "cuda"
            and loaded.engine_config.cuda_graph
            and place_for_graphs(loaded)  # experts pinned, or zero-copy from host RAM
        )
        # decode steps on the graphs' fixed-shape inputs, keyed as the graphs are, without
        # capturing them: run eagerly (CPU tests set it; CUDA graphs imply it)
        self.fixed_shapes = False
        self.ahead_moved = 0  # steps launched ahead on a wider context bucket than the last
        self._rebalance = ZeroCopyRebalance(loaded.runtime)
        # the graphed step through torch.compile (inductor fuses the norms, rotary and residual
        # adds), compiled at warm-up and kept in inductor's disk cache
        self._step_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self._graph_step
        # launch the next decode step before the host handles this one's tokens (run's
        # `lookahead`): where steps are CUDA graphs (eager steps: tests set it)
        self.lookahead = self.use_graphs and loaded.engine_config.lookahead
        self._ahead: _Ahead | None = None
        self.ahead_launched = self.ahead_taken = 0  # steps launched ahead, and those used
        self._compiled = False
        # speculative decoding with the model's MTP layer (enable_speculative)
        self.drafter: MTPDrafter | None = None
        # steps with drafts run on a graph's fixed-shape inputs (replayed from the CUDA graph
        # where graphs are on), and those run packed (more rows than the largest bucket, a
        # prompt chunk among them, no graphs)
        self.verify_graphed = self.verify_packed = 0
        self.buckets: tuple[int, ...] = GRAPH_BUCKETS  # (speculative decoding adds some)
        # seconds each decode graph took to capture, its first one's compile included
        self.capture_seconds: dict[tuple[int, int], float] = {}
        if self.use_graphs and loaded.engine_config.compile_decode:
            self.compile_step()
        self.warm_up_seconds = self.warm_up(max_rows)
        # packed steps (prefill chunks) through torch.compile (engine/prefill_compile.py)
        self.prefill: CompiledPrefill | None = None
        if self.use_graphs and loaded.engine_config.compile_prefill:
            why = prefill_compile.refusal(loaded, with_gate=self.gate_rows is not None)
            if why is None:
                try:
                    self.warm_up_seconds += self.compile_prefill()
                except prefill_compile.COMPILE_ERRORS as exc:  # (eager prefill steps)
                    print(f"moetier: prefill steps run eagerly: compiling them failed "
                          f"({type(exc).__name__}: {exc})", file=sys.stderr)  # fmt: skip
                    self.prefill = None

    def enable_speculative(self, drafts: int = 0) -> MTPDrafter:
        """Draft with the model's MTP layer (engine/speculative.py), `drafts` a step: every
        step then keeps the final hidden states the layer reads. Steps whose items are each one
        token and its drafts run as decode rows (a token a row) on the graphs of the batch
        buckets that hold them (those up to max_rows x (drafts + 1) rows captured now), others
        packed. No steps launched ahead: the next step's tokens are known only after drafting."""
        if getattr(self.model, "mtp", None) is None:
            raise ValueError(
                "speculative decoding drafts with the model's MTP layer, and none is loaded: "
                "load the store's with --mtp (a checkpoint that ships one), or give --mtp-file"
            )
        self.drafter = MTPDrafter(self.model, self.page_size, self.device)
        self.drafter.layout = self  # drafting on fixed shapes where the steps are
        self.lookahead = False
        # verify steps of n requests are n x (k + 1) rows: buckets of those sizes too, so that
        # batch 1 with k = 2 runs 3 rows, not 4 (a padding row routes to experts of its own)
        rows = drafts + 1
        extra = {rows * b for b in GRAPH_BUCKETS if rows * b <= GRAPH_BUCKETS[-1]}
        self.buckets = tuple(sorted(set(GRAPH_BUCKETS) | extra))
        if self.use_graphs:
            began = time.perf_counter()
            width = self.context_buckets[0]
            for bucket in self.buckets:
                if (bucket, width) not in self.graphs and (bucket, width) not in self.graphs.failed:
                    self._capture(bucket, width)
                if bucket >= self.max_rows * (drafts + 1):
                    break
            self.warm_up_seconds += time.perf_counter() - began
        return self.drafter

    def release(self, request_id: str) -> None:
        super().release(request_id)
        if self.drafter is not None:
            self.drafter.forget(request_id)

    def forget_kv(self, request_id: str) -> None:
        if self.drafter is not None:
            self.drafter.forget(request_id)

    def compile_step(self) -> None:
        """Run the fixed-shape decode steps through torch.compile (the CUDA graphs' default;
        CPU tests call it): automatic dynamic shapes, so bucket 1 compiles as is and the second
        batch bucket recompiles with a symbolic row count that every larger one reuses; the
        page-table width is marked dynamic where the context buckets vary, so wider buckets
        reuse those two compilations."""
        use_compile_cache()
        self._compiled = True
        self._step_fn = torch.compile(self._graph_step)

    def compile_prefill(self) -> float:
        """Run packed steps of two tokens or more through torch.compile, compiled now on a
        dummy step (engine/prefill_compile.py; CPU tests call it) -> seconds it took."""
        print("moetier: compiling the prefill step", file=sys.stderr, flush=True)
        use_compile_cache()
        self.prefill = CompiledPrefill(self.model.model)
        vocab = int(self.model.config.vocab_size)
        return self.prefill.warm_up(
            vocab, self.scratch_page, self.page_size, self.cache, self.paged_prefill
        )

    @property
    def context_buckets(self) -> tuple[int, ...]:
        """The page-table widths a decode step's inputs take: the ladder where keys are
        gathered, else one width (the whole table: the kernels read only a row's own pages)."""
        return self._ladder if self.gather_decode_keys else (self.table_width,)

    def warm_up(self, max_rows: int) -> float:
        """Capture (and compile) every batch bucket's decode graph up to `max_rows` rows at the
        smallest context bucket now, padding rows only (they write the scratch page), so the
        first requests find them ready (wider context buckets are captured when a step first
        needs them). -> seconds spent. Nothing to do without CUDA graphs."""
        began = time.perf_counter()
        if not self.use_graphs:
            return 0.0
        width = self.context_buckets[0]
        last = bucket_of(self.buckets, max_rows) or self.buckets[-1]
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") if self._compiled else None
        print(
            f"moetier: {'compiling and capturing' if cache else 'capturing'} the decode step for "
            + ("1 row" if last == 1 else f"1 to {last} rows")
            + (f" (torch.compile's cache: {cache})" if cache else ""),
            file=sys.stderr,
            flush=True,
        )
        for bucket in self.buckets:
            if (bucket, width) not in self.graphs and self._capture(bucket, width) is None:
                self.use_graphs = False  # not even the smallest step captures: eager steps
                break
            if bucket >= max_rows:
                break
        return time.perf_counter() - began

    @torch.inference_mode()
    def run(self, step: Step, lookahead: bool = False) -> Sampled:
        """Compute the step's positions; -> the token sampled for each item that samples (and
        the logprobs asked for, prompt logprobs from every prompt position that gives one).

        lookahead (the engine expects the same rows to decode next): with `self.lookahead`, a
        decode step whose every row samples launches the next step of the same rows (each
        row's sampled token at its next position, where its pages already hold it) before its
        tokens come back to the host, so the device computes step N + 1 while the engine
        handles step N. The next `run` takes that step's logits if its rows are among the
        launched ones (a row that finished meanwhile is dropped), else discards them: what
        the launched step wrote is the KV of tokens already sampled, at their positions."""
        items = step.items
        if not items:
            self._ahead = None
            return Sampled()
        self.positions_run += step.num_tokens
        # (speculative decoding: steps keep their hidden states, below)
        decoding = all(item.count == 1 for item in items) and self.drafter is None
        # speculative decoding: the step's tokens as rows of a graph's inputs (None: packed)
        graph = self._rows_graph(items) if self.drafter is not None else None
        # the pinned path's pairs; zero-copy: the hot set moves between steps
        self._rebalance.step(step.num_tokens, prefill=not decoding and graph is None)
        sampling = [i for i, item in enumerate(items) if item.samples]
        spans = self.prompt_spans(items)
        if decoding:
            logits, launch = self._decode_logits(items)  # [R, V]
            if not sampling and not spans:
                return Sampled()
            every_row_samples = len(sampling) == len(items) and not spans
            if lookahead and self.lookahead and launch is not None and every_row_samples:
                pending = self._sample_start(logits, items)
                self._launch_ahead(items, launch, pending.tokens)
                return self._sample_finish(pending)
            picked = logits
            if len(sampling) < len(items):
                picked = logits.index_select(0, to_device(sampling, self.device))
            prompt = None
            if spans:  # a one-position prompt chunk: its row gives that prompt logprob
                prompt = logits.index_select(0, to_device([s.item for s in spans], self.device))
            return self._sample(picked, [items[i] for i in sampling], prompt, spans)
        self._ahead = None
        every: torch.Tensor | None = None  # the logits of every token (a graph's rows)
        if graph is not None:
            every, hidden = self._rows_step(items, graph)  # [N, V], [N, H]
        else:
            if self.gate_rows is not None:
                self.gate_rows.set_step(items, per_token=True)
            hidden = self._packed(items)  # [N, H]
        if any(item.drafts for item in items):
            if graph is not None:
                self.verify_graphed += 1
            else:
                self.verify_packed += 1
        head = functools.partial(self._head, hidden, every)
        starts = [0]
        for item in items:
            starts.append(starts[-1] + item.count)
        if self.drafter is not None:  # what the MTP layer reads after this step
            for i, item in enumerate(items):
                self.drafter.keep(item.request.id, item.start, hidden[starts[i] : starts[i + 1]])
        if not sampling and not spans:
            return Sampled()
        verify = [i for i in sampling if items[i].drafts]
        plain = [i for i in sampling if not items[i].drafts]
        rows = [starts[i + 1] - 1 for i in plain]
        rows += [starts[s.item] + s.start - items[s.item].start + j for s in spans
                 for j in range(s.count)]  # fmt: skip
        result = Sampled()
        if plain or spans:
            logits = head(rows)  # [S + P, V]: the sampling rows, then the prompt logprob rows
            picked, prompt = logits[: len(plain)], logits[len(plain) :]
            result = self._sample(picked, [items[i] for i in plain], prompt, spans)
        if verify:
            self._verify([items[i] for i in verify], head, [starts[i + 1] for i in verify],
                         result)  # fmt: skip
        return result

    def _head(
        self, hidden: torch.Tensor, every: torch.Tensor | None, rows: list[int]
    ) -> torch.Tensor:
        """The logits of the step's token rows `rows`: taken from `every` (a graph step's, all
        rows) where there, else the LM head over those rows of `hidden`."""
        index = to_device(rows, self.device, torch.int64)
        if every is not None:
            return every.index_select(0, index)
        return self.model.head(hidden.index_select(0, index))

    def _verify(
        self,
        items: list[Scheduled],
        head: Callable[[list[int]], torch.Tensor],
        ends: list[int],
        result: Sampled,
    ) -> None:
        """Items with drafts: the target's logits at the last token's position and each
        draft's (`head` of the step's token rows) -> the drafts kept and the token after them
        (greedy: the longest agreeing prefix; sampled: speculative sampling,
        engine/speculative.py), one read back."""
        assert self.drafter is not None
        rows = [end - item.drafts - 1 + j for item, end in zip(items, ends, strict=True)
                for j in range(item.drafts + 1)]  # fmt: skip
        logits = head(rows)
        back: list[torch.Tensor] = []  # per item: greedy choices, or accepts and tokens
        at = 0
        for item in items:
            params = item.request.params
            rows_of = logits[at : at + item.drafts + 1]
            at += item.drafts + 1
            if params.temperature == 0:
                back.append(rows_of.argmax(dim=-1))
                continue
            settings = sampling_tensors([params] * (item.drafts + 1), self.device)
            sort = params.top_k > 0 or params.top_p < 1
            probs = filtered_rows(rows_of, *settings, sort=sort).softmax(dim=-1)
            proposed = to_device(item.request.drafts[: item.drafts], self.device, torch.int64)
            generator = None
            if params.seed is not None:
                generator = self._generator(item.request.id, params.seed)
            accept, tokens = rejection_rows(probs, proposed, generator)
            back.append(torch.cat([accept.long(), tokens]))
        host = torch.cat(back).tolist() if back else []
        at = 0
        last_rows, row = [], 0  # per item: the logits row its token after the kept drafts is of
        for item in items:
            request, k = item.request, item.drafts
            replayed = self.drafter.replayed(k)  # (benchmarks on random weights)
            if request.params.temperature == 0:
                choices = host[at : at + k + 1]
                kept, token = verify_greedy(request.drafts[:k], choices)
                if replayed is not None:
                    kept, token = request.drafts[:replayed], choices[replayed]
                at += k + 1
            else:
                flags = [bool(v) for v in host[at : at + k]]
                if replayed is not None:
                    flags = [j < replayed for j in range(k)]
                kept, token = verify_sampled(request.drafts[:k], flags,
                                             host[at + k : at + 2 * k + 1])  # fmt: skip
                at += 2 * k + 1
            result.tokens[request.id] = token
            result.accepted[request.id] = kept
            last_rows.append(row + len(kept))
            row += k + 1
            self.drafter.stats.add(k, len(kept))
        if self.gate_rows is not None:  # the confidence gate's next step reads these rows' tops
            picked = to_device(last_rows, self.device, torch.int64)
            self.gate_rows.observe(logits.index_select(0, picked), items)

    def _decode_logits(self, items: list[Scheduled]) -> tuple[torch.Tensor, _Launch | None]:
        """-> the logits [R, V] of the decode rows, and the inputs they ran on where those are
        exactly the rows (None: they came from a step launched ahead with more rows)."""
        rows = len(items)
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            taken = ahead.rows_of(items)
            self.ahead_taken += taken is not None
            if taken == list(range(ahead.count)):
                return ahead.logits[:rows], ahead.launch
            if taken is not None:
                return ahead.logits.index_select(0, to_device(taken, self.device)), None
        bucket = bucket_of(self.buckets, rows)
        if (self.use_graphs or self.fixed_shapes) and bucket is not None:
            needed = max(item.start // self.page_size + 1 for item in items)
            graph = self._graph(bucket, needed)
            if graph is not None:
                pages = self._decode_inputs(items, *graph.host_inputs())
                forced = graph.host_forced()
                if self.gate_rows is not None and forced is not None:
                    assert graph.confidence is not None
                    self.gate_rows.stage(items, forced, graph.confidence)
                graph.stage()
                launch = _Launch(graph.ids, graph.positions, graph.table, graph.replay, pages, True,
                                 graph.confidence)  # fmt: skip
                return launch.run()[:rows], launch
        width = max(len(item.request.pages) for item in items)
        ids, positions = torch.empty(2, rows, 1, dtype=torch.int64).unbind(0)
        table = torch.empty(rows, width, dtype=torch.int32)
        pages = self._decode_inputs(items, ids.numpy(), positions.numpy(), table.numpy())
        ids, positions, table = (t.to(self.device) for t in (ids, positions, table))
        if self.gate_rows is not None:
            self.gate_rows.set_step(items, per_token=False)
        step = functools.partial(self._eager_step, ids, positions, table)
        launch = _Launch(ids, positions, table, step, pages)
        return launch.run(), launch

    def _rows_graph(self, items: list[Scheduled]) -> DecodeGraph | None:
        """Speculative decoding: the graph (or, `fixed_shapes`, the inputs) whose rows hold the
        step's tokens, one a row, where every item is one token and its drafts (decodes and
        verify items) and a batch bucket holds their tokens; None: the packed path."""
        if not (self.use_graphs or self.fixed_shapes):
            return None
        if any(item.count - item.drafts != 1 for item in items):
            return None
        bucket = bucket_of(self.buckets, sum(item.count for item in items))
        if bucket is None:
            return None
        needed = max((item.start + item.count - 1) // self.page_size + 1 for item in items)
        return self._graph(bucket, needed)

    def _rows_step(
        self, items: list[Scheduled], graph: DecodeGraph
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step's tokens as `graph`'s decode rows: an item's last token and its drafts
        k + 1 consecutive rows at positions start .. start + k, each with the request's page
        table. Every layer writes all rows' K/V before any row attends (one stream: the write,
        the fused K/V write kernel included, precedes the attention kernel; SDPA gathers after
        the write), and a row sees the positions up to its own, so a draft's row attends to the
        rows before it as a packed chunk's token does. -> the logits [N, V] (the graph's
        buffer) and final hidden states [N, H] (a copy: the MTP layer keeps them) of the N
        tokens, in the packed path's order."""
        ids, positions, table = graph.host_inputs()
        table.fill(self.scratch_page)
        ids.fill(0)
        positions.fill(0)
        width = table.shape[1]
        row = 0
        for item in items:
            request, count = item.request, item.count
            known = request.tokens[item.start : item.start + count - item.drafts]
            pages = request.pages[:width]
            table[row : row + count, : len(pages)] = pages
            ids[row : row + count, 0] = known + request.drafts[: item.drafts]
            positions[row : row + count, 0] = np.arange(item.start, item.start + count)
            row += count
        forced = graph.host_forced()
        if self.gate_rows is not None and forced is not None:
            assert graph.confidence is not None
            self.gate_rows.stage(items, forced, graph.confidence, per_token=True)
        graph.stage()
        logits = graph.replay()
        assert graph.hidden is not None
        return logits[:row], graph.hidden[:row].clone()

    def _eager_step(
        self, ids: torch.Tensor, positions: torch.Tensor, table: torch.Tensor
    ) -> torch.Tensor:
        batch = AttentionBatch.decode(
            positions, table, self.page_size, with_keys=self.gather_decode_keys
        )
        return self.model.head(self.model.model(ids, positions, self.cache, batch)[:, 0])

    def _launch_ahead(self, items: list[Scheduled], launch: _Launch, tokens: torch.Tensor) -> None:
        """Launch the next decode step of `items`' rows on `launch`'s inputs (which hold this
        step's): each row's `tokens` (on the device) at its next position, a page entered in
        its table where that position starts one; not when a row's next position has no page
        yet (the engine reserves them where it can: Scheduler.reserve_next)."""
        size = self.page_size
        needs = [(item.start + 1) // size + 1 for item in items]  # pages the next positions need
        if any(n > len(item.request.pages) for n, item in zip(needs, items, strict=True)):
            return
        if launch.fixed and max(needs) > launch.table.shape[1]:
            # the next positions cross into a wider context bucket: that bucket's inputs
            moved = self._widen(launch, max(needs))
            if moved is None:
                return
            launch = moved
        if max(needs) > launch.table.shape[1]:
            return
        entries: list[int] = []  # (row, column, page) of the pages the tables lack
        for row, (needed, item) in enumerate(zip(needs, items, strict=True)):
            pages = item.request.pages
            for column in range(launch.pages[row], needed):
                entries += (row, column, pages[column])
        rows = len(items)
        if entries:
            at = torch.tensor(entries, dtype=torch.int64).view(-1, 3)
            if self.device.type == "cuda":
                at = at.pin_memory()
            at = at.to(self.device, non_blocking=True)
            launch.table[at[:, 0], at[:, 1]] = at[:, 2].to(launch.table.dtype)
            for row, needed in enumerate(needs):
                launch.pages[row] = max(launch.pages[row], needed)
        launch.ids[:rows, 0].copy_(tokens)
        launch.positions[:rows] += 1
        if self.gate_rows is not None and self.gate_rows.uses_confidence:  # this step's tops
            if launch.confidence is not None:
                launch.confidence[:rows].copy_(self.gate_rows.confidence_rows(items, False))
            elif not launch.fixed:
                self.gate_rows.set_step(items, per_token=False)
        self.ahead_launched += 1
        self._ahead = _Ahead(
            {item.request.id: (row, item.start + 1) for row, item in enumerate(items)},
            rows,
            launch.run(),
            launch,
        )

    def _widen(self, launch: _Launch, needed: int) -> _Launch | None:
        """`launch`'s rows moved (on the device, in stream order) onto the inputs of the same
        batch bucket at the context bucket that holds `needed` pages; None where there is none
        (eager steps for that key)."""
        graph = self._graph(launch.ids.shape[0], needed)
        if graph is None:
            return None
        width = launch.table.shape[1]
        graph.ids.copy_(launch.ids)
        graph.positions.copy_(launch.positions)
        graph.table[:, :width].copy_(launch.table)
        graph.table[:, width:].fill_(self.scratch_page)
        old = self.graphs.get((launch.ids.shape[0], width))
        if graph.forced is not None and old is not None and old.forced is not None:
            graph.forced.copy_(old.forced)  # the rows' gate inputs move with them
        if graph.confidence is not None and launch.confidence is not None:
            graph.confidence.copy_(launch.confidence)
        self.ahead_moved += 1
        return _Launch(
            graph.ids, graph.positions, graph.table, graph.replay, list(launch.pages), True,
            graph.confidence,
        )  # fmt: skip

    def _graph(self, rows: int, needed: int) -> DecodeGraph | None:
        """The decode step of `rows` rows (a batch bucket) at the smallest context bucket that
        holds `needed` pages, captured now if it is new; None: no bucket holds them, or its
        capture failed (eager steps for that key)."""
        width = bucket_of(self.context_buckets, needed)
        if width is None or (rows, width) in self.graphs.failed:
            return None
        return self.graphs.get((rows, width)) or self._capture(rows, width)

    def _capture(self, rows: int, width: int) -> DecodeGraph | None:
        """Capture the decode graph of `rows` rows and a page table `width` pages wide (every
        row padding: the scratch page); without CUDA graphs (`fixed_shapes` on CPU) the step
        runs eagerly on those inputs. None if capturing fails (that key's steps run eagerly)."""
        graph = DecodeGraph(rows, width, self.device, gate=self.gate_rows is not None)
        self._decode_inputs([], *graph.host_inputs())
        forced = graph.host_forced()
        if forced is not None:
            forced.fill(False)
        for static, staged in zip(graph.inputs, graph.staged, strict=True):
            static.copy_(staged)
        step = functools.partial(self._step_fn, cache=self.cache)
        if self._compiled and len(self.context_buckets) > 1:
            torch._dynamo.maybe_mark_dynamic(graph.table, 1)  # one compilation for every width
        if not self.use_graphs:
            graph.run_eagerly(step)
            self.graphs.add(graph)
            return graph
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        began = time.perf_counter()
        try:
            graph.capture(step, self._pool)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            print(
                f"moetier: decode steps of {rows} rows over {width} pages without a CUDA graph "
                f"({exc})",
                file=sys.stderr,
            )
            self.graphs.failed.add((rows, width))
            return None
        self.capture_seconds[(rows, width)] = time.perf_counter() - began
        self.graphs.add(graph)
        return graph

    def _graph_step(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        table: torch.Tensor,
        forced: torch.Tensor | None = None,
        confidence: torch.Tensor | None = None,
        *,
        cache: torch.Tensor,
    ) -> Any:
        """One decode step -> (logits [B, V], final hidden states [B, H]: speculative
        decoding's MTP layer reads them; a buffer the LM head reads anyway). The cache comes as
        an argument: a graph input of the compiled step, which `moetier::write_pages` updates
        in place. Keys gathered where the attention needs them, over the table's width (the
        step's context bucket). forced / confidence: the confidence gate's rows
        (engine/gate_rows.py), static inputs of the graph."""
        if self.gate_rows is not None and forced is not None:
            self.gate_rows.gate.forced = forced
            self.gate_rows.gate.confidence = confidence if self.gate_rows.uses_confidence else None
        batch = AttentionBatch.decode(
            positions, table, self.page_size, with_keys=self.gather_decode_keys
        )
        runtime = self.loaded.runtime  # padding rows (on the scratch page) take row 0's experts
        runtime.live = table[:, 0] != self.scratch_page
        hidden = self.model.model(ids, positions, cache, batch)[:, 0]
        runtime.live = None
        return self.model.head(hidden), hidden

    def _decode_inputs(
        self, items: list[Scheduled], ids: np.ndarray, positions: np.ndarray, table: np.ndarray
    ) -> list[int]:
        """Fill [rows, 1] ids and positions and the [rows, width] page table of decode rows
        (numpy views of host tensors): a table row holds the row's first `width` pages (those
        past a context bucket's width are never read); rows past the items (padding) read and
        write the scratch page at position 0. -> per row, the table entries that hold pages."""
        table.fill(self.scratch_page)
        ids.fill(0)
        positions.fill(0)
        width = table.shape[1]
        held = []
        for row, item in enumerate(items):
            pages = item.request.pages[:width]
            table[row, : len(pages)] = pages
            ids[row, 0] = item.request.tokens[item.start]
            positions[row, 0] = item.start
            held.append(len(pages))
        return held

    def _packed(self, items: list[Scheduled]) -> torch.Tensor:
        spans = [(item.start, item.count, item.request.pages) for item in items]
        batch = AttentionBatch.packed(spans, self.page_size, self.device, self.paged_prefill)
        tokens = [  # an item's known tokens, then its drafts (speculative decoding)
            t
            for item in items
            for t in item.request.tokens[item.start :][: item.count - item.drafts]
            + item.request.drafts[: item.drafts]
        ]
        ids = torch.tensor([tokens], device=self.device)
        if self.prefill is not None and self.prefill.applies(ids, self.loaded.runtime):
            try:
                return self.prefill(ids, batch, self.cache)[0]
            except prefill_compile.COMPILE_ERRORS as exc:  # (eager from now on)
                print(f"moetier: prefill steps run eagerly from now on: compiling one failed "
                      f"({type(exc).__name__}: {exc})", file=sys.stderr)  # fmt: skip
                self.prefill = None
        return self.model.model(ids, batch.positions, self.cache, batch)[0]


@dataclass
class _Launch:
    """A decode step's device inputs ([B, 1] ids and positions, [B, W] page tables: a graph's
    static inputs or an eager step's) and how to run the step on them -> logits [B, V]."""

    ids: torch.Tensor
    positions: torch.Tensor
    table: torch.Tensor
    run: Callable[[], torch.Tensor]
    pages: list[int]  # per row: the entries of its page table that hold its pages
    fixed: bool = False  # a DecodeGraph's inputs (keyed by batch and context bucket)
    confidence: torch.Tensor | None = None  # a DecodeGraph's gate confidence rows


@dataclass
class _Ahead:
    """A decode step launched before the host saw its tokens: request id -> (row, position),
    its row count, its logits (still being computed), the inputs it ran on."""

    rows: dict[str, tuple[int, int]]
    count: int
    logits: torch.Tensor
    launch: _Launch

    def rows_of(self, items: list[Scheduled]) -> list[int] | None:
        """The launched rows of a step's items in order; None unless every item is a decode
        row launched at the position it computes."""
        taken = []
        for item in items:
            row = self.rows.get(item.request.id)
            if row is None or row[1] != item.start or item.count != 1:
                return None
            taken.append(row[0])
        return taken


def use_compile_cache() -> None:
    """Keep torch.compile's artefacts in moetier's cache folder (core/paths.py: `inductor/`),
    so a second start finds the decode steps compiled; an explicit TORCHINDUCTOR_CACHE_DIR
    wins."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")


class TransformersRunner(StepSampler):
    """The transformers model class, a DynamicCache per request; a step's items run one after
    another (batched only in the scheduler's sense). Needs the page pool without prefix caching:
    a request's KV is in its own cache, not in pages."""

    prefix_caching = False
    lookahead = False  # its steps run one after another

    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__()
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.caches: dict[str, Any] = {}
        self.cache_arg = cache_argument(self.model)
        gate = loaded.runtime.gate
        self.gate_rows = GateRows(gate, self.device) if gate is not None else None

    @torch.inference_mode()
    def run(self, step: Step, lookahead: bool = False) -> Sampled:
        from transformers import DynamicCache

        sampling: list[Scheduled] = []
        logits, prompt = [], []
        spans = self.prompt_spans(step.items)
        span_of = {s.item: s for s in spans}
        for i, item in enumerate(step.items):
            request = item.request
            if item.start == 0:  # a new request, or one preempted and recomputed
                self.caches[request.id] = DynamicCache(config=self.model.config)
            cache = self.caches.get(request.id)
            if cache is None:
                raise RuntimeError(f"request {request.id} resumes at {item.start} with no cache")
            ids = request.tokens[item.start : item.start + item.count]
            if self.gate_rows is not None:
                self.gate_rows.set_step([item], per_token=True)
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                use_cache=True,
                logits_to_keep=item.count if i in span_of else 1,
                **{self.cache_arg: cache},
            )
            if i in span_of:  # positions start.. of the chunk: the span's are its first ones
                prompt.append(out.logits[0, : span_of[i].count])
            if item.samples:
                sampling.append(item)
                logits.append(out.logits[0, -1])
        self.positions_run += step.num_tokens
        if not sampling and not spans:
            return Sampled()
        vocab = int(self.model.config.vocab_size)
        picked = torch.stack(logits) if logits else torch.empty(0, vocab, device=self.device)
        return self._sample(picked, sampling, torch.cat(prompt) if prompt else None, spans)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.caches.pop(request_id, None)

    def forget_kv(self, request_id: str) -> None:
        self.caches.pop(request_id, None)
