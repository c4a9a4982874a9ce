"""The confidence gate in the serving engine: forced rows (engine/gate_rows.py) and the live
quality meter (engine/quality_meter.py).

The meter's figures are checked against an offline measurement of the same text: the
transformers model class, once gated and once with the delta everywhere, over each request's
prompt and output; the meter (a twin sequence per metered request) must give the same mean KLD
and top-token disagreements (on the decode step's fixed shapes: the same KLD at every output
index). Forced rows take the delta whatever the rule: a forced request under a rule that picks
no pair decodes as the delta-everywhere model does."""

from __future__ import annotations

import contextlib
import functools
import time
from unittest import mock

import pytest
import torch

from moetier.config import DeltaRule, EngineConfig
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.gate_rows import GateRows
from moetier.engine.sampler import SamplingParams
from moetier.engine.scheduler import Request, Scheduled
from moetier.gate.state import Gate
from moetier.kernels import moe_ops
from moetier.kernels.moe_ref import moe_slots_ref
from moetier.loader.load import load_model
from moetier.loader.quantize import convert_quantized

GATED = "weight:0.15"  # the tiny random router spreads weight thinly: some pairs pass
NOTHING = "weight:2"  # no routing weight reaches 2: no pair gets the delta
PROMPTS = [[5, 9, 13, 17, 21, 25, 29], [40, 41, 42], list(range(60, 83))]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A tiny qwen3_moe with weights ten times the usual scale (initializer_range 0.2), so
    that its experts' quantisation moves its distributions measurably."""
    from tiny_models import build_tiny

    root = tmp_path_factory.mktemp("meter")
    checkpoint = build_tiny("qwen3_moe", root / "hf", initializer_range=0.2)
    convert_quantized(checkpoint, root / "delta", delta="nvfp4", progress=False)
    return root / "delta"


def native(store, delta):
    config = EngineConfig(native=True, device="cpu", dtype="float32", delta=delta)
    return load_model(store, config)


def drain(engine, prompts, prepare=None):
    """Add every prompt (greedy, 10 tokens), step until done -> (tokens, steps) per request."""
    for i, prompt in enumerate(prompts):
        request = engine.add(f"r{i}", prompt, GREEDY)
        if prepare is not None:
            prepare(request)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for out in engine.step():
            assert out.request_id in tokens, "the meter's twins never reach the client"
            tokens[out.request_id] += out.token_ids
    return tokens


@contextlib.contextmanager
def int8_experts(on: bool = True):
    """The CPU experts op with the int8 activations of the CUDA q2s GEMV (`KernelChoice.int8_act`:
    each matrix's input rounded to int8 per 16-column word; its twin is
    moe_slots_ref(act_int8=True)), which the CUDA engine decodes this store's every experts call
    with (q2s base, fewer than 512 pairs a call)."""
    if not on:
        yield
        return
    twin = functools.partial(moe_slots_ref, act_int8=True)
    with mock.patch.object(moe_ops, "moe_slots_ref", twin):
        yield


def offline_klds(store, prompts, outputs, int8=False):
    """KL(delta everywhere || gated) at every output index of each request ([request][index])
    and the top-token disagreements, by the transformers model class over prompt + output;
    int8: with the CUDA kernels' int8 activations (`int8_experts`)."""
    config = dict(native=False, device="cpu", dtype="float32")
    gated = load_model(store, EngineConfig(**config, delta=GATED)).model
    full = load_model(store, EngineConfig(**config, delta="all")).model
    klds, differs = [], 0
    with torch.no_grad(), int8_experts(int8):
        for prompt, output in zip(prompts, outputs, strict=True):
            ids = torch.tensor([prompt + output])
            span = slice(len(prompt) - 1, len(prompt) - 1 + len(output))
            g = torch.log_softmax(gated(ids).logits[0, span].double(), -1)
            f = torch.log_softmax(full(ids).logits[0, span].double(), -1)
            klds.append((f.exp() * (f - g)).sum(-1).tolist())
            differs += int((f.argmax(-1) != g.argmax(-1)).sum())
    return klds, differs


def offline(store, prompts, outputs, int8=False):
    """-> (mean KLD over every output index, disagreements, indices): `offline_klds`."""
    klds, differs = offline_klds(store, prompts, outputs, int8)
    flat = [kld for request in klds for kld in request]
    return sum(flat) / len(flat), differs, len(flat)


def meter_klds(engine) -> dict[str, list[float]]:
    """The meter's KLD at each output index of each metered sequence, filled in as its twin
    ends (before its sums are added up)."""
    meter, got = engine.meter, {}
    end = meter.end

    def ending(twin):
        sid = meter.sequence_of.get(twin)
        if sid is not None:
            got[sid] = [float(pair[0]) for pair in meter._sums.get(twin, [])]
        end(twin)

    meter.end = ending
    return got


def test_meter_agrees_with_the_offline_measurement(store):
    plain = Engine(native(store, GATED), EngineLimits(num_pages=64, page_size=4))
    expected = drain(plain, PROMPTS)
    engine = Engine(native(store, GATED), EngineLimits(num_pages=64, page_size=4,
                                                        quality_meter=1.0))  # fmt: skip
    got = drain(engine, PROMPTS)
    assert got == expected  # the twins change nothing the client sees
    stats = engine.meter.stats
    mean, differs, positions = offline(store, PROMPTS, [got[f"r{i}"] for i in range(3)])
    assert stats.requests == 3
    assert stats.positions == positions == sum(len(t) for t in got.values())
    assert mean > 1e-6  # the gate leaves a gap to close
    assert stats.mean_kld == pytest.approx(mean, rel=0.02)
    assert stats.disagreements == differs
    # everything handed back: no twin left running, no page held, nothing of theirs cached
    assert not engine.has_work and not engine.meter.twin_of and not engine.runner.keep_logits
    assert engine.pool.used_pages == 0
    assert engine.pool.stats.hit_tokens == plain.pool.stats.hit_tokens


def test_meter_with_fixed_shape_steps_and_preemption(store):
    """Decode steps on a graph's static inputs (the gate's rows staged there) and a KV budget
    so small that twins and requests are preempted: the same figures as without."""
    loose = Engine(native(store, GATED), EngineLimits(num_pages=64, page_size=4,
                                                       quality_meter=1.0))  # fmt: skip
    drain(loose, PROMPTS)
    tight = Engine(native(store, GATED), EngineLimits(num_pages=12, page_size=4,
                                                       quality_meter=1.0))  # fmt: skip
    tight.runner.fixed_shapes = True
    got = drain(tight, PROMPTS)
    assert tight.scheduler.preemptions > 0
    assert tight.meter.stats.positions == sum(len(t) for t in got.values())
    assert tight.meter.stats.mean_kld == pytest.approx(loose.meter.stats.mean_kld, rel=1e-3)


@pytest.mark.parametrize(
    "compiled",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # inductor on the CPU
)
def test_meter_equals_the_offline_kld_at_every_index(store, compiled):
    """On the decode step's fixed shapes (3 requests and their twins on the 8-row bucket, then
    smaller ones: padding rows take row 0's experts, the gate's forced rows are staged) and,
    compiled, as the CUDA graphs run it: the meter's KLD at every output index of every request
    is the offline one (float32 on the CPU, the same computation: equal to rounding, ~1e-4 of
    a KLD of 1e-6 at worst), not only their mean."""
    engine = Engine(native(store, GATED), EngineLimits(num_pages=64, page_size=4,
                                                        quality_meter=1.0))  # fmt: skip
    engine.runner.fixed_shapes = True
    if compiled:
        engine.runner.compile_step()
    klds = meter_klds(engine)
    got = drain(engine, PROMPTS)
    assert engine.runner.graphs  # decode steps ran on the fixed-shape inputs
    want, _ = offline_klds(store, PROMPTS, [got[f"r{i}"] for i in range(3)])
    for i in range(3):
        assert klds[f"r{i}"] == pytest.approx(want[i], rel=1e-3, abs=1e-9)


def test_meter_follows_the_cuda_kernels_numerics(store):
    """The CUDA engine's experts round their inputs to int8 (the q2s GEMV, `int8_experts`): the
    meter measures that model, so test_gate_and_meter_inside_cuda_graphs compares it with the
    offline measurement under the same rounding. Here on the CPU with the kernel's twin: equal
    at every index; the float32 reference is a few percent off in the mean (2.8% here; 2.9% on
    the H100 at 8c63926, which failed that test when it compared with the float reference)."""
    with int8_experts():
        engine = Engine(native(store, GATED), EngineLimits(num_pages=64, page_size=4,
                                                            quality_meter=1.0))  # fmt: skip
        engine.runner.fixed_shapes = True
        klds = meter_klds(engine)
        got = drain(engine, PROMPTS)
    outputs = [got[f"r{i}"] for i in range(3)]
    want, _ = offline_klds(store, PROMPTS, outputs, int8=True)
    for i in range(3):
        assert klds[f"r{i}"] == pytest.approx(want[i], rel=1e-3, abs=1e-9)
    assert engine.meter.stats.mean_kld != pytest.approx(offline(store, PROMPTS, outputs)[0],
                                                        rel=0.01)  # fmt: skip


def test_meter_refuses_a_model_without_a_gate(store):
    with pytest.raises(ValueError, match="--delta rule other than all or none"):
        Engine(native(store, "all"), EngineLimits(num_pages=16, page_size=4, quality_meter=0.5))


def test_forced_rows_take_the_delta_whatever_the_rule(store):
    everywhere = drain(Engine(native(store, "all"), EngineLimits(num_pages=64, page_size=4)),
                       PROMPTS)  # fmt: skip
    nowhere = drain(Engine(native(store, NOTHING), EngineLimits(num_pages=64, page_size=4)),
                    PROMPTS)  # fmt: skip
    assert everywhere != nowhere  # the delta changes the greedy text of this model
    loaded = native(store, NOTHING)
    engine = Engine(loaded, EngineLimits(num_pages=64, page_size=4))
    forced = drain(engine, PROMPTS, prepare=lambda r: setattr(r, "gate_forced", True))
    assert forced == everywhere
    assert loaded.runtime.delta_pairs == loaded.runtime.pairs > 0
    loaded = native(store, NOTHING)  # one forced request among others: only its rows
    engine = Engine(loaded, EngineLimits(num_pages=64, page_size=4))
    mixed = drain(engine, PROMPTS, prepare=lambda r: setattr(r, "gate_forced", r.id == "r1"))
    assert mixed == {"r0": nowhere["r0"], "r1": everywhere["r1"], "r2": nowhere["r2"]}
    assert 0 < loaded.runtime.delta_pairs < loaded.runtime.pairs


def test_gate_rows_keep_each_requests_confidence():
    gate = Gate(DeltaRule.parse("budget:0.5:weight*confidence"))
    rows = GateRows(gate, torch.device("cpu"))
    requests = [Request(f"q{i}", [1, 2, 3]) for i in range(70)]  # more than the first table
    for r in requests:
        r._append(4)  # one output token: the next position is a decode
    items = [Scheduled(r, 3, 1) for r in requests]
    logits = torch.randn(70, 11)
    rows.observe(logits, items)
    top = torch.softmax(logits, -1).amax(-1)
    order = [5, 69, 0]
    got = rows.confidence_rows([items[i] for i in order], per_token=False)
    assert torch.equal(got, top[order])
    # a packed step: prompt tokens read 1.0, a decode token its request's value
    fresh = Request("new", [7, 8, 9])
    chunk = Scheduled(fresh, 0, 3)
    got = rows.confidence_rows([chunk, items[2]], per_token=True)
    assert got.tolist() == [1.0, 1.0, 1.0, pytest.approx(float(top[2]))]
    rows.release("q5")
    rows.set_step([items[1]], per_token=False)
    assert gate.forced is None and torch.equal(gate.confidence, top[[1]])


def test_metrics_show_the_meter(store):
    """`moetier serve --quality-meter 1`: /metrics gives the meter's totals (prometheus_client's
    own parser reads them back), equal to the engine's."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from moetier.engine.async_engine import AsyncEngine
    from moetier.server.app import create_app

    engine = Engine(native(store, GATED), EngineLimits(num_pages=64, page_size=4,
                                                        quality_meter=1.0))  # fmt: skip
    app = create_app(AsyncEngine(engine), "tiny")
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 6, "temperature": 0}
    with TestClient(app) as http:
        assert http.post("/v1/completions", json=body).status_code == 200
        for _ in range(100):  # the engine's stats follow its step, which may end after the answer
            text = http.get("/metrics").text
            scraped = {s.name: s.value for f in text_string_to_metric_families(text)
                       for s in f.samples}  # fmt: skip
            if scraped.get("moetier_quality_meter_positions_total"):
                break
            time.sleep(0.05)
    stats = engine.meter.stats
    assert stats.positions == 6
    assert scraped["moetier_quality_meter_requests_total"] == 1
    assert scraped["moetier_quality_meter_positions_total"] == 6
    assert scraped["moetier_quality_meter_kld_mean"] == pytest.approx(stats.mean_kld)
    assert scraped["moetier_quality_meter_top1_disagreement_rate"] == stats.disagreement_rate


@pytest.mark.parametrize("fraction", [0.25, 0.1, 0.3, 1.0])
def test_meter_picks_an_even_share(fraction):
    from moetier.engine.quality_meter import QualityMeter

    meter = QualityMeter(fraction)
    picks = [meter.pick() for _ in range(40)]
    assert picks[0] and sum(picks) == round(40 * fraction)
    with pytest.raises(ValueError, match="a fraction of requests"):
        QualityMeter(1.5)


def cuda(store, delta, graphs=True):
    config = EngineConfig(native=True, device="cuda", dtype="float32", delta=delta,
                          cuda_graph=graphs)  # fmt: skip
    return load_model(store, config)


@pytest.mark.gpu
def test_gate_and_meter_inside_cuda_graphs(store, monkeypatch):
    """On CUDA the gate's inputs (forced rows, each request's confidence) are staged into the
    graphs' static inputs: the graphed engine's text equals the eager CUDA engine's, its meter
    agrees with the offline measurement of the model it runs (experts with int8 activations),
    and forced rows decode as the delta everywhere."""
    from moetier.kernels import moe_triton

    kernels = set()  # (gate_up, down) int8 activations of every experts call's kernels
    run_kernels = moe_triton.moe_slots_triton

    def spy(*args, **kwargs):
        c_gu, c_dn = run_kernels(*args, **kwargs)
        kernels.add((c_gu.int8_act, c_dn.int8_act))
        return c_gu, c_dn

    monkeypatch.setattr(moe_triton, "moe_slots_triton", spy)
    eager = Engine(cuda(store, GATED, graphs=False), EngineLimits(num_pages=64, page_size=4))
    want = drain(eager, PROMPTS)
    engine = Engine(cuda(store, GATED), EngineLimits(num_pages=64, page_size=4,
                                                     quality_meter=1.0))  # fmt: skip
    assert engine.runner.use_graphs
    got = drain(engine, PROMPTS)
    assert engine.runner.graphs  # decode steps were replayed from graphs
    assert got == want
    # every experts call ran the q2s GEMV with int8 activations (q2s base, < 512 pairs), so the
    # reference is computed with its twin's rounding (`int8_experts`): against the float32
    # reference the meter was 2.9% off on the H100 at 8c63926, all of it this rounding (the
    # CPU with the twin gives the meter 0.0019954, the H100 0.0019978; float 0.0019414). What
    # the tolerance covers is CUDA's float summation order (and the int8 roundings it flips):
    # 1.2e-3 there
    assert kernels == {(True, True)}
    mean, differs, positions = offline(store, PROMPTS, [got[f"r{i}"] for i in range(3)],
                                       int8=True)  # fmt: skip
    assert engine.meter.stats.positions == positions
    assert engine.meter.stats.mean_kld == pytest.approx(mean, rel=0.01)
    everywhere = drain(Engine(cuda(store, "all"), EngineLimits(num_pages=64, page_size=4)),
                       PROMPTS)  # fmt: skip
    forced = Engine(cuda(store, NOTHING), EngineLimits(num_pages=64, page_size=4))
    got = drain(forced, PROMPTS, prepare=lambda r: setattr(r, "gate_forced", r.id == "r1"))
    assert forced.runner.graphs
    assert got["r1"] == everywhere["r1"]


def test_twins_are_not_counted_as_requests(store):
    """/metrics' running and waiting requests count the clients' requests, not the meter's
    twins beside them."""
    from moetier.engine.async_engine import AsyncEngine

    engine = Engine(native(store, GATED), EngineLimits(num_pages=64, page_size=4,
                                                        quality_meter=1.0))  # fmt: skip
    wrapper = AsyncEngine(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add(f"r{i}", prompt, GREEDY)
    counted, with_twins = [], 0
    while engine.has_work:
        engine.step()
        wrapper._update_stats(stepped=True)
        counted.append(wrapper.stats.running + wrapper.stats.waiting)
        if engine.meter.twin_of:
            with_twins += 1
            assert len(engine.scheduler.running) + len(engine.scheduler.waiting) > counted[-1]
    assert max(counted) == 3 and with_twins > 0
