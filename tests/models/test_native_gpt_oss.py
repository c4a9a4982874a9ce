"""The native gpt_oss model file (attention sinks, sliding-window layers alternating with full
ones, q/k/v/o biases, biased top-k router, experts with biases and the clamped SwiGLU) against
the HF transformers forward (eager, its only attention with sinks) on tiny random checkpoints: a
bf16 checkpoint as a bf16 store and a q2s store, and an MXFP4 checkpoint laid out as gpt-oss's
release whose experts the store keeps as FP4 codes; its static-cache decode across window
boundaries, and the serving engine's paged batches against each request decoded alone."""

from __future__ import annotations

import pytest
import torch
from test_breadth_families import load_store_experts
from test_native import graph_replays_eager
from test_oracle import hf_greedy, hf_reference, moetier_greedy, prompt
from tiny_models import build_breadth

from moetier.config import EngineConfig, replace
from moetier.engine.engine import Engine, EngineLimits
from moetier.engine.static_decode import StaticDecoder
from moetier.loader.load import load_model
from moetier.loader.quantize import convert_quantized
from moetier.models.attention_batch import AttentionBatch
from moetier.models.gpt_oss import GptOssForCausalLM, GptOssMLP, model_kwargs
from moetier.quant.convert import convert
from moetier.quant.store import Store
from tests.engine.test_engine import check_against_alone, random_requests

FP32 = EngineConfig(device="cpu", dtype="float32", native=True)
WINDOW = 5  # far shorter than the prompts, so every sliding layer drops keys
VARIANT = dict(
    num_hidden_layers=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    sliding_window=WINDOW,
    initializer_range=0.05,  # sinks and scores large enough to matter
)
LENGTH = 20


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(bf16 checkpoint, its bf16 store, its q2s store)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    src = build_breadth("gpt_oss", root / "hf", dtype=torch.bfloat16, **VARIANT)
    bf16 = convert(src, root / "bf16", progress=False)
    q2s = convert_quantized(src, root / "q2s", group=32, progress=False)
    return src, bf16, q2s


@pytest.fixture(scope="module")
def native(stores):
    return load_model(stores[1], FP32)


def full_logits(loaded, ids: torch.Tensor, max_len: int = 64) -> torch.Tensor:
    cache = loaded.model.new_cache(ids.shape[0], max_len, torch.float32, "cpu")
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.inference_mode():
        return loaded.model(ids, positions, cache)


def check_against_hf(loaded, ref, length: int = LENGTH) -> None:
    """fp32 logits within 1e-4 of HF's, the same argmax everywhere, the same greedy tokens
    (StaticDecoder and the Generator users run; HF's generate keeps its own sliding caches)."""
    ids = prompt(loaded.model_config.vocab_size, length=length)
    with torch.no_grad():
        theirs = ref(ids).logits
    ours = full_logits(loaded, ids)
    max_diff = (ours - theirs).abs().max().item()
    print(f"native gpt_oss: max |logit diff| vs transformers = {max_diff:.3e}")
    assert max_diff <= 1e-4
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    greedy = hf_greedy(ref, ids[:1])
    ours_greedy = StaticDecoder(loaded.model, 1, 64, torch.float32, "cpu").greedy(
        [ids[0].tolist()], 16
    )[0]
    assert ours_greedy[: len(greedy)] == greedy
    assert moetier_greedy(loaded, ids) == greedy
    assert loaded.runtime.residency.stats.misses > 0  # experts ran through moetier's op


def test_bf16_store_matches_hf(stores, native):
    model = native.model
    assert isinstance(model, GptOssForCausalLM)
    assert Store(stores[1]).source_dtype == "bfloat16"
    assert [layer.self_attn.window for layer in model.model.layers] == [WINDOW, None, WINDOW]
    assert all(isinstance(layer.mlp, GptOssMLP) for layer in model.model.layers)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    assert native.model_config.activation.kind == "gpt_oss" and native.model_config.expert_has_bias
    check_against_hf(native, hf_reference(stores[0]))


def test_q2s_store_matches_hf_with_its_experts(stores):
    """The q2s store (expert biases kept beside the codes) against HF holding the store's
    dequantised experts."""
    loaded = load_model(stores[2], FP32)
    assert isinstance(loaded.model, GptOssForCausalLM)
    assert any(f.startswith("q2s") for f in Store(stores[2]).formats)
    ref = hf_reference(stores[0])
    load_store_experts(ref, Store(stores[2]))
    check_against_hf(loaded, ref)


def test_mxfp4_checkpoint_keeps_fp4_codes_and_matches_hf(tiny, tmp_path):
    """gpt-oss's release layout (experts as MXFP4 blocks and E8M0 scales): the store keeps the
    codes (format mxfp4+bias) and the native model matches transformers' own dequantisation
    (Mxfp4Config(dequantize=True))."""
    from source_checkpoints import write_gpt_oss_mxfp4
    from transformers import AutoModelForCausalLM, Mxfp4Config

    src = tmp_path / "mxfp4"
    write_gpt_oss_mxfp4(tiny.checkpoint("gpt_oss"), src)
    store = convert(src, tmp_path / "store", progress=False)
    assert sorted(Store(store).formats) == ["mxfp4+bias"]
    loaded = load_model(store, FP32)
    assert isinstance(loaded.model, GptOssForCausalLM)
    ref = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    check_against_hf(loaded, ref)


def test_sinks_and_windows_show_in_the_logits(native, monkeypatch):
    """The exactness test can fail: attending past the window, or without the sinks (a sink
    logit of -1e4 weighs nothing), moves the logits far past 1e-4."""
    ids = prompt(native.model_config.vocab_size, length=LENGTH)
    exact = full_logits(native, ids)
    attentions = [layer.self_attn for layer in native.model.model.layers]
    for attention in attentions:
        monkeypatch.setattr(attention, "window", None)
    assert (full_logits(native, ids) - exact).abs().max().item() > 1e-2
    monkeypatch.undo()
    sinks = [attention.sinks.detach().clone() for attention in attentions]
    try:
        for attention in attentions:
            attention.sinks.data.fill_(-1e4)
        assert (full_logits(native, ids) - exact).abs().max().item() > 1e-2
    finally:
        for attention, saved in zip(attentions, sinks, strict=True):
            attention.sinks.data.copy_(saved)
    assert torch.equal(full_logits(native, ids), exact)


def test_long_prefill_in_query_chunks_gives_the_same_logits(native, monkeypatch):
    """A prefill whose scores pass SCORE_BYTES attends a chunk of query tokens at a time (3
    here, windows straddling the chunks): the same logits (to float rounding: the products
    run in other GEMM shapes)."""
    from moetier.models import gpt_oss

    ids = prompt(native.model_config.vocab_size, length=LENGTH)
    whole = full_logits(native, ids)
    monkeypatch.setattr(gpt_oss, "SCORE_BYTES", 4 * 2 * 4 * 64 * 3)  # B=2, h=4, Lk=64, fp32
    assert (full_logits(native, ids) - whole).abs().max().item() <= 1e-6


def test_decode_steps_equal_hf_full_forward(stores, native):
    """Two rows of different prompt lengths (right-padded prefill), then a token a step far
    across the window: each step's logits are HF's of the full sequence at that position."""
    ref = hf_reference(stores[0])
    ids = prompt(native.model_config.vocab_size, length=30)
    with torch.no_grad():
        theirs = ref(ids).logits
    decoder = StaticDecoder(native.model, 2, 64, torch.float32, "cpu")
    steps = [decoder.prefill([ids[0, :3].tolist(), ids[1, :8].tolist()])]
    for t in range(20):
        steps.append(decoder.step(torch.stack([ids[0, 3 + t], ids[1, 8 + t]])))
    ours = torch.stack(steps, dim=1)  # [2, 21, V]
    assert (ours[0] - theirs[0, 2:23]).abs().max().item() <= 1e-4
    assert (ours[1] - theirs[1, 7:28]).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_engine_batches_equal_each_request_alone(native):
    """Paged serving: chunked prefill packed with decodes (page_size 4, 8 tokens a step: a
    window spans pages), staggered arrivals, prompts past the window; then preemption."""
    vocab = native.model_config.vocab_size
    engine = Engine(native, EngineLimits(num_pages=64, page_size=4, max_num_batched_tokens=8))
    check_against_alone(native, engine, random_requests(vocab, 6, seed=1))
    tight = Engine(native, EngineLimits(num_pages=12, page_size=4, max_num_batched_tokens=64))
    requests = [(rid, p, params, 0) for rid, p, params, _ in random_requests(vocab, 4, seed=2)]
    check_against_alone(native, tight, requests)
    assert tight.scheduler.preemptions > 0


def test_residency_is_bit_identical(stores, native):
    ids = prompt(native.model_config.vocab_size)
    expected = full_logits(native, ids)
    small = load_model(stores[1], replace(FP32, expert_cache_slots=2))
    assert torch.equal(full_logits(small, ids), expected)
    assert small.runtime.residency.stats.evictions > 0


def test_decode_batch_without_keys_is_refused(native):
    """The decode kernel's batch (no gathered keys) cannot serve sinks and windows."""
    cache = native.model.new_cache(4, 4, torch.float32, "cpu")
    table = torch.zeros(1, 2, dtype=torch.int32)
    batch = AttentionBatch.decode(torch.zeros(1, 1, dtype=torch.int64), table, 4, False)
    with pytest.raises(ValueError, match="with_keys=True"):
        native.model.model(torch.ones(1, 1, dtype=torch.int64), batch.positions, cache, batch)


def test_unknown_layer_types_are_refused():
    from transformers import AutoConfig

    config = AutoConfig.for_model("gpt_oss", num_hidden_layers=2)
    assert model_kwargs(config)["windows"] == (128, None)
    config.layer_types = ["sliding_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        model_kwargs(config)


def test_bfloat16_is_near_transformers_bfloat16(stores):
    """At bfloat16 every parameter is bf16, the norms too (transformers keeps gpt-oss's norms
    in fp32 at float16 only); logits near transformers' own bf16 forward at 90% of the
    positions or more. (Here one token's layer-1 router has its 2nd and 3rd logits 0.0011
    apart at 0.36, under bf16's resolution there: the two forwards choose different experts
    for it, which moves its logits and, through the window, the next few positions'.)"""
    bf16 = load_model(stores[1], replace(FP32, dtype="bfloat16"))
    layer = bf16.model.model.layers[0]
    assert layer.input_layernorm.weight.dtype == torch.bfloat16
    assert layer.self_attn.q_proj.weight.dtype == torch.bfloat16
    assert layer.self_attn.sinks.dtype == torch.bfloat16
    ids = prompt(bf16.model_config.vocab_size, length=LENGTH)
    cache = bf16.model.new_cache(2, 64, torch.bfloat16, "cpu")
    with torch.inference_mode():
        out = bf16.model(ids, torch.arange(LENGTH).expand(2, -1), cache)
    assert out.dtype == torch.bfloat16
    with torch.no_grad():
        theirs = hf_reference(stores[0], torch.bfloat16)(ids).logits.float()
    per_position = (out.float() - theirs).abs().amax(-1)  # [2, LENGTH]
    near = per_position <= 0.02 * theirs.abs().max().item() + 0.02
    assert near.float().mean().item() >= 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_graph_decode_step_replays_eager(stores, dtype_name, compiled):
    """One native gpt_oss decode step over the static cache (sinks and windows in torch, the
    router and the experts op with every expert pinned) captured into a CUDA graph replays
    bit-identically to eager steps; compiled through torch.compile too."""
    graph_replays_eager(stores[1], dtype_name, compiled)


@pytest.mark.gpu
def test_cuda_logits_and_engine(stores):
    """On the GPU in fp32: logits against HF within 1e-4; the engine's decode steps gather
    their pages (no decode kernel with sinks and windows yet), over a context bucket's width,
    replayed from CUDA graphs, each request as alone."""
    loaded = load_model(stores[1], EngineConfig(device="cuda", dtype="float32", native=True))
    ref = hf_reference(stores[0], torch.float32, "cuda")
    ids = prompt(loaded.model_config.vocab_size, length=LENGTH, device="cuda")
    cache = loaded.model.new_cache(2, 64, torch.float32, "cuda")
    positions = torch.arange(ids.shape[1], device="cuda").expand(2, -1)
    with torch.inference_mode():
        ours = loaded.model(ids, positions, cache)
        theirs = ref(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    engine = Engine(loaded, EngineLimits(num_pages=48, page_size=16, max_num_batched_tokens=16))
    check_against_alone(loaded, engine, random_requests(loaded.model_config.vocab_size, 8, 3))
    assert engine.runner.gather_decode_keys and engine.runner.use_graphs


def test_real_shape_slice_runs_natively(tmp_path):
    """`moetier bench --shape gpt-oss-120b --layers N`'s store: a slice of gpt-oss-120b's real
    layer shape builds (on meta); its -tiny copy (window 4), written as a synthetic q2s store
    with expert biases, gives the same logits on the native file and the transformers path."""
    from test_native_glm4 import check_paths_agree

    from moetier.config import DEFAULT_STORE
    from moetier.quant.synthetic import SHAPES, meta_model, shape, slice_layers
    from moetier.quant.synthetic import write_synthetic_store as write

    real = meta_model(shape("gpt-oss-120b", 2))
    assert real.config.layer_types == ["sliding_attention", "full_attention"]
    assert real.model.layers[0].mlp.experts.gate_up_proj.shape == (128, 2880, 2 * 2880)
    store = write(tmp_path, slice_layers(SHAPES["gpt-oss-120b-tiny"], 2), "q2s", DEFAULT_STORE)
    assert all(f.endswith("+bias") for f in Store(store).formats)
    check_paths_agree(store)
