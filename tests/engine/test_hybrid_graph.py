"""Hybrid misses on the zero-copy decode step (residency/hybrid_graph.py,
kernels/cpu/graph_part.py): a tiny native qwen3_moe q2s store whose experts do not fit a 4-slot
GPU cache, decoded on the CUDA graphs' fixed shapes (run eagerly on CPU: the same ops, buffers
and C entry point a graph captures), with a forced CPU share against the same decode without
it: 16 greedy tokens each, identical; every pair of a flagged expert reached the C call
(counted there) and none the experts kernel (its table entry -1). On CUDA the same with the
host node captured in the graphs (`gpu`)."""

from __future__ import annotations

import shutil

import pytest
import torch

from moetier.config import EngineConfig
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.graph_placement import place_for_graphs
from moetier.engine.sampler import SamplingParams
from moetier.kernels.cpu.build import load
from moetier.loader.load import load_model
from moetier.residency.hybrid_graph import choose_cpu, expected_pairs
from moetier.residency.hybrid_split import HybridSpeeds
from tests.engine.test_engine import run

PROMPTS = [[5, 9, 17, 3, 44], [7, 7, 120, 31], [200, 11, 3, 8, 90, 61, 2]]


@pytest.fixture(scope="module")
def q2s_store(tiny, tmp_path_factory):
    from moetier.quant.requantize import requantize_experts

    store = tmp_path_factory.mktemp("hybrid_graph") / "q2s"
    shutil.copytree(tiny.store("qwen3_moe"), store)
    requantize_experts(store, "q2s", progress=False)
    return store


def _decode(store, cpu_experts: str, device: str = "cpu", spy=None, graphs: bool = True,
            compiled: bool = False):  # fmt: skip
    loaded = load_model(store, EngineConfig(device=device, dtype="float32", native=True,
                                            expert_cache_slots=4, host_memory="64MiB",
                                            cpu_experts=cpu_experts,
                                            cuda_graph=graphs))  # fmt: skip
    if device == "cpu" or not graphs:
        assert place_for_graphs(loaded)  # (the runner places experts itself with CUDA graphs)
    if spy is not None:
        spy(loaded)
    engine = Engine(loaded, EngineLimits(num_pages=64, page_size=4))
    engine.runner.fixed_shapes = True
    if compiled:  # the step through torch.compile, as the CUDA graphs run it
        engine.runner.compile_step()
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    got = run(engine, {0: [(f"r{i}", prompt, greedy) for i, prompt in enumerate(PROMPTS)]})
    return loaded, engine, {rid: tokens for rid, (tokens, *_) in got.items()}


def _record_outputs(outputs: list[torch.Tensor]):
    """Wraps the experts op the MoE blocks call (the loader handed them `runtime.forward`):
    each call's output [T, H] (its live rows) is kept."""

    def install(loaded):
        runtime = loaded.runtime
        forward = runtime.forward

        def spy(layer, hidden, topk_ids, topk_weights):
            y = forward(layer, hidden, topk_ids, topk_weights)
            live = runtime.live
            if live is not None and live.shape[0] == y.shape[0] > 1:
                outputs.append(y[live].clone())
            else:
                outputs.append(y.clone())
            return y

        blocks = [m for m in loaded.model.modules() if getattr(m, "experts", None) == forward]
        assert blocks
        for block in blocks:
            block.experts = spy

    return install


def _spy_on_kernel(checks: dict[str, int]):
    """Wraps the experts kernel: each zero-copy call's pairs of flagged experts (live rows)
    are counted, and none of them may have a table entry (the kernel skips entries < 0)."""

    def install(loaded):
        runtime = loaded.runtime
        run_kernel = runtime._run

        def spy(layer, hidden, topk_ids, topk_weights, table, *args, **kwargs):
            split = runtime.hybrid_graph
            assert split is not None
            flags = split.flags[split.placement.layer_index[layer]]
            flagged = flags[topk_ids]
            live = runtime.live
            if live is not None and live.shape[0] == topk_ids.shape[0] > 1:
                flagged &= live[:, None]
            checks["cpu_pairs"] += int(flagged.sum())
            checks["gpu_pairs_of_flagged"] += int((table[topk_ids[flags[topk_ids]]] >= 0).sum())
            return run_kernel(layer, hidden, topk_ids, topk_weights, table, *args, **kwargs)

        runtime._run = spy

    return install


@pytest.mark.skipif(load() is None, reason="no C compiler: the graph step keeps eager hybrid steps")
def test_graph_step_split_matches_the_step_without_it(q2s_store):
    plain: list[torch.Tensor] = []
    _, _, want = _decode(q2s_store, "off", spy=_record_outputs(plain))
    checks = {"cpu_pairs": 0, "gpu_pairs_of_flagged": 0}
    split_out: list[torch.Tensor] = []

    def spies(loaded):
        _spy_on_kernel(checks)(loaded)
        _record_outputs(split_out)(loaded)

    loaded, engine, got = _decode(q2s_store, "share:0.5", spy=spies)
    assert got == want
    # each experts call's output: the CPU's rows (int8 activation words, as the GPU's q2s GEMV)
    # within 2% of the call's range of the reference path's float rows
    assert len(split_out) == len(plain) > 0
    for a, b in zip(plain, split_out, strict=True):
        assert (a - b).abs().max().item() <= 0.02 * a.abs().max().item()
    assert max(len(tokens) for tokens in got.values()) == 16
    runtime = loaded.runtime
    split = runtime.hybrid_graph
    assert split is not None and runtime.zero_copy is not None
    assert engine.runner.graphs, "no decode step ran on the fixed shapes"
    assert any(split.marked), "no expert was given to the CPU"
    done = split.counters()
    assert checks["cpu_pairs"] > 0 and done.pairs == checks["cpu_pairs"]
    assert checks["gpu_pairs_of_flagged"] == 0
    assert done.failed == 0 and done.calls > 0
    cpu = runtime.telemetry()["cpu"]  # /metrics' tier="cpu"
    assert cpu.hits == done.pairs and cpu.bytes > 0
    # the flags and the tables agree: a flagged expert has no entry, no other one lacks it
    zc = runtime.zero_copy
    assert torch.equal(zc.table < 0, split.flags)


@pytest.mark.slow  # inductor on the CPU
@pytest.mark.skipif(load() is None, reason="no C compiler: the graph step keeps eager hybrid steps")
def test_compiled_graph_step_runs_the_split(q2s_store):
    """The pack, the C call and the join as custom ops inside the compiled step (torch.compile
    traces them as the CUDA graphs' step does): the same tokens, the C calls counted."""
    _, _, want = _decode(q2s_store, "off")
    loaded, _, got = _decode(q2s_store, "share:0.5", compiled=True)
    assert got == want
    split = loaded.runtime.hybrid_graph
    assert split is not None and any(split.marked)
    assert split.counters().pairs > 0 and split.counters().failed == 0


def test_formats_without_a_c_kernel_keep_eager_steps(tiny, capsys):
    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(
        device="cpu", dtype="float32", native=True, expert_cache_slots=4, host_memory="64MiB",
        cpu_experts="share:0.5"))  # fmt: skip
    assert place_for_graphs(loaded) is False
    assert loaded.runtime.zero_copy is None and loaded.runtime.hybrid_graph is None
    assert "have no C CPU kernel" in capsys.readouterr().err


def test_without_a_c_compiler_steps_stay_eager(q2s_store, monkeypatch, capsys):
    """Where no C compiler built the CPU kernel (the skips above), the graph step does not
    split: the engine keeps eager hybrid steps and says why."""
    from moetier.kernels.cpu import build

    monkeypatch.setattr(build, "load", lambda: None)
    loaded = load_model(q2s_store, EngineConfig(
        device="cpu", dtype="float32", native=True, expert_cache_slots=4, host_memory="64MiB",
        cpu_experts="share:0.5"))  # fmt: skip
    assert place_for_graphs(loaded) is False and loaded.runtime.hybrid_graph is None
    assert "no C compiler built the CPU expert kernel" in capsys.readouterr().err


def test_choose_cpu_takes_the_cheapest_prefix():
    speeds = HybridSpeeds(gpu_path=2.0, cpu=1.0)
    expected = {0: 0.01, 1: 0.01, 2: 2.0, 3: 0.5, 4: 0.0}
    assert choose_cpu(expected, 100, speeds, share=0.4) == [0, 4]
    chosen = choose_cpu(expected, 100, speeds)
    assert 4 in chosen and 2 not in chosen  # the rare first, the busy one stays on the GPU
    slow = choose_cpu(expected, 100, HybridSpeeds(gpu_path=2.0, cpu=1.0, sync=1e6))
    assert slow == []  # a host node costlier than every miss: nothing to the CPU
    uniform = expected_pairs(torch.zeros(4, dtype=torch.float64), 2, 2)
    assert uniform.tolist() == [1.0] * 4


@pytest.mark.gpu
def test_cuda_graph_host_node_matches_the_step_without_it(q2s_store):
    """The captured graphs hold each layer's host node (C kernel on a side stream): the same 16
    greedy tokens as the zero-copy graphs without the split, the CPU's pairs counted by the C
    calls the replays made."""
    _, plain, want = _decode(q2s_store, "off", device="cuda")
    loaded, engine, got = _decode(q2s_store, "share:0.5", device="cuda")
    assert plain.runner.use_graphs and engine.runner.use_graphs
    split = loaded.runtime.hybrid_graph
    assert split is not None, "capturing the host node failed (see stderr)"
    assert engine.runner.graphs and not engine.runner.graphs.failed
    assert got == want
    assert any(split.marked) and split.counters().pairs > 0 and split.counters().failed == 0


@pytest.mark.gpu
def test_cuda_eager_host_function_matches_the_step_without_it(q2s_store):
    """The same ops on CUDA without capture (host function queued on the side stream, joined
    by an event): each experts call's output within 2% of the reference path's, and no pair
    of a flagged expert given to the kernel."""
    plain: list[torch.Tensor] = []
    _, _, want = _decode(q2s_store, "off", device="cuda", spy=_record_outputs(plain),
                         graphs=False)  # fmt: skip
    checks = {"cpu_pairs": 0, "gpu_pairs_of_flagged": 0}
    split_out: list[torch.Tensor] = []

    def spies(loaded):
        _spy_on_kernel(checks)(loaded)
        _record_outputs(split_out)(loaded)

    loaded, _, got = _decode(q2s_store, "share:0.5", device="cuda", spy=spies, graphs=False)
    assert got == want and len(split_out) == len(plain) > 0
    for a, b in zip(plain, split_out, strict=True):
        assert (a - b).abs().max().item() <= 0.02 * a.abs().max().item()
    split = loaded.runtime.hybrid_graph
    assert split is not None and split.counters().pairs == checks["cpu_pairs"] > 0
    assert checks["gpu_pairs_of_flagged"] == 0
