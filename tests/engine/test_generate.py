from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tiny_models import TEXT, build_tokenizer

from moetier.config import EngineConfig, replace
from moetier.engine import generate as generate_module
from moetier.engine import graph_placement
from moetier.engine.detokenizer import StreamingDetokenizer
from moetier.engine.generate import Generator
from moetier.engine.graph_placement import place_for_graphs
from moetier.engine.sampler import SamplingParams
from moetier.engine.static_decode import StaticDecoder
from moetier.loader.load import load_model


@pytest.fixture(scope="module")
def generator(tiny):
    return Generator(load_model(tiny.store("qwen3_moe"), EngineConfig(native=False, device="cpu")))


def test_detokenizer_streams_exact_text_and_honours_stop():
    tok = build_tokenizer()
    text = "naïve café — the quick brown fox jumps"
    ids = tok.encode(text)
    detok = StreamingDetokenizer(tok, ())
    assert "".join(detok.push(t)[0] for t in ids) + detok.flush() == text
    detok = StreamingDetokenizer(tok, ("brown fox",))
    out, stopped = "", False
    for t in ids:
        piece, stopped = detok.push(t)
        out += piece
        if stopped:
            break
    assert stopped and out == "naïve café — the quick " and detok.matched == "brown fox"


def test_stream_equals_generate_and_counts_tokens(generator):
    ids = generator.prompt_ids(TEXT[:40])
    params = SamplingParams(max_new_tokens=12, temperature=0.9, seed=3)
    deltas = list(generator.stream(ids, params))
    full = generator.generate(ids, params)
    assert "".join(d.text for d in deltas) == full.text
    assert deltas[-1].finish_reason == full.finish_reason
    assert sum(len(d.token_ids) for d in deltas) == len(full.token_ids)
    if full.finish_reason == "length":
        assert len(full.token_ids) == 12
    assert full.text == generator.tokenizer.decode(full.token_ids, skip_special_tokens=True)


def test_stop_string_cuts_output(generator):
    ids = generator.prompt_ids("Hello")
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    text = generator.generate(ids, greedy).text
    assert len(text) > 6
    stop = text[3:6]
    first = text.index(stop)
    result = generator.generate(ids, SamplingParams(max_new_tokens=24, temperature=0, stop=(stop,)))
    assert result.finish_reason == "stop"
    assert result.text == text[:first]


def test_chat_prompt_uses_template(generator):
    ids = generator.chat_prompt_ids([{"role": "user", "content": "Hi"}])
    assert (
        generator.tokenizer.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_generation_stops_when_the_context_is_full(generator):
    limit = generator.max_context
    ids = (generator.prompt_ids(TEXT) * limit)[: limit - 3]
    result = generator.generate(ids, SamplingParams(max_new_tokens=50, temperature=0))
    assert len(result.token_ids) <= 3 and result.finish_reason in ("length", "stop")
    if result.finish_reason == "length":
        assert len(result.token_ids) == 3
    with pytest.raises(ValueError, match="context is"):
        generator.generate(ids + [1, 2, 3], SamplingParams(max_new_tokens=5))


def test_native_model_generates_as_transformers_path(tiny, generator):
    """`--native`: the same Generator over the native model's static cache gives the same
    greedy tokens and the same seeded samples."""
    native = Generator(load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True)))
    ids = generator.prompt_ids(TEXT[:40])
    for params in (
        SamplingParams(max_new_tokens=16, temperature=0),
        SamplingParams(max_new_tokens=12, temperature=0.9, seed=3),
    ):
        assert native.generate(ids, params).token_ids == generator.generate(ids, params).token_ids


def test_cuda_graph_needs_cuda_and_a_native_model(tiny, generator):
    assert not generator.graphs  # transformers path, CPU
    native = Generator(load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True)))
    assert not native.graphs  # CPU: eager decode, nothing pinned
    assert not native.loaded.runtime.pinned


def eager_capture(self: StaticDecoder) -> Callable[[], torch.Tensor]:
    """Stand-in for `StaticDecoder.capture` on CPU: the same step and position advance, run
    eagerly at each "replay"."""

    def replay() -> torch.Tensor:
        logits = self.step_static()
        self.positions.add_(1)
        return logits

    return replay


def test_graphed_path_on_cpu(tiny, generator, monkeypatch):
    """The Generator's graphed path (buckets, reuse, one stream at a time) with the capture
    replaced by the same step run eagerly, on CPU: the tokens of the eager native path; a second
    stream while one is open is refused (they would share a KV cache) until the first closes."""

    monkeypatch.setattr(StaticDecoder, "capture", eager_capture)
    monkeypatch.setattr(generate_module, "GRAPH_MIN_BUCKET", 32)
    native = Generator(load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True)))
    native.graphs = True
    ids = native.prompt_ids(TEXT[:40])[:20]
    params = SamplingParams(max_new_tokens=10, temperature=0)
    for prompt_ids in (ids, ids[:12]):  # both in bucket 32: the second reuses the decoder
        assert (
            native.generate(prompt_ids, params).token_ids
            == generator.generate(prompt_ids, params).token_ids
        )
    assert list(native._decoders) == [(1, 32)]  # (rows, bucket)
    first = native.stream(ids, SamplingParams(max_new_tokens=40, temperature=0, stop=()))
    next(first)
    with pytest.raises(RuntimeError, match="another generation is still running"):
        next(native.stream(ids, params))
    first.close()
    assert not native._busy
    assert len(native.generate(ids, params).token_ids) > 0


def test_zero_copy_when_experts_do_not_fit(tiny, generator, monkeypatch):
    """Experts that do not all fit the expert cache, with a host tier: the Generator keeps the
    graphed path through zero-copy mode (hot blobs in slots, the rest read from host rows), gives
    the tokens of the eager path, and rebalances the hot set between steps. (CPU: the capture is
    replaced by the same step run eagerly; zero-copy gathers the host rows.)"""

    monkeypatch.setattr(StaticDecoder, "capture", eager_capture)
    monkeypatch.setattr(generate_module, "GRAPH_MIN_BUCKET", 32)
    monkeypatch.setattr(graph_placement, "ZERO_COPY_REBALANCE_TOKENS", 3)
    config = EngineConfig(device="cpu", native=True, expert_cache_slots=4, host_memory="64MiB")
    native = Generator(load_model(tiny.store("qwen3_moe"), config))
    assert not native.graphs  # CPU
    native.graphs = place_for_graphs(native.loaded)
    zero_copy = native.loaded.runtime.zero_copy
    assert native.graphs and zero_copy is not None and not native.loaded.runtime.pinned
    ids = native.prompt_ids(TEXT[:40])[:20]
    params = SamplingParams(max_new_tokens=10, temperature=0, stop=())
    assert native.generate(ids, params).token_ids == generator.generate(ids, params).token_ids
    assert zero_copy.scores.sum() > 0  # rebalanced: counts folded into the scores


def test_zero_copy_staging_in_the_generator(tiny, generator, monkeypatch):
    """With room (a quarter of the cache holds a staging slot per MoE layer), the Generator's
    zero-copy mode also stages the next layer's guesses each decode step (--zero-copy-stage),
    guessed from each layer's output: same tokens as the eager path, guesses really copied;
    --zero-copy-stage 0 and a cache too
    small for it leave staging off."""
    monkeypatch.setattr(StaticDecoder, "capture", eager_capture)
    monkeypatch.setattr(generate_module, "GRAPH_MIN_BUCKET", 32)
    store = tiny.store("qwen3_moe")
    ids = generator.prompt_ids(TEXT[:40])[:20]
    params = SamplingParams(max_new_tokens=10, temperature=0, stop=())
    want = generator.generate(ids, params).token_ids
    for slots, stage, staged in ((12, 2, 1), (12, 0, 0), (7, 2, 0)):
        config = EngineConfig(device="cpu", native=True, expert_cache_slots=slots,
                              host_memory="64MiB", zero_copy_stage=stage)  # fmt: skip
        native = Generator(load_model(store, config))
        native.graphs = place_for_graphs(native.loaded)
        zero_copy = native.loaded.runtime.zero_copy
        assert zero_copy is not None and zero_copy.stage == staged  # 12 // (4 * 2 layers) = 1
        assert native.generate(ids, params).token_ids == want
        assert (int(zero_copy.staged_blobs) > 0) == (staged > 0)
        # native layers hand their output over (`after_layer`): the guesses come from it
        assert native.loaded.runtime.guess_from == ("output" if staged else "input")


@pytest.mark.gpu
@pytest.mark.parametrize("compile_decode", [False, True])
def test_cuda_graph_decode_equals_eager(tiny, compile_decode, monkeypatch):
    """Serving's decode path on CUDA (experts pinned, each step replayed from the graph of its
    context bucket) gives the tokens of eager decode: two requests in one bucket (the second
    reuses the first's decoder and graph over a cache holding the first's entries), one in a
    larger bucket, then the first bucket again."""
    monkeypatch.setattr(generate_module, "GRAPH_MIN_BUCKET", 32)  # the tiny context is 256
    store = tiny.store("qwen3_moe")
    config = EngineConfig(device="cuda", dtype="float32", native=True)
    eager = Generator(load_model(store, replace(config, cuda_graph=False)))
    graphed = Generator(load_model(store, replace(config, compile_decode=compile_decode)))
    assert graphed.graphs and graphed.loaded.runtime.pinned and not eager.graphs
    ids = eager.prompt_ids(TEXT[:40])[:20]
    greedy = SamplingParams(max_new_tokens=12, temperature=0, stop=())
    cases = [  # (prompt, params, bucket: the power of two >= prompt + new tokens, from 32)
        (ids, greedy, 32),
        (ids[:15], SamplingParams(max_new_tokens=10, temperature=0.9, seed=3), 32),
        (ids, SamplingParams(max_new_tokens=150, temperature=0), 256),
        (ids[:7], greedy, 32),
    ]
    first = None
    for prompt_ids, params, bucket in cases:
        want = eager.generate(prompt_ids, params).token_ids
        assert graphed.generate(prompt_ids, params).token_ids == want
        decoder, replay = graphed._decoders[(1, bucket)]
        assert replay is not None  # the decode steps ran from the graph
        if bucket == 32:
            first = first or (decoder, replay)
            assert (decoder, replay) == first  # reused, not captured again
    assert sorted(graphed._decoders) == [(1, 32), (1, 256)]


@pytest.mark.gpu
def test_cuda_graph_zero_copy_decode_equals_eager(tiny):
    """On CUDA, experts that do not fit 4 slots decode from CUDA graphs in zero-copy mode (the
    rest read from pinned host RAM by the kernel) with the tokens of eager decode."""
    store = tiny.store("qwen3_moe")
    config = EngineConfig(device="cuda", dtype="float32", native=True)
    eager = Generator(load_model(store, replace(config, cuda_graph=False)))
    limited = replace(config, expert_cache_slots=4, host_memory="64MiB")
    graphed = Generator(load_model(store, limited))
    assert graphed.graphs and graphed.loaded.runtime.zero_copy is not None
    ids = eager.prompt_ids(TEXT[:40])
    for params in (
        SamplingParams(max_new_tokens=16, temperature=0),
        SamplingParams(max_new_tokens=80, temperature=0.9, seed=3),  # past a rebalance
    ):
        assert graphed.generate(ids, params).token_ids == eager.generate(ids, params).token_ids


def test_pinned_pairs_are_counted_as_gpu_hits(tiny):
    """With every expert pinned the step touches no Python state; the Generator counts each
    forward's pairs instead, and the runtime's telemetry (what /metrics serves) reports them as
    hits of the pool's tier: tokens forwarded x MoE layers x top-k."""
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True))
    loaded.runtime.pin_all()
    native = Generator(loaded)
    ids = native.prompt_ids(TEXT[:40])
    done = native.generate(ids, SamplingParams(max_new_tokens=6, temperature=0, stop=()))
    sampled = len(done.token_ids) + (done.finish_reason == "stop")  # a sampled eos ends the loop
    forwarded = len(ids) + sampled - 1  # the prompt, then every sampled token but the last
    cfg = loaded.model_config
    assert loaded.runtime.pinned_pairs == forwarded * len(loaded.store.moe_layers) * cfg.top_k
    tel = loaded.runtime.telemetry()[loaded.runtime.residency.tier_name]  # "host" on CPU
    assert tel.hits == loaded.runtime.pinned_pairs + loaded.runtime.residency.stats.hits


def test_stream_rows_decodes_rows_together_as_each_alone(tiny, generator):
    """Rows decoded as one batch (one forward per step for all rows) give each row's tokens of
    decoding it alone, on both paths, for exactly the tokens asked (eos does not stop a row);
    the timing counts them. Prompts of different lengths: right-padded by the native path,
    refused by the transformers one."""
    native = Generator(load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", native=True)))
    text = generator.prompt_ids(TEXT)
    prompts = [text[:9], text[20:29], text[40:49]]
    for gen in (generator, native):
        together = list(gen.stream_rows(prompts, 5))  # [step][row]
        assert gen.timing.rows == 3
        assert (gen.timing.prompt_tokens, gen.timing.new_tokens) == (27, 15)
        for row, prompt in enumerate(prompts):
            alone = [step[0] for step in gen.stream_rows([prompt], 5)]
            assert [step[row] for step in together] == alone
    uneven = [text[:9], text[20:25]]
    steps = list(native.stream_rows(uneven, 4))
    assert [step[1] for step in steps] == [s[0] for s in native.stream_rows([text[20:25]], 4)]
    with pytest.raises(ValueError, match="use --native for prompts of different lengths"):
        list(generator.stream_rows(uneven, 4))
    with pytest.raises(ValueError, match="exceed this model's context"):
        list(generator.stream_rows([text[:9]], generator.max_context))


def test_stream_times_itself(generator):
    ids = generator.prompt_ids(TEXT[:40])
    done = generator.generate(ids, SamplingParams(max_new_tokens=7, temperature=0, stop=()))
    t = generator.timing
    assert t.prompt_tokens == len(ids) and t.rows == 1
    assert t.new_tokens == len(done.token_ids) + (done.finish_reason == "stop")  # eos sampled
    assert t.prefill_seconds > 0 and t.decode_seconds > 0
