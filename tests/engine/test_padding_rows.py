"""Padding rows of a fixed-shape decode step (engine/decode_graphs.py: 3 streams run on the
4-row bucket) take row 0's experts: they read no expert of their own and the zero-copy
placement's access counts (what decides which experts stay on the GPU) hold only real tokens'
pairs. Tokens still equal each request generated alone."""

from __future__ import annotations

import pytest
import torch

from moetier.config import EngineConfig
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model
from tests.engine.test_engine import alone, run


@pytest.mark.parametrize(
    "compiled",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # inductor on the CPU
)
def test_padding_rows_read_and_count_no_experts_of_their_own(tiny, compiled):
    loaded = load_model(
        tiny.store("qwen3_moe"),
        EngineConfig(
            device="cpu", dtype="float32", native=True, expert_cache_slots=4, host_memory="64MiB"
        ),  # fmt: skip
    )
    runtime = loaded.runtime
    zc = runtime.enable_zero_copy()
    steps: list[torch.Tensor] = []  # the pairs each decode step's kernel was given, layer 0
    run_kernel = runtime._run

    def spy(layer, hidden, topk_ids, *args, **kwargs):
        if layer == min(zc.layer_index) and hidden.shape[0] == 4:
            steps.append(topk_ids.clone())
        return run_kernel(layer, hidden, topk_ids, *args, **kwargs)

    runtime._run = spy
    engine = Engine(loaded, EngineLimits(num_pages=64, page_size=4))
    engine.runner.fixed_shapes = True
    if compiled:  # as the CUDA graphs run it (the spy sees the traced call's tensors once)
        engine.runner.compile_step()
    greedy = [SamplingParams(temperature=0, max_new_tokens=n) for n in (6, 4, 5)]
    prompts = [[5, 9, 17, 3, 44], [7, 7, 120, 31], [200, 11, 3, 8, 90, 61, 2]]
    before = int(zc.counts.sum())
    cases = list(enumerate(zip(prompts, greedy, strict=True)))
    got = run(engine, {0: [(f"r{i}", prompt, params) for i, (prompt, params) in cases]})
    counted = int(zc.counts.sum()) - before
    assert steps, "no decode step ran on the 4-row bucket"
    # 3 streams on 4 rows: the padding row's experts are row 0's
    assert all(torch.equal(ids[3], ids[0]) for ids in steps)
    # counted: each prompt token's pairs and each generated token's but the last (not fed back)
    tokens = sum(map(len, prompts)) + sum(len(got[f"r{i}"][0]) - 1 for i in range(3))
    assert counted == tokens * loaded.model_config.top_k * len(zc.layers)
    for i, (prompt, params) in cases:
        assert got[f"r{i}"][0] == alone(loaded, prompt, params)[0]
    assert engine.pool.used_pages == 0 and not engine.has_work
