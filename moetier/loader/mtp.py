"""The MTP layer of a native model (models/mtp.py), for speculative decoding: from the store's
own MTP tensors (a checkpoint that ships them: `model.layers.{num_hidden_layers}.*`, kept by
the converter) or from a file of them beside a store without (`--mtp-file`, e.g.
scripts/train_mtp.py's). The layer's block is the family's own decoder layer at index
num_hidden_layers (so its attention writes the cache's extra layer); families whose MTP block
is an MoE layer (DeepSeek, GLM) are not wired yet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetier.models.mtp import MTPLayer, module_name
from moetier.quant.store import DENSE_FILE, Store

MTP_FAMILIES = ("qwen3_moe",)  # whose MTP block (a dense decoder layer) is built here


def attach_mtp(
    model: Any, store: Store, mtp_file: str, device: torch.device, dtype: torch.dtype
) -> None:
    """Build `model.mtp` from `mtp_file` (or the store's MTP tensors where it is empty); a
    ValueError that says what to do where neither has one or the family is not wired."""
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
        block = type(model.model.layers[0])(config, layer)
        own_head = f"{prefix}shared_head.head.weight" in keys
        mtp = MTPLayer(block, config.hidden_size, config.vocab_size, config.rms_norm_eps,
                       own_head)  # fmt: skip
        state = {}
        for key in keys:
            name = module_name(key, prefix)
            if name is not None:
                state[name] = f.get_tensor(key).to(dtype)
    missing, unexpected = mtp.load_state_dict(state, strict=False)
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
