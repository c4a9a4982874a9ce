"""Speculative decoding with an MTP layer (engine/speculative.py, models/mtp.py): greedy output
is the engine's without drafts, token for token, whatever the drafts (an MTP layer of random
weights, which the model rarely agrees with, and drafts taken from the true continuation with
wrong tokens mixed in, which it mostly does), under preemption too; the MTP layer's forward is
its formula over the checkpoint's tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from moetier.config import EngineConfig
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.kv_pages import PagePool
from moetier.engine.sampler import SamplingParams
from moetier.engine.scheduler import Request, Scheduler
from moetier.engine.speculative import SpecStats, verify_greedy
from moetier.loader.load import load_model

PROMPTS = [[5, 9, 13, 17, 21, 25, 29], [40, 41, 42], list(range(60, 83))]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=14)


def native(store, **config):
    return load_model(store, EngineConfig(native=True, device="cpu", dtype="float32", **config))


@pytest.fixture(scope="module")
def store(tiny):
    return tiny.store("qwen3_moe")


@pytest.fixture(scope="module")
def mtp_file(store, tmp_path_factory):
    """A random MTP layer for the tiny qwen3_moe, in the checkpoint's names."""
    from moetier.models.mtp import MTPLayer

    model = native(store).model
    config = model.config
    torch.manual_seed(3)
    block = type(model.model.layers[0])(config, config.num_layers)
    layer = MTPLayer(block, config.hidden_size, config.vocab_size, config.rms_norm_eps, False)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    prefix = f"model.layers.{config.num_layers}."
    tensors = {}
    for name, value in layer.state_dict().items():
        key = name.removeprefix("block.") if name.startswith("block.") else name
        tensors[prefix + key] = value.contiguous()
    path = tmp_path_factory.mktemp("mtp") / "mtp.safetensors"
    save_file(tensors, str(path))
    return path


def drain(engine, prompts=PROMPTS, params=GREEDY):
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, params)
    out = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return out


def test_verify_greedy_keeps_the_agreeing_prefix():
    assert verify_greedy([4, 5, 6], [4, 5, 6, 7]) == ([4, 5, 6], 7)
    assert verify_greedy([4, 9, 6], [4, 5, 6, 7]) == ([4], 5)
    assert verify_greedy([9, 5], [4, 5, 6]) == ([], 4)
    stats = SpecStats()
    stats.add(3, 1)
    stats.add(2, 2)
    assert stats.drafted == [2, 2, 1] and stats.accepted == [2, 1, 0]
    assert stats.acceptance == 3 / 5 and stats.mean_accepted == 1.5


def test_scheduler_appends_the_kept_drafts_and_stops_at_eos():
    scheduler = Scheduler(PagePool(16, 4), 64)
    request = Request("a", [1, 2, 3], max_tokens=10, eos_ids=frozenset({99}))
    scheduler.add(request)
    step = scheduler.schedule()
    scheduler.update(step, {"a": 7})
    request.drafts = [8, 9, 10]
    step = scheduler.schedule()
    assert [(i.start, i.count, i.drafts) for i in step.items] == [(3, 4, 3)]
    scheduler.update(step, {"a": 11}, {"a": [8, 9]})  # two kept, the third rejected
    assert request.output == [7, 8, 9, 11] and request.computed == 6 and not request.drafts
    request.drafts = [99, 5]
    step = scheduler.schedule()
    done = scheduler.update(step, {"a": 6}, {"a": [99, 5]})
    assert done == [request] and request.output[-1] == 99 and request.finish_reason == "stop"


def test_drafts_never_pass_max_tokens_or_the_context():
    scheduler = Scheduler(PagePool(16, 4), 8)
    request = Request("a", [1, 2, 3], max_tokens=3)
    scheduler.add(request)
    scheduler.update(scheduler.schedule(), {"a": 7})
    request.drafts = [1, 2, 3, 4]
    step = scheduler.schedule()
    assert step.items[0].drafts == 1  # one more token may follow it: 3 - 1 - 1


def test_greedy_output_is_unchanged_with_a_random_mtp_layer(store, mtp_file):
    want = drain(Engine(native(store), EngineLimits(num_pages=64, page_size=4)))
    engine = Engine(native(store, mtp_file=str(mtp_file)),
                    EngineLimits(num_pages=64, page_size=4, speculative_tokens=3))  # fmt: skip
    assert drain(engine) == want
    stats = engine.runner.drafter.stats
    assert stats.steps > 0 and len(stats.drafted) == 3  # drafts were proposed and verified


@pytest.mark.parametrize("pages", [64, 10])
def test_greedy_output_is_unchanged_with_good_and_bad_drafts(store, mtp_file, pages):
    """Drafts from the true continuation, every third one wrong: most are accepted, and the
    text is the plain engine's (with 10 pages of 4, requests are preempted)."""
    want = drain(Engine(native(store), EngineLimits(num_pages=64, page_size=4)))
    engine = Engine(native(store, mtp_file=str(mtp_file)),
                    EngineLimits(num_pages=pages, page_size=4, speculative_tokens=3,
                                 speculative_policy="always"))  # fmt: skip
    drafter = engine.runner.drafter
    real = drafter.draft
    calls = []

    def oracle(requests, k, cache):
        real(requests, k, cache)  # the MTP layer runs (its KV written), then drafts replaced
        for request in requests:
            truth = want[request.id][len(request.output) :]
            drafts = truth[:k] + [1] * max(0, k - len(truth))
            calls.append(len(drafts))
            if len(calls) % 3 == 0:
                drafts[len(calls) % k] = (drafts[len(calls) % k] + 1) % 300
            request.drafts = drafts

    drafter.draft = oracle
    assert drain(engine) == want
    assert drafter.stats.acceptance > 0.5
    if pages == 10:
        assert engine.scheduler.preemptions > 0
    assert engine.pool.used_pages == 0


def oracle_drafts(engine, want, wrong_every=3):
    """Replace the MTP layer's drafts (after it ran: its KV written) by the true continuation,
    every `wrong_every`-th call's one draft wrong."""
    drafter = engine.runner.drafter
    real, calls = drafter.draft, []

    def oracle(requests, k, cache):
        real(requests, k, cache)
        for request in requests:
            truth = want[request.id][len(request.output) :]
            drafts = truth[:k] + [1] * max(0, k - len(truth))
            calls.append(len(drafts))
            if len(calls) % wrong_every == 0:
                drafts[len(calls) % k] = (drafts[len(calls) % k] + 1) % 300
            request.drafts = drafts

    drafter.draft = oracle


def fixed_shape_engine(loaded, pages, drafts=3, gathered=True, prefix_caching=True):
    """An engine whose decode and verify steps run on the CUDA graphs' fixed-shape inputs (CPU:
    run eagerly on them); gathered False: the decode batches without gathered keys, the
    attention through the decode kernels (Triton's interpreter), as on CUDA."""
    limits = EngineLimits(num_pages=pages, page_size=4, speculative_tokens=drafts,
                          speculative_policy="always", prefix_caching=prefix_caching)  # fmt: skip
    engine = Engine(loaded, limits)
    engine.runner.fixed_shapes = True
    engine.runner.gather_decode_keys = gathered
    return engine


def check_rows_equal_packed(engine, monkeypatch):
    """Every graphed speculative step computed again on the packed path: hidden states equal."""
    runner = engine.runner
    original, seen = runner._rows_step, []

    def both(items, graph):
        every, hidden = original(items, graph)
        packed = runner._packed(items)  # rewrites the same K/V rows
        seen.append(sum(item.drafts for item in items))
        assert (hidden - packed).abs().max().item() <= 1e-4 * max(1.0, packed.abs().max().item())
        return every, hidden

    monkeypatch.setattr(runner, "_rows_step", both)
    return seen


@pytest.mark.parametrize("pages", [64, 10])
def test_verify_steps_on_fixed_shape_rows_keep_the_greedy_text(store, mtp_file, pages,
                                                               monkeypatch):  # fmt: skip
    """Speculative steps as decode rows on the graphs' fixed-shape inputs (a request's last
    token and its drafts consecutive rows): the plain engine's greedy text with the random
    layer's drafts and with the true continuation's (every third call one wrong); each such
    step's hidden states equal the packed path's; 10 pages of 4: requests are preempted."""
    want = drain(Engine(native(store), EngineLimits(num_pages=64, page_size=4)))
    engine = fixed_shape_engine(native(store, mtp_file=str(mtp_file)), pages)
    seen = check_rows_equal_packed(engine, monkeypatch)
    assert drain(engine) == want
    assert engine.runner.verify_graphed > 0 and any(seen)
    engine = fixed_shape_engine(native(store, mtp_file=str(mtp_file)), pages)
    oracle_drafts(engine, want)
    assert drain(engine) == want
    runner = engine.runner
    assert runner.drafter.stats.acceptance > 0.5 and runner.verify_graphed > 0
    if pages == 10:
        assert engine.scheduler.preemptions > 0
    else:  # every step after the prompts' is one of decode rows
        assert runner.verify_packed == 0
    assert engine.pool.used_pages == 0 and not runner.lookahead


def test_verify_rows_through_the_decode_kernels(store, mtp_file, monkeypatch):
    """The decode batches as on CUDA: no gathered keys, the GQA decode kernel attending and the
    fused K/V write kernel writing (both under Triton's interpreter), a request's rows in one
    launch each: the plain engine's greedy text, drafts mostly right."""
    from moetier.kernels import paged_kv
    from moetier.models import attention_batch, layers

    want = drain(Engine(native(store), EngineLimits(num_pages=64, page_size=4)))
    writes, attends = [], []

    def fused(cache, layer, page, offset, k, v):
        writes.append(page.shape)
        paged_kv.write_kv_pages_triton(cache, layer, page, offset, k, v)

    monkeypatch.setattr(attention_batch, "write_kv_pages", fused)
    engine = fixed_shape_engine(native(store, mtp_file=str(mtp_file)), 64, drafts=2,
                                gathered=False)  # fmt: skip
    real = layers.decode_attention
    monkeypatch.setattr(layers, "decode_attention", lambda *a: attends.append(a[4]) or real(*a))
    oracle_drafts(engine, want)
    assert drain(engine) == want
    assert engine.runner.verify_graphed > 0 and engine.runner.drafter.stats.acceptance > 0.5
    rows = [p.tolist() for p in attends if p.shape[0] >= 3]
    # one launch held a request's last token and both drafts: consecutive positions
    assert any(any(r[i + 1] == r[i] + 1 == r[i + 2] - 1 for i in range(len(r) - 2))
               for r in rows)  # fmt: skip
    assert writes


def test_logprob_and_penalised_requests_get_no_drafts(store, mtp_file):
    engine = Engine(native(store, mtp_file=str(mtp_file)),
                    EngineLimits(num_pages=64, page_size=4, speculative_tokens=2))  # fmt: skip
    drain(engine, params=SamplingParams(temperature=0.0, logprobs=2, max_new_tokens=6))
    drain(engine, params=SamplingParams(temperature=0.7, presence_penalty=0.5, max_new_tokens=6))
    assert engine.runner.drafter.stats.steps == 0


# chi-square's 99.9% quantile by degrees of freedom (a fixed seed: the test is deterministic)
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52}


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs` over the tokens of mass > 0, and its
    degrees of freedom."""
    live = probs > 0
    expected = probs[live] * counts.sum()
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    assert int(counts[~live].sum()) == 0  # nothing outside the support
    return stat, int(live.sum()) - 1


def test_speculative_sampling_keeps_the_target_distribution():
    """Drafts d0, d1 proposed greedily; the first token emitted is distributed as p0, the
    second (after d0) as p1, the third (after d0 d1) as p2, by chi-square at 99.9%."""
    from moetier.engine.speculative import rejection_rows, verify_sampled

    p = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
                      [0.05, 0.40, 0.05, 0.20, 0.10, 0.20],
                      [0.10, 0.10, 0.10, 0.30, 0.00, 0.40]])  # fmt: skip
    drafts = [1, 3]
    generator = torch.Generator().manual_seed(11)
    first = torch.zeros(6)
    second = torch.zeros(6)
    third = torch.zeros(6)
    trials = 20000
    for _ in range(trials):
        accept, tokens = rejection_rows(p, torch.tensor(drafts), generator)
        kept, token = verify_sampled(drafts, accept.tolist(), tokens.tolist())
        emitted = [*kept, token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
        if len(emitted) > 2:
            third[emitted[2]] += 1
    assert int(second.sum()) == int(first[1])  # a second token only after d0
    for counts, probs in ((first, p[0]), (second, p[1]), (third, p[2])):
        stat, df = chi2(counts, probs)
        assert stat < CHI2_999[df], (stat, counts.tolist())


def test_sampled_requests_with_top_k_1_decode_as_greedy(store, mtp_file):
    """top_k 1 leaves one token per position: sampled requests with drafts (random MTP and
    mostly-right ones) must give the greedy text."""
    want = drain(Engine(native(store), EngineLimits(num_pages=64, page_size=4)))
    one = SamplingParams(temperature=0.9, top_k=1, seed=5, max_new_tokens=14)
    engine = Engine(native(store, mtp_file=str(mtp_file)),
                    EngineLimits(num_pages=64, page_size=4, speculative_tokens=3,
                                 speculative_policy="always"))  # fmt: skip
    drafter = engine.runner.drafter
    real = drafter.draft

    def mostly_right(requests, k, cache):
        real(requests, k, cache)
        for request in requests:
            truth = want[request.id][len(request.output) :]
            request.drafts = (truth[:k] + [2] * k)[:k]
            if len(request.output) % 2:
                request.drafts[-1] = (request.drafts[-1] + 1) % 300

    drafter.draft = mostly_right
    assert drain(engine, params=one) == want
    assert drafter.stats.acceptance > 0.5


def test_the_mtp_layer_is_its_formula(store, mtp_file):
    """enorm / hnorm / eh_proj / the block / shared_head.norm and the main LM head, recomputed
    from the file's tensors by hand for one position."""
    from safetensors.torch import load_file

    loaded = native(store, mtp_file=str(mtp_file))
    model = loaded.model
    n = model.config.num_layers
    t = {k.removeprefix(f"model.layers.{n}."): v for k, v in load_file(str(mtp_file)).items()}
    eps = model.config.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    hidden = torch.randn(1, 1, model.config.hidden_size)
    token = torch.tensor([[7]])
    embeds = model.model.embed_tokens(token)
    x = torch.cat([rms(embeds, t["enorm.weight"]), rms(hidden, t["hnorm.weight"])], -1)
    x = x @ t["eh_proj.weight"].t()
    cache = model.new_cache(2, 4, torch.float32, "cpu")
    assert cache.shape[0] == n + 1  # the MTP layer's KV: one more layer
    from moetier.models.attention_batch import AttentionBatch

    batch = AttentionBatch.packed([(0, 1, [0])], 4, "cpu")
    cos, sin = model.model.rotary_emb(batch.positions, x.dtype)
    with torch.no_grad():
        block_out = model.mtp.block(x, cos, sin, batch, cache)
        got = model.mtp.logits(model.mtp(embeds, hidden, cos, sin, batch, cache), model.lm_head)
    want = rms(block_out, t["shared_head.norm.weight"]) @ model.lm_head.weight.t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_mtp_layers_fused_qkv_is_on_the_models_device(store, mtp_file):
    """The drafter's block runs q, k and v as one GEMM over `qkv_weight` (a plain attribute):
    it goes to the device with the layer (on an H100 it stayed on the CPU, 8c63926). Attached
    to the meta device here, the one other device a CPU box has."""
    from moetier.loader.mtp import attach_mtp

    loaded = native(store)
    attach_mtp(loaded.model, loaded.store, str(mtp_file), torch.device("meta"), torch.float32)
    attention = loaded.model.mtp.block.self_attn
    assert attention.qkv_weight is not None and attention.qkv_weight.is_meta
    assert all(p.is_meta for p in loaded.model.mtp.parameters())


def test_a_model_without_mtp_refuses_speculation(store, tmp_path):
    with pytest.raises(ValueError, match="none is loaded"):
        Engine(native(store), EngineLimits(num_pages=16, page_size=4, speculative_tokens=2))
    empty = tmp_path / "none.safetensors"
    save_file({"x": torch.zeros(1)}, str(empty))
    with pytest.raises(ValueError, match="has no MTP layer"):
        native(store, mtp_file=str(empty))


def test_metrics_show_the_drafts(store, mtp_file):
    """/metrics through the app: drafted and accepted by position, equal to the engine's."""
    import time

    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from moetier.engine.async_engine import AsyncEngine
    from moetier.server.app import create_app

    engine = Engine(native(store, mtp_file=str(mtp_file)),
                    EngineLimits(num_pages=64, page_size=4, speculative_tokens=2))  # fmt: skip
    app = create_app(AsyncEngine(engine), "tiny")
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "temperature": 0}
    with TestClient(app) as http:
        assert http.post("/v1/completions", json=body).status_code == 200
        for _ in range(100):
            samples = {(s.name, s.labels.get("position")): s.value
                       for f in text_string_to_metric_families(http.get("/metrics").text)
                       for s in f.samples}  # fmt: skip
            steps = engine.runner.drafter.stats.steps  # final: the answer came after its step
            if samples.get(("moetier_spec_verify_steps_total", None)) == steps:
                break  # /metrics follows the engine's step, which may end after the answer
            time.sleep(0.05)
    stats = engine.runner.drafter.stats
    assert stats.steps > 0
    assert samples[("moetier_spec_verify_steps_total", None)] == stats.steps
    for position, (d, a) in enumerate(zip(stats.drafted, stats.accepted, strict=True)):
        assert samples[("moetier_spec_drafted_total", str(position))] == d
        assert samples[("moetier_spec_accepted_total", str(position))] == a
    assert samples[("moetier_spec_mean_accepted", None)] == pytest.approx(stats.mean_accepted)


def test_policy_drafts_where_its_measured_steps_give_more_tokens_a_second():
    from moetier.engine.speculative import SpecPolicy

    policy = SpecPolicy(explore=10)
    assert policy.choose(1)  # a new bucket tries drafting first
    policy.record(1, True, 3, 0.012)  # one row: 3 tokens in 12 ms with drafts
    assert not policy.choose(1)  # then without
    policy.record(1, False, 1, 0.010)  # 1 token in 10 ms
    assert policy.choose(1)  # 250 tokens/s against 100
    policy.record(12, True, 24, 0.200)  # 12 rows (bucket 16): 120 tokens/s with drafts
    policy.record(16, False, 16, 0.050)  # 320 without
    picks = [policy.choose(16) for _ in range(20)]
    assert picks.count(True) == 2 and picks[9] and picks[19]  # off, but tried every 10th
    assert [SpecPolicy.bucket(r) for r in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]


def test_auto_policy_keeps_the_greedy_text(store, mtp_file):
    want = drain(Engine(native(store), EngineLimits(num_pages=64, page_size=4)))
    engine = Engine(native(store, mtp_file=str(mtp_file)),
                    EngineLimits(num_pages=64, page_size=4, speculative_tokens=2))  # fmt: skip
    assert engine.spec_policy is not None
    assert drain(engine) == want
    assert engine.spec_policy.buckets  # decode steps were measured


def test_moetier_bench_reports_the_acceptance(store, mtp_file, capsys):
    import json

    from moetier.cli.main import main

    args = ["bench", str(store), "--device", "cpu", "--json", "--native", "--batch", "2",
            "--prompt-tokens", "6", "--new-tokens", "8", "--warmup", "0",
            "--mtp-file", str(mtp_file), "--speculative-tokens", "2"]  # fmt: skip
    assert main(args) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    spec = line["speculative"]
    assert spec["k"] == 2 and len(spec["drafted_by_position"]) == 2
    assert sum(spec["drafted_by_position"]) > 0 and 0 <= spec["acceptance"] <= 1
    assert line["tokens_out"] == 16


def shipped_store(tiny, tmp_path_factory, family):
    """A tiny checkpoint of a family whose releases ship an MTP layer with an MoE block
    (`model.layers.{L}.*`, random weights), converted: the store keeps the layer."""
    from tiny_models import skip_without_transformers_family

    from moetier.quant.convert import convert
    from tests.quant.test_mtp_layers import with_mtp_layer

    skip_without_transformers_family(family)
    root = tmp_path_factory.mktemp(f"mtp-{family}")
    with_mtp_layer(tiny.checkpoint(family), root / "hf", family)
    return convert(root / "hf", root / "store", progress=False)


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe", "glm_moe_dsa"])
def shipped(request, tiny, tmp_path_factory):
    return shipped_store(tiny, tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def deepseek(tiny, tmp_path_factory):
    return shipped_store(tiny, tmp_path_factory, "deepseek_v3")


def test_shipped_mtp_layers_draft_and_keep_the_greedy_text(shipped):
    """The store's own MTP layer (an MoE block: its experts through the same runtime), k = 2:
    the greedy text of the model without it, with its drafts and with mostly-right ones."""
    want = drain(Engine(native(shipped), EngineLimits(num_pages=64, page_size=4)))
    loaded = native(shipped, mtp=True)
    layer = loaded.model.config.num_layers
    assert layer in loaded.runtime.formats  # the MTP layer's experts joined the runtime
    limits = EngineLimits(num_pages=64, page_size=4, speculative_tokens=2,
                          speculative_policy="always")  # fmt: skip
    engine = Engine(loaded, limits)
    assert drain(engine) == want
    assert engine.runner.drafter.stats.steps > 0
    engine = Engine(native(shipped, mtp=True), limits)
    real = engine.runner.drafter.draft

    def mostly_right(requests, k, cache):
        real(requests, k, cache)
        for request in requests:
            request.drafts = (want[request.id][len(request.output) :] + [3] * k)[:k]

    engine.runner.drafter.draft = mostly_right
    assert drain(engine) == want
    assert engine.runner.drafter.stats.acceptance > 0.8


def test_shipped_mtp_layers_verify_on_fixed_shape_rows(shipped):
    """Each family whose checkpoints ship an MTP layer (GLM-5's indexer scoring each row's
    gathered keys among them): verify steps as fixed-shape decode rows, mostly-right drafts,
    the greedy text of the model without drafts."""
    want = drain(Engine(native(shipped), EngineLimits(num_pages=64, page_size=4)))
    engine = fixed_shape_engine(native(shipped, mtp=True), 64, drafts=2)
    oracle_drafts(engine, want)
    assert drain(engine) == want
    runner = engine.runner
    assert runner.verify_graphed > 0 and runner.verify_packed == 0
    assert runner.drafter.stats.acceptance > 0.5


@pytest.mark.parametrize("pages, gathered", [(64, True), (10, True), (64, False)])
def test_deepseek_verify_rows_keep_the_greedy_text(deepseek, pages, gathered, monkeypatch):
    """deepseek_v3 with its shipped MTP layer (MLA, its MoE block's experts in the runtime):
    speculative steps as fixed-shape decode rows give the greedy text of the model without
    drafts, with the layer's drafts and with mostly-right ones; gathered False: the rows attend
    through the MLA decode kernel (Triton's interpreter), as on CUDA; 10 pages: preempted."""
    from moetier.kernels.mla_decode import mla_decode
    from moetier.models import layers

    want = drain(Engine(native(deepseek), EngineLimits(num_pages=64, page_size=4)))
    calls = []
    monkeypatch.setattr(layers, "mla_decode", lambda *a: calls.append(a[3]) or mla_decode(*a))
    engine = fixed_shape_engine(native(deepseek, mtp=True), pages, drafts=2, gathered=gathered)
    seen = check_rows_equal_packed(engine, monkeypatch)
    assert drain(engine) == want
    assert engine.runner.verify_graphed > 0 and any(seen)
    engine = fixed_shape_engine(native(deepseek, mtp=True), pages, drafts=2, gathered=gathered)
    oracle_drafts(engine, want)
    assert drain(engine) == want
    assert engine.runner.drafter.stats.acceptance > 0.5 and engine.runner.verify_graphed > 0
    assert (pages == 10) == (engine.scheduler.preemptions > 0)
    assert bool(calls) == (not gathered)  # the kernel took the rows only without gathered keys


def test_verify_steps_take_buckets_of_k_plus_one_rows(store, mtp_file):
    """With k drafts a step, batch buckets of n x (k + 1) rows join the powers of two: one
    request's verify step at k = 2 runs on 3 rows (a padding row would route to experts of its
    own), the text unchanged."""
    want = drain(Engine(native(store), EngineLimits(num_pages=64, page_size=4)), PROMPTS[:1])
    engine = fixed_shape_engine(native(store, mtp_file=str(mtp_file)), 64, drafts=2)
    runner = engine.runner
    assert runner.buckets == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    assert drain(engine, PROMPTS[:1]) == want
    used = {rows for rows, _ in runner.graphs}
    assert runner.verify_graphed > 0 and 3 in used and 4 not in used


def record_drafts(engine):
    """The MTP layer's own drafts of each drafting call, (request, tokens so far, drafts)."""
    drafter = engine.runner.drafter
    real, seen = drafter.draft, []

    def recording(requests, k, cache):
        real(requests, k, cache)
        seen.extend((r.id, len(r.output), tuple(r.drafts)) for r in requests)

    drafter.draft = recording
    return seen


@pytest.mark.parametrize(
    "family, pages, gathered",
    [("qwen3_moe", 64, True), ("qwen3_moe", 10, True), ("qwen3_moe", 64, False),
     ("deepseek_v3", 64, True), ("deepseek_v3", 64, False)],
)  # fmt: skip
def test_drafting_on_fixed_shapes_gives_the_eager_drafts(family, pages, gathered, request):
    """Drafting on the draft graphs' fixed-shape inputs (engine/draft_graphs.py: every
    request's catch-up as k + 1 decode rows, then the chain) proposes the drafts that eager
    drafting does, call for call, with the layer's own drafts verified and with mostly-right
    ones (1 to k + 1 catch-up positions a request); the text stays the plain engine's.
    gathered False: the rows attend through the decode kernels (Triton's interpreter)."""
    if family == "qwen3_moe":
        store = request.getfixturevalue("store")
        extra = {"mtp_file": str(request.getfixturevalue("mtp_file"))}
    else:
        store, extra = request.getfixturevalue("deepseek"), {"mtp": True}
    want = drain(Engine(native(store), EngineLimits(num_pages=64, page_size=4)))
    runs = []
    for fixed_drafting in (True, False):
        for oracle in (False, True):
            engine = fixed_shape_engine(native(store, **extra), pages, drafts=2,
                                        gathered=gathered)  # fmt: skip
            drafter = engine.runner.drafter
            if not fixed_drafting:
                drafter.layout = None  # eager drafting, verify steps on fixed rows as before
            seen = record_drafts(engine)
            if oracle:
                oracle_drafts(engine, want)
            assert drain(engine) == want
            assert (drafter.graphed > 0) == fixed_drafting and drafter.eager > 0
            runs.append(seen)
            if pages == 10:
                assert engine.scheduler.preemptions > 0
    assert runs[0] == runs[2] and runs[1] == runs[3]
    assert len(runs[0]) > len(PROMPTS) and len(set(runs[0])) > 1


def test_draft_graphs_beyond_their_cap_are_dropped_and_drafts_stay_the_same(
    store, mtp_file, monkeypatch
):
    """The drafter keeps its graphs as the runner does (a DecodeGraphs): with a cap of one,
    each new key drops the last one and is made again when needed; the drafts are the same.
    Context buckets from one page of 4 positions, so the requests cross widths."""
    from moetier.engine import decode_graphs

    monkeypatch.setattr(decode_graphs, "FIRST_CONTEXT_TOKENS", 4)
    want = drain(Engine(native(store), EngineLimits(num_pages=64, page_size=4)))
    runs, kept = [], []
    for cap in (None, 1):
        engine = fixed_shape_engine(native(store, mtp_file=str(mtp_file)), 64, drafts=2,
                                    gathered=True)  # fmt: skip
        drafter = engine.runner.drafter
        if cap is not None:
            drafter.graphs.cap = cap
        seen = record_drafts(engine)
        assert drain(engine) == want and drafter.graphed > 0
        runs.append(seen)
        kept.append((len(drafter.graphs), drafter.graphs.dropped))
    assert runs[0] == runs[1]
    assert kept[0][0] > 1 and kept[0][1] == 0  # several keys, none dropped
    assert kept[1][0] == 1 and kept[1][1] > 0


def test_sampled_verify_rows_keep_seeded_sampling(store, mtp_file):
    """Seeded sampled requests with drafts: on fixed-shape rows the tokens the packed verify
    steps draw (the same generator draws from logits equal to float error), and a second run
    the same; top_k 1 gives the greedy text."""
    want = drain(Engine(native(store), EngineLimits(num_pages=64, page_size=4)))
    seeded = SamplingParams(temperature=0.8, seed=7, max_new_tokens=14)
    runs = []
    for fixed in (False, True, True):
        engine = fixed_shape_engine(native(store, mtp_file=str(mtp_file)), 64)
        engine.runner.fixed_shapes = fixed
        oracle_drafts(engine, want)
        runs.append(drain(engine, params=seeded))
        assert (engine.runner.verify_graphed > 0) == fixed
        assert (engine.runner.verify_packed > 0) == (not fixed)
    assert runs[0] == runs[1] == runs[2]
    engine = fixed_shape_engine(native(store, mtp_file=str(mtp_file)), 64)
    oracle_drafts(engine, want)
    one = SamplingParams(temperature=0.9, top_k=1, seed=5, max_new_tokens=14)
    assert drain(engine, params=one) == want
    assert engine.runner.verify_graphed > 0


@pytest.mark.parametrize("rates, kept", [("1,1", [1.0, 1.0]), ("0,0", [0.0, 0.0])])
def test_bench_replays_acceptance_on_a_synthetic_shape(capsys, rates, kept):
    """`moetier bench --shape tiny --speculative-tokens 2 --mtp-replay R`: the synthetic store
    gets an MTP layer; drafts are kept at the replayed rates (all, none), the counts hold."""
    import json

    from moetier.cli.main import main

    args = ["bench", "--shape", "tiny", "--layers", "1", "--device", "cpu", "--json",
            "--native", "--prompt-tokens", "6", "--new-tokens", "9", "--warmup", "0",
            "--speculative-tokens", "2", "--mtp-replay", rates]  # fmt: skip
    assert main(args) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    spec = line["speculative"]
    rate = [a / d for a, d in zip(spec["accepted_by_position"], spec["drafted_by_position"],
                                  strict=True)]  # fmt: skip
    assert rate == kept and line["tokens_out"] == 9


def test_bench_with_the_auto_policy_stops_drafting_that_never_pays(capsys):
    """`moetier bench ... --speculative-policy auto` (serve's rule): with no draft ever kept
    (replayed rate 0), drafting only costs, so the engine's measured steps turn it off; under
    `always` every step drafts."""
    import json

    from moetier.cli.main import main

    base = ["bench", "--shape", "tiny", "--layers", "1", "--device", "cpu", "--json",
            "--native", "--prompt-tokens", "6", "--new-tokens", "40", "--warmup", "0",
            "--speculative-tokens", "2", "--mtp-replay", "0,0"]  # fmt: skip
    drafted = {}
    for policy in ("always", "auto"):
        assert main([*base, "--speculative-policy", policy]) == 0
        line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert line["speculative_policy"] == policy and line["tokens_out"] == 40
        drafted[policy] = line["speculative"]["drafted_by_position"][0]
    assert drafted["always"] >= 38  # every decode step (39) drafts
    assert drafted["auto"] < 20, drafted


def test_replayed_rates_must_not_increase(store, mtp_file):
    engine = Engine(native(store, mtp_file=str(mtp_file)),
                    EngineLimits(num_pages=16, page_size=4, speculative_tokens=2))  # fmt: skip
    with pytest.raises(ValueError, match="must not increase"):
        engine.runner.drafter.replay([0.2, 0.5])


def test_moetier_generate_with_drafts_writes_the_same_text(store, mtp_file, capsys):
    from moetier.cli.main import main

    base = ["generate", str(store), "--device", "cpu", "--native", "--prompt", "hello world",
            "--max-new-tokens", "12", "--temperature", "0"]  # fmt: skip
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--mtp-file", str(mtp_file), "--speculative-tokens", "2"]) == 0
    out = capsys.readouterr()
    assert out.out == plain
    assert "tokens a verify step" in out.err


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_greedy_output_is_unchanged_with_drafts_on_cuda(family, request):
    """On CUDA, decode and verify steps replayed from the batch buckets' graphs (a verify
    step's tokens as decode rows: the GQA decode kernel and fused K/V write, or MLA's decode
    kernel): the drafted engine's greedy text equals the plain one's, with the layer's drafts
    and with drafts from the true continuation (most accepted); no verify step ran packed."""
    if family == "qwen3_moe":
        store, extra = request.getfixturevalue("store"), {}
        extra["mtp_file"] = str(request.getfixturevalue("mtp_file"))
    else:
        store, extra = request.getfixturevalue("deepseek"), {"mtp": True}
    cuda = dict(device="cuda", dtype="float32", native=True)
    plain = Engine(load_model(store, EngineConfig(**cuda)), EngineLimits(num_pages=64, page_size=4))
    want = drain(plain, PROMPTS)
    assert plain.runner.graphs
    loaded = load_model(store, EngineConfig(**cuda, **extra))
    limits = EngineLimits(num_pages=64, page_size=4, speculative_tokens=2,
                          speculative_policy="always")  # fmt: skip
    engine = Engine(loaded, limits)
    assert engine.runner.use_graphs
    assert drain(engine) == want
    assert engine.runner.verify_graphed > 0 and engine.runner.verify_packed == 0
    engine = Engine(loaded, limits)
    oracle_drafts(engine, want)
    assert drain(engine) == want
    runner = engine.runner
    assert runner.drafter.stats.acceptance > 0.5
    assert runner.verify_graphed > 0 and runner.verify_packed == 0
    assert all(runner.graphs.get(key).graph is not None for key in runner.graphs)  # captured
    drafter = runner.drafter  # drafting replayed from its graphs after each prompt's first
    assert drafter.graphed > drafter.eager and not drafter.graphs.failed
    assert all(drafter.graphs.get(key).graph is not None for key in drafter.graphs)


def test_a_stop_string_inside_the_accepted_drafts_ends_the_count_there(store, mtp_file):
    """A verify step appends up to k + 1 tokens; where a stop string ends at the first of
    them, the ones after it are neither sent nor counted in completion_tokens (as without
    drafts)."""
    prompt, greedy = PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=12)
    plain = Engine(native(store), EngineLimits(num_pages=64, page_size=4))
    plain.add("a", prompt, greedy)
    tokens, text, ends = [], "", []  # ends: the text's length after each token
    while plain.has_work:
        for o in plain.step():
            tokens += o.token_ids
            text += o.text
            ends.append(len(text))
    # a stop string ending with a token in the middle of the answer, seen nowhere before
    cuts = [text[: ends[j]][-2:] for j in range(3, len(ends) - 3) if ends[j] >= 2]
    stop = next((c for c in cuts if text.find(c) + 2 in ends[3:-3]), None)
    assert stop and len(tokens) >= 6, "the tiny model's answer has a stop string to find"
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop=(stop,))
    outputs = {}
    for drafts in (0, 3):
        limits = EngineLimits(num_pages=64, page_size=4, speculative_tokens=drafts,
                              speculative_policy="always")  # fmt: skip
        engine = Engine(native(store, mtp_file=str(mtp_file)) if drafts else native(store), limits)
        if drafts:
            drafter, real = engine.runner.drafter, engine.runner.drafter.draft

            def oracle(requests, k, cache, real=real):
                real(requests, k, cache)
                for request in requests:
                    request.drafts = (tokens[len(request.output) :] + [1] * k)[:k]

            drafter.draft = oracle
        engine.add("a", prompt, params)
        got, last = "", None
        while engine.has_work:
            for o in engine.step():
                got, last = got + o.text, o
        outputs[drafts] = (got, last.finish_reason, last.completion_tokens, last.token_ids)
    assert outputs[3][:3] == outputs[0][:3]
    assert outputs[0][1] == "stop" and outputs[0][2] < len(tokens)


def test_steps_without_drafts_keep_the_mtp_layer_caught_up(store, mtp_file):
    """While the policy drafts nothing, a request's kept hidden states stay within
    STASH_POSITIONS (the MTP layer runs over them in batches), and once drafting resumes its
    drafts are those of an engine that drafted all along (the layer's KV is complete)."""
    from moetier.engine.speculative import STASH_POSITIONS

    params = SamplingParams(temperature=0.0, max_new_tokens=150)
    seen = {}
    for off_until in (0, 110):  # output tokens before drafting starts
        limits = EngineLimits(num_pages=64, page_size=4, speculative_tokens=2)
        engine = Engine(native(store, mtp_file=str(mtp_file)), limits)
        engine.spec_policy.choose = lambda rows, e=engine, n=off_until: all(
            len(r.output) >= n for r in e.scheduler.running
        )
        drafter, real, drafts, stash = engine.runner.drafter, engine.runner.drafter.draft, {}, []

        def record(requests, k, cache, real=real, drafts=drafts, drafter=drafter, stash=stash):
            real(requests, k, cache)
            for r in requests:
                drafts[len(r.output)] = list(r.drafts)

        drafter.draft = record
        engine.add("a", PROMPTS[0], params)
        tokens = []
        while engine.has_work:
            for o in engine.step():
                tokens += o.token_ids
            stash.append(drafter.stashed("a"))
        seen[off_until] = (tokens, drafts, max(stash[:-1]))
    assert seen[110][0] == seen[0][0]
    assert seen[110][2] <= STASH_POSITIONS + 1 < seen[110][2] * 2
    both = [n for n in seen[110][1] if n >= 110 and n in seen[0][1]]
    assert len(both) >= 10 and all(seen[110][1][n] == seen[0][1][n] for n in both)


@pytest.mark.parametrize("fixed", [False, True])
def test_verify_steps_update_the_confidence_gate(tiny, tmp_path_factory, mtp_file, fixed):
    """Under a gate rule with the confidence term, a verify step leaves each request's top
    probability of the distribution its last token came from, as a plain decode step does:
    the table after each step equals the engine's without drafts at the same output length
    (within 2%: a verify step's drafted tokens see confidence 1.0, so the gate's choices,
    and the logits, move a little). fixed: steps on the graphs' fixed-shape inputs (the gate's
    rows staged there, a token a row in verify steps)."""
    from moetier.loader.quantize import convert_quantized

    delta_store = tmp_path_factory.mktemp("gated") / "delta"
    convert_quantized(tiny.checkpoint("qwen3_moe"), delta_store, delta="nvfp4", progress=False)
    rule = "budget:0.5:weight*confidence"
    tops = {}
    for drafts in (0, 2):
        limits = EngineLimits(num_pages=64, page_size=4, speculative_tokens=drafts,
                              speculative_policy="always")  # fmt: skip
        config = {"mtp_file": str(mtp_file)} if drafts else {}
        engine = Engine(native(delta_store, delta=rule, **config), limits)
        engine.runner.fixed_shapes = fixed
        if drafts:
            real = engine.runner.drafter.draft

            def oracle(requests, k, cache, real=real):
                real(requests, k, cache)
                for request in requests:
                    request.drafts = (tops[0]["tokens"][len(request.output) :] + [1] * k)[:k]

            engine.runner.drafter.draft = oracle
        request = engine.add("a", PROMPTS[2], GREEDY)
        rows = engine.runner.gate_rows
        seen, tokens = {}, []
        while engine.has_work:
            for o in engine.step():
                tokens += o.token_ids
            if engine.has_work:
                seen[len(request.output)] = float(rows.top[rows._slot("a")])
        tops[drafts] = {"tokens": tokens, "seen": seen}
    assert tops[2]["tokens"] == tops[0]["tokens"]
    assert engine.runner.drafter.stats.acceptance > 0.5
    assert (engine.runner.verify_graphed > 0) == fixed
    common = [n for n in tops[2]["seen"] if n in tops[0]["seen"]]
    assert len(common) >= 3
    for n in common:
        assert tops[2]["seen"][n] == pytest.approx(tops[0]["seen"][n], rel=0.02), n
    assert any(v < 0.999 for v in tops[0]["seen"].values())  # a table worth comparing


def mtp_kv(engine, request):
    """The MTP layer's KV entries of a request's computed positions, position by position."""
    cache = engine.runner.cache[engine.loaded.model.config.num_layers]
    size = engine.pool.page_size
    at = [(request.pages[p // size], p % size) for p in range(request.computed)]
    if cache.dim() == 5:  # GQA: [2, pages, kv_heads, page_size, head_dim]
        return [cache[:, page, :, offset].clone() for page, offset in at]
    return [cache[page, offset].clone() for page, offset in at]  # MLA: [pages, size, latent]


def second_request(engine, first, first_params, second):
    """Serve `first` (with first_params), then `second` (a function of first's output, or a
    prompt): -> (every request's tokens, second's drafts call by call, the MTP layer's KV of
    second's positions at its first draft, its prompt tokens from the prefix cache)."""
    drafter = engine.runner.drafter
    real, drafts, seen = drafter.draft, [], {}

    def record(requests, k, cache):
        real(requests, k, cache)
        for request in requests:
            if request.id == "b":
                drafts.append((len(request.output), tuple(request.drafts)))
                seen.setdefault("kv", mtp_kv(engine, request))
                seen.setdefault("cached", request.cached_tokens)

    drafter.draft = record
    out: dict[str, list[int]] = {"a": [], "b": []}
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    for rid, prompt, p in (("a", first, first_params), ("b", second, params)):
        prompt = prompt(out["a"]) if callable(prompt) else prompt
        engine.add(rid, prompt, p, ignore_eos=True)
        while engine.has_work:
            for o in engine.step():
                out[o.request_id] += o.token_ids
    return out, drafts, seen["kv"], seen["cached"]


SHARED = list(range(30, 38))  # two pages of 4
PREFIX_HITS = {  # (first prompt, its params, second prompt, second's expected hit)
    # a shared prefix ending on a page boundary, another token after it: without the token in
    # the page's key the MTP entry at position 7 was the first request's (its token 8: 50)
    "boundary": (SHARED + [50, 51], dict(max_new_tokens=6), SHARED + [60, 61, 62], 4),
    # the shared prefix ends inside a page: the hit's last MTP entry has the same next token
    "mid_page": (SHARED + [44, 50], dict(max_new_tokens=6), SHARED + [44, 60, 61], 8),
    # the next turn of a conversation, its first turn ended on the step that filled its third
    # page: the MTP entry at position 11 was never written (or the chain's) before it ended
    "next_turn": (
        SHARED + [44],
        dict(max_new_tokens=4),
        lambda out: SHARED + [44, *out, 70, 71],
        12,
    ),
    # a first request that never drafts (a penalty) wrote no MTP KV at all
    "no_drafts": (
        SHARED + [44],
        dict(max_new_tokens=6, repetition_penalty=1.3),
        SHARED + [44, 9],
        8,
    ),
}


@pytest.mark.parametrize("case", list(PREFIX_HITS))
@pytest.mark.parametrize("family, fixed", [("qwen3_moe", False), ("qwen3_moe", True),
                                           ("deepseek_v3", False)])  # fmt: skip
def test_a_prefix_hit_drafts_as_if_it_computed_the_prefix(case, family, fixed, request):
    """The MTP layer's KV sits in the request's pages and its entry at position p needs the
    token at p + 1: a request that takes pages from the prefix cache finds there, at its first
    draft, the MTP KV it would have written itself (prefix cache off), and drafts the same
    tokens call for call; the text is the same. Pages enter the cache once their MTP KV is
    written (a finishing request's last positions included), keyed with the token after them,
    so only a hit whose next token differs from the page writer's loses its last page.
    deepseek_v4: test_speculative_deepseek_v4.py's test of this name (its MTP stores)."""
    if family == "qwen3_moe":
        store = request.getfixturevalue("store")
        extra = {"mtp_file": str(request.getfixturevalue("mtp_file"))}
    else:
        store, extra = request.getfixturevalue("deepseek"), {"mtp": True}
    first, first_params, second, hit = PREFIX_HITS[case]
    first_params = SamplingParams(temperature=0.0, **first_params)
    runs = []
    for caching in (True, False):
        if fixed:
            engine = fixed_shape_engine(native(store, **extra), 64, drafts=2,
                                        prefix_caching=caching)  # fmt: skip
        else:
            limits = EngineLimits(num_pages=64, page_size=4, speculative_tokens=2,
                                  speculative_policy="always", prefix_caching=caching)  # fmt: skip
            engine = Engine(native(store, **extra), limits)
        runs.append(second_request(engine, first, first_params, second))
        if fixed:
            assert engine.runner.drafter.graphed > 0
    (out, drafts, kv, cached), (out_off, drafts_off, kv_off, cached_off) = runs
    assert (cached, cached_off) == (hit, 0)
    assert out == out_off
    stale = [p for p, (a, b) in enumerate(zip(kv, kv_off, strict=True))
             if not torch.allclose(a, b, atol=1e-5)]  # fmt: skip
    assert stale == []
    assert drafts == drafts_off and len(drafts) > 3
