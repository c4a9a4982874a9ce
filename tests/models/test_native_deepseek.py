"""The native deepseek_v3 model file (MLA over a latent cache, sigmoid group-limited router,
shared experts, dense first layers) against the HF transformers forward, and its static-cache
prefill/decode against itself."""

from __future__ import annotations

import pytest
import torch
from test_native import graph_replays_eager
from test_oracle import hf_greedy, hf_reference, moetier_greedy, prompt

from moetier.config import EngineConfig, replace
from moetier.engine.static_decode import StaticDecoder
from moetier.loader.load import load_model
from moetier.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE
from moetier.models.layers import MLP

FP32 = EngineConfig(device="cpu", dtype="float32", native=True)


@pytest.fixture(scope="module")
def native(tiny):
    return load_model(tiny.store("deepseek_v3"), FP32)


def full_logits(loaded, ids: torch.Tensor, max_len: int = 64) -> torch.Tensor:
    cache = loaded.model.new_cache(ids.shape[0], max_len, torch.float32, "cpu")
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.inference_mode():
        return loaded.model(ids, positions, cache)


def test_logits_match_hf(tiny, native):
    model = native.model
    assert isinstance(model, DeepseekV3ForCausalLM)
    # first_k_dense_replace = 1: layer 0 dense, the rest MoE with a shared expert
    assert isinstance(model.model.layers[0].mlp, MLP)
    assert all(isinstance(layer.mlp, DeepseekV3MoE) for layer in model.model.layers[1:])
    ref = hf_reference(tiny.checkpoint("deepseek_v3"))
    ids = prompt(native.model_config.vocab_size)
    with torch.no_grad():
        theirs = ref(ids).logits
    max_diff = (full_logits(native, ids) - theirs).abs().max().item()
    print(f"native deepseek_v3: max |logit diff| vs transformers = {max_diff:.3e}")
    assert max_diff <= 1e-5
    assert native.runtime.residency.stats.misses > 0  # experts ran through moetier's op


def test_prefill_then_decode_equals_full_sequence(native):
    ids = prompt(native.model_config.vocab_size, batch=1, length=12)
    full = full_logits(native, ids)[0]  # [12, V]
    decoder = StaticDecoder(native.model, 1, 64, torch.float32, "cpu")
    steps = [decoder.prefill([ids[0, :5].tolist()])[0]]
    for t in range(5, 12):
        steps.append(decoder.step(ids[:, t])[0])
    # prefill logits are of token 4, step t's of token t
    assert (torch.stack(steps) - full[4:]).abs().max().item() <= 1e-5


def test_batched_decode_equals_each_alone(native):
    """Three prompts of lengths 3, 9, 6, right-padded into one batch."""
    ids = prompt(native.model_config.vocab_size, batch=3, length=9)
    prompts = [ids[0, :3].tolist(), ids[1].tolist(), ids[2, :6].tolist()]
    batched = StaticDecoder(native.model, 3, 48, torch.float32, "cpu")
    logits = batched.prefill(prompts)
    alone = [StaticDecoder(native.model, 1, 48, torch.float32, "cpu") for _ in prompts]
    alone_logits = [d.prefill([p])[0] for d, p in zip(alone, prompts, strict=True)]
    for step in range(8):
        for row in range(3):
            assert (logits[row] - alone_logits[row]).abs().max().item() <= 1e-5, (step, row)
        tokens = logits.argmax(-1)
        assert tokens.tolist() == [int(x.argmax()) for x in alone_logits]
        logits = batched.step(tokens)
        alone_logits = [d.step(t[None])[0] for d, t in zip(alone, tokens, strict=True)]


def test_greedy_matches_hf_generate(tiny, native):
    ref = hf_reference(tiny.checkpoint("deepseek_v3"))
    ids = prompt(native.model_config.vocab_size, batch=1)
    ours = StaticDecoder(native.model, 1, 64, torch.float32, "cpu").greedy([ids[0].tolist()], 16)[0]
    theirs = hf_greedy(ref, ids)
    assert ours[: len(theirs)] == theirs
    assert len(theirs) == 16 or ours[len(theirs)] == 0  # HF stopped at eos 0
    assert moetier_greedy(native, ids) == theirs  # the Generator users run, native cache


def test_residency_and_pinning_are_bit_identical(tiny, native):
    ids = prompt(native.model_config.vocab_size)
    expected = full_logits(native, ids)
    small = load_model(tiny.store("deepseek_v3"), replace(FP32, expert_cache_slots=2))
    assert torch.equal(full_logits(small, ids), expected)
    assert small.runtime.residency.stats.evictions > 0
    pinned = load_model(tiny.store("deepseek_v3"), FP32)
    pinned.runtime.pin_all()
    assert torch.equal(full_logits(pinned, ids), expected)


def test_variant_matches_hf(tmp_path):
    """The config branches the tiny checkpoint does not take: yarn rope with mscale and
    mscale_all_dim (cos/sin scaling and softmax scale), no q low-rank (q_proj), rotary dims not
    interleaved, attention biases, 4 groups choosing 2, no renormalisation, two shared experts,
    two dense layers, an rms_norm_eps unlike the latent norms' 1e-6; e_score_correction_bias stays
    fp32 at bfloat16, as in transformers."""
    from tiny_models import build_tiny

    from moetier.quant.convert import convert

    checkpoint = build_tiny(
        "deepseek_v3",
        tmp_path / "hf",
        num_hidden_layers=4,
        first_k_dense_replace=2,
        q_lora_rank=None,
        rope_interleave=False,
        attention_bias=True,
        n_group=4,
        topk_group=2,
        norm_topk_prob=False,
        n_shared_experts=2,
        rms_norm_eps=1e-3,
        initializer_range=0.05,  # scores large enough that the softmax scale shows
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    store = convert(checkpoint, tmp_path / "store", progress=False)
    loaded = load_model(store, FP32)
    config = loaded.model.config
    assert config.moe_layers == (2, 3) and config.q_lora_rank == 0
    assert config.mla_softmax_scale != (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    assert loaded.model.model.rotary_emb.attention_scaling != 1.0
    ids = prompt(loaded.model_config.vocab_size)
    ref = hf_reference(checkpoint)
    with torch.no_grad():
        theirs = ref(ids).logits
    max_diff = (full_logits(loaded, ids) - theirs).abs().max().item()
    print(f"native deepseek_v3 variant: max |logit diff| vs transformers = {max_diff:.3e}")
    assert max_diff <= 1e-5
    ours = StaticDecoder(loaded.model, 1, 64, torch.float32, "cpu").greedy([ids[0].tolist()], 16)
    theirs_greedy = hf_greedy(ref, ids[:1])
    assert ours[0][: len(theirs_greedy)] == theirs_greedy
    bf16 = load_model(store, replace(FP32, dtype="bfloat16"))
    gate = bf16.model.model.layers[2].mlp.gate
    assert gate.weight.dtype == torch.bfloat16
    assert gate.e_score_correction_bias.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_graph_decode_step_replays_eager(tiny, dtype_name, compiled):
    """One native deepseek_v3 decode step (static ids/positions buffers, the latent cache, the
    router and the experts op with every expert pinned) captured into a CUDA graph; replays equal
    eager steps on a second cache. With `compiled`, both decoders run the step through
    torch.compile."""
    graph_replays_eager(tiny.store("deepseek_v3"), dtype_name, compiled)


@pytest.mark.gpu
def test_cuda_bfloat16_logits_near_hf(tiny):
    """On the GPU at bfloat16 (SDPA's CUDA kernels, the Triton experts op), the native logits
    stay close to transformers' at the same dtype."""
    loaded = load_model(
        tiny.store("deepseek_v3"), EngineConfig(device="cuda", dtype="bfloat16", native=True)
    )
    ref = hf_reference(tiny.checkpoint("deepseek_v3"), torch.bfloat16, "cuda")
    ids = prompt(loaded.model_config.vocab_size, device="cuda")
    cache = loaded.model.new_cache(2, 64, torch.bfloat16, "cuda")
    positions = torch.arange(ids.shape[1], device="cuda").expand(2, -1)
    with torch.inference_mode():
        ours = loaded.model(ids, positions, cache).float()
        theirs = ref(ids).logits.float()
    max_diff = (ours - theirs).abs().max().item()
    print(f"native deepseek_v3 bf16 cuda: max |logit diff| vs transformers = {max_diff:.3e}")
    assert max_diff <= 0.05 * theirs.abs().max().item()
