"""The gate inside a model: a policy's masks reach the experts op as if given directly, the gate's
weight rule is the old threshold path bit for bit, entropy / margin see transformers' own router
probabilities, and (GPU) a gate decides without a host sync."""

from __future__ import annotations

import pytest
import torch

from moetier.config import EngineConfig
from moetier.gate.policies import budget_count
from moetier.gate.tables import write_table
from moetier.loader.load import load_model
from moetier.loader.quantize import convert_quantized

IDS = torch.randint(1, 320, (2, 16), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def store(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("gate") / "delta"
    convert_quantized(tiny.checkpoint("qwen3_moe"), path, delta="nvfp4", progress=False)
    return path


def load(store, delta):
    return load_model(store, EngineConfig(native=False, device="cpu", dtype="float32", delta=delta))


def greedy(loaded, steps=6):
    ids = IDS[:1]
    with torch.no_grad():
        for _ in range(steps):
            nxt = loaded.model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids[0, IDS.shape[1] :].tolist()


def test_gate_weight_rule_is_the_threshold_path(store):
    # the tiny random router spreads weight thinly (~1/8 per expert): 0.15 picks some pairs
    old = load(store, "weight:0.15")
    old.runtime.gate = None  # the runtime's own threshold path, without the gate
    new = load(store, "weight+forced:0.15")  # the same score through the gate
    assert new.runtime.gate is not None
    with torch.no_grad():
        a, b = old.model(IDS).logits, new.model(IDS).logits
    assert torch.equal(a, b)
    assert 0 < new.runtime.delta_pairs < new.runtime.pairs
    assert old.runtime.delta_pairs == new.runtime.delta_pairs


class Replay:
    """A gate stand-in that hands the experts op recorded masks, in call order."""

    def __init__(self, masks, rule):
        self.masks, self.rule, self.calls = list(masks), rule, 0

    def decide(self, layer, hidden, ids, weights, resident=None):
        layer_seen, mask = self.masks[self.calls]
        assert layer_seen == layer
        self.calls += 1
        return mask.clone()


def test_policy_equals_the_same_mask_given_directly(store):
    layers = sorted(load(store, "none").store.moe_layers)
    table = {layer: torch.rand(8, generator=torch.Generator().manual_seed(layer)).tolist()
             for layer in layers}  # fmt: skip
    write_table(store / "gate_sensitivity.json", "sensitivity", table, "random (test)")
    gated = load(store, "budget:0.25:weight*sensitivity+entropy")
    recorded = []
    decide = gated.runtime.gate.decide

    def recording(layer, hidden, ids, weights, resident=None):
        mask = decide(layer, hidden, ids, weights, resident)
        recorded.append((layer, mask.clone()))
        place = gated.runtime.gate.ordinal[layer]  # among the MoE layers
        assert mask.sum() == budget_count(ids.numel(), 0.25, place)  # the budget, exactly
        return mask

    gated.runtime.gate.decide = recording
    tokens = greedy(gated)
    with torch.no_grad():
        logits = gated.model(IDS[:1]).logits
    # the same masks handed to a model loaded with the delta, no policy
    direct = load(store, "weight+forced:0.5")
    direct.runtime.gate = Replay(recorded, direct.runtime.gate.rule)
    assert greedy(direct) == tokens
    with torch.no_grad():
        assert torch.equal(direct.model(IDS[:1]).logits, logits)
    assert direct.runtime.gate.calls == len(recorded)
    # and the policy matters: it is neither the base nor the delta everywhere
    base = load(store, "none")
    full = load(store, "all")
    with torch.no_grad():
        assert not torch.equal(base.model(IDS[:1]).logits, logits)
        assert not torch.equal(full.model(IDS[:1]).logits, logits)


def test_entropy_sees_the_routers_probabilities(store):
    loaded = load(store, "budget:0.5:entropy")
    gate = loaded.runtime.gate
    assert gate.needs_router and set(gate.routers) == set(loaded.store.moe_layers)
    seen, theirs = {}, {}
    inputs = gate.inputs

    def spy(layer, hidden, ids, weights, resident=None):
        x = inputs(layer, hidden, ids, weights, resident)
        seen[layer] = x.router_probs
        return x

    gate.inputs = spy
    hooks = []
    for layer in loaded.store.moe_layers:
        router = loaded.model.model.layers[layer].mlp.gate

        def hook(module, args, out, layer=layer):  # (logits, top-k scores, top-k indices)
            theirs[layer] = torch.softmax(out[0].float(), dim=-1)
            theirs[(layer, "ids")] = out[2]

        hooks.append(router.register_forward_hook(hook))
    with torch.no_grad():
        loaded.model(IDS)
    for layer in loaded.store.moe_layers:
        assert torch.allclose(seen[layer], theirs[layer], atol=1e-6)
        ids = theirs[(layer, "ids")]  # our probabilities' top-k is the router's choice
        ours = torch.topk(seen[layer], ids.shape[-1], dim=-1).indices
        assert torch.equal(ours.sort(-1).values, ids.sort(-1).values)


@pytest.mark.gpu
def test_gate_decides_without_host_sync(tmp_path):
    from moetier.config import DeltaRule
    from moetier.gate.state import Gate

    table = {0: torch.rand(32).tolist()}
    write_table(tmp_path / "gate_sensitivity.json", "sensitivity", table, "random (test)")
    terms = "weight*sensitivity+entropy+margin+confidence+random"
    rule = DeltaRule.parse(f"resident:budget:0.25:{terms}")
    gate = Gate(rule, tmp_path, "cuda")
    gate.set_routers({0: torch.randn(32, 64, device="cuda")})
    hidden = torch.randn(16, 64, device="cuda")
    ids = torch.randint(0, 32, (16, 4), device="cuda")
    weights = torch.rand(16, 4, device="cuda")
    gate.observe(torch.randn(16, 100, device="cuda"))
    gate.force(torch.zeros(16, dtype=torch.bool, device="cuda"))
    resident = torch.rand(32, device="cuda") < 0.5
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = gate.decide(0, hidden, ids, weights, resident)
        gate.observe(torch.randn(16, 100, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert mask.sum().item() <= 16
    assert not mask[~resident[ids]].any()
