"""The confidence gate's per-row inputs in the serving engine (moetier/gate, docs/gate.md).

The gate reads two things per token of an experts call that only the engine knows:
- forced: the row's request is inside a structured span (a grammar-constrained output, or the
  quality meter's full-delta twin, engine/quality_meter.py): its pairs all take the delta;
- confidence: the top probability of the row's previous next-token distribution (the
  `confidence` term), kept per request on the device and never read by the host.

`GateRows` keeps each request's last top probability in a device table (a slot per request)
and writes the step's rows into the gate before the model runs: decode rows one value per row,
a packed step one per token (prompt tokens have no previous distribution of their own: 1.0,
which scores 0). For a CUDA graph the rows go into the graph's static buffers (`stage`), which
the captured step hands to the gate.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moetier.engine.sampler import to_device
from moetier.engine.scheduler import Scheduled


class GateRows:
    def __init__(self, gate: Any, device: torch.device) -> None:
        self.gate = gate  # moetier.gate.state.Gate
        self.device = device
        self.uses_confidence = "confidence" in gate.rule.terms()
        self._slots: dict[str, int] = {}  # request id -> row of `top`
        self.top = torch.ones(64, device=device)  # last top probability per slot
        self._free = list(range(63, -1, -1))  # lowest slot first

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def _slot(self, request_id: str) -> int:
        slot = self._slots.get(request_id)
        if slot is None:
            if not self._free:  # twice the table (a graph reads rows through an index copy)
                old = self.top.shape[0]
                self.top = torch.cat([self.top, torch.ones(old, device=self.device)])
                self._free = list(range(2 * old - 1, old - 1, -1))
            slot = self._free.pop()
            self.top[slot] = 1.0
            self._slots[request_id] = slot
        return slot

    @staticmethod
    def forced_of(items: list[Scheduled], per_token: bool) -> list[bool]:
        flags = []
        for item in items:
            flags += [bool(item.request.gate_forced)] * (item.count if per_token else 1)
        return flags

    def confidence_rows(self, items: list[Scheduled], per_token: bool) -> torch.Tensor:
        """[rows or tokens] float32 on the device: each decode row's previous top probability
        (1.0 for a prompt token, and for a row whose request has none yet)."""
        index = []
        for item in items:
            slot = self._slot(item.request.id)
            if per_token:  # the chunk's tokens: only a decode token has a previous step
                known = item.count - item.drafts  # (a verify item: its last token, drafts)
                decode = known == 1 and item.start >= len(item.request.prompt)
                index += [-1] * (known - 1) + [slot if decode else -1] + [-1] * item.drafts
            else:
                index.append(slot)
        ids = to_device(index, self.device, torch.int64)
        padded = torch.cat([self.top, self.top.new_ones(1)])  # -1 reads the 1.0 at the end
        return padded.index_select(0, ids.remainder(padded.shape[0]))

    def set_step(self, items: list[Scheduled], per_token: bool) -> None:
        """Eager steps: the step's forced rows and confidence straight into the gate."""
        forced = self.forced_of(items, per_token)
        self.gate.forced = to_device(forced, self.device, torch.bool) if any(forced) else None
        self.gate.confidence = (
            self.confidence_rows(items, per_token) if self.uses_confidence else None
        )

    def stage(
        self,
        items: list[Scheduled],
        forced: np.ndarray,
        confidence: torch.Tensor,
        per_token: bool = False,
    ) -> None:
        """A graph's rows: `forced` (its host staging buffer [rows], padding rows False) and
        `confidence` (its static device buffer [rows], padding rows 1.0) filled in. per_token:
        a row per token of each item (a speculative step's rows: an item's last token and its
        drafts), as a packed step's tokens see them."""
        flags = self.forced_of(items, per_token)
        forced.fill(False)
        forced[: len(flags)] = flags
        if self.uses_confidence:
            confidence[len(flags) :].fill_(1.0)
            if flags:
                confidence[: len(flags)].copy_(self.confidence_rows(items, per_token))

    def observe(self, logits: torch.Tensor, items: list[Scheduled]) -> None:
        """The rows' sampled distributions (raw logits [S, V], in `items`' order): each
        request's top probability, kept for its next step (device work only)."""
        if not self.uses_confidence or not items:
            return
        top = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
        slots = to_device([self._slot(item.request.id) for item in items], self.device)
        self.top.index_copy_(0, slots, top)
