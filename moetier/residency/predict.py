"""Prefetch prediction: guess a later layer's experts from an earlier hidden state.

The guess applies the target layer's own router (and the RMSNorm in front of it) to a hidden
state the engine already has, e.g. the residual stream after layer L for layer L+1 (as
mixtral-offloading does). Routers rank experts by a linear score, so the top-m of the logits is
the top-m of the softmax; no probability is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def predict_experts(
    hidden: torch.Tensor,
    router_weight: torch.Tensor,
    m: int,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    router_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The `m` experts the router would pick for `hidden`, best first.

    hidden: [T, H] (any float dtype; computed in fp32); router_weight: [E, H];
    norm_weight: [H] weight of the RMSNorm before the router (None: no norm);
    router_bias: [E] added to the logits (e.g. DeepSeek's score-correction bias), or None.
    Returns [T, m] int64 expert ids."""
    if hidden.dim() != 2 or router_weight.dim() != 2 or hidden.shape[1] != router_weight.shape[1]:
        raise ValueError(
            f"hidden must be [T, H] and router_weight [E, H], got {tuple(hidden.shape)} and "
            f"{tuple(router_weight.shape)}"
        )
    if not 1 <= m <= router_weight.shape[0]:
        raise ValueError(f"m must be in 1..{router_weight.shape[0]} (experts), got {m}")
    x = hidden.float()
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_weight.float()
    logits = x @ router_weight.float().T  # [T, E]
    if router_bias is not None:
        logits = logits + router_bias.float()
    return torch.topk(logits, m, dim=-1).indices


@dataclass(frozen=True)
class PredictionQuality:
    """precision = correct guesses / guesses; recall = experts needed that were guessed."""

    tokens: int
    predicted_per_token: int
    needed_per_token: int
    correct: int

    @property
    def precision(self) -> float:
        return self.correct / (self.tokens * self.predicted_per_token) if self.tokens else 0.0

    @property
    def recall(self) -> float:
        return self.correct / (self.tokens * self.needed_per_token) if self.tokens else 0.0


def prediction_quality(predicted: torch.Tensor, actual: torch.Tensor) -> PredictionQuality:
    """predicted [T, m], actual [T, k] expert ids (distinct within a row)."""
    if predicted.dim() != 2 or actual.dim() != 2 or predicted.shape[0] != actual.shape[0]:
        raise ValueError(
            f"predicted [T, m] and actual [T, k] must have the same T, got "
            f"{tuple(predicted.shape)} and {tuple(actual.shape)}"
        )
    correct = (predicted[:, :, None] == actual[:, None, :]).any(-1).sum()  # [T, m] -> scalar
    return PredictionQuality(
        tokens=predicted.shape[0],
        predicted_per_token=predicted.shape[1],
        needed_per_token=actual.shape[1],
        correct=int(correct),
    )
