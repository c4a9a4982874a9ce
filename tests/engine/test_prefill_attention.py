"""A warm agent turn's first token (#42): a prompt whose prefix is in the prefix cache gets its
first token from one step that computes only the new tokens, captures no decode step, and
attends without cuDNN's SDPA (kernels/masked_attention.py's PREFILL_SDPA_BACKENDS: cuDNN builds an
execution plan for every new (query length, key length), and a prefill over a cached prefix has
a new one at nearly every turn); decode rows keep every backend. On CUDA, a turn of a new shape
costs about what a turn of a shape already seen costs."""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import pytest
import torch
import torch.nn.functional as F

from moetier.config import EngineConfig
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model
from moetier.models import layers

FP32 = EngineConfig(device="cpu", dtype="float32", native=True)
PAGE = 4


@pytest.fixture(scope="module")
def qwen3(tiny):
    return load_model(tiny.store("qwen3_moe"), FP32)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every SDPA call's query length and whether cuDNN's backend was enabled for it."""
    calls: list[tuple[int, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def recorded(q, *args, **kwargs):
        calls.append((q.shape[-2], torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    return calls


def _first_token(engine: Engine, rid: str, prompt: list[int], new: int = 4):
    """Run a request alone: -> (steps to its first token, positions those steps computed, its
    prefix hit, its output)."""
    before = engine.runner.positions_run
    request = engine.add(rid, prompt, SamplingParams(temperature=0, max_new_tokens=new))
    steps = 0
    while not request.output:
        engine.step()
        steps += 1
    computed = engine.runner.positions_run - before
    while engine.has_work:
        engine.step()
    return steps, computed, request.cached_tokens, list(request.output)


def test_a_warm_turn_computes_its_new_tokens_in_one_step_without_cudnn(qwen3, sdpa_calls):
    engine = Engine(qwen3, EngineLimits(num_pages=128, page_size=PAGE))
    engine.runner.fixed_shapes = True  # decode steps on graph-shaped inputs, as on CUDA
    vocab = qwen3.model_config.vocab_size
    conversation = [3 + (7 * i) % (vocab - 3) for i in range(37)]
    steps, computed, cached, answer = _first_token(engine, "turn-1", conversation)
    assert (steps, computed, cached) == (1, 37, 0)
    graphs = set(engine.runner.graphs)
    for turn in (2, 3):
        # the last turn's prompt and answer but its last token: its KV, in full pages, cached
        known = (len(conversation) + len(answer) - 1) // PAGE * PAGE
        conversation += answer + [5 + turn, 9, 11, 4, 6]
        sdpa_calls.clear()
        before = set(engine.runner.graphs)
        steps, computed, cached, answer = _first_token(engine, f"turn-{turn}", conversation)
        # the earlier turns' full pages came from the prefix cache: one step computed the rest
        assert (steps, computed, cached) == (1, len(conversation) - known, known)
        assert set(engine.runner.graphs) == before  # nothing captured on the way
        prefill = [cudnn for queries, cudnn in sdpa_calls if queries > 1]
        decode = [cudnn for queries, cudnn in sdpa_calls if queries == 1]
        assert prefill and not any(prefill)  # a plan per new shape: never for a prefill
        assert decode and all(decode)  # decode rows: the backends as PyTorch orders them
    assert set(engine.runner.graphs) >= graphs
    # the cold prompt of the same length (its own first token: nothing cached) computes it all
    cold = [conversation[0] + 1, *conversation[1:]]
    steps, computed, cached, _ = _first_token(engine, "cold", cold, new=1)
    assert (steps, computed, cached) == (1, len(cold), 0)


def test_masked_attention_is_sdpa():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 16, generator=gen) for n in (5, 9, 9))
    mask = torch.rand(1, 1, 5, 9, generator=gen) > 0.3
    mask[..., 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(layers.masked_attention(q, k, v, mask, 0.25), want)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the backends are as they were after it


@pytest.mark.gpu
def test_a_warm_turn_of_a_new_shape_costs_what_a_seen_shape_costs(tmp_path, monkeypatch):
    """bf16 on CUDA (the bench's tiny q2s shape): turns over cached prefixes of (chunk, context)
    shapes never run before take about as long as turns of a shape already run (with cuDNN's
    SDPA each new shape built a plan of tens of milliseconds). Every chunk length is run once
    beforehand over another prefix, so the kernels' specializations are compiled already."""
    from moetier.config import DEFAULT_STORE
    from moetier.quant.synthetic import shape, write_synthetic_store

    store = write_synthetic_store(tmp_path / "store", shape("tiny", 2), "q2s", DEFAULT_STORE)
    loaded = load_model(store, EngineConfig(device="cuda", native=True, compile_decode=False))
    engine = Engine(loaded, EngineLimits(num_pages=512, page_size=16))
    vocab = loaded.model_config.vocab_size

    slowest: dict[str, object] = {"ms": 0.0}
    compiled: list[str] = []  # the Triton kernels (and their specializations) compiled in turns

    def on_compile(*, repr: str, **_: object) -> bool:
        compiled.append(repr[:400])
        return False  # (True would skip the compile)

    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # Triton >= 3.4
        monkeypatch.setattr(knobs.runtime, "jit_cache_hook", on_compile)

    def turn(rid: str, prompt: list[int]) -> float:
        torch.cuda.synchronize()
        host = cProfile.Profile()  # where a slow turn's time went, for the failure's message
        host.enable()
        began = time.perf_counter()
        request = engine.add(rid, prompt, SamplingParams(temperature=0, max_new_tokens=1))
        while engine.has_work:  # one step: the first token is the last
            engine.step()
        torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - began)
        host.disable()
        assert request.output
        if rid != "fill" and ms > float(slowest["ms"]):  # type: ignore[arg-type]
            text = io.StringIO()
            pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(12)
            slowest.update(ms=ms, turn=rid, top=text.getvalue())
        return ms

    base = [10 + (11 * i) % (vocab - 10) for i in range(2000)]
    turn("fill", base)  # its pages cached: the later turns' prefixes
    chunks = [100 + 7 * n for n in range(1, 6)]
    for n, chunk in enumerate(chunks):  # each chunk length once, over a prefix of 512
        turn(f"warm-{n}", base[:512] + [12] * chunk)
    seen = [turn(f"seen-{i}", base[:1024] + [13 + i] * 161) for i in range(4)]  # one shape
    compiled.clear()
    new = [turn(f"new-{n}", base[: 1088 + 64 * n] + [12] * chunk) for n, chunk in enumerate(chunks)]
    if max(new) >= min(seen[1:]) + 15:  # pytest.fail: its message is not cut, as an assert's is
        kernels = "\n".join(compiled)
        pytest.fail(
            f"seen {seen}, new {new}\nTriton compiled during the new turns:\n{kernels}\n"
            f"slowest turn {slowest['turn']} ({slowest['ms']:.1f} ms):\n{slowest['top']}"
        )
