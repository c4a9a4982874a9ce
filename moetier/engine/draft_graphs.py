"""Speculative decoding's drafting on fixed-shape inputs, replayed from CUDA graphs
(engine/speculative.py's MTPDrafter; research/serving.md §3).

After a verify step each request has 1 to k + 1 positions whose next token is now known and
whose MTP-layer KV is not yet in the cache (the catch-up), then k drafts to chain. Eagerly that
is one packed call of the MTP layer plus k - 1 chained calls, each a few dozen kernel launches
and a batch built on the host: about as long as a whole decode step at batch 1. Here it is one
graph per (request bucket, page-table width): every request takes k + 1 decode rows (its
catch-up positions first; rows past them sit at the following positions, whose KV the chain or
the next catch-up writes again before anything reads it), the rows' MTP outputs at each
request's last catch-up position give the first drafts, and the chain runs k - 1 more one-row
steps of the layer on its own output and draft. Rows of a request attend as a verify step's do
(every row's KV written before any row attends, each sees the positions up to its own).

`DraftGraph` holds one key's static inputs (the rows' next-token ids, positions and page tables;
the row of each request's last catch-up position; the chain's positions and page tables), the
main model's hidden states per row (written on the device before each replay), their host
staging copies, and the drafting captured into a CUDA graph on them (or, `captured` False: CPU
tests, run eagerly on them). Its output is the drafts [requests, k]. The drafter keeps them in
a `DecodeGraphs` (engine/decode_graphs.py), as the runner keeps its steps: the least recently
used dropped first beyond its cap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

DraftFn = Callable[..., torch.Tensor]


class DraftGraph:
    def __init__(
        self,
        requests: int,
        drafts: int,
        width: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        rows = requests * (drafts + 1)
        self.requests, self.drafts_per_request = requests, drafts
        i64, i32 = torch.int64, torch.int32
        self.ids = torch.zeros(rows, 1, dtype=i64, device=device)
        self.positions = torch.zeros(rows, 1, dtype=i64, device=device)
        self.table = torch.zeros(rows, width, dtype=i32, device=device)
        self.last = torch.zeros(requests, dtype=i64, device=device)
        self.chain_positions = torch.zeros(max(drafts - 1, 0), requests, 1, dtype=i64,
                                           device=device)  # fmt: skip
        self.chain_table = torch.zeros(requests, width, dtype=i32, device=device)
        self.hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        # where each request's kept hidden states go in `hidden` (written before a replay)
        self.hidden_rows = torch.zeros(rows, dtype=i64, device=device)
        pin = device.type == "cuda"
        self.staged = [
            torch.zeros_like(t, device="cpu").pin_memory() if pin else torch.zeros_like(t)
            for t in self.inputs
        ]
        self.graph: Any = None
        self.out: torch.Tensor | None = None  # the drafts of the last replay [requests, k]
        self._eager: Callable[[], torch.Tensor] | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return self.requests, self.drafts_per_request, self.table.shape[1]

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The static inputs staged from the host."""
        return (self.ids, self.positions, self.table, self.last, self.chain_positions,
                self.chain_table, self.hidden_rows)  # fmt: skip

    def _args(self) -> tuple[torch.Tensor, ...]:
        return (*self.inputs[:6], self.hidden)

    def host_inputs(self) -> list[np.ndarray]:
        """numpy views of the staging copies, in `inputs`' order."""
        return [t.numpy() for t in self.staged]

    def capture(self, fn: DraftFn, pool: Any) -> None:
        """Warm up on a side stream, then capture `fn` (-> drafts [requests, k])."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*self._args())
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn(*self._args())

    def run_eagerly(self, fn: DraftFn) -> None:
        self._eager = lambda: fn(*self._args())

    def replay(self, kept: torch.Tensor) -> torch.Tensor:
        """Stage the host inputs, put `kept` (the requests' kept hidden states, [n, H], in
        staging order) into their rows, run -> the drafts [requests, k] (the graph's buffer)."""
        for static, staged in zip(self.inputs, self.staged, strict=True):
            static.copy_(staged, non_blocking=True)
        self.hidden.index_copy_(0, self.hidden_rows[: kept.shape[0]], kept.to(self.hidden.dtype))
        if self._eager is not None:
            self.out = self._eager()
            return self.out
        self.graph.replay()
        assert self.out is not None
        return self.out
