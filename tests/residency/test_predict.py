"""Prefetch prediction on a tiny random Qwen3-MoE, against a brute-force per-token reference."""

from __future__ import annotations

import math

import pytest
import torch

from moetier.residency.predict import predict_experts, prediction_quality


def brute_force_topk(h, router_weight, m, norm_weight, eps):
    """One token at a time, one expert at a time, in Python floats."""
    out = []
    for x in h.tolist():
        rms = math.sqrt(sum(v * v for v in x) / len(x) + eps)
        xn = [v / rms * w for v, w in zip(x, norm_weight.tolist(), strict=True)]
        logits = [
            sum(a * b for a, b in zip(xn, row, strict=True)) for row in router_weight.tolist()
        ]
        out.append(sorted(range(len(logits)), key=lambda e: -logits[e])[:m])
    return out


@pytest.fixture(scope="module")
def captured(tiny):
    """Each layer's input, output, post-attention residual (what its router sees, before the
    norm) and the experts its router chose, for 24 tokens of a tiny random qwen3_moe."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3_moe"), dtype=torch.float32)
    model.eval()
    rec: dict[str, dict[int, torch.Tensor]] = {"in": {}, "out": {}, "resid": {}, "topk": {}}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(
            layer.register_forward_pre_hook(lambda m, a, i=i: rec["in"].__setitem__(i, a[0][0]))
        )
        hooks.append(
            layer.register_forward_hook(
                lambda m, a, o, i=i: rec["out"].__setitem__(
                    i, (o[0] if isinstance(o, tuple) else o)[0]
                )
            )
        )
        hooks.append(
            layer.post_attention_layernorm.register_forward_pre_hook(
                lambda m, a, i=i: rec["resid"].__setitem__(i, a[0][0])
            )
        )
        hooks.append(
            layer.mlp.gate.register_forward_hook(
                lambda m, a, o, i=i: rec["topk"].__setitem__(i, o[2])
            )
        )
    ids = torch.randint(3, 320, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return model, rec


def layer_router(model, i):
    layer = model.model.layers[i]
    return layer.mlp.gate.weight.detach(), layer.post_attention_layernorm


@pytest.mark.parametrize("m", [1, 2, 5])
def test_prediction_matches_brute_force(captured, m):
    model, rec = captured
    weight, norm = layer_router(model, 1)
    got = predict_experts(rec["out"][0], weight, m, norm.weight.detach(), norm.variance_epsilon)
    assert got.shape == (24, m) and got.dtype == torch.int64
    ref = brute_force_topk(rec["out"][0], weight, m, norm.weight.detach(), norm.variance_epsilon)
    assert got.tolist() == ref


def test_the_routers_own_input_reproduces_its_choice(captured):
    model, rec = captured
    for i in range(len(model.model.layers)):
        weight, norm = layer_router(model, i)
        pred = predict_experts(
            rec["resid"][i], weight, 2, norm.weight.detach(), norm.variance_epsilon
        )
        assert torch.equal(pred.sort(-1).values, rec["topk"][i].sort(-1).values)
        q = prediction_quality(pred, rec["topk"][i])
        assert (q.precision, q.recall) == (1.0, 1.0)


def test_precision_and_recall_against_sets(captured):
    model, rec = captured
    weight, norm = layer_router(model, 1)
    actual = rec["topk"][1]
    for source in ("in", "out"):
        pred = predict_experts(
            rec[source][0], weight, 4, norm.weight.detach(), norm.variance_epsilon
        )
        q = prediction_quality(pred, actual)
        correct = sum(
            len(set(p) & set(a)) for p, a in zip(pred.tolist(), actual.tolist(), strict=True)
        )
        assert q.correct == correct
        assert q.precision == pytest.approx(correct / (24 * 4))
        assert q.recall == pytest.approx(correct / (24 * 2))


def test_hand_computed_quality_and_errors():
    q = prediction_quality(torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([[1, 7], [9, 8]]))
    assert (q.correct, q.precision, q.recall) == (1, 1 / 6, 1 / 4)
    with pytest.raises(ValueError, match=r"m must be in 1..4"):
        predict_experts(torch.zeros(2, 3), torch.zeros(4, 3), 5)
    with pytest.raises(ValueError, match="hidden must be"):
        predict_experts(torch.zeros(2, 3), torch.zeros(4, 2), 1)
