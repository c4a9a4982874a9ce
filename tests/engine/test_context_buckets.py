"""Decode steps keyed by (batch bucket, context bucket) (engine/decode_graphs.py, the runner's
graph keying) for the families that attend over keys gathered from the pages (glm_moe_dsa's
indexer, deepseek_v4, gpt_oss): on CPU the runner's fixed-shape steps run eagerly on the inputs
a CUDA graph would capture (`fixed_shapes`), with a ladder whose first bucket is one page of 4
positions, so short prompts cross buckets. Their logits equal the gathered path over each
step's own widest table (the path before context buckets), and the engine's batched greedy
tokens equal each request generated alone (static cache), steps launched ahead included."""

from __future__ import annotations

import pytest
import torch
from tiny_models import skip_without_transformers_family

from moetier.config import EngineConfig
from moetier.engine import decode_graphs
from moetier.engine.decode_graphs import DecodeGraphs, bucket_of, context_ladder
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.graph_placement import place_for_graphs
from moetier.engine.sampler import SamplingParams
from moetier.loader.load import load_model
from tests.engine.test_engine import alone, check_against_alone, random_requests, run

FP32 = EngineConfig(device="cpu", dtype="float32", native=True)
PAGE = 4  # positions a page; the first context bucket is one page
FAMILIES = ["glm_moe_dsa", "deepseek_v4", "gpt_oss"]
# deepseek_v4 with every layer type (sliding, CSA with its indexer, HCA), as its own tests
DSV4_LAYERS = dict(
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    index_n_heads=8,
    partial_rotary_factor=0.25,
)


@pytest.fixture(scope="module", params=FAMILIES)
def gathered(request, tiny, tmp_path_factory):
    """A tiny native model of a family whose attention gathers its keys on every device."""
    family = request.param
    skip_without_transformers_family(family)
    if family != "deepseek_v4":
        return load_model(tiny.store(family), FP32)
    from tiny_models import build_tiny

    from moetier.quant.convert import convert

    root = tmp_path_factory.mktemp("dsv4-buckets")
    checkpoint = build_tiny("deepseek_v4", root / "hf", **DSV4_LAYERS)
    return load_model(convert(checkpoint, root / "store", progress=False), FP32)


@pytest.fixture
def one_page_first(monkeypatch):
    """Context buckets of 1, 2, 4 ... pages of PAGE positions."""
    monkeypatch.setattr(decode_graphs, "FIRST_CONTEXT_TOKENS", PAGE)


def fixed_engine(loaded, num_pages: int = 64, **limits) -> Engine:
    engine = Engine(loaded, EngineLimits(num_pages=num_pages, page_size=PAGE, **limits))
    engine.runner.fixed_shapes = True
    return engine


def test_context_ladder_and_buckets():
    assert context_ladder(1, 64) == (1, 2, 4, 8, 16, 32, 64)
    assert context_ladder(64, 12_663) == (64, 128, 256, 512, 1024, 2048, 4096, 8192, 12_663)
    assert context_ladder(3, 10) == (3, 6, 10)
    assert context_ladder(200, 50) == (50,)  # the first bucket no wider than the table
    assert context_ladder(0, 5) == (1, 2, 4, 5)
    with pytest.raises(ValueError):
        context_ladder(1, 0)
    ladder = context_ladder(2, 9)
    assert [bucket_of(ladder, n) for n in (1, 2, 3, 4, 5, 8, 9, 10)] == [2, 2, 4, 4, 8, 8, 9, None]


def test_graphs_keep_the_most_recently_used():
    graphs = DecodeGraphs(cap=2)
    made = [decode_graphs.DecodeGraph(rows, width, torch.device("cpu"))
            for rows, width in ((1, 1), (1, 2), (2, 1))]  # fmt: skip
    graphs.add(made[0])
    graphs.add(made[1])
    assert graphs.get((1, 1)) is made[0]  # now the most recent
    graphs.add(made[2])  # drops (1, 2)
    assert list(graphs) == [(1, 1), (2, 1)] and graphs.dropped == 1
    assert graphs.get((1, 2)) is None and len(graphs) == 2


def test_fixed_width_steps_equal_the_gathered_path(gathered, one_page_first, monkeypatch):
    """Each decode step runs twice on the same items: on the gathered path over the rows'
    widest page table (fixed_shapes off), then on the fixed-shape inputs of its (batch,
    context) bucket; logits equal. Requests cross from one bucket to the next during decode
    and share steps with rows in other buckets; tokens equal each request alone."""
    engine = fixed_engine(gathered, max_num_batched_tokens=64)
    runner = engine.runner
    assert runner.context_buckets == context_ladder(1, runner.table_width)
    original = runner._decode_logits
    steps = []

    def both(items):
        runner.fixed_shapes = False
        plain, _ = original(items)
        plain = plain.clone()
        runner.fixed_shapes = True
        fixed, launch = original(items)
        needed = {item.request.id: item.start // PAGE + 1 for item in items}
        scale = plain.abs().max().item()
        steps.append((needed, tuple(launch.table.shape), (fixed - plain).abs().max().item(), scale))
        return fixed, launch

    monkeypatch.setattr(runner, "_decode_logits", both)
    new = SamplingParams(temperature=0, max_new_tokens=14)
    prompts = {"a": [5, 9], "b": list(range(3, 12)), "c": list(range(40, 59)), "d": [7] * 6}
    # "a" decodes alone first (its positions 2 .. 7: buckets of one page, then two)
    later = [(rid, prompts[rid], new) for rid in ("b", "c")]
    got = run(engine, {0: [("a", prompts["a"], new)], 6: later, 9: [("d", prompts["d"], new)]})
    for rid, prompt in prompts.items():
        assert got[rid][0] == alone(gathered, prompt, new)[0], rid
    assert steps
    for needed, shape, diff, scale in steps:
        rows = bucket_of(decode_graphs.BATCH_BUCKETS, len(needed))
        assert shape == (rows, bucket_of(runner.context_buckets, max(needed.values())))
        assert diff <= 1e-5 * scale, (needed, diff)
    ladder = runner.context_buckets
    a_buckets = {bucket_of(ladder, s[0]["a"]) for s in steps if "a" in s[0]}
    assert {1, 2, 4} <= a_buckets  # "a" crossed from one page's bucket to two, then four
    mixed = [s for s in steps if len({bucket_of(ladder, n) for n in s[0].values()}) > 1]
    assert mixed  # rows of different buckets in one step
    assert {width for (_, width) in runner.graphs} >= {1, 2, 8}
    assert engine.pool.used_pages == 0


def test_steps_launched_ahead_across_buckets_equal_alone(gathered, one_page_first):
    """Lookahead on the fixed-shape steps: a step launched ahead whose rows' next positions
    need a wider bucket moves onto that bucket's inputs; staggered arrivals, chunked prefill,
    rows finishing while a step is ahead: tokens as each request alone."""
    engine = fixed_engine(gathered, max_num_batched_tokens=8)
    engine.runner.lookahead = True
    requests = random_requests(gathered.model_config.vocab_size, 6, seed=11, max_new=20)
    check_against_alone(gathered, engine, requests)
    runner = engine.runner
    assert runner.ahead_taken > 0 and runner.ahead_moved > 0


def test_a_small_graph_cap_drops_graphs_and_decodes_the_same(gathered, one_page_first):
    engine = fixed_engine(gathered, max_num_batched_tokens=16)
    engine.runner.graphs.cap = 2
    engine.runner.lookahead = True
    requests = random_requests(gathered.model_config.vocab_size, 5, seed=4, max_new=16)
    check_against_alone(gathered, engine, requests)
    assert engine.runner.graphs.dropped > 0 and len(engine.runner.graphs) <= 2


def test_preemption_under_a_tiny_kv_budget(gathered, one_page_first):
    """Preempted and recomputed requests re-enter smaller buckets; the table's widest bucket is
    the page pool (12 pages: ladder 1, 2, 4, 8, 12)."""
    engine = fixed_engine(gathered, num_pages=12, max_num_batched_tokens=64)
    assert engine.runner.context_buckets == (1, 2, 4, 8, 12)
    requests = random_requests(gathered.model_config.vocab_size, 6, seed=2, max_prompt=14)
    requests = [(rid, p, SamplingParams(temperature=0, max_new_tokens=16), 0)
                for rid, p, _, _ in requests]  # fmt: skip
    check_against_alone(gathered, engine, requests)
    assert engine.scheduler.preemptions > 0


def test_kernel_families_keep_one_width(tiny, one_page_first):
    """Where the decode kernels read the pages (no gathered keys: as qwen3_moe on CUDA), the
    steps are keyed by batch bucket only: one width, the whole table."""
    loaded = load_model(tiny.store("qwen3_moe"), FP32)
    engine = fixed_engine(loaded, num_pages=32, max_num_batched_tokens=16)
    runner = engine.runner
    assert len(runner.context_buckets) > 1  # CPU: SDPA gathers
    runner.gather_decode_keys = False  # the decode kernel reads pages (interpreted on CPU)
    assert runner.context_buckets == (runner.table_width,)
    new = SamplingParams(temperature=0, max_new_tokens=6)
    requests = [("x", [4, 5, 6], new, 0), ("y", list(range(3, 13)), new, 1)]
    check_against_alone(loaded, engine, requests)
    assert {width for (_, width) in runner.graphs} == {runner.table_width}


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("compiled", [False, True], ids=["graphs", "compiled"])
def test_gathered_families_decode_from_graphs_on_cuda(tiny, family, compiled, monkeypatch):
    """On CUDA the gathered families' decode steps replay CUDA graphs per (batch, context)
    bucket (first bucket one page of 16 positions, so 30-token prompts cross buckets; warmed
    at load at the smallest context bucket, wider ones captured as steps need them), steps
    launched ahead included; fp32, batched greedy = each request alone."""
    skip_without_transformers_family(family)
    monkeypatch.setattr(decode_graphs, "FIRST_CONTEXT_TOKENS", 16)
    config = EngineConfig(device="cuda", dtype="float32", native=True, compile_decode=compiled)
    loaded = load_model(tiny.store(family), config)
    limits = EngineLimits(num_pages=48, page_size=16, max_num_seqs=8, max_num_batched_tokens=16)
    engine = Engine(loaded, limits)
    runner = engine.runner
    assert runner.use_graphs and runner.gather_decode_keys
    assert sorted(runner.graphs) == [(b, 1) for b in (1, 2, 4, 8)]  # warmed at load
    check_against_alone(loaded, engine, random_requests(loaded.model_config.vocab_size, 8, 3))
    assert {width for (_, width) in runner.graphs} >= {1, 2}
    assert not runner.graphs.failed and runner.ahead_taken > 0


@pytest.mark.slow  # compiles the tiny model's step twice on the CPU (inductor)
def test_compiled_steps_keep_two_compilations_across_buckets(tiny, monkeypatch):
    """The compiled step (as the CUDA graphs run it: experts pinned) over context buckets of 2,
    4 and 8 pages and batch buckets 1 and 2: the width is symbolic, so the step compiles twice
    (one row, then a symbolic row count), not once per width; tokens as each request alone."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(decode_graphs, "FIRST_CONTEXT_TOKENS", 2 * PAGE)
    loaded = load_model(tiny.store("glm_moe_dsa"), FP32)
    assert place_for_graphs(loaded)  # every expert pinned, as for the CUDA graphs
    engine = fixed_engine(loaded)
    engine.runner.compile_step()
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    new = SamplingParams(temperature=0, max_new_tokens=14)
    a, b = [5, 9], list(range(3, 20))
    got = run(engine, {0: [("a", a, new)], 8: [("b", b, new)]})
    assert sorted(engine.runner.graphs) == [(1, 2), (1, 4), (1, 8), (2, 8)]
    assert counters["stats"]["unique_graphs"] - before == 2
    assert got["a"][0] == alone(loaded, a, new)[0] and got["b"][0] == alone(loaded, b, new)[0]
