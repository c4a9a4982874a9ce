"""Gate policies on small tensors against hand-computed masks; the budget's bound; the grammar."""

from __future__ import annotations

import math

import pytest
import torch

from moetier.config import DeltaRule, EngineConfig
from moetier.gate.policies import (
    GateInputs,
    budget_count,
    budget_mask,
    decide,
    router_entropy,
    router_margin,
)
from moetier.gate.tables import hot_set, read_table, write_table

IDS = torch.tensor([[0, 1], [2, 3], [1, 2]])
WEIGHTS = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.55, 0.45]])
# router probabilities over 4 experts: uniform, one-hot, a close call
PROBS = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 1.0, 0.0], [0.1, 0.45, 0.4, 0.05]])


def mask(rule: str, **inputs) -> list[list[bool]]:
    parsed = DeltaRule.parse(rule)
    assert parsed is not None
    x = GateInputs(IDS, WEIGHTS, **inputs)
    return decide(parsed, x).tolist()


def test_weight_threshold_is_the_old_rule():
    assert mask("weight:0.45") == [[True, False], [True, False], [True, True]]
    assert EngineConfig(delta="weight:0.45").delta_threshold() == 0.45


def test_entropy_and_margin():
    assert torch.allclose(router_entropy(PROBS[:2]), torch.tensor([1.0, 0.0]))
    # third row: -(0.1 ln 0.1 + 0.45 ln 0.45 + 0.4 ln 0.4 + 0.05 ln 0.05) / ln 4
    h = -sum(p * math.log(p) for p in (0.1, 0.45, 0.4, 0.05)) / math.log(4)
    assert router_entropy(PROBS)[2].item() == pytest.approx(h, rel=1e-6)
    assert torch.allclose(router_margin(PROBS), torch.tensor([1.0, 0.0, 0.95]))
    assert mask("entropy:0.5", router_probs=PROBS) == [[True, True], [False, False], [True, True]]
    assert mask("margin:0.9", router_probs=PROBS) == [[True, True], [False, False], [True, True]]
    assert mask("margin:0.99", router_probs=PROBS) == [[True, True], [False, False], [False, False]]


def test_previous_token_confidence():
    conf = torch.tensor([0.9, 0.2, 0.5])  # uncertainty 0.1, 0.8, 0.5
    assert mask("confidence:0.5", confidence=conf) == [[False, False], [True, True], [True, True]]
    # no previous distribution: nothing is uncertain
    assert mask("confidence:0.5") == [[False, False]] * 3


def test_sensitivity_table_and_sum_of_products():
    table = torch.tensor([1.0, 0.0, 2.0, 0.5])
    # weight * sensitivity: [[0.6, 0], [1.4, 0.15], [0, 0.9]]
    got = mask("weight*sensitivity:0.5", tables={"sensitivity": table})
    assert got == [[True, False], [True, False], [False, True]]
    # + entropy [1, 0, h3 ~ 0.77]: [[1.6, 1.0], [1.4, 0.15], [0.77, 1.67]]
    got = mask("weight*sensitivity+entropy:1.2", tables={"sensitivity": table}, router_probs=PROBS)
    assert got == [[True, False], [True, False], [False, True]]


def test_budget_keeps_the_best_pairs():
    # 6 pairs, 50%: the 3 largest weights (0.7, 0.6, 0.55)
    assert mask("budget:0.5:weight") == [[True, False], [True, False], [True, False]]
    assert mask("budget:0:weight") == [[False, False]] * 3
    assert mask("budget:1:weight") == [[True, True]] * 3


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25, 0.33, 0.5, 0.9, 1.0])
def test_budget_never_exceeds_its_fraction(fraction):
    gen = torch.Generator().manual_seed(3)
    for tokens, k in [(1, 4), (3, 8), (7, 2), (64, 4), (5, 1)]:
        scores = torch.rand(tokens, k, generator=gen)
        scores[0] = scores[0, 0]  # ties
        m = budget_mask(scores, fraction)
        assert m.sum().item() <= fraction * tokens * k + 1e-9
        assert m.sum().item() == math.floor(fraction * tokens * k + 1e-9)
        if m.any() and not m.all():  # best first: every kept score >= every dropped one
            assert scores[m].min() >= scores[~m].max()


@pytest.mark.parametrize("fraction", [0.1, 0.125, 0.224, 0.25, 0.3])
def test_a_budget_carries_fractions_of_a_pair_across_layers(fraction):
    """At batch 1 a layer's share of a pair (8 pairs x 10% = 0.8) is not dropped in every
    layer: layers 0..L-1 take floor(L F p) pairs together, none more than ceil(F p), and where
    F p is whole every layer takes exactly that."""
    for pairs, layers in [(8, 8), (8, 48), (4, 5), (6, 61), (2048, 5)]:
        counts = [budget_count(pairs, fraction, layer) for layer in range(layers)]
        assert sum(counts) == math.floor(layers * fraction * pairs + 1e-9)
        assert max(counts) <= math.ceil(fraction * pairs - 1e-9)
        assert min(counts) >= math.floor(fraction * pairs + 1e-9)
        if float(fraction * pairs).is_integer():
            assert set(counts) == {int(fraction * pairs)}
        scores = torch.rand(1, pairs, generator=torch.Generator().manual_seed(pairs))
        for layer in range(layers):
            kept = budget_mask(scores, fraction, layer)
            assert kept.sum() == counts[layer]
            if kept.any() and not kept.all():
                assert scores[kept].min() >= scores[~kept].max()
    # 8 layers of one token's 8 pairs at 10%: 6 pairs, where a floor per call gave none
    assert sum(budget_count(8, 0.1, layer) for layer in range(8)) == 6
    x = GateInputs(torch.zeros(1, 8, dtype=torch.long), torch.rand(1, 8))
    rule = DeltaRule.parse("budget:0.1:weight")
    assert sum(int(decide(rule, x, layer).sum()) for layer in range(8)) == 6


def test_a_budget_carries_on_over_moe_layers_only():
    """Layer numbers skip dense layers (DeepSeek's first three, models with a MoE layer every
    other layer): the carried fraction goes to the next MoE layer, so 8 MoE layers at odd
    numbers with 2 pairs a call at 25% take 4 pairs, not one in every layer."""
    from moetier.gate.state import Gate

    odd = list(range(1, 16, 2))
    gate = Gate(DeltaRule.parse("budget:0.25:weight"), moe_layers=odd)
    ids, weights = torch.tensor([[0, 1]]), torch.tensor([[0.7, 0.3]])
    hidden = torch.zeros(1, 4)
    masks = [gate.decide(layer, hidden, ids, weights) for layer in odd]
    assert sum(int(m.sum()) for m in masks) == 4
    assert all(not m[0, 1] for m in masks)  # the best pair first


def test_forced_rows_and_resident_only():
    forced = torch.tensor([False, True, False])
    assert mask("weight:0.5", forced=forced) == [[True, False], [True, True], [True, False]]
    resident = torch.tensor([True, False, True, False])  # deltas of experts 0 and 2 on the GPU
    got = mask("resident:weight:0.3", resident=resident)
    assert got == [[True, False], [True, False], [False, True]]
    # without a resident vector (every delta pinned) the rule is the plain one
    assert mask("resident:weight:0.3") == [[True, True], [True, True], [True, True]]
    # `forced` as a term: only the forced rows
    assert mask("forced:1", forced=forced) == [[False, False], [True, True], [False, False]]


def test_random_is_a_uniform_draw():
    torch.manual_seed(11)
    got = mask("random:0.7")
    torch.manual_seed(11)
    assert got == (torch.rand(3, 2) >= 0.7).tolist()
    torch.manual_seed(0)
    x = GateInputs(torch.zeros(4000, 4), torch.ones(4000, 4))
    big = decide(DeltaRule.parse("random:0.75"), x)
    assert abs(big.float().mean().item() - 0.25) < 0.02


def test_hot_set_and_table_files(tmp_path):
    # layer 0: expert 2 has half the pairs, 0 a third, 1 a sixth, 3 none
    trace = torch.tensor([[[2, 0], [2, 1], [2, 0]]])
    assert hot_set(trace, 4, 0.5) == {0: [0.0, 0.0, 1.0, 0.0]}
    assert hot_set(trace, 4, 0.9) == {0: [1.0, 0.0, 1.0, 0.0]}
    write_table(tmp_path / "t.json", "hot", {0: [0.0, 1.0], 3: [0.5, 0.25]}, "test")
    got = read_table(tmp_path / "t.json")
    assert got[0].tolist() == [0.0, 1.0] and got[3].tolist() == [0.5, 0.25]
    with pytest.raises(ValueError, match="gate table"):
        read_table(tmp_path / "missing.json")


def test_grammar():
    rule = DeltaRule.parse("resident:budget:0.25:weight*sensitivity@/x/t.json+entropy")
    assert rule == DeltaRule(
        (("weight", "sensitivity@/x/t.json"), ("entropy",)), None, 0.25, True, False
    )
    assert rule.terms() == {"weight", "sensitivity", "entropy"}
    assert DeltaRule.parse("none") is None
    assert DeltaRule.parse("all") == DeltaRule(everywhere=True)
    assert math.isnan(EngineConfig(delta="budget:0.25:weight").delta_threshold())
    assert EngineConfig(delta="all").delta_threshold() == 0.0
    assert EngineConfig(delta="none").delta_threshold() is None
    for bad in ["weight", "budget:1.5:weight", "budget:0.2:", "speed:0.3", "weight@f:0.3",
                "weight:nan", "budget:x:weight"]:  # fmt: skip
        with pytest.raises(ValueError, match="--delta"):
            EngineConfig(delta=bad).delta_rule()
