"""Quantized source checkpoints (FP8, MXFP4, NVFP4) as converter input: each tiny fixture is
written the way the real release is (tests/source_checkpoints.py), read back by the producing
library, converted, and run against the HF forward of the same dequantised weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import source_checkpoints as sc
import torch
from safetensors.torch import load_file, save_file

from moetier.config import EngineConfig
from moetier.core.layout import blob_view
from moetier.kernels.moe_ref import expert_matrix, expert_matrix_with_delta
from moetier.loader.load import load_model
from moetier.loader.quantize import convert_quantized
from moetier.quant.convert import ConvertError, convert
from moetier.quant.fp4 import unpack_nibbles
from moetier.quant.sources import dequant_fp8_block
from moetier.quant.store import Store

IDS = torch.randint(1, 320, (2, 12), generator=torch.Generator().manual_seed(7))
# fixture -> (tiny model it is made from, writer)
FIXTURES = {
    "fp8": ("deepseek_v3", sc.write_fp8_block),
    "mxfp4": ("gpt_oss", sc.write_gpt_oss_mxfp4),
    "nvfp4-ct": ("qwen3_moe", sc.write_nvfp4_compressed_tensors),
    "nvfp4-modelopt": ("mixtral", sc.write_nvfp4_modelopt),
}


class Sources:
    def __init__(self, tiny, root: Path) -> None:
        self.tiny, self.root, self.refs = tiny, root, {}

    def checkpoint(self, name: str) -> Path:
        path = self.root / name
        if name not in self.refs:
            model_type, writer = FIXTURES[name]
            self.refs[name] = writer(self.tiny.checkpoint(model_type), path)
        return path

    def store(self, name: str, kind: str = "source") -> Path:
        path = self.root / "stores" / f"{name}-{kind}"
        if not path.exists():
            if kind == "source":
                convert(self.checkpoint(name), path, progress=False)
            else:
                convert_quantized(self.checkpoint(name), path, kind, progress=False)
        return path

    def hf_reference(self, name: str):  # type: ignore[no-untyped-def]
        """The HF model holding the producing library's dequantisation of the fixture."""
        from transformers import (
            AutoModelForCausalLM,
            FineGrainedFP8Config,
            Mxfp4Config,
        )

        src = self.checkpoint(name)
        kwargs = dict(dtype=torch.float32, experts_implementation="eager")
        if name == "fp8":
            qc = FineGrainedFP8Config(dequantize=True, weight_block_size=(8, 8))
            return AutoModelForCausalLM.from_pretrained(src, quantization_config=qc, **kwargs)
        if name == "mxfp4":
            qc = Mxfp4Config(dequantize=True)
            return AutoModelForCausalLM.from_pretrained(src, quantization_config=qc, **kwargs)
        # NVFP4: transformers 5.17 reads neither producer's per-expert NVFP4 into its fused
        # experts (compressed-tensors' global scales come out UNEXPECTED), so the reference is
        # the unquantized model with the library-dequantised weights put in.
        ref = self.root / f"{name}-reference"
        if not ref.exists():
            model_type = FIXTURES[name][0]
            state = load_file(str(self.tiny.checkpoint(model_type) / "model.safetensors"))
            state.update(self.refs[name])
            sc._copy_aux(self.tiny.checkpoint(model_type), ref)
            save_file(state, str(ref / "model.safetensors"), metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(ref, **kwargs)


@pytest.fixture(scope="module")
def sources(tiny, tmp_path_factory) -> Sources:
    return Sources(tiny, tmp_path_factory.mktemp("sources"))


def test_compressed_tensors_decompressor_reads_the_fixture(sources):
    """The library's own decompressor, on the checkpoint's tensors, gives our dequantisation."""
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    from moetier.quant.convert import dequantized_dtype, find_shards, scan_sources
    from moetier.quant.sources import TensorReader, detect_quantization, fold_quantized

    src = sources.checkpoint("nvfp4-ct")
    state = load_file(str(src / "model.safetensors"))
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    quant = detect_quantization(src)
    tensors, _ = fold_quantized(scan_sources(find_shards(src)), quant, dequantized_dtype(src))
    read = TensorReader(quant)
    quantized = [t for t in tensors if t.quant == "nvfp4"]
    assert len(quantized) == 2 * (4 + 3 * 8)  # attention and every expert projection
    for t in quantized:
        prefix = t.key[: -len("weight")]
        theirs = NVFP4PackedCompressor.decompress(
            {
                p: state[prefix + p]
                for p in ("weight_packed", "weight_scale", "weight_global_scale")
            },
            scheme,
        )["weight"]  # bf16, the library's own output dtype
        ours = read(t)
        assert theirs.dtype == torch.bfloat16
        torch.testing.assert_close(ours.to(torch.bfloat16), theirs, rtol=2**-8, atol=0)
        assert torch.equal(ours, sources.refs["nvfp4-ct"][t.key])


@pytest.mark.parametrize("name", list(FIXTURES))
def test_store_holds_the_reference_dequantisation(sources, name):
    """Dense tensors and experts of the converted store equal the producing library's
    dequantisation (FP4 experts: their codes decode to it)."""
    store = Store(sources.store(name))
    ref = sources.hf_reference(name).state_dict()
    dense = load_file(str(store.path / "dense.safetensors"))
    assert dense, name
    for key, value in dense.items():
        torch.testing.assert_close(value.float(), ref[key].float(), rtol=1e-6, atol=0)
    cfg = json.loads((store.path / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert store.index["source_quantization"]["method"] == name.split("-")[0]
    for layer, path in store.moe_modules.items():
        fmt = store.blob_format(layer)
        for e in (0, 7):
            gate_up = ref[f"{path}.gate_up_proj"][e].float()
            down = ref[f"{path}.down_proj"][e].float()
            if name == "mxfp4":  # gpt-oss: transposed, interleaved
                gate_up = torch.cat([gate_up.t()[0::2], gate_up.t()[1::2]])
                down = down.t()
            blob = store.blob(layer, e)
            torch.testing.assert_close(
                expert_matrix(blob, fmt, "gate_up"), gate_up, rtol=1e-6, atol=0
            )
            torch.testing.assert_close(expert_matrix(blob, fmt, "down"), down, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", list(FIXTURES))
def test_logits_match_hf_dequantised_forward(sources, name):
    loaded = load_model(
        sources.store(name), EngineConfig(native=False, device="cpu", dtype="float32")
    )
    ref = sources.hf_reference(name).float().eval()
    with torch.no_grad():
        ours, theirs = loaded.model(IDS).logits, ref(IDS).logits
    max_diff = (ours - theirs).abs().max().item()
    print(f"{name}: experts {sorted(loaded.store.formats)}, max |logit diff| = {max_diff:.3e}")
    assert max_diff <= 1e-4
    assert loaded.runtime.residency.stats.misses > 0


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4-ct", "nvfp4-modelopt"])
def test_fp4_codes_kept_and_nested_is_bit_exact(sources, name):
    """FP4 sources keep their codes and block scales: the nvfp4/mxfp4 store holds the
    checkpoint's bytes, and nested base + delta rebuilds them bit for bit."""
    fp4 = Store(sources.store(name))
    nested = Store(sources.store(name, "nested"))
    kind = "mxfp4" if name == "mxfp4" else "nvfp4"
    bias = "+bias" if name == "mxfp4" else ""  # the gpt-oss fixture has expert biases
    assert sorted(fp4.formats) == [kind + bias]
    assert Store(sources.store(name, kind)).verify() == []
    state = load_file(str(sources.checkpoint(name) / "model.safetensors"))
    for layer, path in fp4.moe_modules.items():
        fmt = fp4.blob_format(layer)
        for e in range(8):
            blob = fp4.blob(layer, e)
            codes = blob_view(blob, fmt.tensor("down.codes"))
            if name == "mxfp4":
                theirs = state[f"{path}.down_proj_blocks"][e].reshape(codes.shape)
            elif name == "nvfp4-ct":
                theirs = state[f"{path}.{e}.down_proj.weight_packed"]
            else:
                theirs = state[f"model.layers.{layer}.block_sparse_moe.experts.{e}.w2.weight"]
            assert torch.equal(codes, theirs)
            for m in ("gate_up", "down"):
                rebuilt = expert_matrix_with_delta(
                    nested.blob(layer, e),
                    nested.blob_format(layer),
                    nested.blob(layer, e, "delta"),
                    nested.blob_format(layer, "delta"),
                    m,
                )
                assert torch.equal(rebuilt, expert_matrix(blob, fmt, m))
            base_codes = blob_view(
                nested.blob(layer, e), nested.blob_format(layer).tensor("down.codes")
            )
            assert torch.equal(unpack_nibbles(codes) >> 2, _unpack2(base_codes))
    both = load_model(
        nested.path, EngineConfig(native=False, device="cpu", dtype="float32", delta="all")
    )
    same = load_model(fp4.path, EngineConfig(native=False, device="cpu", dtype="float32"))
    with torch.no_grad():
        assert torch.equal(both.model(IDS).logits, same.model(IDS).logits)


def _unpack2(packed: torch.Tensor) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    return ((packed[..., None] >> shifts) & 3).reshape(packed.shape[0], -1)


def test_other_formats_from_fp4_dequantise_first(sources):
    """--experts q2s (or the other FP4 flavour) re-encodes the dequantised weights."""
    q2s = Store(sources.store("nvfp4-ct", "q2s"))
    assert q2s.blob_format(1).name.startswith("q2s")
    mx = Store(sources.store("nvfp4-ct", "mxfp4"))
    ref = sources.refs["nvfp4-ct"]["model.layers.1.mlp.experts.3.down_proj.weight"]
    from moetier.quant.fp4 import quantize_mxfp4

    expected = quantize_mxfp4(ref).dequantize()
    assert torch.equal(expert_matrix(mx.blob(1, 3), mx.blob_format(1), "down"), expected)


def test_fp8_partial_tiles():
    """DeepSeek's [128, 128] tiles on a shape that is not a multiple of them (edge tiles
    partial): each element takes the scale of the tile it lies in."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(200, 300, generator=g) * 100).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3, generator=g) + 0.5
    out = dequant_fp8_block(weight, scale_inv, (128, 128))
    for i, j in ((0, 0), (127, 127), (128, 128), (199, 299), (150, 10)):
        assert out[i, j] == weight[i, j].float() * scale_inv[i // 128, j // 128]
    with pytest.raises(ConvertError, match=r"needs a \[2, 3\] scale grid"):
        dequant_fp8_block(weight, scale_inv[:1], (128, 128))


def test_unsupported_quantization_names_what_is_supported(tiny, tmp_path):
    src = tmp_path / "awq"
    shutil.copytree(tiny.checkpoint("qwen3_moe"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="'awq'.*not supported.*Supported: FP8 block-scaled"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_nvfp4_gate_up_with_different_global_scales_refuses_to_keep_codes(sources, tmp_path):
    src = tmp_path / "unfused"
    shutil.copytree(sources.checkpoint("nvfp4-ct"), src)
    state = load_file(str(src / "model.safetensors"))
    state["model.layers.1.mlp.experts.2.up_proj.weight_global_scale"] *= 2
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConvertError, match="expert 2: gate and up projections have different"):
        convert(src, tmp_path / "out", progress=False)
    convert_quantized(src, tmp_path / "q2s", "q2s", progress=False)  # dequantising still works
