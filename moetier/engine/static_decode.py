"""Batched prefill + decode of a native model over one static KV cache.

Rows are right-padded in prefill (see models/layers.py: a pad token's cache entries are
overwritten by its row's decode tokens before any query can see them). A decode step reads its
inputs from static buffers (`input_ids` [B, 1], `positions` [B, 1]) and writes logits [B, V]: one
fixed-shape call, which is what a CUDA graph captures (`step_static`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn


class StaticDecoder:
    """Decodes `batch` sequences together with a KV cache of `max_len` positions."""

    def __init__(
        self,
        model: nn.Module,
        batch: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        compile_step: bool = False,
    ) -> None:
        """compile_step: run the decode step through torch.compile (inductor fuses the norms,
        rotary and residual adds into a few Triton kernels; CUDA only, compiled on first use)."""
        self.model = model
        self.batch, self.max_len = batch, max_len
        self.cache: torch.Tensor = model.new_cache(batch, max_len, dtype, device)  # type: ignore[operator]
        self.input_ids = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        self.cache_used = False  # whether prefill ran
        self.compile_step = compile_step

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], pad_id: int = 0) -> torch.Tensor:
        """Right-padded prefill of one prompt per row -> logits [B, V] of each row's last prompt
        token; leaves `positions` at each row's next position."""
        if len(prompts) != self.batch or not all(prompts):
            raise ValueError(f"prefill takes {self.batch} non-empty prompts")
        longest = max(len(p) for p in prompts)
        if longest >= self.max_len:
            raise ValueError(f"a prompt of {longest} tokens leaves no room in {self.max_len}")
        device = self.input_ids.device
        ids = torch.tensor([p + [pad_id] * (longest - len(p)) for p in prompts], device=device)
        positions = torch.arange(longest, device=device).expand(self.batch, -1)  # [B, T]
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        logits = self.model(ids, positions, self.cache, last_only=lengths - 1)  # [B, V]
        self.positions.copy_(lengths[:, None])
        self.cache_used = True
        return logits

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] at each row's current position -> logits [B, V]; positions advance."""
        self.input_ids.copy_(tokens[:, None])
        logits = self.step_static()
        self.positions.add_(1)
        return logits

    def step_static(self) -> torch.Tensor:
        """One decode step from the static buffers (no host sync, fixed shapes) -> [B, V]."""
        step = _compiled_step() if self.compile_step else _step
        return step(self.model, self.input_ids, self.positions, self.cache)

    def capture(self, greedy: bool = False) -> Callable[[], torch.Tensor]:
        """A CUDA graph of one `step`: returns replay() -> logits [B, V] (a static buffer,
        valid until the next replay), which reads `input_ids` and `positions` and advances
        the positions; with `greedy` it also writes each row's argmax into `input_ids` (the
        next step's tokens, no host round trip). Call after prefill, with `input_ids` already
        holding the next tokens: the warm-up step writes the same cache entries the first
        replay writes again."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            self.step_static()  # warm-up (and compilation) outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            logits = self.step_static()
            if greedy:
                self.input_ids.copy_(logits.argmax(-1)[:, None])
            self.positions.add_(1)

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt (tokens past an eos are the caller's to trim)."""
        if max(len(p) for p in prompts) + max_new_tokens > self.max_len:
            raise ValueError("prompt + max_new_tokens exceeds the cache length")
        logits = self.prefill(prompts)
        out = []
        for i in range(max_new_tokens):
            tokens = logits.argmax(dim=-1)  # [B]
            out.append(tokens)
            if i + 1 < max_new_tokens:
                logits = self.step(tokens)
        return torch.stack(out, dim=1).tolist()  # one host sync, at the end


def _step(
    model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor
) -> torch.Tensor:
    return model(input_ids, positions, cache)[:, 0]


@functools.cache
def _compiled_step() -> Callable[..., torch.Tensor]:
    """One compiled step shared by every decoder, so decoders of one model run the same kernels
    (inductor autotunes some kernels on first use; two compilations could pick different ones)."""
    return torch.compile(_step, dynamic=False)
