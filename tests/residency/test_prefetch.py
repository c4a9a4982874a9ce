"""Prefetch of the next layer's predicted experts and layer-streamed prefill: the blobs arrive
ahead of need (hits where blocking fetches would miss), prediction quality is counted, and the
numbers never change."""

from __future__ import annotations

import torch

from moetier.config import EngineConfig
from moetier.loader.load import load_model
from moetier.models.experts import router_weights
from moetier.residency.predict import predict_experts


def native(tiny, prefetch=False, stream=0, **engine):
    loaded = load_model(
        tiny.store("qwen3_moe"), EngineConfig(device="cpu", dtype="float32", native=True, **engine)
    )
    if prefetch:
        loaded.runtime.enable_prefetch(
            *router_weights(loaded.model, sorted(loaded.runtime.formats))
        )
    loaded.runtime.stream_tokens = stream
    return loaded


def greedy(loaded, prompt, steps):
    """Logits of a prompt and `steps` greedy decode steps, one token each."""
    cache = loaded.model.new_cache(1, 64, torch.float32, "cpu")
    outs = []
    with torch.no_grad():
        logits = loaded.model(prompt, torch.arange(prompt.shape[1])[None], cache)
        outs.append(logits)
        for t in range(prompt.shape[1], prompt.shape[1] + steps):
            logits = loaded.model(logits[:, -1:].argmax(-1), torch.tensor([[t]]), cache)
            outs.append(logits)
    return torch.cat(outs, dim=1)


def test_prediction_from_the_experts_input_is_the_next_router_on_the_same_residual():
    """The op sees x·r·w_L; scaling by w_N / w_L gives what layer N's norm + router would pick
    for the same residual x."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=gen)
    w_here, w_next = torch.rand(32, generator=gen) + 0.5, torch.rand(32, generator=gen) + 0.5
    router = torch.randn(16, 32, generator=gen)
    op_input = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w_here
    scaled = predict_experts(op_input * (w_next / w_here), router, 4)
    assert torch.equal(scaled, predict_experts(x, router, 4, norm_weight=w_next))


def test_decode_prefetch_counts_and_bit_identity(tiny):
    prompt = torch.randint(1, 300, (1, 1), generator=torch.Generator().manual_seed(6))
    full = greedy(native(tiny), prompt, 6)
    loaded = native(tiny, prefetch=True, expert_cache_slots=5, host_memory="64MiB")
    assert torch.equal(greedy(loaded, prompt, 6), full)
    gpu = loaded.runtime.residency.telemetry()["gpu"]
    top_k = loaded.model_config.top_k
    # one token per forward: each predicts top_k blobs of layer 1 and layer 1 asks for top_k
    assert gpu.prefetch_needed == 7 * top_k and gpu.prefetch_issued == 7 * top_k
    assert 0 < gpu.prefetch_used <= gpu.prefetch_issued
    assert 0 <= gpu.prefetch_precision <= 1 and gpu.prefetch_recall == gpu.prefetch_precision


def test_streamed_prefill_prefetches_the_next_chunk(tiny):
    """A prompt at the streaming threshold: each layer's experts in chunks of half the pool, the
    next chunk (and the next layer's first) copied while one computes; same logits, and the
    streamed copies turn what would be misses into hits."""
    prompt = torch.randint(1, 300, (1, 24), generator=torch.Generator().manual_seed(7))
    full = greedy(native(tiny), prompt, 0)
    plain = native(tiny, expert_cache_slots=4)
    streamed = native(tiny, stream=16, expert_cache_slots=4)
    assert torch.equal(greedy(plain, prompt, 0), full)
    assert torch.equal(greedy(streamed, prompt, 0), full)
    plain_stats, stats = plain.runtime.residency.stats, streamed.runtime.residency.stats
    assert plain_stats.hits == 0 and stats.hits > 0 and stats.misses < plain_stats.misses
    below = native(tiny, stream=25, expert_cache_slots=4)  # under the threshold: no streaming
    greedy(below, prompt, 0)
    assert below.runtime.residency.stats.hits == 0
