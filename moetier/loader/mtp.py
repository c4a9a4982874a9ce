"""The MTP layer of a native model (models/mtp.py), for speculative decoding: from the store's
own MTP tensors (a checkpoint that ships them, `model.layers.{num_hidden_layers}.*`, kept by
the converter: `--mtp`, on with --speculative-tokens) or from a file of them beside a store
without (`--mtp-file`, e.g. scripts/train_mtp.py's). The layer's block is the family's own
decoder layer at index num_hidden_layers, so its attention writes the cache's extra layer; where
the store keeps the layer's routed experts (DeepSeek-V3, GLM-4.x: an MoE block), they join the
main model's expert layers (the same tiers, the same runtime). Wired: qwen3_moe (dense block,
from a file), deepseek_v3, glm4_moe and glm_moe_dsa (GLM-5: the block runs its own indexer);
deepseek_v4 (its `mtp.` layout, hyper-connections) and Qwen3-Next / Qwen3.5 not yet."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetier.models.mtp import MTPLayer, module_name
from moetier.quant.store import DENSE_FILE, Store

MTP_FAMILIES = (
    "qwen3_moe",
    "deepseek_v3",
    "glm4_moe",
    "glm_moe_dsa",
)  # whose MTP block is built here


def attach_mtp(
    model: Any,
    store: Store,
    mtp_file: str,
    device: torch.device,
    dtype: torch.dtype,
    keep_fp32: tuple[str, ...] = (),
) -> None:
    """Build `model.mtp` from `mtp_file` (or the store's MTP tensors where it is empty); a
    ValueError that says what to do where neither has one or the family is not wired. Call
    before the experts runtime is built: the store's MTP experts join its expert layers."""
    from safetensors import safe_open

    config = model.config
    layer = config.num_layers
    prefix = f"model.layers.{layer}."
    path = Path(mtp_file) if mtp_file else store.path / DENSE_FILE
    if mtp_file and not path.is_file():
        raise ValueError(f"--mtp-file {mtp_file}: no such file")
    with safe_open(str(path), framework="pt") as f:
        keys = [k for k in f.keys() if k.startswith(prefix)]
        if not keys:
            where = path.name if mtp_file else "this store"
            raise ValueError(
                f"{where} has no MTP layer (no {prefix}* tensors): give --mtp-file (an MTP "
                "layer trained for this model, scripts/train_mtp.py) or convert a checkpoint "
                "that ships one"
            )
        if config.model_type not in MTP_FAMILIES:
            raise ValueError(
                f"speculative decoding with {config.model_type}'s MTP layer is not wired yet "
                f"(only {', '.join(MTP_FAMILIES)})"
            )
        routed = not mtp_file and layer in store.mtp_modules
        block_config = config
        if routed:  # an MoE block whose experts are the store's MTP blobs
            block_config = dataclasses.replace(config, moe_layers=(*config.moe_layers, layer))
        own_head = f"{prefix}shared_head.head.weight" in keys
        with torch.device("meta"):  # every tensor comes from the file (assign below)
            new_layer = getattr(model, "new_layer", None) or type(model.model.layers[0])
            block = new_layer(block_config, layer)
            mtp = MTPLayer(block, config.hidden_size, config.vocab_size, config.rms_norm_eps,
                           own_head)  # fmt: skip
        state = {}
        for key in keys:
            name = module_name(key, prefix)
            if name is not None:
                tensor = f.get_tensor(key)
                if tensor.is_floating_point():
                    tensor = tensor.to(torch.float32 if key.endswith(keep_fp32) else dtype)
                state[name] = tensor
    missing, unexpected = mtp.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"{path.name}'s MTP layer does not match the model (missing {missing[:4]}, "
            f"unexpected {unexpected[:4]})"
        )
    for module in mtp.modules():
        fuse = getattr(module, "fuse_qkv", None)
        if fuse is not None and isinstance(getattr(module, "q_proj", None), nn.Linear):
            fuse()
    model.mtp = mtp.to(device).eval().requires_grad_(False)
    if routed:  # the MTP layer's experts join the main model's (residency, runtime, plans)
        store.adopt_mtp_experts(layer)
