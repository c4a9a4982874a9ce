"""The native deepseek_v4 model file (hyper-connections, sliding-window / compressed sparse /
heavily compressed attention over a position-indexed paged cache, hash and sqrt-softplus
routers, clamped experts) against the HF transformers forward on tiny random checkpoints, and
the serving engine's paged batches against each request decoded alone."""

from __future__ import annotations

import pytest
import torch
from test_native import graph_replays_eager
from test_oracle import hf_greedy, hf_reference, moetier_greedy, prompt

from moetier.config import EngineConfig, replace
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.static_decode import StaticDecoder
from moetier.loader.load import load_model
from moetier.models import deepseek_v4_attention
from moetier.models.attention_batch import AttentionBatch
from moetier.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4MoE
from tests.engine.test_engine import check_against_alone, random_requests

pytest.importorskip(
    "transformers.models.deepseek_v4", reason="this transformers has no DeepSeek-V4"
)

FP32 = EngineConfig(device="cpu", dtype="float32", native=True)
# every layer type, windows short enough that a 40-token prompt closes several (CSA: more
# entries than index_topk = 4, so the indexer's choice shows); 8 indexer heads make exact ties
# of its scores (every head's ReLU at zero), whose order torch.topk leaves open, unlikely
VARIANT = dict(
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    index_n_heads=8,
    partial_rotary_factor=0.25,
)


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    from tiny_models import build_tiny

    from moetier.quant.convert import convert

    root = tmp_path_factory.mktemp("dsv4")
    checkpoint = build_tiny("deepseek_v4", root / "hf", **VARIANT)
    return checkpoint, convert(checkpoint, root / "store", progress=False)


@pytest.fixture(scope="module")
def native(variant):
    return load_model(variant[1], FP32)


def full_logits(loaded, ids: torch.Tensor, max_len: int = 64) -> torch.Tensor:
    cache = loaded.model.new_cache(ids.shape[0], max_len, torch.float32, "cpu")
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.inference_mode():
        return loaded.model(ids, positions, cache)


def test_logits_match_hf(variant, native):
    model = native.model
    assert isinstance(model, DeepseekV4ForCausalLM)
    assert all(isinstance(layer.mlp, DeepseekV4MoE) for layer in model.model.layers)
    assert model.model.layers[0].mlp.gate.hashed and not model.model.layers[1].mlp.gate.hashed
    ref = hf_reference(variant[0])
    ids = prompt(native.model_config.vocab_size, length=40)
    with torch.no_grad():
        theirs = ref(ids).logits
    ours = full_logits(native, ids)
    max_diff = (ours - theirs).abs().max().item()
    print(f"native deepseek_v4: max |logit diff| vs transformers = {max_diff:.3e}")
    assert max_diff <= 1e-4 * theirs.abs().max().item()
    assert native.runtime.residency.stats.misses > 0  # experts ran through moetier's op


def test_indexer_choice_and_compressed_entries_show_in_the_logits(native, monkeypatch):
    """The exactness test can fail: attending to every finished CSA entry instead of the
    indexer's top-k, or to no compressed entry at all, moves the logits far past 1e-4."""
    ids = prompt(native.model_config.vocab_size, length=40)
    exact = full_logits(native, ids)
    monkeypatch.setattr(
        deepseek_v4_attention.Indexer,
        "select",
        lambda self, x, q, keys, where: where.closed(self.rate),
    )
    assert (full_logits(native, ids) - exact).abs().max().item() > 1e-2
    monkeypatch.setattr(
        deepseek_v4_attention.Positions, "closed", lambda self, rate: self.mask & False
    )
    assert (full_logits(native, ids) - exact).abs().max().item() > 1e-2


def test_default_tiny_checkpoint_matches_hf(tiny):
    """The shared tiny checkpoint: transformers' default layer schedule (heavily compressed
    layers, whose 128-token windows never close here) and rope."""
    loaded = load_model(tiny.store("deepseek_v4"), FP32)
    ref = hf_reference(tiny.checkpoint("deepseek_v4"))
    ids = prompt(loaded.model_config.vocab_size, length=20)
    with torch.no_grad():
        theirs = ref(ids).logits
    assert (full_logits(loaded, ids) - theirs).abs().max().item() <= 1e-4 * theirs.abs().max()
    assert moetier_greedy(loaded, ids) == hf_greedy(ref, ids[:1])


def test_decode_steps_equal_hf_full_forward(variant, native):
    """Two rows of different prompt lengths (right-padded prefill), then one token a step
    across window boundaries of every layer type: each step's logits are HF's of the full
    sequence at that position."""
    ref = hf_reference(variant[0])
    ids = prompt(native.model_config.vocab_size, length=40)
    with torch.no_grad():
        theirs = ref(ids).logits
    decoder = StaticDecoder(native.model, 2, 64, torch.float32, "cpu")
    steps = [decoder.prefill([ids[0, :5].tolist(), ids[1, :9].tolist()])]
    for t in range(30):
        steps.append(decoder.step(torch.stack([ids[0, 5 + t], ids[1, 9 + t]])))
    ours = torch.stack(steps, dim=1)  # [2, 31, V]
    scale = theirs.abs().max().item()
    assert (ours[0] - theirs[0, 4:35]).abs().max().item() <= 1e-4 * scale
    assert (ours[1] - theirs[1, 8:39]).abs().max().item() <= 1e-4 * scale


def test_greedy_matches_hf_generate(variant, native):
    """HF's generate runs its own compressor caches (prefill, then a token a step)."""
    ref = hf_reference(variant[0])
    ids = prompt(native.model_config.vocab_size, batch=1, length=14)
    ours = StaticDecoder(native.model, 1, 64, torch.float32, "cpu").greedy([ids[0].tolist()], 16)
    theirs = hf_greedy(ref, ids)
    assert ours[0][: len(theirs)] == theirs
    assert len(theirs) == 16 or ours[0][len(theirs)] == 0  # HF stopped at eos 0
    assert moetier_greedy(native, ids) == theirs  # the Generator users run


def test_residency_is_bit_identical(variant, native):
    ids = prompt(native.model_config.vocab_size, length=24)
    expected = full_logits(native, ids)
    small = load_model(variant[1], replace(FP32, expert_cache_slots=2))
    assert torch.equal(full_logits(small, ids), expected)
    assert small.runtime.residency.stats.evictions > 0


def test_engine_batches_equal_each_request_alone(native):
    """Paged serving: chunked prefill packed with decodes (page_size 4, 8 tokens a step),
    staggered arrivals, prompts past every window; then preemption under a tiny KV budget."""
    vocab = native.model_config.vocab_size
    engine = Engine(native, EngineLimits(num_pages=64, page_size=4, max_num_batched_tokens=8))
    check_against_alone(native, engine, random_requests(vocab, 8, seed=1, max_prompt=36))
    tight = Engine(native, EngineLimits(num_pages=12, page_size=4, max_num_batched_tokens=64))
    requests = [(rid, p, params, 0) for rid, p, params, _ in random_requests(vocab, 5, seed=2)]
    check_against_alone(native, tight, requests)
    assert tight.scheduler.preemptions > 0


def test_prefix_reuse_equals_alone(native):
    """A second turn reuses the first turn's pages (keys, compressor rows and candidate entries
    are functions of the tokens up to their position) and decodes as alone."""
    from moetier.engine.sampler import SamplingParams
    from tests.engine.test_engine import alone, run

    engine = Engine(native, EngineLimits(num_pages=64, page_size=4))
    turn1 = list(range(3, 26))
    first = run(engine, {0: [("t1", turn1, SamplingParams(temperature=0, max_new_tokens=5))]})
    turn2 = turn1 + first["t1"][0] + [7, 8, 9]
    params = SamplingParams(temperature=0, max_new_tokens=6)
    second = run(engine, {0: [("t2", turn2, params)]})
    assert second["t2"][3].cached_tokens == 24
    assert second["t2"][0] == alone(native, turn2, params)[0]


def test_decode_batch_without_keys_is_refused(native):
    """The decode kernel's batch (no gathered keys) cannot serve V4's masks: a clear error."""
    cache = native.model.new_cache(4, 4, torch.float32, "cpu")
    table = torch.zeros(1, 2, dtype=torch.int32)
    batch = AttentionBatch.decode(torch.zeros(1, 1, dtype=torch.int64), table, 4, False)
    with pytest.raises(ValueError, match="with_keys=True"):
        native.model.model(torch.ones(1, 1, dtype=torch.int64), batch.positions, cache, batch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_graph_decode_step_replays_eager(variant, dtype_name, compiled):
    """One native deepseek_v4 decode step (every layer type, the experts pinned) captured into
    a CUDA graph replays bit-identically to eager steps; compiled through torch.compile too."""
    graph_replays_eager(variant[1], dtype_name, compiled)


@pytest.mark.gpu
def test_cuda_engine_and_logits_match(variant):
    """On the GPU in fp32: logits against HF within 1e-4 of their range, and the paged engine's
    batches equal each request alone."""
    loaded = load_model(variant[1], EngineConfig(device="cuda", dtype="float32", native=True))
    ref = hf_reference(variant[0], torch.float32, "cuda")
    ids = prompt(loaded.model_config.vocab_size, length=40, device="cuda")
    cache = loaded.model.new_cache(2, 64, torch.float32, "cuda")
    positions = torch.arange(ids.shape[1], device="cuda").expand(2, -1)
    with torch.inference_mode():
        ours = loaded.model(ids, positions, cache)
        theirs = ref(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item()
    engine = Engine(loaded, EngineLimits(num_pages=64, page_size=4, max_num_batched_tokens=8))
    requests = random_requests(loaded.model_config.vocab_size, 6, seed=3, max_prompt=36)
    check_against_alone(loaded, engine, requests)


def test_bfloat16_keeps_transformers_fp32_parameters(variant, native):
    """At bfloat16 the parameters transformers keeps in fp32 (hyper-connections, sinks,
    position biases, norms, correction bias) stay fp32, the rest is bf16; logits near
    transformers' own bf16 forward."""
    bf16 = load_model(variant[1], replace(FP32, dtype="bfloat16"))
    layer = bf16.model.model.layers[1]
    fp32 = [layer.attn_hc.fn, layer.self_attn.sinks, layer.self_attn.compressor.position_bias,
            layer.self_attn.kv_norm.weight, layer.mlp.gate.e_score_correction_bias,
            bf16.model.model.hc_head.hc_fn]  # fmt: skip
    assert all(p.dtype == torch.float32 for p in fp32)
    assert layer.self_attn.q_b_proj.weight.dtype == torch.bfloat16
    assert bf16.model.model.layers[0].mlp.gate.tid2eid.dtype == torch.int64
    ids = prompt(native.model_config.vocab_size, length=24)
    cache = bf16.model.new_cache(2, 64, torch.bfloat16, "cpu")
    with torch.inference_mode():
        ours = bf16.model(ids, torch.arange(24).expand(2, -1), cache).float()
    try:  # transformers 5.17's V4 fails in bf16 (a dtype mismatch after its fp32 hyper-connection)
        with torch.no_grad():
            theirs = hf_reference(variant[0], torch.bfloat16)(ids).logits.float()
    except RuntimeError as exc:
        import transformers
        from packaging.version import Version

        if Version(transformers.__version__) >= Version("5.24"):
            raise  # it runs there: a failure is real
        pytest.skip(f"transformers' DeepSeek-V4 does not run in bfloat16 here: {exc}")
    # both in bf16 (their error against fp32 is ~7% of the logit range on this model)
    assert (ours - theirs).abs().max().item() <= 0.02 * theirs.abs().max().item()
