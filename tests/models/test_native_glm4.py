"""The native glm4_moe model file (GLM-4.5 to 4.7: partial rotary, optional q/k norm, q/k/v
biases, sigmoid group-limited router with correction bias and scaling, shared experts, dense
first layers) against the HF transformers forward on tiny random checkpoints saved in bf16 (a
bf16 store and a q2s store), its static-cache decode against itself, and the serving engine's
paged batches against each request decoded alone."""

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
from moetier.models import layers
from moetier.models.attention_batch import AttentionBatch
from moetier.models.glm4_moe import Glm4MoeForCausalLM, Glm4MoeMoE
from moetier.models.layers import MLP
from moetier.quant.convert import convert
from moetier.quant.store import Store
from tests.engine.test_engine import check_against_alone, random_requests

FP32 = EngineConfig(device="cpu", dtype="float32", native=True)
# every branch of the config the real releases use: q/k norm (GLM-4.5-Air has none, 4.6 too;
# the option is transformers'), q/k/v biases, 4 groups choosing 2, a routed scaling factor;
# partial_rotary_factor 0.5 is transformers' default for the family
VARIANT = dict(
    num_hidden_layers=3,
    use_qk_norm=True,
    attention_bias=True,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    initializer_range=0.05,  # router scores spread enough that the group choice shows
)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(bf16 checkpoint, its bf16 store, its q2s store)."""
    root = tmp_path_factory.mktemp("glm4")
    src = build_breadth("glm4_moe", root / "hf", dtype=torch.bfloat16, **VARIANT)
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


def check_against_hf(loaded, ref, length: int = 20) -> None:
    """fp32 logits within 1e-4 of HF's, the same argmax everywhere, the same greedy tokens
    (StaticDecoder and the Generator users run)."""
    ids = prompt(loaded.model_config.vocab_size, length=length)
    with torch.no_grad():
        theirs = ref(ids).logits
    ours = full_logits(loaded, ids)
    max_diff = (ours - theirs).abs().max().item()
    print(f"native glm4_moe: max |logit diff| vs transformers = {max_diff:.3e}")
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
    assert isinstance(model, Glm4MoeForCausalLM)
    assert Store(stores[1]).source_dtype == "bfloat16"
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    assert isinstance(layer0.mlp, MLP) and isinstance(layer1.mlp, Glm4MoeMoE)
    assert model.config.moe_layers == (1, 2)
    attention = layer1.self_attn
    assert attention.q_proj.bias is not None and attention.o_proj.bias is None
    assert isinstance(attention.q_norm, layers.RMSNorm)
    # partial rotary: half of the 16 head dims rotate
    assert model.model.rotary_emb.inv_freq.numel() * 2 == model.config.head_dim // 2
    assert layer1.mlp.gate.scaling == 2.5 and layer1.mlp.gate.n_group == 4
    check_against_hf(native, hf_reference(stores[0]))


def test_q2s_store_matches_hf_with_its_experts(stores):
    """The q2s store against HF holding the store's dequantised experts."""
    loaded = load_model(stores[2], FP32)
    assert isinstance(loaded.model, Glm4MoeForCausalLM)
    assert any(f.startswith("q2s") for f in Store(stores[2]).formats)
    ref = hf_reference(stores[0])
    load_store_experts(ref, Store(stores[2]))
    check_against_hf(loaded, ref)


def test_default_tiny_checkpoint_matches_hf(tiny):
    """The shared tiny checkpoint: transformers' defaults (no q/k norm, no biases, one group)."""
    loaded = load_model(tiny.store("glm4_moe"), FP32)
    attention = loaded.model.model.layers[1].self_attn
    assert attention.q_proj.bias is None and not isinstance(attention.q_norm, layers.RMSNorm)
    ref = hf_reference(tiny.checkpoint("glm4_moe"))
    ids = prompt(loaded.model_config.vocab_size)
    with torch.no_grad():
        theirs = ref(ids).logits
    assert (full_logits(loaded, ids) - theirs).abs().max().item() <= 1e-4
    assert moetier_greedy(loaded, ids) == hf_greedy(ref, ids[:1])


def test_prefill_then_decode_equals_full_sequence(native):
    ids = prompt(native.model_config.vocab_size, batch=1, length=12)
    full = full_logits(native, ids)[0]  # [12, V]
    decoder = StaticDecoder(native.model, 1, 64, torch.float32, "cpu")
    steps = [decoder.prefill([ids[0, :5].tolist()])[0]]
    for t in range(5, 12):
        steps.append(decoder.step(ids[:, t])[0])
    # prefill logits are of token 4, step t's of token t
    assert (torch.stack(steps) - full[4:]).abs().max().item() <= 1e-5


def test_paged_decode_kernel_equals_the_static_cache(native, monkeypatch):
    """Decode rows reading shuffled pages through their page tables in the GQA decode kernel
    (under Triton's interpreter here; on CUDA the engine's graphed step) give the static
    cache's logits: the kernel serves partial rotary and q/k norm unchanged."""
    page, vocab = 4, native.model_config.vocab_size
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (7, 10)]
    pages = torch.randperm(12, generator=gen).view(2, 6).tolist()  # 6 pages of 4 per sequence
    cache = native.model.new_cache(12, page, torch.float32, "cpu")
    for seq, own in zip(seqs, pages, strict=True):  # prefill each into its pages
        batch = AttentionBatch.packed([(0, len(seq), own)], page, "cpu")
        with torch.inference_mode():
            native.model(torch.tensor([seq]), batch.positions, cache, batch=batch)
    monkeypatch.setattr(layers, "_decode_kernel_applies", lambda x, tokens: tokens == 1)
    table = torch.tensor(pages, dtype=torch.int32)
    extra = torch.randint(1, vocab, (2, 3), generator=gen)
    for step in range(3):
        positions = torch.tensor([[len(s)] for s in seqs])
        batch = AttentionBatch.decode(positions, table, page, with_keys=False)
        with torch.inference_mode():
            logits = native.model(extra[:, step : step + 1], positions, cache, batch=batch)
        for row, seq in enumerate(seqs):
            seq.append(int(extra[row, step]))
            want = full_logits(native, torch.tensor([seq]))[0, -1]
            assert (logits[row, 0] - want).abs().max().item() <= 1e-5, (step, row)


def test_engine_batches_equal_each_request_alone(native):
    """Paged serving: chunked prefill packed with decodes (page_size 4, 8 tokens a step),
    staggered arrivals; then preemption under a tiny KV budget."""
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


def test_bfloat16_keeps_the_router_in_fp32(stores):
    """At bfloat16 the router weight and correction bias stay fp32 (transformers'
    _keep_in_fp32_modules_strict), the rest is bf16; logits near transformers' own bf16."""
    bf16 = load_model(stores[1], replace(FP32, dtype="bfloat16"))
    gate = bf16.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32 == gate.e_score_correction_bias.dtype
    assert bf16.model.model.layers[1].self_attn.q_proj.weight.dtype == torch.bfloat16
    ids = prompt(bf16.model_config.vocab_size)
    cache = bf16.model.new_cache(2, 64, torch.bfloat16, "cpu")
    with torch.inference_mode():
        ours = bf16.model(ids, torch.arange(12).expand(2, -1), cache).float()
    with torch.no_grad():
        theirs = hf_reference(stores[0], torch.bfloat16)(ids).logits.float()
    assert (ours - theirs).abs().max().item() <= 0.02 * theirs.abs().max().item() + 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_graph_decode_step_replays_eager(stores, dtype_name, compiled):
    """One native glm4_moe decode step (static buffers, the GQA decode kernel, the sigmoid
    router and the experts op with every expert pinned) captured into a CUDA graph replays
    bit-identically to eager steps; compiled through torch.compile too."""
    graph_replays_eager(stores[1], dtype_name, compiled)


@pytest.mark.gpu
def test_cuda_logits_and_graphed_engine(stores):
    check_cuda_logits_and_graphed_engine(stores)


def check_cuda_logits_and_graphed_engine(stores) -> None:
    """On the GPU in fp32: logits against HF within 1e-4; the engine's decode steps read pages
    in the decode kernel and replay from CUDA graphs, each request as alone. stores: (the HF
    checkpoint, its bf16 store, ...)."""
    loaded = load_model(stores[1], EngineConfig(device="cuda", dtype="float32", native=True))
    ref = hf_reference(stores[0], torch.float32, "cuda")
    ids = prompt(loaded.model_config.vocab_size, length=20, device="cuda")
    cache = loaded.model.new_cache(2, 64, torch.float32, "cuda")
    positions = torch.arange(ids.shape[1], device="cuda").expand(2, -1)
    with torch.inference_mode():
        ours = loaded.model(ids, positions, cache)
        theirs = ref(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    engine = Engine(loaded, EngineLimits(num_pages=48, page_size=16, max_num_batched_tokens=16))
    check_against_alone(loaded, engine, random_requests(loaded.model_config.vocab_size, 8, 3))
    assert engine.runner.use_graphs and engine.runner.graphs
    assert not engine.runner.gather_decode_keys


def test_docs_mark_exactly_the_native_families():
    """docs/models.md's path column says `native` for the families loader/native.py has."""
    from test_breadth_families import DOC, ROW

    from moetier.loader.native import NATIVE_FAMILIES

    marked = set()
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match is not None and "native" in match.group(2):
            marked.add(match.group(1))
    assert marked == set(NATIVE_FAMILIES)


def test_real_shape_slice_runs_natively(tmp_path):
    """`moetier bench --shape glm-4.5 --layers N`'s store: a slice of GLM-4.5's real layer
    shape builds (on meta); its -tiny copy, written as a synthetic q2s store, gives the same
    logits on the native file and on the transformers path."""
    from moetier.config import DEFAULT_STORE
    from moetier.quant.synthetic import SHAPES, meta_model, shape, slice_layers
    from moetier.quant.synthetic import write_synthetic_store as write

    real = meta_model(shape("glm-4.5", 2))
    attention = real.model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (96 * 128, 5120) and attention.q_proj.bias is not None
    assert real.model.layers[1].mlp.experts.gate_up_proj.shape == (160, 2 * 1536, 5120)
    store = write(tmp_path, slice_layers(SHAPES["glm-4.5-tiny"], 2), "q2s", DEFAULT_STORE)
    check_paths_agree(store)


def check_paths_agree(store) -> None:
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(0))
    native = load_model(store, FP32)
    cache = native.model.new_cache(1, 16, torch.float32, "cpu")
    breadth = load_model(store, replace(FP32, native=False))
    with torch.inference_mode():
        ours = native.model(ids, torch.arange(10)[None], cache)
        theirs = breadth.model(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
