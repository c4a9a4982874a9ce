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


def test_streamed_chunk_kernels_are_queued_before_the_next_copies(tiny, monkeypatch):
    """Each streamed chunk: an event is marked, the chunk's kernel queued, then the next chunk's
    (or next layer's) copies issued waiting on that mark only, so the copies overlap the kernel
    and the kernel's launch does not wait for the copies' issue; no blob crosses twice in a
    layer."""
    loaded = native(tiny, stream=16, expert_cache_slots=4)
    runtime, pool = loaded.runtime, loaded.runtime.residency
    calls: list[tuple[str, object]] = []
    real_run, real_prefetch, real_copy_in = runtime._run, pool.prefetch, pool._copy_in

    def mark():
        token = object()  # stands in for the CUDA event
        calls.append(("mark", token))
        return token

    def run(layer, *args, **kwargs):
        calls.append(("run", layer))
        return real_run(layer, *args, **kwargs)

    def prefetch(keys, protect=(), after=None):
        calls.append(("prefetch", after))
        return real_prefetch(keys, protect)

    copied: list[tuple[int, int, str]] = []

    def copy_in(misses):
        copied.extend(key for key, _ in misses)
        return real_copy_in(misses)

    monkeypatch.setattr(pool, "mark", mark)
    monkeypatch.setattr(runtime, "_run", run)
    monkeypatch.setattr(pool, "prefetch", prefetch)
    monkeypatch.setattr(pool, "_copy_in", copy_in)
    prompt = torch.randint(1, 300, (1, 24), generator=torch.Generator().manual_seed(7))
    greedy(loaded, prompt, 0)
    kinds = [kind for kind, _ in calls]
    assert kinds and kinds == ["mark", "run", "prefetch"] * (len(kinds) // 3)
    for i in range(0, len(calls), 3):
        assert calls[i + 2][1] is calls[i][1]  # the copies wait on the mark before the kernel
    for layer in {key[0] for key in copied}:
        in_layer = [key for key in copied if key[0] == layer]
        assert len(in_layer) == len(set(in_layer)), layer
