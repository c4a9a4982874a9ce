"""The native glm_moe_dsa model file (GLM-5: MLA with the DSA indexer's top-k key selection,
sigmoid group-limited router, shared experts, dense first layers) against the HF transformers
forward, and its static-cache prefill/decode against itself.

The checkpoints here have 16 index heads: a key's index score is exactly 0 only when all its
heads' scores are <= 0 (relu), rare with 16, so no two keys tie at the top-k boundary and the
keys chosen are transformers' (whose tie-breaking is torch.topk's own; see dsa_indexer.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "transformers.models.glm_moe_dsa", reason="this transformers has no glm_moe_dsa"
)

from test_native import graph_replays_eager  # noqa: E402
from test_oracle import hf_greedy, hf_reference, moetier_greedy, prompt  # noqa: E402
from tiny_models import build_tiny  # noqa: E402

from moetier.config import EngineConfig, replace  # noqa: E402
from moetier.engine.static_decode import StaticDecoder  # noqa: E402
from moetier.loader.load import load_model  # noqa: E402
from moetier.models import dsa_indexer  # noqa: E402
from moetier.models.deepseek_v3 import DeepseekV3MoE  # noqa: E402
from moetier.models.dsa_indexer import DsaIndexer, top_k_mask  # noqa: E402
from moetier.models.glm_moe_dsa import GlmMoeDsaForCausalLM  # noqa: E402
from moetier.models.layers import MLP  # noqa: E402
from moetier.quant.convert import convert  # noqa: E402

FP32 = EngineConfig(device="cpu", dtype="float32", native=True)
TIE_FREE = dict(index_n_heads=16)  # see the module docstring
LONG = 40  # prompt tokens: well past index_topk (8), so the selection matters


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5")
    hf = build_tiny("glm_moe_dsa", root / "hf", **TIE_FREE)
    return hf, convert(hf, root / "store", progress=False)


@pytest.fixture(scope="module")
def native(checkpoint):
    return load_model(checkpoint[1], FP32)


def full_logits(loaded, ids: torch.Tensor, max_len: int = 64) -> torch.Tensor:
    cache = loaded.model.new_cache(ids.shape[0], max_len, torch.float32, "cpu")
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.inference_mode():
        return loaded.model(ids, positions, cache)


def test_logits_match_hf(checkpoint, native, monkeypatch):
    model = native.model
    assert isinstance(model, GlmMoeDsaForCausalLM)
    # first_k_dense_replace = 1: layer 0 dense, the rest MoE with a shared expert
    assert isinstance(model.model.layers[0].mlp, MLP)
    assert all(isinstance(layer.mlp, DeepseekV3MoE) for layer in model.model.layers[1:])
    ref = hf_reference(checkpoint[0])
    ids = prompt(native.model_config.vocab_size, length=LONG)
    with torch.no_grad():
        theirs = ref(ids).logits
    ours = full_logits(native, ids)
    max_diff = (ours - theirs).abs().max().item()
    print(f"native glm_moe_dsa: max |logit diff| vs transformers = {max_diff:.3e}")
    assert max_diff <= 1e-4 * theirs.abs().max().item()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    assert native.runtime.residency.stats.misses > 0  # experts ran through moetier's op
    # the indexer's choice matters here: attending to every visible key gives other logits
    for layer in model.model.layers:
        monkeypatch.setattr(layer.self_attn.indexer, "topk", 10**6)
    assert (full_logits(native, ids) - theirs).abs().max().item() > 1e-3


def test_prefill_then_decode_equals_full_sequence(native):
    ids = prompt(native.model_config.vocab_size, batch=1, length=30)
    full = full_logits(native, ids)[0]  # [30, V]
    decoder = StaticDecoder(native.model, 1, 64, torch.float32, "cpu")
    steps = [decoder.prefill([ids[0, :5].tolist()])[0]]
    for t in range(5, 30):
        steps.append(decoder.step(ids[:, t])[0])
    # prefill logits are of token 4, step t's of token t
    assert (torch.stack(steps) - full[4:]).abs().max().item() <= 1e-5


def test_batched_decode_equals_each_alone(native):
    """Three prompts of lengths 3, 20, 11, right-padded into one batch."""
    ids = prompt(native.model_config.vocab_size, batch=3, length=20)
    prompts = [ids[0, :3].tolist(), ids[1].tolist(), ids[2, :11].tolist()]
    batched = StaticDecoder(native.model, 3, 48, torch.float32, "cpu")
    logits = batched.prefill(prompts)
    alone = [StaticDecoder(native.model, 1, 48, torch.float32, "cpu") for _ in prompts]
    alone_logits = [d.prefill([p])[0] for d, p in zip(alone, prompts, strict=True)]
    for step in range(10):
        for row in range(3):
            assert (logits[row] - alone_logits[row]).abs().max().item() <= 1e-5, (step, row)
        tokens = logits.argmax(-1)
        assert tokens.tolist() == [int(x.argmax()) for x in alone_logits]
        logits = batched.step(tokens)
        alone_logits = [d.step(t[None])[0] for d, t in zip(alone, tokens, strict=True)]


def test_greedy_matches_hf_generate(checkpoint, native):
    ref = hf_reference(checkpoint[0])
    ids = prompt(native.model_config.vocab_size, batch=1, length=20)
    ours = StaticDecoder(native.model, 1, 64, torch.float32, "cpu").greedy([ids[0].tolist()], 16)[0]
    theirs = hf_greedy(ref, ids)
    assert ours[: len(theirs)] == theirs
    assert len(theirs) == 16 or ours[len(theirs)] == 0  # HF stopped at eos 0
    assert moetier_greedy(native, ids) == theirs  # the Generator users run, native cache


def test_residency_and_pinning_are_bit_identical(checkpoint, native):
    ids = prompt(native.model_config.vocab_size, length=20)
    expected = full_logits(native, ids)
    small = load_model(checkpoint[1], replace(FP32, expert_cache_slots=2))
    assert torch.equal(full_logits(small, ids), expected)
    assert small.runtime.residency.stats.evictions > 0
    pinned = load_model(checkpoint[1], FP32)
    pinned.runtime.pin_all()
    assert torch.equal(full_logits(pinned, ids), expected)


def test_variant_matches_hf(tmp_path):
    """The config branches the first checkpoint does not take: "shared" indexer layers (reusing
    the selection of the layer before), yarn rope with mscale_all_dim (cos/sin scaling and
    softmax scale), attention biases, 4 groups choosing 2, no renormalisation, two shared
    experts, two dense layers, a smaller top-k; gate.weight, e_score_correction_bias and the
    indexer's weights_proj stay fp32 at bfloat16, as in transformers."""
    checkpoint = build_tiny(
        "glm_moe_dsa",
        tmp_path / "hf",
        num_hidden_layers=4,
        first_k_dense_replace=2,
        indexer_types=["full", "shared", "full", "shared"],
        index_topk=4,
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
        **TIE_FREE,
    )
    store = convert(checkpoint, tmp_path / "store", progress=False)
    loaded = load_model(store, FP32)
    layers = loaded.model.model.layers
    assert [layer.self_attn.indexer is None for layer in layers] == [False, True, False, True]
    config = loaded.model.config
    assert config.moe_layers == (2, 3)
    assert config.mla_softmax_scale != (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    assert loaded.model.model.rotary_emb.attention_scaling != 1.0
    ids = prompt(loaded.model_config.vocab_size, length=24)
    ref = hf_reference(checkpoint)
    with torch.no_grad():
        theirs = ref(ids).logits
    max_diff = (full_logits(loaded, ids) - theirs).abs().max().item()
    print(f"native glm_moe_dsa variant: max |logit diff| vs transformers = {max_diff:.3e}")
    assert max_diff <= 1e-4 * theirs.abs().max().item()
    ours = StaticDecoder(loaded.model, 1, 64, torch.float32, "cpu").greedy([ids[0].tolist()], 16)
    theirs_greedy = hf_greedy(ref, ids[:1])
    assert ours[0][: len(theirs_greedy)] == theirs_greedy
    bf16 = load_model(store, replace(FP32, dtype="bfloat16"))
    attention = bf16.model.model.layers[2].self_attn
    gate = bf16.model.model.layers[2].mlp.gate
    assert attention.q_a_proj.weight.dtype == torch.bfloat16
    assert attention.indexer.weights_proj.weight.dtype == torch.float32
    assert gate.weight.dtype == torch.float32 == gate.e_score_correction_bias.dtype


def test_unsupported_layouts_are_refused():
    """A first layer without its own indexer, and MoE layers not after the dense ones, are
    refused with a reason (never built wrong)."""
    from transformers import AutoConfig

    from moetier.models.glm_moe_dsa import model_kwargs

    def config(**kwargs):
        return AutoConfig.for_model("glm_moe_dsa", num_hidden_layers=3, **kwargs)

    assert model_kwargs(config(first_k_dense_replace=1))["dsa"].indexer_types == ("full",) * 3
    with pytest.raises(ValueError, match="first layer"):
        model_kwargs(config(indexer_types=["shared", "full", "full"]))
    with pytest.raises(ValueError, match="mlp_layer_types"):
        model_kwargs(config(mlp_layer_types=["sparse", "dense", "sparse"]))


def test_top_k_mask_breaks_ties_towards_earlier_keys():
    scores = torch.tensor([[0.0, 3.0, 0.0, -1.0, 0.0, 2.0, float("-inf")]])
    assert top_k_mask(scores, 3).int().tolist() == [[1, 1, 0, 0, 0, 1, 0]]
    assert top_k_mask(scores, 4).int().tolist() == [[1, 1, 1, 0, 0, 1, 0]]
    assert top_k_mask(scores, 9).all()  # fewer entries than k: every one
    # the same keys chosen with the row padded by keys that are not visible (other layouts)
    padded = torch.cat((scores, torch.full((1, 5), float("-inf"))), dim=-1)
    assert torch.equal(top_k_mask(padded, 4)[:, :7], top_k_mask(scores, 4))


def test_indexer_matches_transformers_module(monkeypatch):
    """DsaIndexer against transformers' GlmMoeDsaIndexer on the same weights: the same keys
    chosen, prompts of length past top-k, a causal mask; also with the query tokens scored a
    chunk of 5 at a time (a long prefill's memory bound)."""
    from transformers import AutoConfig
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

    from moetier.models.layers import RotaryEmbedding

    config = AutoConfig.for_model(
        "glm_moe_dsa", hidden_size=64, q_lora_rank=32, index_n_heads=16, index_head_dim=16,
        index_topk=5, qk_rope_head_dim=8, num_hidden_layers=1,
    )  # fmt: skip
    torch.manual_seed(1)
    theirs = hf_glm.GlmMoeDsaIndexer(config, 0).eval()
    ours = DsaIndexer(64, 32, 16, 16, 8, 5)
    ours.load_state_dict(theirs.state_dict())
    rotary = hf_glm.GlmMoeDsaRotaryEmbedding(config)
    x, q_resid = torch.randn(2, 12, 64), torch.randn(2, 12, 32)
    positions = torch.arange(12).expand(2, -1)
    cos, sin = RotaryEmbedding(rotary.inv_freq)(positions, torch.float32)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None, None].expand(2, 1, 12, 12)
    with torch.no_grad():
        top = theirs(x, q_resid, (cos, sin), causal[:, 0], positions)  # [B, S, k]
        chosen = ours.select(x, q_resid, cos, sin, ours.key(x, cos, sin), causal)
    want = torch.zeros(2, 12, 12, dtype=torch.bool).scatter_(-1, top.long(), True) & causal[:, 0]
    assert torch.equal(chosen[:, 0], want)
    assert (chosen.sum(-1) == torch.arange(1, 13).clamp(max=5)).all()
    monkeypatch.setattr(dsa_indexer, "SCORE_BYTES", 4 * 2 * 16 * 12 * 5)  # 5 tokens a chunk
    with torch.no_grad():
        chunked = ours.select(x, q_resid, cos, sin, ours.key(x, cos, sin), causal)
    assert torch.equal(chunked, chosen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_graph_decode_step_replays_eager(checkpoint, dtype_name, compiled):
    """One native glm_moe_dsa decode step (static ids/positions buffers, the latent + index key
    cache, the indexer's top-k, the router and the experts op with every expert pinned) captured
    into a CUDA graph; replays equal eager steps on a second cache."""
    graph_replays_eager(checkpoint[1], dtype_name, compiled)


@pytest.mark.gpu
def test_cuda_float32_matches_hf_and_bfloat16_is_near(checkpoint):
    """On the GPU: fp32 logits as close to transformers' as on the CPU (40 tokens, the indexer
    choosing 8); at bfloat16 (SDPA's CUDA kernels, the Triton experts op) close to transformers'
    at the same dtype, over 8 tokens (every key chosen: bf16 rounding could otherwise swap a
    near-tied key at the top-k boundary, which is not what this compares)."""
    for dtype, length, tolerance in ((torch.float32, LONG, 1e-4), (torch.bfloat16, 8, 0.05)):
        ids = prompt(320, length=length, device="cuda")
        loaded = load_model(
            checkpoint[1], EngineConfig(device="cuda", dtype=str(dtype)[6:], native=True)
        )
        ref = hf_reference(checkpoint[0], dtype, "cuda")
        cache = loaded.model.new_cache(2, 64, dtype, "cuda")
        positions = torch.arange(ids.shape[1], device="cuda").expand(2, -1)
        with torch.inference_mode():
            ours = loaded.model(ids, positions, cache).float()
            theirs = ref(ids).logits.float()
        max_diff = (ours - theirs).abs().max().item()
        print(f"native glm_moe_dsa {dtype} cuda: max |logit diff| vs transformers = {max_diff:.3e}")
        assert max_diff <= tolerance * theirs.abs().max().item()
