"""Speculative decoding with the model's own MTP layer (models/mtp.py; research/serving.md §3).

Each decoding request carries drafts (`Request.drafts`): the next step computes its last token
and its k drafts together (k + 1 decode rows of the graphed step, or one packed chunk: the
experts op reads each distinct expert once for all of them) and keeps the drafts as far as the
model agrees (`verify_greedy`: the longest prefix of drafts equal to the model's own greedy
choices, then the model's token after it). Greedy output is the same as without drafts, token
for token.

`MTPDrafter` proposes them. The MTP layer at position p reads the main model's final hidden
state h_p (DeepSeek-V4: its hyper-connection streams before the final collapse, flattened) and
the embedding of token p + 1 (the layer's `step`); its own KV sits in the paged cache's layer
num_hidden_layers, at the main model's pages and positions. After each step the drafter runs the
layer over every position whose next token is now known (catch-up: hidden states kept from the
main model's steps, `keep`), the last one giving the first draft; then it applies the layer
again on its own output and draft (EAGLE-style) for the others, writing their KV at the next
positions (overwritten by the catch-up once the real tokens are known). The layer's KV is part
of what a page caches (engine/scheduler.py: a page enters the prefix cache once it is written,
keyed with the token after it), so every request keeps it written, drafting or not, and a
prefix hit's drafts are those of the request computing the prefix itself. Where the runner's steps
are graphed (or on their fixed shapes, CPU tests) and every request is in step (its catch-up 1
to k + 1 positions), the catch-up and the chain replay one graph (engine/draft_graphs.py);
otherwise they run eagerly. The verify steps replay the graphed decode step where a batch
bucket holds their tokens (engine/runner.py: a token a decode row). Sampled requests keep a
draft with the target's probability of it and draw the token after a rejection from the rest of
that distribution (`rejection_rows`: speculative sampling with point-mass proposals), so their
tokens follow the target distribution; requests with penalties, logit bias, grammars or
logprobs decode one token a step.
"""

from __future__ import annotations

import functools
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moetier.engine.decode_graphs import BATCH_BUCKETS, DecodeGraphs, bucket_of
from moetier.engine.draft_graphs import DraftGraph
from moetier.engine.sampler import to_device
from moetier.engine.scheduler import Request
from moetier.models.attention_batch import AttentionBatch


@dataclass
class SpecStats:
    """Drafts proposed and accepted by position (index 0: the first draft after a token)."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    steps: int = 0  # verify steps (one per request and step with drafts)

    def add(self, proposed: int, kept: int) -> None:
        grow = max(0, proposed - len(self.drafted))
        self.drafted += [0] * grow
        self.accepted += [0] * grow
        for j in range(proposed):
            self.drafted[j] += 1
            self.accepted[j] += int(j < kept)
        self.steps += 1

    @property
    def acceptance(self) -> float:
        """Share of drafts accepted."""
        return sum(self.accepted) / sum(self.drafted) if sum(self.drafted) else 0.0

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per verify step (tokens a step gives: this + 1)."""
        return sum(self.accepted) / self.steps if self.steps else 0.0


def rejection_rows(
    probs: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling with drafts proposed greedily (a draft's proposal distribution is a
    point mass on it): probs [k + 1, V], the target's distribution at the last token's position
    and at each draft's; drafts [k]. -> (accept [k] bool: draft j is kept with probability
    p_j(d_j), on the device; tokens [k + 1]: row j < k a draw from p_j without d_j
    (renormalised: what follows a rejection at j), row k a draw from p_k (what follows k kept
    drafts)). The tokens emitted are then distributed as the target's own draws
    (`verify_sampled` takes them)."""
    k = drafts.shape[0]
    rows = torch.arange(k, device=probs.device)
    kept_p = probs[rows, drafts]  # [k]
    uniform = torch.rand(k, device=probs.device, generator=generator)
    accept = uniform < kept_p
    residual = probs.clone()
    residual[rows, drafts] = 0.0
    noise = torch.empty_like(residual).exponential_(generator=generator)
    noise = noise.clamp(min=torch.finfo(noise.dtype).tiny)
    tokens = (residual / noise).argmax(dim=-1)  # an exponential race: a draw from each row
    return accept, tokens


def verify_sampled(
    drafts: list[int], accept: list[bool], tokens: list[int]
) -> tuple[list[int], int]:
    """`rejection_rows`' results on the host -> (the drafts kept, the token after them)."""
    kept = 0
    while kept < len(drafts) and accept[kept]:
        kept += 1
    return drafts[:kept], tokens[kept]


def verify_greedy(drafts: list[int], choices: list[int]) -> tuple[list[int], int]:
    """`choices` the model's greedy token at the last token's position and at each draft's
    (len(drafts) + 1 of them) -> (the drafts kept, the model's token after them)."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == choices[kept]:
        kept += 1
    return drafts[:kept], choices[kept]


# hidden states a request may keep for the MTP layer while its steps draft nothing, before
# the layer runs over them (MTPDrafter.catch_up): 64 x hidden size x 2 bytes a request
STASH_POSITIONS = 64


class MTPDrafter:
    def __init__(self, model: Any, page_size: int, device: torch.device) -> None:
        self.model = model
        self.mtp = model.mtp
        self.page_size = page_size
        self.device = device
        # request id -> (first position, the main model's hidden states from it on [n, H])
        self._hidden: dict[str, tuple[int, torch.Tensor]] = {}
        self._done: dict[str, int] = {}  # request id -> positions whose MTP KV is in the cache
        self.stats = SpecStats()
        # benchmarks on random weights (`replay`): drafts kept at given rates, not by the model
        self._replay: list[float] | None = None
        self._rng = random.Random(0)
        # drafting on fixed-shape inputs (engine/draft_graphs.py): the runner says whether its
        # steps are graphed (or on fixed shapes), its scratch page and page-table widths
        self.layout: Any = None  # engine/runner.py's PagedRunner, set by enable_speculative
        self.graphs: DecodeGraphs[DraftGraph] = DecodeGraphs()  # (requests, k, width)
        self._pool: Any = None
        self.graphed = self.eager = 0  # drafting calls on fixed-shape inputs, and eager ones

    def replay(self, acceptance: list[float]) -> None:
        """Benchmarks on random weights, whose drafts the model never agrees with: keep drafts
        at measured rates instead (acceptance[j]: the share of steps that keep draft j, as
        SpecStats reports it, non-increasing), the model's token at the first one not kept
        after them. The text is then not the model's: timing only."""
        if any(b > a for a, b in zip(acceptance, acceptance[1:], strict=False)):
            raise ValueError(f"replayed acceptance {acceptance} must not increase by position")
        self._replay = list(acceptance)

    def replayed(self, drafts: int) -> int | None:
        """Drafts kept under `replay` (None: not replaying)."""
        if self._replay is None:
            return None
        u = self._rng.random()
        return sum(1 for j in range(drafts) if j < len(self._replay) and u < self._replay[j])

    def forget(self, request_id: str) -> None:
        self._hidden.pop(request_id, None)
        self._done.pop(request_id, None)

    def keep(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """The main model's final hidden states of positions start.. ([n, H]) of a step."""
        old = self._hidden.get(request_id)
        if old is not None and old[0] <= start <= old[0] + old[1].shape[0]:
            hidden = torch.cat([old[1][: start - old[0]], hidden])
            start = old[0]
        self._hidden[request_id] = (start, hidden)
        self._done.setdefault(request_id, start)

    def stashed(self, request_id: str) -> int:
        """Positions of the main model's hidden states kept for the request."""
        kept = self._hidden.get(request_id)
        return 0 if kept is None else int(kept[1].shape[0])

    @torch.inference_mode()
    def catch_up(
        self, requests: list[Request], cache: torch.Tensor, now: frozenset[str] = frozenset()
    ) -> None:
        """Steps that draft nothing (the policy's choice, or a request that never drafts)
        still keep hidden states for the MTP layer's KV: requests holding more than
        STASH_POSITIONS of them, and those named in `now` (a prompt chunk just computed, a
        request ending: their pages enter the prefix cache once the layer's KV is written),
        have the layer run over those now (one packed call), so the stash stays small and a
        later draft, or a prefix hit, finds its KV complete."""
        behind = [r for r in requests if r.id in now or self.stashed(r.id) > STASH_POSITIONS]
        if behind:
            self._catch_up(behind, cache)

    def _catch_up(
        self, requests: list[Request], cache: torch.Tensor
    ) -> tuple[list[Request], torch.Tensor | None]:
        """Run the MTP layer over each request's positions whose next token is known and whose
        MTP KV is not yet in the cache -> (the requests it ran for, the layer's output at each
        one's last position [R, H])."""
        spans, embeds_ids, rows, ready = [], [], [], []
        for request in requests:
            kept = self._hidden.get(request.id)
            done = min(self._done.get(request.id, request.computed), request.computed - 1)
            if kept is None or not kept[0] <= done or done < 0:
                continue
            first, hidden = kept
            # positions [done, end): their next tokens are known (a request that ended at a
            # kept draft has computed its last token too)
            end = min(request.computed, len(request.tokens) - 1)
            if first + hidden.shape[0] < end or end <= done:
                continue
            spans.append((done, end - done, request.pages))
            embeds_ids += request.tokens[done + 1 : end + 1]
            rows.append(hidden[done - first : end - first])
            ready.append(request)
        if not ready:
            return ready, None
        model = self.model.model
        fold = getattr(model, "layer_batch", lambda b: b)  # (MLA: one latent key, all heads)
        batch = fold(AttentionBatch.packed(spans, self.page_size, self.device))
        ids = to_device(embeds_ids, self.device, torch.int64)[None]
        out = self.mtp.step(model, ids, torch.cat(rows)[None], batch, cache)[0]  # [N, H]
        ends = torch.tensor([s[1] for s in spans]).cumsum(0) - 1
        last = out.index_select(0, ends.to(self.device))  # [R, H]
        for request, (start, count, _) in zip(ready, spans, strict=True):
            self._done[request.id] = request.mtp_written = start + count
            first, hidden = self._hidden[request.id]
            self._hidden[request.id] = (start + count, hidden[start + count - first :])
        return ready, last

    @torch.inference_mode()
    def draft(self, requests: list[Request], k: int, cache: torch.Tensor) -> None:
        """Set `drafts` (k tokens) of each request, whose pages hold its next k + 1 positions;
        a request with no kept hidden state for a position it needs gets none."""
        if self._draft_fixed(requests, k, cache):
            self.graphed += 1
            return
        self.eager += 1
        ready, last = self._catch_up(requests, cache)
        if last is None:
            return
        model = self.model.model
        fold = getattr(model, "layer_batch", lambda b: b)
        drafts = [self.mtp.logits(last, self.model.lm_head).argmax(-1)]
        for j in range(1, k):  # chained: the layer's own output and draft, one position on
            chain = [(request.computed + j - 1, 1, request.pages) for request in ready]
            batch = fold(AttentionBatch.packed(chain, self.page_size, self.device))
            last = self.mtp.step(model, drafts[-1][None], last[None], batch, cache)[0]
            drafts.append(self.mtp.logits(last, self.model.lm_head).argmax(-1))
        table = torch.stack(drafts, dim=1).tolist()  # [R, k]: one read back
        for request, tokens in zip(ready, table, strict=True):
            request.drafts = list(tokens)

    def _draft_fixed(self, requests: list[Request], k: int, cache: torch.Tensor) -> bool:
        """Draft on a DraftGraph's fixed-shape inputs (replayed where the runner's steps are
        graphed); False, nothing done, where that does not apply: steps not on fixed shapes,
        more requests than a bucket holds, a request whose catch-up is not 1 to k + 1
        positions of kept hidden states, or a graph that did not capture."""
        layout = self.layout
        if layout is None or not (layout.use_graphs or layout.fixed_shapes) or not requests:
            return False
        bucket = bucket_of(BATCH_BUCKETS, len(requests))
        if bucket is None:
            return False
        spans = []  # per request: first catch-up position, their count, the hidden states
        needed = 0
        for request in requests:
            kept = self._hidden.get(request.id)
            done = min(self._done.get(request.id, request.computed), request.computed - 1)
            if kept is None or done < 0:
                return False
            first, hidden = kept
            count = request.computed - done
            if not (first <= done and first + hidden.shape[0] >= request.computed):
                return False
            if not 1 <= count <= k + 1:
                return False
            pages = (request.computed + k - 1) // self.page_size + 1  # the chain's last
            if len(request.pages) < pages:
                return False
            needed = max(needed, pages)
            spans.append((done, count, hidden[done - first : request.computed - first]))
        width = bucket_of(layout.context_buckets, needed)
        if width is None:
            return False
        first_kept = spans[0][2]  # (DeepSeek-V4: its streams, hc x H wide)
        graph = self.graphs.get((bucket, k, width)) or self._capture(
            bucket, k, width, cache, first_kept.shape[-1], first_kept.dtype
        )
        if graph is None:
            return False
        ids, positions, table, last, chain_positions, chain_table, rows = graph.host_inputs()
        self._pad(graph)
        at = 0
        for i, (request, (done, count, _)) in enumerate(zip(requests, spans, strict=True)):
            base = i * (k + 1)
            held = request.pages[:width]
            table[base : base + k + 1, : len(held)] = held
            positions[base : base + k + 1, 0] = np.arange(done, done + k + 1)
            ids[base : base + count, 0] = request.tokens[done + 1 : done + count + 1]
            last[i] = base + count - 1
            chain_positions[:, i, 0] = np.arange(request.computed, request.computed + k - 1)
            chain_table[i, : len(held)] = held
            rows[at : at + count] = np.arange(base, base + count)
            at += count
        drafts = graph.replay(torch.cat([span[2] for span in spans]))
        table_out = drafts[: len(requests)].tolist()  # [R, k]: one read back
        for request, tokens, (done, count, _) in zip(requests, table_out, spans, strict=True):
            request.drafts = list(tokens)
            self._done[request.id] = request.mtp_written = done + count
            first, hidden = self._hidden[request.id]
            self._hidden[request.id] = (done + count, hidden[done + count - first :])
        return True

    def _pad(self, graph: DraftGraph) -> None:
        """Every row of `graph`'s staged inputs a padding row: the scratch page, position 0."""
        ids, positions, table, last, chain_positions, chain_table, rows = graph.host_inputs()
        table.fill(self.layout.scratch_page)
        chain_table.fill(self.layout.scratch_page)
        for array in (ids, positions, last, chain_positions):
            array.fill(0)
        rows[:] = np.arange(rows.shape[0])

    def _capture(
        self,
        requests: int,
        k: int,
        width: int,
        cache: torch.Tensor,
        size: int,
        dtype: torch.dtype,
    ) -> DraftGraph | None:
        """The drafting of `requests` requests (a bucket) with k drafts over `width` pages:
        captured into a CUDA graph where the runner's steps are, else run eagerly on the same
        inputs; None (eager drafting for that key) if capturing fails."""
        key = (requests, k, width)
        if key in self.graphs.failed:
            return None
        graph = DraftGraph(requests, k, width, size, dtype, self.device)
        self._pad(graph)
        for static, staged in zip(graph.inputs, graph.staged, strict=True):
            static.copy_(staged)
        fn = functools.partial(self._fixed_drafts, k, cache=cache)
        if not self.layout.use_graphs:
            graph.run_eagerly(fn)
        else:
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            try:
                graph.capture(fn, self._pool)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                print(f"moetier: drafting for {requests} requests without a CUDA graph ({exc})",
                      file=sys.stderr)  # fmt: skip
                self.graphs.failed.add(key)
                return None
        self.graphs.add(graph)
        return graph

    def _fixed_drafts(
        self,
        k: int,
        ids: torch.Tensor,
        positions: torch.Tensor,
        table: torch.Tensor,
        last: torch.Tensor,
        chain_positions: torch.Tensor,
        chain_table: torch.Tensor,
        hidden: torch.Tensor,
        *,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """The drafting on a DraftGraph's inputs -> drafts [requests, k]: the MTP layer over
        every request's k + 1 rows (its catch-up positions first), each request's first draft
        from its row `last`, then k - 1 chained one-row steps."""
        model = self.model.model
        fold = getattr(model, "layer_batch", lambda b: b)
        gather = self.layout.gather_decode_keys
        gate = getattr(self.layout, "gate_rows", None)
        if gate is not None:  # the gate's row inputs are the decode steps' (other shapes)
            gate.gate.forced = gate.gate.confidence = None

        runtime = self.layout.loaded.runtime

        def layer(tokens: torch.Tensor, before: torch.Tensor, at: torch.Tensor,
                  pages: torch.Tensor) -> torch.Tensor:  # fmt: skip
            batch = fold(AttentionBatch.decode(at, pages, self.page_size, with_keys=gather))
            runtime.live = pages[:, 0] != self.layout.scratch_page  # padding: row 0's experts
            out = self.mtp.step(model, tokens, before[:, None], batch, cache)[:, 0]
            runtime.live = None
            return out

        out = layer(ids, hidden, positions, table).index_select(0, last)  # [requests, H]
        token = self.mtp.logits(out, self.model.lm_head).argmax(-1)
        drafts = [token]
        for j in range(k - 1):
            out = layer(token[:, None], out, chain_positions[j], chain_table)
            token = self.mtp.logits(out, self.model.lm_head).argmax(-1)
            drafts.append(token)
        return torch.stack(drafts, dim=1)


@dataclass
class _Rates:
    """Decaying sums of a choice's measured steps: tokens given and seconds taken."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.steps += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class SpecPolicy:
    """Whether drafting pays at a batch size, from the engine's own measured decode steps: per
    batch bucket (1, 2, 4 ... rows), the tokens a step gives its rows and the seconds it takes,
    with drafts and without (decaying sums); the faster choice by tokens a second wins, and
    every `explore` steps of a bucket the other is tried once, so a change (longer contexts, a
    colder expert cache, lower acceptance) is seen. A bucket tries drafting first, then
    without. Verifying k + 1 tokens of every row reads the union of their experts: where that
    costs more than the accepted drafts give (large batches, experts off the GPU), drafting
    turns itself off at that batch size."""

    def __init__(self, explore: int = 32, decay: float = 0.9) -> None:
        self.explore = explore
        self.decay = decay
        self.buckets: dict[int, tuple[_Rates, _Rates]] = {}  # rows bucket -> (plain, drafted)
        self._since: dict[int, int] = {}  # steps since the other choice was tried

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def choose(self, rows: int) -> bool:
        """Draft for the next step of `rows` decoding rows?"""
        key = self.bucket(rows)
        plain, drafted = self.buckets.setdefault(key, (_Rates(), _Rates()))
        if drafted.steps == 0:
            return True
        if plain.steps == 0:
            return False
        best = drafted.rate >= plain.rate
        self._since[key] = self._since.get(key, 0) + 1
        if self._since[key] >= self.explore:
            self._since[key] = 0
            return not best
        return best

    def record(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode step of `rows` rows (with drafts or not) gave `tokens` in `seconds`."""
        plain, with_drafts = self.buckets.setdefault(self.bucket(rows), (_Rates(), _Rates()))
        (with_drafts if drafted else plain).add(tokens, seconds, self.decay)
