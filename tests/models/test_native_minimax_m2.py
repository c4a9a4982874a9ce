"""The native minimax_m2 model file (MiniMax-M2: q/k RMSNorm over the whole projection, partial
rotary, sigmoid router whose correction bias sits on the MoE block, every layer MoE) against the
HF transformers forward on tiny random checkpoints saved in bf16 (a bf16 store and a q2s store),
and the serving engine's paged batches against each request decoded alone."""

from __future__ import annotations

import pytest
import torch
from test_breadth_families import load_store_experts
from test_native_glm4 import check_against_hf, check_cuda_logits_and_graphed_engine, full_logits
from test_oracle import hf_reference
from tiny_models import build_breadth

from moetier.config import EngineConfig, experts_classes, replace
from moetier.engine.engine import Engine, EngineLimits
from moetier.loader.load import load_model
from moetier.loader.quantize import convert_quantized
from moetier.models import layers
from moetier.models.minimax_m2 import MiniMaxM2ForCausalLM, MiniMaxM2SparseMoeBlock
from moetier.quant.convert import convert
from moetier.quant.store import Store
from tests.engine.test_engine import check_against_alone, random_requests

FP32 = EngineConfig(device="cpu", dtype="float32", native=True)
# the release's partial rotary (rotary_dim 64 of head_dim 128: half), router scores spread
# enough that the correction bias changes choices
VARIANT = dict(
    num_hidden_layers=3,
    rope_parameters={"rope_theta": 5e6, "rope_type": "default", "partial_rotary_factor": 0.5},
    initializer_range=0.05,
)

pytestmark = pytest.mark.skipif(
    not experts_classes("minimax_m2"), reason="this transformers has no minimax_m2"
)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(bf16 checkpoint, its bf16 store, its q2s store)."""
    root = tmp_path_factory.mktemp("minimax")
    src = build_breadth("minimax_m2", root / "hf", dtype=torch.bfloat16, **VARIANT)
    bf16 = convert(src, root / "bf16", progress=False)
    q2s = convert_quantized(src, root / "q2s", group=32, progress=False)
    return src, bf16, q2s


@pytest.fixture(scope="module")
def native(stores):
    return load_model(stores[1], FP32)


def test_bf16_store_matches_hf(stores, native):
    model = native.model
    assert isinstance(model, MiniMaxM2ForCausalLM)
    block = model.model.layers[0].mlp
    assert isinstance(block, MiniMaxM2SparseMoeBlock)
    assert block.e_score_correction_bias.abs().sum() > 0  # the checkpoint's random bias
    attention = model.model.layers[0].self_attn
    assert attention.flat_qk_norm and isinstance(attention.q_norm, layers.RMSNorm)
    assert attention.q_norm.weight.numel() == model.config.num_heads * model.config.head_dim
    # partial rotary: half of the head dims rotate
    assert model.model.rotary_emb.inv_freq.numel() * 2 == model.config.head_dim // 2
    check_against_hf(native, hf_reference(stores[0]))


def test_q2s_store_matches_hf_with_its_experts(stores):
    """The q2s store against HF holding the store's dequantised experts."""
    loaded = load_model(stores[2], FP32)
    assert isinstance(loaded.model, MiniMaxM2ForCausalLM)
    assert any(f.startswith("q2s") for f in Store(stores[2]).formats)
    ref = hf_reference(stores[0])
    load_store_experts(ref, Store(stores[2]))
    check_against_hf(loaded, ref)


def test_the_correction_bias_changes_the_choice(native):
    """The bias moves the top-k choice but not the weights' source (unbiased scores): zeroing
    it changes the logits, so the test above exercises it."""
    ids = torch.randint(1, native.model_config.vocab_size, (2, 12))
    with_bias = full_logits(native, ids)
    block = native.model.model.layers[0].mlp
    saved = block.e_score_correction_bias.detach().clone()
    try:
        block.e_score_correction_bias.data.zero_()
        assert not torch.allclose(full_logits(native, ids), with_bias)
    finally:
        block.e_score_correction_bias.data.copy_(saved)


def test_engine_batches_equal_each_request_alone(native):
    """Paged serving: chunked prefill packed with decodes, staggered arrivals, preemption."""
    vocab = native.model_config.vocab_size
    engine = Engine(native, EngineLimits(num_pages=64, page_size=4, max_num_batched_tokens=8))
    check_against_alone(native, engine, random_requests(vocab, 6, seed=1))
    tight = Engine(native, EngineLimits(num_pages=12, page_size=4, max_num_batched_tokens=64))
    requests = [(rid, p, params, 0) for rid, p, params, _ in random_requests(vocab, 4, seed=2)]
    check_against_alone(native, tight, requests)
    assert tight.scheduler.preemptions > 0


def test_bfloat16_keeps_the_router_in_fp32(stores):
    bf16 = load_model(stores[1], replace(FP32, dtype="bfloat16"))
    block = bf16.model.model.layers[0].mlp
    assert block.gate.weight.dtype == torch.float32 == block.e_score_correction_bias.dtype
    assert bf16.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


@pytest.mark.gpu
def test_cuda_logits_and_graphed_engine(stores):
    check_cuda_logits_and_graphed_engine(stores)


def test_real_shape_slice_runs_natively(tmp_path):
    """`moetier bench --shape minimax-m2 --layers N`'s store: a slice of MiniMax-M2's real layer
    shape builds (on meta); its -tiny copy, written as a synthetic q2s store, gives the same
    logits on the native file and on the transformers path."""
    from test_native_glm4 import check_paths_agree

    from moetier.config import DEFAULT_STORE
    from moetier.quant.synthetic import SHAPES, meta_model, shape, slice_layers
    from moetier.quant.synthetic import write_synthetic_store as write

    real = meta_model(shape("minimax-m2", 2))
    attention = real.model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (48 * 128, 3072)
    assert attention.q_norm.weight.shape == (48 * 128,)
    assert real.model.layers[1].mlp.experts.gate_up_proj.shape == (256, 2 * 1536, 3072)
    store = write(tmp_path, slice_layers(SHAPES["minimax-m2-tiny"], 2), "q2s", DEFAULT_STORE)
    check_paths_agree(store)
