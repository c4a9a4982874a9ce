"""Samples a step's rows: one row of logits per request that samples in the step -> its next
token. Each request samples with its own generator (seeded from its SamplingParams), so what it
draws does not depend on which requests share its steps. The runners (engine/runner.py) derive
from StepSampler.
"""

from __future__ import annotations

import sys

import torch

from moetier.engine.sampler import SamplingParams, sample
from moetier.engine.scheduler import Scheduled


class StepSampler:
    """Per-request generators and the sampling of one step's rows."""

    device: torch.device

    def __init__(self) -> None:
        self.generators: dict[str, torch.Generator] = {}
        self.positions_run = 0  # positions computed over the runner's life (tests, metrics)

    def release(self, request_id: str) -> None:
        """Forget a finished or preempted-for-good request's state."""
        self.generators.pop(request_id, None)

    def _sample(self, logits: torch.Tensor, items: list[Scheduled]) -> dict[str, int]:
        """logits [S, V], one row per item (in order) -> request id -> token. A row whose
        sampling fails is left out (the engine ends that request alone)."""
        out: dict[str, int] = {}
        params_of = [
            item.request.params if item.request.params is not None else SamplingParams()
            for item in items
        ]
        greedy = [row for row, params in enumerate(params_of) if params.temperature == 0]
        if greedy:  # one argmax and one device-to-host copy for every greedy row
            rows = torch.tensor(greedy, device=logits.device)
            tokens = logits.index_select(0, rows).float().argmax(dim=-1).tolist()
            out.update(
                (items[row].request.id, tok) for row, tok in zip(greedy, tokens, strict=True)
            )
        for row, item in enumerate(items):
            request = item.request
            params = params_of[row]
            if params.temperature == 0:
                continue
            try:
                generator = self._generator(request.id, getattr(params, "seed", None))
                out[request.id] = int(sample(logits[row : row + 1], params, generator)[0])
            except (RuntimeError, ValueError) as exc:
                print(f"moetier: sampling failed for {request.id}: {exc}", file=sys.stderr)
        return out

    def forget_kv(self, request_id: str) -> None:
        """A preempted request's KV outside the page pool, if any, is dropped (it is
        recomputed when it runs again). The paged cache holds none."""

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if request_id not in self.generators:
            self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[request_id]
