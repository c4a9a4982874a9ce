"""`moetier convert`: store layout, streaming, and refusal of bad inputs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_models import COMMON, build_tokenizer

from moetier.core.layout import blob_view
from moetier.quant.convert import ConvertError, convert
from moetier.quant.store import BLOB_ALIGN, Store


def test_store_layout(tiny):
    store = Store(tiny.store("deepseek_v3"))
    cfg = store.model_config
    assert store.moe_layers == [1, 2]  # first_k_dense_replace=1: layer 0 is a dense MLP
    assert len(store.blobs) == 2 * cfg.num_experts
    index = json.loads((store.path / "experts.json").read_text())
    for b in index["blobs"]:
        assert b["offset"] % BLOB_ALIGN == 0
        assert set(b) >= {"layer", "expert", "plane", "offset", "bytes", "format", "shape", "crc32"}
        assert b["shape"]["gate_up"] == [2 * cfg.expert_intermediate_size, cfg.hidden_size]
    assert store.verify() == []
    with safe_open(str(store.path / "dense.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert not [k for k in keys if ".experts." in k and "shared_experts" not in k]
    assert any("shared_experts" in k for k in keys)  # shared experts stay dense
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (store.path / name).is_file()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_blobs_hold_the_hf_expert_weights(tiny, model_type):
    """Each blob equals the expert as transformers loads it, in the canonical layout
    (gpt-oss: transposed back and de-interleaved)."""
    from transformers import AutoModelForCausalLM

    store = Store(tiny.store(model_type))
    ref = AutoModelForCausalLM.from_pretrained(tiny.checkpoint(model_type), dtype=torch.float32)
    for layer, path in store.moe_modules.items():
        experts = ref.get_submodule(path)
        fmt = store.blob_format(layer)
        for e in (0, 5):
            blob = store.blob(layer, e)
            gate_up, down = experts.gate_up_proj[e], experts.down_proj[e]
            if model_type == "gpt_oss":
                gate_up = torch.cat([gate_up.t()[0::2], gate_up.t()[1::2]])
                down = down.t()
                bias = experts.gate_up_proj_bias[e]
                assert torch.equal(
                    blob_view(blob, fmt.tensor("gate_up_bias")), torch.cat([bias[0::2], bias[1::2]])
                )
                assert torch.equal(
                    blob_view(blob, fmt.tensor("down_bias")), experts.down_proj_bias[e]
                )
            assert torch.equal(blob_view(blob, fmt.tensor("gate_up")), gate_up)
            assert torch.equal(blob_view(blob, fmt.tensor("down")), down)


def test_corrupted_blob_fails_verification(tiny, tmp_path):
    src = tiny.store("mixtral")
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    with open(copy / "experts.bin", "r+b") as f:
        f.seek(Store(src).blobs[(1, 3, "base")].offset + 100)
        f.write(b"\xff\xfe")
    assert Store(copy).verify() == [(1, 3, "base")]


def _dense_checkpoint(path: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", **{**COMMON, "intermediate_size": 64, "head_dim": 16})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def test_refuses_non_moe(tmp_path):
    src = _dense_checkpoint(tmp_path / "dense")
    with pytest.raises(ConvertError, match="no routed experts.*Mixture-of-Experts"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_refuses_unsupported_architecture(tiny, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny.checkpoint("qwen3_moe"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "qwen2"  # a dense family: its MLP has no @use_experts_implementation
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ConvertError, match="'qwen2' is not supported: its transformers experts module does not"
    ):
        convert(src, tmp_path / "out", progress=False)


def test_refuses_missing_and_truncated_shards(tmp_path):
    from tiny_models import build_tiny

    src = build_tiny("qwen3_moe", tmp_path / "sharded")
    # Re-save in several shards
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    sharded = tmp_path / "shards"
    model.save_pretrained(sharded, max_shard_size="100KB")
    build_tokenizer().save_pretrained(sharded)
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 2
    convert(sharded, tmp_path / "ok", progress=False)  # the intact one converts

    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) - 1000])
    with pytest.raises(
        ConvertError, match=rf"{shards[1].name}: tensor .* past the end of the file.*download it"
    ):
        convert(sharded, tmp_path / "out", progress=False)
    shards[1].unlink()
    with pytest.raises(
        ConvertError, match=r"1 shard\(s\) listed in model.safetensors.index.json are missing"
    ):
        convert(sharded, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    # a refused source writes nothing: no work folder, no lock left behind
    assert not list(tmp_path.glob(".out.*")), list(tmp_path.iterdir())


def test_refuses_missing_expert(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(tiny.checkpoint("mixtral"), src)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.6.w3.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConvertError, match="expert 6 has no up projection"):
        convert(src, tmp_path / "out", progress=False)


def test_existing_target_needs_force(tiny, tmp_path):
    """--force replaces a store or an empty folder, never a folder holding anything else
    (tests/cli/test_convert_safety.py has the rest)."""
    out = tmp_path / "store"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    for force in (False, True):
        with pytest.raises(ConvertError, match="not a moetier store: it holds precious.txt"):
            convert(tiny.checkpoint("qwen3_moe"), out, force=force, progress=False)
    assert (out / "precious.txt").read_text() == "keep me"
    (out / "precious.txt").unlink()
    convert(tiny.checkpoint("qwen3_moe"), out, force=True, progress=False)  # empty: replaced
    with pytest.raises(ConvertError, match="already exists.*--force"):
        convert(tiny.checkpoint("qwen3_moe"), out, progress=False)
    convert(tiny.checkpoint("qwen3_moe"), out, force=True, progress=False)  # a store: replaced
    assert Store(out).verify() == []


PEAK_SCRIPT = r"""
import sys, threading, time
from moetier.quant.convert import convert
import transformers.models.qwen3_moe.modeling_qwen3_moe  # import cost outside the measurement
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
peak, done = [anon()], []
base = peak[0]
def watch():
    while not done:
        peak.append(anon()); time.sleep(0.002)
t = threading.Thread(target=watch); t.start()
convert(sys.argv[1], sys.argv[2], progress=False)
done.append(1); t.join()
print((max(peak) - base) / 2**20)
"""


@pytest.mark.slow
def test_conversion_streams(eval_model, tmp_path):
    """Converting the 141 MB eval model grows anonymous memory by far less than the model:
    tensors stream from the memory-mapped shards one at a time."""
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(eval_model), str(tmp_path / "s")],
        capture_output=True,
        text=True,
        check=True,
    )
    growth_mb = float(out.stdout.strip().splitlines()[-1])
    print(f"peak anonymous memory growth while converting eval-moe-70m: {growth_mb:.1f} MiB")
    assert growth_mb < 48  # model: 141 MB; largest tensor: 8 MiB (embeddings)
