"""The engine's decode step compiled (torch.compile) and captured per batch bucket at load
(CUDA): the graphs exist before the first request, and batched greedy output is each request's
own, as the Generator decodes it alone."""

from __future__ import annotations

import pytest

from moetier.config import EngineConfig
from moetier.engine.engine import Engine, EngineLimits
from moetier.loader.load import load_model
from tests.engine.test_engine import check_against_alone, random_requests


@pytest.mark.gpu
def test_compiled_graphs_are_captured_at_load_and_decode_exactly(tiny):
    config = EngineConfig(device="cuda", dtype="float32", native=True, compile_decode=True)
    loaded = load_model(tiny.store("qwen3_moe"), config)
    limits = EngineLimits(num_pages=64, page_size=16, max_num_seqs=6, max_num_batched_tokens=16)
    engine = Engine(loaded, limits)
    width = engine.runner.table_width  # the decode kernel reads pages: one context bucket
    assert sorted(engine.runner.graphs) == [(b, width) for b in (1, 2, 4, 8)]  # to 6 rows
    assert engine.runner.warm_up_seconds > 0
    check_against_alone(loaded, engine, random_requests(loaded.model_config.vocab_size, 6, 5))


@pytest.mark.gpu
def test_experts_that_do_not_fit_decode_graphed_through_zero_copy(tiny):
    """A GPU expert cache of 4 slots with a host tier: the engine keeps the graphed (and
    compiled) decode path through zero-copy mode (hot blobs in slots, the rest read from pinned
    host rows, the hot set moved between steps), and decodes as each request alone."""
    config = EngineConfig(device="cuda", dtype="float32", native=True, expert_cache_slots=4,
                          host_memory="64MiB")  # fmt: skip
    loaded = load_model(tiny.store("qwen3_moe"), config)
    limits = EngineLimits(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=16)
    engine = Engine(loaded, limits)
    runtime = loaded.runtime
    assert engine.runner.use_graphs and runtime.zero_copy is not None and not runtime.pinned
    check_against_alone(loaded, engine, random_requests(loaded.model_config.vocab_size, 6, 7))
    assert runtime.zero_copy.scores.sum() > 0  # rebalanced between steps
