from __future__ import annotations

import pytest
import torch

from moetier.engine.sampler import (
    SamplingParams,
    filtered_logits,
    filtered_rows,
    sample,
    sample_rows,
    sampling_tensors,
)


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


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_p", 0),
        ("top_p", float("nan")),
        ("temperature", -1),
        ("temperature", float("inf")),
        ("top_k", -1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0),
        ("logprobs", 21),
        ("prompt_logprobs", -1),
        ("grammar", ("yaml", "{}")),
    ],
)
def test_rejects_bad_params_naming_the_field_and_the_range(field, value):
    with pytest.raises(ValueError, match=f"^{field} = .*: use "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("bias", [((1, 101.0),), ((-1, 1.0),), ((1.5, 1.0),), ((1, 2, 3),)])
def test_rejects_bad_logit_bias(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


ROW_PARAMS = [
    SamplingParams(temperature=0.8, top_k=4, top_p=1.0),
    SamplingParams(temperature=1.0, top_k=0, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.8),
    SamplingParams(temperature=0.5, top_k=0, top_p=1.0),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1),
]
# chi-square critical values at p = 0.001 for 1..7 degrees of freedom
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32]


def test_sample_rows_follows_sample_distribution():
    """Each row of one batched call draws from `sample`'s filtered distribution (chi-square at
    p = 0.001 over 20000 draws per setting; never a token outside the filter)."""
    x = logits(2, batch=1, vocab=8)
    draws_per_setting = 20000
    params = [p for p in ROW_PARAMS for _ in range(draws_per_setting)]
    settings = sampling_tensors(params, "cpu")
    tokens = sample_rows(
        x.expand(len(params), -1), *settings, torch.Generator().manual_seed(0)
    ).view(len(ROW_PARAMS), draws_per_setting)
    for p, row in zip(ROW_PARAMS, tokens, strict=True):
        expected = filtered_logits(x, p).softmax(-1)[0]
        counts = torch.bincount(row, minlength=8).double()
        support = expected > 0
        assert counts[~support].sum() == 0, p
        exp_counts = expected[support].double() * draws_per_setting
        chi2 = ((counts[support] - exp_counts) ** 2 / exp_counts).sum().item()
        dof = int(support.sum()) - 1
        if dof > 0:
            assert chi2 < CHI2_999[dof - 1], (p, chi2)


def test_sample_rows_greedy_rows_are_argmax():
    x = logits(3, batch=6, vocab=50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 3
    out = sample_rows(x, *sampling_tensors(params, "cpu"), torch.Generator().manual_seed(1))
    assert torch.equal(out[0::2], x[0::2].argmax(-1))
    one = [SamplingParams(temperature=1, top_k=1), SamplingParams(temperature=1, top_p=1e-6)] * 3
    assert torch.equal(sample_rows(x, *sampling_tensors(one, "cpu"), None), x.argmax(-1))


def test_sample_rows_seed_reproducible():
    x = logits(4, batch=8, vocab=50)
    settings = sampling_tensors([SamplingParams(temperature=1.0, top_p=0.95)] * 8, "cpu")
    a, b, c = (sample_rows(x, *settings, torch.Generator().manual_seed(seed)) for seed in (5, 5, 6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_sample_rows_top_p_keeps_smallest_nucleus():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(500, -1)
    settings = sampling_tensors([SamplingParams(temperature=1, top_p=0.8)] * 500, "cpu")
    draws = set(sample_rows(x, *settings, torch.Generator().manual_seed(0)).tolist())
    assert draws == {0, 1}


def test_unsorted_filter_equals_the_sorted_one_without_top_k_and_top_p():
    x = logits(6, batch=5, vocab=64)
    settings = [(1.0, 0.0), (0.7, 0.05), (1.3, 0.3), (0.2, 0.9), (1.0, 1.0)]
    params = [SamplingParams(temperature=t, top_p=1.0, top_k=0, min_p=m) for t, m in settings]
    temperature, top_k, top_p, min_p = sampling_tensors(params, "cpu")
    sorted_ = filtered_rows(x, temperature, top_k, top_p, min_p)
    unsorted = filtered_rows(x, temperature, top_k, top_p, min_p, sort=False)
    assert torch.equal(sorted_, unsorted)
    assert (unsorted[1:].isinf().sum(-1) > 0).all()  # min-p dropped some in each row
