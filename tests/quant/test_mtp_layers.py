"""Multi-token-prediction (MTP) layers are kept in the store, not dropped.

Tiny checkpoints get an MTP layer named as the real releases name it: DeepSeek-V3 and GLM-4.5+ /
GLM-5 at `model.layers.{num_hidden_layers}` (enorm, hnorm, eh_proj, shared_head, embed_tokens
and a whole MoE decoder block, ../shared/research/serving.md §3.1, DeepSeek-V3's
README_WEIGHTS.md), DeepSeek-V4 at `mtp.0.` (e_proj, h_proj, enorm, hnorm, norm, hc_head_* and a
block named like `layers.N.`: attn, ffn.experts.N.w1/w2/w3, ...). Checked: every checkpoint
tensor lands in the store (MTP experts as blobs equal to the written weights, the rest in
dense.safetensors under its name), the index names the MTP layers, re-encoding keeps them, and
the main model's logits are those of the same checkpoint without the MTP layer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moetier.config import EngineConfig
from moetier.core.layout import blob_view
from moetier.loader.load import load_model
from moetier.quant.convert import convert, mtp_place
from moetier.quant.requantize import requantize_experts
from moetier.quant.store import DENSE_FILE, Store

# model_type -> (prefix of the MTP layer, given num_hidden_layers; expert projection names
# gate, up, down as the checkpoint writes them; the MTP-only tensors and their shapes from
# (hidden, vocab))
FAMILIES = {
    "deepseek_v3": ("model.layers.{L}.", ("gate_proj", "up_proj", "down_proj")),
    "glm4_moe": ("model.layers.{L}.", ("gate_proj", "up_proj", "down_proj")),
    "glm_moe_dsa": ("model.layers.{L}.", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v4": ("mtp.0.", ("w1", "w3", "w2")),
}


def hf_reference(checkpoint: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, experts_implementation="eager"
    )
    return model.eval()


def prompt(vocab: int) -> torch.Tensor:
    return torch.randint(1, vocab, (2, 12), generator=torch.Generator().manual_seed(7))


def _mtp_only(model_type: str, hidden: int, vocab: int, hc_shapes: dict) -> dict[str, tuple]:
    if model_type == "deepseek_v4":  # the release's mtp.0 head (DeepSeek-V4 inference code)
        return {
            "e_proj.weight": (hidden, hidden),
            "h_proj.weight": (hidden, hidden),
            "enorm.weight": (hidden,),
            "hnorm.weight": (hidden,),
            "norm.weight": (hidden,),
            **{f"hc_head_{k}": v for k, v in hc_shapes.items()},
        }
    return {  # DeepSeek-V3 / GLM: model.layers.{L}.*
        "enorm.weight": (hidden,),
        "hnorm.weight": (hidden,),
        "eh_proj.weight": (hidden, 2 * hidden),
        "shared_head.norm.weight": (hidden,),
        "shared_head.head.weight": (vocab, hidden),
        "embed_tokens.weight": (vocab, hidden),
    }


def with_mtp_layer(src: Path, dst: Path, model_type: str) -> dict[str, torch.Tensor]:
    """A copy of checkpoint `src` with one MTP layer added (random weights, shapes of the last
    decoder layer); returns the MTP tensors written, by checkpoint name."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    layers, hidden, vocab = (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["vocab_size"],
    )
    tensors = load_file(str(src / "model.safetensors"))
    last = f"model.layers.{layers - 1}."
    prefix = FAMILIES[model_type][0].format(L=layers)
    gen = torch.Generator().manual_seed(1)
    mtp = {
        prefix + key[len(last) :]: torch.randn(t.shape, generator=gen) * 0.1
        for key, t in tensors.items()
        if key.startswith(last) and t.is_floating_point()
    }
    hc = {k.rsplit("_", 1)[-1]: tuple(t.shape) for k, t in tensors.items() if "hc_head" in k}
    for name, shape in _mtp_only(model_type, hidden, vocab, hc).items():
        mtp[prefix + name] = torch.randn(shape, generator=gen) * 0.1
    save_file({**tensors, **mtp}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    # the releases' config.json counts it (transformers' glm_moe_dsa config does not write it)
    config.setdefault("num_nextn_predict_layers", 1)
    (dst / "config.json").write_text(json.dumps(config))
    return mtp


@pytest.fixture(scope="module")
def mtp_stores(tiny, tmp_path_factory):
    """model_type -> (store with the MTP layer, the MTP tensors written)."""
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for model_type in FAMILIES:
        checkpoint = with_mtp_layer(
            tiny.checkpoint(model_type), root / f"hf-{model_type}", model_type
        )
        out[model_type] = (
            convert(root / f"hf-{model_type}", root / model_type, progress=False),
            checkpoint,
        )
    return out


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_mtp_tensor_is_in_the_store(mtp_stores, tiny, model_type):
    path, mtp = mtp_stores[model_type]
    store = Store(path)
    plain = Store(tiny.store(model_type))
    layers = store.model_config.num_layers
    prefix = FAMILIES[model_type][0].format(L=layers)
    assert store.mtp_layers == {layers: prefix}
    assert store.moe_modules == plain.moe_modules  # the main model's experts as before
    (experts_path,) = store.mtp_modules.values()
    assert store.mtp_modules == {layers: experts_path} and experts_path.endswith("mlp.experts")
    assert store.index["skipped_source_tensors"] == []
    assert store.verify() == []

    # routed experts: blobs of layer `layers`, equal to the written projections
    gate, up, down = FAMILIES[model_type][1]
    fmt = store.blob_format(layers)
    experts = {k for k in mtp if ".experts." in k and "shared" not in k}
    n_exp = store.model_config.num_experts
    assert len(experts) == 3 * n_exp
    assert sorted(store.mtp_blobs) == [(layers, e, "base") for e in range(n_exp)]
    assert set(store.blobs) == set(plain.blobs)  # MTP blobs are not the main model's
    for e in range(n_exp):
        blob = store.blob(layers, e)
        stem = f"{prefix}{'ffn' if model_type == 'deepseek_v4' else 'mlp'}.experts.{e}."
        want = torch.cat([mtp[f"{stem}{gate}.weight"], mtp[f"{stem}{up}.weight"]])
        assert torch.equal(blob_view(blob, fmt.tensor("gate_up")), want)
        assert torch.equal(blob_view(blob, fmt.tensor("down")), mtp[f"{stem}{down}.weight"])

    # everything else: dense.safetensors under the checkpoint's own name, values unchanged
    rest = {k: v for k, v in mtp.items() if k not in experts}
    assert store.mtp_dense == set(rest)
    with safe_open(str(store.path / DENSE_FILE), "pt") as f:
        keys = set(f.keys())
        for name, value in rest.items():
            assert torch.equal(f.get_tensor(name), value), name
    with safe_open(str(plain.path / DENSE_FILE), "pt") as f:
        assert keys == set(f.keys()) | set(rest)  # and the main model's tensors, all of them
    assert store.dense_size == plain.dense_size
    assert store.mtp_dense_size[0] == sum(v.numel() for v in rest.values())


@pytest.mark.parametrize(
    "model_type,native",
    [(m, False) for m in FAMILIES] + [("deepseek_v3", True)],
)
def test_main_model_logits_unchanged(mtp_stores, tiny, model_type, native):
    """The store with the MTP layer runs the main model exactly as the store without it, and
    as the HF forward of the checkpoint without it."""
    config = EngineConfig(device="cpu", dtype="float32", native=native)
    with_mtp = load_model(mtp_stores[model_type][0], config)
    without = load_model(tiny.store(model_type), config)
    ids = prompt(with_mtp.model_config.vocab_size)
    with torch.no_grad():
        theirs = hf_reference(tiny.checkpoint(model_type))(ids).logits
        if native:
            cache = [m.model.new_cache(2, 64, torch.float32, "cpu") for m in (with_mtp, without)]
            positions = torch.arange(ids.shape[1]).expand(2, -1)
            ours = with_mtp.model(ids, positions, cache[0])
            base = without.model(ids, positions, cache[1])
        else:
            ours, base = with_mtp.model(ids).logits, without.model(ids).logits
    assert torch.equal(ours, base)
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_reencoding_keeps_the_mtp_layer(mtp_stores, tiny, tmp_path):
    """q2s re-encoding (convert --experts q2s) re-encodes the MTP layer's experts too; the
    main model's blobs are byte for byte those of the store without the MTP layer."""
    model_type = "deepseek_v3"
    stores = {}
    for name, src in (("mtp", mtp_stores[model_type][0]), ("plain", tiny.store(model_type))):
        shutil.copytree(src, tmp_path / name)
        requantize_experts(tmp_path / name, "q2s", progress=False)
        stores[name] = Store(tmp_path / name)
    store, plain = stores["mtp"], stores["plain"]
    layer = store.model_config.num_layers
    assert store.mtp_layers == Store(mtp_stores[model_type][0]).mtp_layers
    assert sorted(store.mtp_blobs) == [(layer, e, "base") for e in range(8)]
    assert store.blob_format(layer).name == store.blob_format(store.moe_layers[0]).name
    assert {k: e.crc32 for k, e in store.blobs.items()} == {
        k: e.crc32 for k, e in plain.blobs.items()
    }
    assert store.verify() == []
    # the re-encoded MTP expert decodes near the written weights (2-bit: a coarse check that
    # the blob holds this expert, not another's)
    from moetier.kernels.moe_ref import expert_matrix

    prefix = f"model.layers.{layer}.mlp.experts.3."
    written = mtp_stores[model_type][1][prefix + "down_proj.weight"]
    decoded = expert_matrix(store.blob(layer, 3), store.blob_format(layer), "down")
    other = expert_matrix(store.blob(layer, 4), store.blob_format(layer), "down")
    assert (decoded - written).norm() < 0.7 * (other - written).norm()


def test_mtp_place():
    assert mtp_place("model.layers.61.eh_proj.weight", 61, 1) == (61, "model.layers.61.")
    assert mtp_place("model.layers.60.eh_proj.weight", 61, 1) is None  # a main layer
    assert mtp_place("model.layers.62.eh_proj.weight", 61, 1) is None  # beyond the MTP count
    assert mtp_place("model.layers.61.eh_proj.weight", 61, 0) is None  # config names none
    assert mtp_place("mtp.0.ffn.experts.3.w1.weight", 43, 1) == (43, "mtp.0.")  # DeepSeek-V4
    assert mtp_place("mtp.layers.0.mlp.gate.weight", 48, 1) == (48, "mtp.layers.0.")  # Qwen3-Next
    assert mtp_place("mtp.fc.weight", 48, 1) == (48, "mtp.")  # Qwen3-Next's shared fc
    assert mtp_place("model.embed_tokens.weight", 48, 1) is None
