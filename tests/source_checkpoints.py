"""Tiny quantized checkpoints laid out as the real releases are, made from the tiny fp32 ones.

- FP8 block-scaled, DeepSeek-V3 layout: `weight` float8_e4m3fn + `weight_scale_inv` float32
  [ceil(N/b0), ceil(K/b1)] for every decoder Linear but the router (no library writes this
  on CPU; written here as DeepSeek's `weight_dequant` reads it).
- MXFP4, gpt-oss layout: `experts.gate_up_proj_blocks` uint8 [E, 2I, H/32, 16] + `_scales` uint8
  E8M0 [E, 2I, H/32], rows interleaved gate/up as transformers' gpt-oss expects (transformers
  only writes MXFP4 with its GPU kernels).
- NVFP4, compressed-tensors layout: written by the compressed-tensors library's own
  NVFP4 compressor, with llm-compressor's fused gate/up global scale.
- NVFP4, ModelOpt layout: tensors from ModelOpt's `NVFP4QTensor.quantize`, keys and
  hf_quant_config.json as ModelOpt's HF export names them, gate/up sharing weight_scale_2.

Each writer also returns the reference dequantisation of every quantized tensor (checkpoint
key -> float32), computed with the producing library's decode where it has one.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Decoder Linear weights that the real releases quantize: not norms, not the router.
_LINEAR = re.compile(r"layers\.\d+\..*(_proj|_proj_with_mqa|\.w[123])\.weight$")


def _copy_aux(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors"):
            shutil.copyfile(path, out / path.name)


def _set_quant_config(out: Path, quantization_config: dict) -> None:
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def _state(src: Path) -> dict[str, torch.Tensor]:
    return load_file(str(src / "model.safetensors"))


def write_fp8_block(src: Path, out: Path, block: tuple[int, int] = (8, 8)) -> dict:
    """DeepSeek-V3 FP8: W = fp8 * scale_inv, one scale per block[0] x block[1] tile."""
    _copy_aux(src, out)
    state, ref = _state(src), {}
    for key in [k for k in state if _LINEAR.search(k)]:
        w = state[key].float()
        n, k = w.shape
        rows, cols = -(-n // block[0]), -(-k // block[1])
        padded = torch.zeros(rows * block[0], cols * block[1])
        padded[:n, :k] = w
        tiles = padded.view(rows, block[0], cols, block[1])
        scale_inv = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)  # [rows, cols]
        full = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
        q = (w / full).to(torch.float8_e4m3fn)
        state[key] = q
        state[key + "_scale_inv"] = scale_inv
        ref[key] = q.float() * full
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _set_quant_config(
        out,
        {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(block),
        },
    )
    return ref


def write_gpt_oss_mxfp4(src: Path, out: Path) -> dict:
    """gpt-oss MXFP4: experts as blocks/scales in [E, out, K/32, ...]; the rest unquantized."""
    from moetier.quant.fp4 import pack_nibbles, quantize_mxfp4

    _copy_aux(src, out)
    state, ref = _state(src), {}
    for key in [k for k in state if re.search(r"experts\.(gate_up|down)_proj$", k)]:
        w = state.pop(key).float().transpose(1, 2)  # [E, out, in], as the blocks are laid out
        blocks, scales = [], []
        for matrix in w:
            q = quantize_mxfp4(matrix)
            blocks.append(pack_nibbles(q.codes).view(matrix.shape[0], -1, 16))
            scales.append(q.scales)
        state[key + "_blocks"] = torch.stack(blocks)
        state[key + "_scales"] = torch.stack(scales)
        ref[key] = None  # transformers' own dequantisation is the reference (the test loads it)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _set_quant_config(
        out,
        {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
    )
    return ref


def _fused_partner(key: str) -> str | None:
    """The key sharing a global scale with `key` (gate with up), as llm-compressor and
    ModelOpt fuse them; None for other weights."""
    for a, b in ((".gate_proj.", ".up_proj."), (".w1.", ".w3.")):
        if a in key:
            return key.replace(a, b)
        if b in key:
            return key.replace(b, a)
    return None


def write_nvfp4_compressed_tensors(src: Path, out: Path) -> dict:
    """compressed-tensors NVFP4 (nvfp4-pack-quantized), by the library's compressor."""
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    _copy_aux(src, out)
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    state, original, ref = _state(src), _state(src), {}
    for key in [k for k in state if _LINEAR.search(k)]:
        w = state.pop(key).float()
        partner = _fused_partner(key)
        both = torch.cat([w.view(-1), original[partner].float().view(-1)]) if partner else w
        global_scale = generate_gparam(both.min(), both.max())
        groups = w.view(w.shape[0], -1, 16)
        scale, _ = calculate_qparams(
            groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=global_scale
        )
        packed = NVFP4PackedCompressor.compress(
            {"weight": w, "weight_scale": scale, "weight_global_scale": global_scale}, scheme
        )
        prefix = key[: -len("weight")]
        for name, value in packed.items():
            state[prefix + name] = value
        codes = unpack_fp4_from_uint8(packed["weight_packed"], *w.shape, dtype=torch.float32)
        ref[key] = dequantize(
            x_q=codes,
            scale=packed["weight_scale"].float(),
            args=scheme.weights,
            global_scale=packed["weight_global_scale"],
            dtype=torch.float32,
        )
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="nvfp4-pack-quantized",
        quantization_status="compressed",
        ignore=["lm_head", "re:.*mlp.gate$"],
    )
    _set_quant_config(out, config.model_dump(mode="json", exclude_none=True))
    return ref


def write_nvfp4_modelopt(src: Path, out: Path) -> dict:
    """ModelOpt NVFP4 export: `weight` uint8, `weight_scale` fp8, `weight_scale_2`, `input_scale`
    (keys as ModelOpt's HF export writes them)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    _copy_aux(src, out)
    state, original, ref = _state(src), _state(src), {}
    for key in [k for k in state if _LINEAR.search(k)]:
        w = state.pop(key).float()
        partner = _fused_partner(key)
        both = torch.cat([w.view(-1), original[partner].float().view(-1)]) if partner else w
        scale_2 = NVFP4QTensor.get_weights_scaling_factor_2(both)
        qtensor, scale, scale_2 = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=scale_2)
        prefix = key[: -len("weight")]
        state[key] = qtensor._quantized_data
        state[prefix + "weight_scale"] = scale
        state[prefix + "weight_scale_2"] = scale_2.reshape(())
        state[prefix + "input_scale"] = torch.tensor(1.0 / 448)
        ref[key] = qtensor.dequantize(
            dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16}
        )
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "hf_quant_config.json").write_text(
        json.dumps(
            {
                "producer": {"name": "modelopt", "version": "0.47.0"},
                "quantization": {
                    "quant_algo": "NVFP4",
                    "kv_cache_quant_algo": None,
                    "group_size": 16,
                    "exclude_modules": ["lm_head", "model.layers.*.block_sparse_moe.gate"],
                },
            },
            indent=2,
        )
    )
    return ref
