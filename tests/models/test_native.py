"""The native qwen3_moe model file against the HF transformers forward (the oracle), and its
static-cache prefill/decode against itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_oracle import hf_greedy, hf_reference, prompt

from moetier.config import EngineConfig, replace
from moetier.engine.static_decode import StaticDecoder
from moetier.loader.load import load_model
from moetier.loader.native import load_native
from moetier.models.qwen3_moe import Qwen3MoeForCausalLM

FP32 = EngineConfig(device="cpu", dtype="float32", native=True)


@pytest.fixture(scope="module")
def native(tiny):
    return load_model(tiny.store("qwen3_moe"), FP32)


def full_logits(loaded, ids: torch.Tensor, max_len: int = 64) -> torch.Tensor:
    cache = loaded.model.new_cache(ids.shape[0], max_len, torch.float32, "cpu")
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.inference_mode():
        return loaded.model(ids, positions, cache)


def test_logits_match_hf(tiny, native):
    assert isinstance(native.model, Qwen3MoeForCausalLM)
    ref = hf_reference(tiny.checkpoint("qwen3_moe"))
    ids = prompt(native.model_config.vocab_size)
    with torch.no_grad():
        theirs = ref(ids).logits
    max_diff = (full_logits(native, ids) - theirs).abs().max().item()
    print(f"native qwen3_moe: max |logit diff| vs transformers = {max_diff:.3e}")
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
    diff = (torch.stack(steps[:-1]) - full[4:11]).abs().max().item()
    assert diff <= 1e-5, diff
    assert (steps[-1] - full[11]).abs().max().item() <= 1e-5


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
    greedy = StaticDecoder(native.model, 3, 48, torch.float32, "cpu").greedy(prompts, 12)
    for row, p in enumerate(prompts):
        assert (
            greedy[row]
            == StaticDecoder(native.model, 1, 48, torch.float32, "cpu").greedy([p], 12)[0]
        )


def test_greedy_matches_hf_generate(tiny, native):
    ref = hf_reference(tiny.checkpoint("qwen3_moe"))
    ids = prompt(native.model_config.vocab_size, batch=1)
    ours = StaticDecoder(native.model, 1, 64, torch.float32, "cpu").greedy([ids[0].tolist()], 16)[0]
    theirs = hf_greedy(ref, ids)
    assert ours[: len(theirs)] == theirs
    assert len(theirs) == 16 or ours[len(theirs)] == 0  # HF stopped at eos 0


def test_two_slot_budget_is_bit_identical(tiny, native):
    small = load_model(tiny.store("qwen3_moe"), replace(FP32, expert_cache_slots=2))
    ids = prompt(native.model_config.vocab_size)
    assert torch.equal(full_logits(small, ids), full_logits(native, ids))
    assert small.runtime.residency.stats.evictions > 0


def test_refuses_family_without_native_file(tiny):
    with pytest.raises(ValueError, match="no native model file for 'mixtral'"):
        load_native(tiny.store("mixtral"), FP32)


@pytest.mark.slow
def test_eval_model_loss_matches_transformers(eval_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from moetier.quant.convert import convert

    store = convert(eval_model, tmp_path / "eval-store", progress=False)
    tokens = np.load(eval_model / "heldout_tokens.npz")["tokens"][: 4 * 512].astype(np.int64)
    ids = torch.from_numpy(tokens).view(4, 512)
    loaded = load_model(store, FP32)
    logits = full_logits(loaded, ids, max_len=512).float()
    ours = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    del loaded, logits
    ref = AutoModelForCausalLM.from_pretrained(
        eval_model, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        theirs = ref(ids, labels=ids).loss.item()
    print(
        f"eval-moe-70m native loss on 4x512 held-out tokens: {ours.item():.6f}, "
        f"transformers {theirs:.6f}, diff {abs(ours.item() - theirs):.2e}"
    )
    assert abs(ours.item() - theirs) <= 1e-4


def test_pinned_experts_are_bit_identical(tiny, native):
    """pin_all (every expert resident, one kernel call per layer, no host sync) changes no
    number, on the native path and the transformers path alike."""
    ids = prompt(native.model_config.vocab_size)
    expected = full_logits(native, ids)
    pinned = load_model(tiny.store("qwen3_moe"), FP32)
    pinned.runtime.pin_all()
    misses = pinned.runtime.residency.stats.misses
    assert torch.equal(full_logits(pinned, ids), expected)
    assert pinned.runtime.residency.stats.misses == misses  # nothing fetched after pinning
    hf_path = load_model(
        tiny.store("qwen3_moe"), EngineConfig(native=False, device="cpu", dtype="float32")
    )
    with torch.no_grad():
        before = hf_path.model(ids).logits
        hf_path.runtime.pin_all()
        assert torch.equal(hf_path.model(ids).logits, before)
    small = load_model(tiny.store("qwen3_moe"), replace(FP32, expert_cache_slots=2))
    with pytest.raises(ValueError, match="pinning every expert needs 16 slots"):
        small.runtime.pin_all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_graph_decode_step_replays_eager(tiny, dtype_name, compiled):
    """One native decode step (static ids/positions buffers, the cache, the experts op with every
    expert pinned) captured into a CUDA graph; replays equal eager steps on a second cache. With
    `compiled`, both decoders run the step through torch.compile (greedy tokens must agree)."""
    graph_replays_eager(tiny.store("qwen3_moe"), dtype_name, compiled)


def graph_replays_eager(store, dtype_name: str, compiled: bool) -> None:
    """A native model's decode step captured by `StaticDecoder.capture` replays bit-identically
    to eager steps of a second decoder, for 6 greedy steps of a 2-row batch."""
    loaded = load_model(store, EngineConfig(device="cuda", dtype=dtype_name, native=True))
    loaded.runtime.pin_all()
    ids = prompt(loaded.model_config.vocab_size, batch=2, length=9)
    prompts = [ids[0, :4].tolist(), ids[1].tolist()]
    graphed = StaticDecoder(loaded.model, 2, 64, loaded.dtype, "cuda", compile_step=compiled)
    eager = StaticDecoder(loaded.model, 2, 64, loaded.dtype, "cuda", compile_step=compiled)
    logits = graphed.prefill(prompts)
    assert torch.equal(logits, eager.prefill(prompts))
    tokens = logits.argmax(-1)
    graphed.input_ids.copy_(tokens[:, None])
    replay = graphed.capture()  # the warm-up rewrites the cache entries the first replay writes
    for _ in range(6):
        graphed.input_ids.copy_(tokens[:, None])
        static_logits = replay()  # advances the positions inside the graph
        expected = eager.step(tokens)
        assert torch.equal(static_logits, expected)
        tokens = expected.argmax(-1)


def test_dense_layers_and_tied_head_match_hf(tmp_path):
    """mlp_only_layers / decoder_sparse_step (dense SwiGLU layers between MoE ones), norm_topk_prob
    and a tied lm_head, as the config says."""
    from tiny_models import build_tiny

    from moetier.quant.convert import convert

    checkpoint = build_tiny(
        "qwen3_moe",
        tmp_path / "hf",
        num_hidden_layers=4,
        mlp_only_layers=[0],
        decoder_sparse_step=2,
        norm_topk_prob=True,
        tie_word_embeddings=True,
    )
    loaded = load_model(convert(checkpoint, tmp_path / "store", progress=False), FP32)
    assert loaded.model.config.moe_layers == (1, 3)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    ids = prompt(loaded.model_config.vocab_size)
    with torch.no_grad():
        theirs = hf_reference(checkpoint)(ids).logits
    assert (full_logits(loaded, ids) - theirs).abs().max().item() <= 1e-5
