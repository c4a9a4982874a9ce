"""q2s + additive NVFP4 delta plane: stored separately, applied per (token, expert) pair."""

from __future__ import annotations

import pytest
import torch

from moetier.config import EngineConfig
from moetier.loader.load import load_model
from moetier.loader.quantize import convert_quantized
from moetier.quant.fp4 import quantize_nvfp4
from moetier.quant.q2s import quantize_q2s
from moetier.quant.store import Store

IDS = torch.randint(1, 320, (2, 16), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def stores(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("delta")
    src = tiny.checkpoint("qwen3_moe")
    return {
        "src": src,
        "base": convert_quantized(src, root / "base", progress=False),
        "delta": convert_quantized(src, root / "delta", delta="nvfp4", progress=False),
        "q2": convert_quantized(src, root / "q2", delta="q2", progress=False),
    }


def logits(store, **engine) -> tuple[torch.Tensor, object]:
    loaded = load_model(store, EngineConfig(native=False, device="cpu", dtype="float32", **engine))
    with torch.no_grad():
        return loaded.model(IDS).logits, loaded


def test_layout_base_then_delta(stores):
    store = Store(stores["delta"])
    assert store.index["quantization"]["delta"] == "nvfp4"
    base = [b for b in store.blobs.values() if b.plane == "base"]
    delta = [b for b in store.blobs.values() if b.plane == "delta"]
    assert len(base) == len(delta) == 2 * 8
    assert max(b.offset for b in base) < min(b.offset for b in delta)  # base plane contiguous
    assert store.blob_format(1, "delta").name == "nvfp4"


def test_delta_everywhere_equals_fake_quant(stores):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        stores["src"], dtype=torch.float32, experts_implementation="eager"
    )
    with torch.no_grad():
        for path in Store(stores["delta"]).moe_modules.values():
            mod = ref.get_submodule(path)
            for e in range(8):
                for param, g in ((mod.gate_up_proj, 32), (mod.down_proj, 16)):
                    base = quantize_q2s(param[e], None, group=g).dequantize()
                    param[e] = base + quantize_nvfp4(param[e] - base).dequantize()
        theirs = ref(IDS).logits
    ours, loaded = logits(stores["delta"], delta="all")
    assert (ours - theirs).abs().max() < 1e-4
    assert loaded.runtime.delta_pairs == loaded.runtime.pairs > 0


def test_delta_off_is_the_base_store_and_never_reads_delta(stores):
    base_only, _ = logits(stores["base"])
    off, loaded = logits(stores["delta"], delta="none")
    assert torch.equal(base_only, off)
    assert loaded.runtime.delta_pairs == 0
    assert not [k for k in loaded.runtime.residency.resident() if k[2] == "delta"]


def test_delta_restores_precision(tiny, stores):
    full, _ = logits(tiny.store("qwen3_moe"))
    base, _ = logits(stores["delta"], delta="none")
    everywhere, _ = logits(stores["delta"], delta="all")
    # The tiny random router spreads weight thinly (~1/8 per expert): 0.15 selects ~40% of pairs.
    some, loaded = logits(stores["delta"], delta="weight:0.15")
    err = {
        name: ((x - full) ** 2).mean().item()
        for name, x in (("base", base), ("some", some), ("all", everywhere))
    }
    print(f"mean squared logit error vs the unquantized store: {err}")
    assert err["all"] < err["some"] < err["base"]
    assert 0 < loaded.runtime.delta_pairs < loaded.runtime.pairs


def test_mask_is_per_pair_and_cache_size_does_not_matter(stores):
    big, a = logits(stores["delta"], delta="weight:0.15")
    small, b = logits(stores["delta"], delta="weight:0.15", expert_cache_slots=2)
    assert torch.equal(big, small)
    assert b.runtime.residency.stats.evictions > 0
    with pytest.raises(ValueError, match="use all, none or weight:T"):
        EngineConfig(delta="sometimes").delta_threshold()


def test_q2_delta_plane_cuts_the_error_and_is_applied(tiny, stores):
    from transformers import AutoModelForCausalLM

    from moetier.kernels.moe_ref import expert_matrix, expert_matrix_with_delta

    store, full = Store(stores["q2"]), Store(tiny.store("qwen3_moe"))
    assert store.index["quantization"]["delta"] == "q2"
    assert store.blob_format(1, "delta").name == "q2s-g16-down-g16"
    for layer in store.moe_layers:
        fmt, delta_fmt = store.blob_format(layer), store.blob_format(layer, "delta")
        for e in range(8):
            for name in ("gate_up", "down"):
                w = expert_matrix(full.blob(layer, e), full.blob_format(layer), name)
                base = expert_matrix(store.blob(layer, e), fmt, name)
                delta = store.blob(layer, e, "delta")
                both = expert_matrix_with_delta(store.blob(layer, e), fmt, delta, delta_fmt, name)
                assert ((w - both) ** 2).sum() < 0.3 * ((w - base) ** 2).sum()
    # The runtime applies it: logits equal transformers running base + q2s(W - base) experts.
    ref = AutoModelForCausalLM.from_pretrained(
        stores["src"], dtype=torch.float32, experts_implementation="eager"
    )
    with torch.no_grad():
        for path in store.moe_modules.values():
            mod = ref.get_submodule(path)
            for e in range(8):
                for param, g in ((mod.gate_up_proj, 32), (mod.down_proj, 16)):
                    base = quantize_q2s(param[e], None, group=g).dequantize()
                    param[e] = base + quantize_q2s(param[e] - base, None, group=16).dequantize()
        theirs = ref(IDS).logits
    ours, loaded = logits(stores["q2"], delta="all")
    assert (ours - theirs).abs().max() < 1e-4
    assert loaded.runtime.delta_pairs == loaded.runtime.pairs > 0
    reference, _ = logits(tiny.store("qwen3_moe"))
    base_only, _ = logits(stores["q2"], delta="none")
    assert ((ours - reference) ** 2).mean() < ((base_only - reference) ** 2).mean()


def test_nested_planes_rebuild_nvfp4_bit_for_bit(tiny, tmp_path):
    from moetier.kernels.moe_ref import expert_matrix, expert_matrix_with_delta

    src = tiny.checkpoint("gpt_oss")
    nvfp4 = Store(convert_quantized(src, tmp_path / "nvfp4", "nvfp4", progress=False))
    nested = Store(convert_quantized(src, tmp_path / "nested", "nested", progress=False))
    assert nested.blob_format(1).name == "nested-base"
    assert nested.blob_format(1, "delta").name == "nested-delta"
    for layer in nested.moe_layers:
        for e in range(8):
            for name in ("gate_up", "down"):
                full = expert_matrix_with_delta(
                    nested.blob(layer, e),
                    nested.blob_format(layer),
                    nested.blob(layer, e, "delta"),
                    nested.blob_format(layer, "delta"),
                    name,
                )
                assert torch.equal(
                    full, expert_matrix(nvfp4.blob(layer, e), nvfp4.blob_format(layer), name)
                )
    # Whole model: base + delta everywhere is the NVFP4 store exactly; base alone is coarser.
    fp4, _ = logits(nvfp4.path)
    both, _ = logits(nested.path, delta="all")
    base, _ = logits(nested.path, delta="none")
    full, _ = logits(tiny.store("gpt_oss"))
    assert torch.equal(both, fp4)
    assert ((base - full) ** 2).mean() > ((both - full) ** 2).mean()
