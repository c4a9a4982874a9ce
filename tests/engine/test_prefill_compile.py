"""Packed steps through torch.compile (engine/prefill_compile.py): one compiled forward, made at
load on a dummy step that writes only the scratch page, serves every chunk length and context
after it without compiling again, and every request gets the tokens it gets from the eager
steps, alone (float32 greedy): staggered arrivals, chunked prefill, decodes mixed into prompt
chunks, a conversation's second turn over its cached prefix, one-token steps (eager)."""

from __future__ import annotations

import time

import pytest
import torch
from torch._dynamo.utils import counters

from moetier.config import EngineConfig
from moetier.engine import prefill_compile
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.graph_placement import place_for_graphs
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model
from tests.engine.test_engine import alone, check_against_alone, random_requests, run

FP32 = EngineConfig(device="cpu", dtype="float32", native=True)


@pytest.fixture(scope="module")
def pinned(tiny):
    """The tiny Qwen3-MoE with every expert pinned, as the CUDA graphs' placement pins them."""
    loaded = load_model(tiny.store("qwen3_moe"), FP32)
    assert place_for_graphs(loaded)
    return loaded


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("page", [4, 16])
def test_one_compiled_forward_serves_every_packed_step_as_eager_does(pinned, page):
    engine = Engine(pinned, EngineLimits(num_pages=96, page_size=page, max_num_batched_tokens=8))
    runner = engine.runner
    scratch = runner.scratch_page
    before = _graphs()
    assert runner.compile_prefill() > 0
    # (none new where this process compiled the same graph before: the model's weights are
    # the graph's inputs, so another engine's graph of the same shapes serves)
    assert _graphs() <= before + 1
    warm = _graphs()
    assert runner.prefill is not None and runner.prefill.steps == 0
    # the dummy step wrote the scratch page only
    assert not runner.cache[:, :, :scratch].any() and runner.cache[:, :, scratch].any()

    vocab = pinned.model_config.vocab_size
    requests = random_requests(vocab, 8, seed=3)  # chunks of up to 8 tokens, decodes mixed in
    check_against_alone(pinned, engine, requests)
    compiled = runner.prefill.steps
    assert compiled > 4

    # a conversation's second turn: its new tokens over the cached prefix, in one step
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    first = [3 + (11 * i) % (vocab - 3) for i in range(21)]
    got = run(engine, {0: [("turn-1", first, greedy)]})
    second = first + got["turn-1"][0] + [7, 8, 9, 10, 12, 13]
    got = run(engine, {0: [("turn-2", second, greedy)]})
    assert got["turn-2"][3].cached_tokens > 0
    assert got["turn-2"][0] == alone(pinned, second, greedy)[0]
    # a one-token prompt runs eagerly: the count of compiled steps is that of the longer ones
    steps = runner.prefill.steps
    run(engine, {0: [("one", [5], greedy)]})
    assert runner.prefill.steps == steps
    assert runner.prefill.steps > compiled
    assert _graphs() == warm  # every length and context on the warm-up's graph


def test_eager_where_the_compiled_path_does_not_apply(tiny, pinned):
    assert prefill_compile.refusal(pinned, with_gate=False) is None
    assert "gate" in prefill_compile.refusal(pinned, with_gate=True)
    hosted = load_model(
        tiny.store("qwen3_moe"), EngineConfig(device="cpu", dtype="float32", native=True,
                                              expert_cache_slots=4, host_memory="64MiB"),
    )  # fmt: skip
    assert place_for_graphs(hosted) and hosted.runtime.zero_copy is not None
    assert "host RAM" in prefill_compile.refusal(hosted, with_gate=False)
    gpt_oss = load_model(tiny.store("gpt_oss"), FP32)
    assert place_for_graphs(gpt_oss)
    assert "attention" in prefill_compile.refusal(gpt_oss, with_gate=False)
    # on CPU the engine never compiles them itself (CUDA graphs are its condition)
    assert Engine(pinned, EngineLimits(num_pages=16, page_size=4)).runner.prefill is None


@pytest.mark.gpu
def test_compiled_prefill_on_cuda_costs_the_host_less(tiny):
    """On CUDA with --compile-prefill the engine compiles its packed steps at load, decodes each
    request as it decodes alone, and a warm turn's first token comes sooner than from eager
    steps on the same model: medians of 5 turns of 40 new tokens each."""
    config = EngineConfig(device="cuda", dtype="float32", native=True, compile_prefill=True)
    loaded = load_model(tiny.store("qwen3_moe"), config)
    limits = EngineLimits(num_pages=256, page_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    engine = Engine(loaded, limits)
    assert engine.runner.prefill is not None
    check_against_alone(loaded, engine, random_requests(loaded.model_config.vocab_size, 6, 7))

    eager = Engine(loaded, limits)
    eager.runner.prefill = None
    vocab = loaded.model_config.vocab_size

    def warm_turn_ms(engine: Engine, seed: int) -> float:
        base = [3 + (13 * i + seed) % (vocab - 3) for i in range(200)]
        greedy = SamplingParams(temperature=0, max_new_tokens=1)
        run(engine, {0: [(f"w{seed}", base, greedy)]})
        times = []
        for turn in range(6):
            prompt = base + [3 + (turn * 17 + j) % (vocab - 3) for j in range(40)]
            torch.cuda.synchronize()
            began = time.perf_counter()
            run(engine, {0: [(f"t{seed}-{turn}", prompt, greedy)]})
            torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        return 1e3 * sorted(times[1:])[2]

    compiled_ms, eager_ms = warm_turn_ms(engine, 1), warm_turn_ms(eager, 2)
    assert compiled_ms < 0.9 * eager_ms, (compiled_ms, eager_ms)


def test_a_step_the_compiler_fails_on_runs_eagerly_and_so_do_the_rest(pinned, capsys):
    engine = Engine(pinned, EngineLimits(num_pages=32, page_size=4))
    engine.runner.compile_prefill()
    prefill = engine.runner.prefill

    def fails(*args, **kwargs):
        raise torch._dynamo.exc.InternalTorchDynamoError("inductor could not")

    prefill._forward = fails
    greedy = SamplingParams(temperature=0, max_new_tokens=4)
    prompt = [5, 9, 14, 3, 22, 8]
    got = run(engine, {0: [("a", prompt, greedy)], 1: [("b", prompt[:4], greedy)]})
    assert engine.runner.prefill is None
    err = capsys.readouterr().err
    assert err.count("prefill steps run eagerly from now on") == 1
    assert "InternalTorchDynamoError: inductor could not" in err
    for rid, p in (("a", prompt), ("b", prompt[:4])):
        assert got[rid][0] == alone(pinned, p, greedy)[0]


def test_an_error_of_the_step_itself_is_not_taken_for_the_compilers(pinned):
    """Out of memory (or a kernel's own error) propagates as an eager step's would, and the
    compiled prefill stays on for the next steps."""
    engine = Engine(pinned, EngineLimits(num_pages=32, page_size=4))
    engine.runner.compile_prefill()
    prefill = engine.runner.prefill
    compiled = prefill._forward

    def fails_once(*args, **kwargs):
        prefill._forward = compiled
        raise torch.OutOfMemoryError("CUDA out of memory")

    prefill._forward = fails_once
    engine.add("a", [5, 9, 14, 3], SamplingParams(temperature=0, max_new_tokens=2))
    with pytest.raises(torch.OutOfMemoryError):
        engine.step()
    assert engine.runner.prefill is prefill
    steps = prefill.steps
    engine.add("b", [7, 8, 9], SamplingParams(temperature=0, max_new_tokens=2))
    engine.step()
    assert prefill.steps > steps  # compiled again
