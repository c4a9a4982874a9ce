"""Token sampling: greedy, temperature, top-k, top-p, seeded. Pure tensor ops on the logits.

`sample` takes one SamplingParams for the batch; `sample_rows` takes per-row settings as tensors
and never syncs with the host (for captured decode steps).
"""

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
    if params.temperature == 0:
        return logits.float().argmax(dim=-1)
    probs = filtered_logits(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [B, V] -> fp32 logits / temperature with tokens outside top-k / top-p at -inf:
    the distribution `sample` draws from (temperature > 0)."""
    logits = logits.float() / params.temperature
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
    return logits


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Batched, sync-free `sample`: each row its own settings, no host sync, no data-dependent
    shape, so it captures into a CUDA graph.

    logits [B, V]; temperature [B] float (0 = greedy); top_k [B] int64 (0 = off); top_p [B] float
    in (0, 1] (1 = off) -> token ids [B] int64. Rows draw from the distribution `sample` draws
    from, by an exponential race (argmax of p / E, E ~ Exp(1), is a draw from p) in place of
    torch.multinomial; the noise comes from `generator`, so a seeded generator repeats."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = logits.argmax(dim=-1)
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)  # [B, V]
    # top-k: keep every token >= the k-th largest (ties kept, as `sample` does)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).clamp(min=1)
    kth = sorted_logits.gather(-1, (k - 1)[:, None])  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # top-p over what top-k left: drop a token when the mass before it already reaches top_p
    probs = sorted_logits.softmax(dim=-1)
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a 0 draw would make 0 / 0 for a dropped token
    choice = (probs / noise).argmax(dim=-1, keepdim=True)  # [B, 1], index into the sorted order
    sampled = order.gather(-1, choice).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy)


def sampling_tensors(
    params: list[SamplingParams], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature [B], top_k [B], top_p [B]) for `sample_rows`, built once per batch."""
    return (
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
    )
