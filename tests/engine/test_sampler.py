from __future__ import annotations

import pytest
import torch

from moetier.engine.sampler import SamplingParams, sample


def logits(seed: int = 0, batch: int = 3, vocab: int = 50) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_degenerate_filters_pick_argmax():
    x = logits()
    expected = x.argmax(-1)
    assert torch.equal(sample(x, SamplingParams(temperature=0), None), expected)
    assert torch.equal(
        sample(x, SamplingParams(temperature=1, top_k=1), torch.Generator()), expected
    )
    assert torch.equal(
        sample(x, SamplingParams(temperature=1, top_p=1e-6), torch.Generator()), expected
    )


def test_seed_reproducible():
    x = logits(1)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20)
    a = [sample(x, p, torch.Generator().manual_seed(5)) for _ in range(3)]
    assert all(torch.equal(a[0], t) for t in a)


def test_frequencies_follow_the_filtered_distribution():
    x = logits(2, batch=1, vocab=8)
    p = SamplingParams(temperature=0.8, top_k=4, top_p=1.0)
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(x, p, gen) for _ in range(4000)]).flatten()
    counts = torch.bincount(draws, minlength=8).float() / draws.numel()
    probs = (x[0] / 0.8).softmax(-1)
    keep = probs.topk(4).indices
    expected = torch.zeros(8)
    expected[keep] = probs[keep] / probs[keep].sum()
    assert counts[expected == 0].sum() == 0  # never outside the top-k
    assert (counts - expected).abs().max() < 0.03


def test_top_p_keeps_smallest_nucleus():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = {int(sample(x, SamplingParams(temperature=1, top_p=0.8), gen)) for _ in range(300)}
    assert draws == {0, 1}  # 0.5 + 0.3 reaches 0.8


def test_rejects_bad_params():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
