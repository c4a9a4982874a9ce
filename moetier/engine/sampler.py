"""Token sampling: greedy, temperature, top-k, top-p, seeded. Pure tensor ops on the logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Each field is also a CLI flag of `moetier generate`."""

    max_new_tokens: int = field(default=256, metadata={"help": "stop after this many new tokens"})
    temperature: float = field(default=0.7, metadata={"help": "0 = greedy"})
    top_p: float = field(default=0.95, metadata={"help": "nucleus sampling mass (1 = off)"})
    top_k: int = field(default=0, metadata={"help": "keep the k most likely tokens (0 = off)"})
    seed: int | None = field(
        default=None, metadata={"help": "random seed for reproducible sampling"}
    )
    stop: tuple[str, ...] = field(default=(), metadata={"help": "stop string (repeatable)"})

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64, same device)."""
    logits = logits.float()
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
