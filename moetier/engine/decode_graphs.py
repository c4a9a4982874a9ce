"""The serving engine's decode steps of fixed shape (engine/runner.py), keyed by (batch bucket,
context bucket).

A decode step of R rows runs on the inputs of the smallest batch bucket (1, 2, 4 ... 64 rows)
that holds R; padding rows read and write a scratch page. Where the attention gathers its keys
from the pages (SDPA on CPU; glm_moe_dsa's indexer, deepseek_v4 and gpt_oss on every device) the
page table is also cut to a fixed width, the step's *context bucket*: the smallest width of a
geometric ladder of pages (`context_ladder`: the pages of FIRST_CONTEXT_TOKENS positions, then
twice as many ... up to the widest table) that holds every row's position. Keys are gathered over
that width only and masked by each row's position, so a step costs what its contexts need, not
the model's context. Where every layer's kernel reads pages itself (the GQA and MLA decode
kernels), the ladder is one width, the whole table: the graphs are per batch bucket only.

`DecodeGraph` holds one key's static inputs (ids and positions [B, 1], page table [B, W]), their
host staging copies, and the step captured on them into a CUDA graph, or (`captured` False: CPU
tests) the step itself, run eagerly on the same inputs. The step gives the logits [B, V] and the
final hidden states [B, H] (what speculative decoding's MTP layer reads; engine/runner.py runs a
verify step's k + 1 positions of a request as k + 1 of these rows). `DecodeGraphs` keeps them
by key, least recently used dropped first beyond a cap.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # decode rows a step's inputs are padded to
FIRST_CONTEXT_TOKENS = 1024  # positions the smallest context bucket holds (rounded up to pages)
MAX_DECODE_GRAPHS = 48  # graphs kept at once (least recently used dropped first)

Key = tuple[int, int]  # (rows, page-table width)


def context_ladder(first_pages: int, top_pages: int) -> tuple[int, ...]:
    """Page-table widths of the context buckets: first_pages, twice that, ... up to top_pages
    (the last one top_pages itself; one bucket where first_pages >= top_pages)."""
    if top_pages < 1:
        raise ValueError(f"a page table of {top_pages} pages")
    ladder = [max(1, min(first_pages, top_pages))]
    while ladder[-1] < top_pages:
        ladder.append(min(2 * ladder[-1], top_pages))
    return tuple(ladder)


def bucket_of(buckets: tuple[int, ...], needed: int) -> int | None:
    """The smallest bucket >= needed (None: none holds it)."""
    return next((b for b in buckets if b >= needed), None)


class DecodeGraph:
    """One key's decode step: static inputs, their host staging copies (pinned on CUDA), and
    the step captured into a CUDA graph on them (or run eagerly on them: `captured` False)."""

    def __init__(self, rows: int, width: int, device: torch.device, gate: bool = False) -> None:
        self.ids = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)
        # `gate`: the confidence gate's row inputs (engine/gate_rows.py): forced rows, staged
        # from the host like the others, and each row's previous top probability, written on
        # the device
        self.forced = torch.zeros(rows, dtype=torch.bool, device=device) if gate else None
        self.confidence = torch.ones(rows, device=device) if gate else None
        pin = device.type == "cuda"
        self.staged = [
            torch.zeros_like(t, device="cpu").pin_memory() if pin else torch.zeros_like(t)
            for t in self.inputs
        ]
        self.graph: Any = None
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None  # the last replay's final hidden states [B, H]
        self._eager: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def key(self) -> Key:
        return self.table.shape[0], self.table.shape[1]

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The static inputs staged from the host: ids, positions, table (and forced rows)."""
        gate = () if self.forced is None else (self.forced,)
        return self.ids, self.positions, self.table, *gate

    def _args(self) -> tuple[torch.Tensor, ...]:
        """What the step is called with: the inputs, then the gate's confidence rows."""
        return self.inputs if self.confidence is None else (*self.inputs, self.confidence)

    def host_inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """numpy views of the staging copies of ids, positions and table: what `stage` copies
        in. (The previous replay's copies are done: the sampled tokens were read back since.)"""
        ids, positions, table = (t.numpy() for t in self.staged[:3])
        return ids, positions, table

    def host_forced(self) -> np.ndarray | None:
        """The staging copy of the forced rows (None: no gate inputs)."""
        return self.staged[3].numpy() if self.forced is not None else None

    def capture(self, step: Callable[..., tuple[torch.Tensor, torch.Tensor]], pool: Any) -> None:
        """Warm up on a side stream (compiles a compiled step; writes what the replays
        write), then capture. `step` -> (logits, hidden)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # a compiled step's first call compiles, the second is steady
                step(*self._args())
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits, self.hidden = step(*self._args())

    def run_eagerly(self, step: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
        """No capture: `replay` runs `step` on the static inputs (the graph's shapes, CPU)."""
        self._eager = lambda: step(*self._args())

    def stage(self) -> None:
        """Copy the staged host inputs in (asynchronously; queued before the next replay)."""
        for static, staged in zip(self.inputs, self.staged, strict=True):
            static.copy_(staged, non_blocking=True)

    def replay(self) -> torch.Tensor:
        """Run the step on the static inputs as they are -> the logits (a captured graph's own
        buffer; `hidden` then holds the rows' final hidden states)."""
        if self._eager is not None:
            self.logits, self.hidden = self._eager()
            return self.logits
        self.graph.replay()
        assert self.logits is not None
        return self.logits


class Keyed(Protocol):
    @property
    def key(self) -> tuple[int, ...]: ...


G = TypeVar("G", bound=Keyed)


class DecodeGraphs(Generic[G]):
    """Captured steps by their key (decode steps: (rows, width); engine/draft_graphs.py's
    drafting: (requests, k, width)), at most `cap` of them: adding one beyond drops the least
    recently used (its graph's memory goes back to the shared pool); keys whose capture failed
    are remembered so that they are not tried again."""

    def __init__(self, cap: int = MAX_DECODE_GRAPHS) -> None:
        self.cap = cap
        self._graphs: OrderedDict[tuple[int, ...], G] = OrderedDict()
        self.failed: set[tuple[int, ...]] = set()
        self.dropped = 0  # graphs dropped for the cap

    def get(self, key: tuple[int, ...]) -> G | None:
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
        return graph

    def add(self, graph: G) -> None:
        self._graphs[graph.key] = graph
        self._graphs.move_to_end(graph.key)
        while len(self._graphs) > max(1, self.cap):
            self._graphs.popitem(last=False)
            self.dropped += 1

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(list(self._graphs))

    def __len__(self) -> int:
        return len(self._graphs)
