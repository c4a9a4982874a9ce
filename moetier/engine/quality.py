"""Quality of a store against reference logits: KL divergence, top-1 agreement, perplexity.

The default protocol is llama.cpp's `llama-perplexity --kl-divergence`: the text is tokenised
once, cut into chunks of `ctx` tokens evaluated independently, and the second half of each chunk
is scored (the last `ctx // 2` next-token predictions), so figures compare with llama.cpp's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

Forward = Callable[[torch.Tensor], torch.Tensor]  # ids [B, T] -> logits [B, T, V]


@dataclass(frozen=True)
class QualityReport:
    chunks: int
    scored_tokens: int
    mean_kld: float
    median_kld: float
    p99_kld: float
    p999_kld: float
    same_top1: float
    ppl: float
    reference_ppl: float
    ppl_ratio: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# what must agree between a store and its reference for their logits to be compared: the
# vocabulary (the logits' width, the ids the store's tokenizer gives) and the model's geometry
# (ModelConfig fields; a store keeps its checkpoint's config.json)
MATCHED = (
    ("model_type", "model_type"),
    ("vocab_size", "vocab_size"),
    ("hidden_size", "hidden_size"),
    ("num_layers", "num_hidden_layers"),
    ("num_experts", "experts"),
    ("top_k", "experts per token"),
    ("expert_intermediate_size", "expert size"),
)


def reference_mismatch(store_config: dict[str, Any], reference_config: dict[str, Any]) -> str:
    """What differs between a store's config.json and its reference's, as 'vocab_size 8192 in
    the store, 320 in the reference; ...'; '' when they are the same model. A reference that is
    no MoE model moetier knows says why."""
    from moetier.config import ModelConfig

    ours = ModelConfig.from_hf(store_config)
    try:
        theirs = ModelConfig.from_hf(reference_config)
    except ValueError as err:
        return str(err)
    return "; ".join(
        f"{label} {getattr(ours, field)} in the store, {getattr(theirs, field)} in the reference"
        for field, label in MATCHED
        if getattr(ours, field) != getattr(theirs, field)
    )


def chunks(ids: list[int], ctx: int, max_chunks: int = 0) -> torch.Tensor:
    """Token ids -> [n, ctx] non-overlapping chunks (the tail that does not fill one is dropped);
    at most `max_chunks` of them (0: all). ValueError for a ctx under 2: a chunk scores its
    second half, the predictions from position ctx // 2 on, so it needs two tokens."""
    if ctx < 2:
        raise ValueError(
            f"chunks of {ctx} token(s): a chunk needs 2 or more (its second half is scored)"
        )
    n = len(ids) // ctx
    if max_chunks > 0:
        n = min(n, max_chunks)
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    return torch.tensor(ids[: n * ctx]).view(n, ctx)


def _scored(forward: Forward, batch: torch.Tensor, first: int) -> torch.Tensor:
    """log-probs of the scored predictions: [B, ctx - first, V] float64."""
    logits = forward(batch)[:, first - 1 : -1]  # position p predicts token p + 1
    return torch.log_softmax(logits.double(), dim=-1)


def compare(
    forward: Forward,
    reference: Forward,
    token_chunks: torch.Tensor,
    batch_size: int = 4,
    progress: Callable[[Iterator[torch.Tensor]], Iterator[torch.Tensor]] | None = None,
) -> QualityReport:
    """Score the second half of every chunk with both models and compare their distributions."""
    ctx = token_chunks.shape[1]
    first = ctx // 2
    klds, nll, ref_nll, same = [], 0.0, 0.0, 0
    batches: Iterator[torch.Tensor] = iter(token_chunks.split(batch_size))
    if progress is not None:
        batches = progress(batches)
    with torch.inference_mode():
        for batch in batches:
            logp = _scored(forward, batch, first)  # [B, S, V]
            ref_logp = _scored(reference, batch, first)
            targets = batch[:, first:].unsqueeze(-1)  # [B, S, 1]
            # KL(P_ref || P): sum_v p_ref (log p_ref - log p)
            kld = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # [B, S]
            klds.append(kld.flatten().clamp_min(0))
            nll -= logp.gather(-1, targets).sum().item()
            ref_nll -= ref_logp.gather(-1, targets).sum().item()
            same += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
    all_kld = torch.cat(klds)
    count = all_kld.numel()
    ppl, ref_ppl = math.exp(nll / count), math.exp(ref_nll / count)
    return QualityReport(
        chunks=token_chunks.shape[0],
        scored_tokens=count,
        mean_kld=all_kld.mean().item(),
        median_kld=all_kld.median().item(),
        p99_kld=torch.quantile(all_kld, 0.99).item(),
        p999_kld=torch.quantile(all_kld, 0.999).item(),
        same_top1=same / count,
        ppl=ppl,
        reference_ppl=ref_ppl,
        ppl_ratio=ppl / ref_ppl,
    )
