"""Random but valid expert blobs of any format, written directly in their stored form.

For kernel tests and benchmarks at shapes no real checkpoint is at hand for: every byte pattern
of the codes is legal, scales are drawn in a realistic range, so a decoder that misreads any
field is caught. Never materialises unquantized weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from moetier.core.layout import DTYPES, BlobFormat
from moetier.quant.dense_formats import DensePolicy, dense_class


def random_blob(
    fmt: BlobFormat,
    generator: torch.Generator,
    out: torch.Tensor | None = None,
    fitted_grid: bool = True,
) -> torch.Tensor:
    """One blob of `fmt` (uint8 [fmt.nbytes], or written into `out`, a uint8 view of at least
    that size on any device) with random codes and plausible scales. q2s grids (a, b) are drawn
    freely (`fitted_grid`) or with b = 3a, the evenly spaced grid the quantizer uses today."""
    blob = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    for spec in fmt.tensors:
        shape, dtype = spec.shape, DTYPES[spec.dtype]
        leaf = spec.name.rsplit(".", 1)[-1]
        if leaf == "scales" and spec.dtype == "uint8":  # E8M0 (MXFP4, nested MXFP4)
            value = torch.randint(118, 128, shape, generator=generator, dtype=torch.uint8)
        elif dtype == torch.uint8:
            value = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
        elif leaf in ("scales", "row_scale", "tensor_scale"):
            value = (torch.rand(shape, generator=generator) * 1.5 + 0.25).to(dtype)
        elif leaf == "grid":  # q2s (a, b) with 0 < a < b
            a = torch.rand((), generator=generator) * 0.4 + 0.3
            ratio = 2.5 + float(torch.rand((), generator=generator)) if fitted_grid else 3.0
            # b from the float32 a, so b = 3a holds in float32 too (the kernels test b - 3a
            # against 0; 3.0 times a float64 a, rounded, missed it for ~40% of the blobs)
            value = torch.stack([a, a * ratio]).float()
        elif leaf == "table":  # nested: mean E2M1 value of each (sign, exponent MSB) code
            value = torch.tensor([0.75, 3.75, -0.75, -3.75]) * (
                1 + 0.1 * torch.randn(4, generator=generator)
            )
        else:  # raw matrices and biases
            value = (torch.randn(shape, generator=generator) * 0.05).to(dtype)
        raw = value.contiguous().view(-1).view(torch.uint8)
        blob[spec.offset : spec.offset + spec.nbytes] = raw
    if out is None:
        return blob
    out[: blob.numel()].copy_(blob)
    return out


QWEN3_30B_A3B = dict(  # the Qwen3-30B-A3B shape (vocab cut to 8192)
    model_type="qwen3_moe",
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    moe_intermediate_size=768,
    intermediate_size=6144,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    vocab_size=8192,
    max_position_embeddings=4096,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    torch_dtype="bfloat16",
)


TINY_QWEN3_MOE = dict(  # the CPU smoke-test shape: Qwen3-MoE layout, tiny sizes
    QWEN3_30B_A3B,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    moe_intermediate_size=64,
    intermediate_size=256,
    num_experts=32,  # eval-moe-70m's router_trace.npz maps onto it (bench/decode.py, CPU smoke)
    num_experts_per_tok=4,
    vocab_size=512,
)

# The shapes a synthetic store can be written at, by name (`moetier bench --shape NAME`).
SHAPES: dict[str, dict[str, Any]] = {"qwen3-30b-a3b": QWEN3_30B_A3B, "tiny": TINY_QWEN3_MOE}


def shape(name: str, layers: int | None = None) -> dict[str, Any]:
    """The HF config of shape `name` (SHAPES), with `layers` decoder layers where given;
    ValueError naming the shapes for an unknown one."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}: the shapes are {', '.join(SHAPES)}")
    if layers is not None and layers < 1:
        raise ValueError(f"--layers {layers}: a model needs at least one layer")
    config = dict(SHAPES[name])
    if layers is not None:
        config["num_hidden_layers"] = layers
    return config


def _expert_format(hf_config: dict[str, Any], experts: str) -> BlobFormat:
    """The blob format of a synthetic store's experts: "q2s" (g32, down g16) or "bfloat16"."""
    from moetier.core.layout import q2s_expert_format, raw_expert_format

    hidden, inter = hf_config["hidden_size"], hf_config["moe_intermediate_size"]
    if experts == "q2s":
        return q2s_expert_format(hidden, inter, False, 32, 16)
    if experts == "bfloat16":
        return raw_expert_format("bfloat16", hidden, inter, False)
    raise ValueError(f"synthetic experts are q2s or bfloat16, not {experts!r}")


def _meta_model(hf_config: dict[str, Any]) -> torch.nn.Module:
    """The transformers model of `hf_config` on the meta device (names and shapes only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if hf_config.get("model_type") != "qwen3_moe":
        raise ValueError("synthetic stores are written for qwen3_moe shapes only")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config))


def synthetic_store_bytes(hf_config: dict[str, Any], experts: str = "q2s") -> int:
    """Bytes `write_synthetic_store` writes for `hf_config`: bf16 dense tensors and one
    aligned blob per (layer, expert)."""
    from moetier.core.layout import align_up
    from moetier.quant.store import BLOB_ALIGN

    dense = sum(
        t.numel() * 2
        for name, t in _meta_model(hf_config).state_dict().items()
        if ".mlp.experts." not in name
    )
    blobs = hf_config["num_hidden_layers"] * hf_config["num_experts"]
    return dense + blobs * align_up(_expert_format(hf_config, experts).nbytes, BLOB_ALIGN)


def write_synthetic_store(
    dst: Path,
    hf_config: dict[str, Any],
    experts: str = "q2s",
    tokenizer_from: Path | None = None,
    seed: int = 0,
    distinct: int = 8,
    progress: bool = False,
    dense: DensePolicy | None = None,
) -> Path:
    """A moetier store of a qwen3_moe-shaped model with random weights, written directly:
    dense tensors random bf16, experts in `experts` form ("q2s" g32/down g16, or "bfloat16"),
    `distinct` random blobs repeated over all (layer, expert) slots, never an unquantized
    expert. For benchmarks at shapes no checkpoint is at hand for; `tokenizer_from` (a store or
    HF directory) lends its tokenizer files; `progress`: a progress bar of the layers written;
    `dense`: the dense classes' formats, as `moetier convert --dense` (quant/dense_formats.py)."""
    from safetensors.torch import save_file

    from moetier.core.layout import align_up
    from moetier.quant.store import (
        BLOB_ALIGN,
        DENSE_FILE,
        EXPERTS_FILE,
        INDEX_FILE,
        STORE_VERSION,
        blob_index_entry,
    )

    model = _meta_model(hf_config)
    fmt = _expert_format(hf_config, experts)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(hf_config, indent=1))
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer_from / name).exists():
                shutil.copyfile(tokenizer_from / name, dst / name)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, Any] = {}
    for name, tensor in model.state_dict().items():
        if ".mlp.experts." in name:
            continue
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(tensor.shape, dtype=torch.bfloat16)
            continue
        weight = (torch.randn(tensor.shape, generator=gen) * 0.02).to(torch.bfloat16)
        dense_fmt = dense.choose(name, tuple(tensor.shape)) if dense is not None else None
        if dense_fmt is None:
            tensors[name] = weight
            continue
        parts = dense_fmt.quantize(weight)
        for (part, _, _), value in zip(dense_fmt.tensors(name, weight.shape), parts, strict=True):
            tensors[part] = value
        quantized[name[: -len(".weight")]] = {
            "format": dense_fmt.to_json(),
            "class": dense_class(name),
            "shape": list(tensor.shape),
        }
    save_file(tensors, str(dst / DENSE_FILE))
    del tensors
    stride = align_up(fmt.nbytes, BLOB_ALIGN)
    blobs = []
    for _ in range(distinct):
        blob = torch.zeros(stride, dtype=torch.uint8)
        random_blob(fmt, gen, blob, fitted_grid=False)
        blobs.append(blob)
    layers, num_experts = hf_config["num_hidden_layers"], hf_config["num_experts"]
    index_blobs = []
    with open(dst / EXPERTS_FILE, "wb") as f:
        for layer in tqdm(range(layers), desc="layers", unit="layer", disable=not progress):
            for expert in range(num_experts):
                i = layer * num_experts + expert
                blob = blobs[i % distinct]
                f.write(blob.numpy().tobytes())
                index_blobs.append(blob_index_entry(layer, expert, i * stride, fmt, blob))
    index = {
        "version": STORE_VERSION,
        "model_type": "qwen3_moe",
        "source_dtype": "bfloat16",
        "alignment": BLOB_ALIGN,
        "formats": {fmt.name: fmt.to_json()},
        "moe_modules": {str(i): f"model.layers.{i}.mlp.experts" for i in range(layers)},
        "skipped_source_tensors": [],
        "blobs": index_blobs,
        "quantization": {"experts": experts, "synthetic": True},
    }
    if dense is not None:
        index["dense"] = {"policy": dense.to_json(), "tensors": quantized}
    (dst / INDEX_FILE).write_text(json.dumps(index))
    return dst
