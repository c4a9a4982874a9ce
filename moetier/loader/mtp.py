"""The MTP layer of a native model (models/mtp.py), for speculative decoding: from the store's
own MTP tensors (a checkpoint that ships them, `model.layers.{num_hidden_layers}.*`, kept by
the converter: `--mtp`, on with --speculative-tokens) or from a file of them beside a store
without (`--mtp-file`, e.g. scripts/train_mtp.py's). The layer's block is the family's own
decoder layer at index num_hidden_layers, so its attention writes the cache's extra layer; where
the store keeps the layer's routed experts (DeepSeek-V3, GLM-4.x, DeepSeek-V4: an MoE block),
they join the main model's expert layers (the same tiers, the same runtime). Wired: qwen3_moe
(dense block, from a file), deepseek_v3, glm4_moe and glm_moe_dsa (GLM-5: the block runs its own
indexer), deepseek_v4 (models/mtp_deepseek_v4.py: the store's `mtp.0.*`, its block's names
mapped by transformers' own deepseek_v4 renames, its attention type from config.json's
`compress_ratios[num_hidden_layers]`; the main model then hands on its hyper-connection
streams); Qwen3-Next / Qwen3.5 not yet."""

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
    "deepseek_v4",
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
    if config.model_type == "deepseek_v4":
        _attach_deepseek_v4(model, store, mtp_file, device, dtype, keep_fp32)
        return
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
        names = {key: name for key in keys if (name := module_name(key, prefix)) is not None}
        state = _read_state(f, names, dtype, keep_fp32)
    missing, unexpected = mtp.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"{path.name}'s MTP layer does not match the model (missing {missing[:4]}, "
            f"unexpected {unexpected[:4]})"
        )
    # on the device first: fuse_qkv's [q; k; v] is a plain attribute, which `.to` would not move
    mtp = mtp.to(device).eval().requires_grad_(False)
    for module in mtp.modules():
        fuse = getattr(module, "fuse_qkv", None)
        if fuse is not None and isinstance(getattr(module, "q_proj", None), nn.Linear):
            fuse()
    model.mtp = mtp
    if routed:  # the MTP layer's experts join the main model's (residency, runtime, plans)
        store.adopt_mtp_experts(layer)


def deepseek_v4_kind(hf_config: dict[str, Any], layer: int) -> str:
    """DeepSeek-V4's MTP layer `layer` (= num_hidden_layers + i) attends as DeepSeek's code
    builds layer `layer`: `compress_ratios[layer]` of the release's config.json (0: sliding
    window, 4: CSA, 128: HCA). transformers' config keeps only the decoder's entries, so the
    raw list is read; a ValueError where it has no entry for the layer."""
    from moetier.models.deepseek_v4_attention import CSA, HCA, SLIDING

    ratios = hf_config.get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) <= layer:
        have = f"{len(ratios)} entries" if isinstance(ratios, list) else "none"
        raise ValueError(
            f"config.json does not say which attention DeepSeek-V4's MTP layer {layer} uses: "
            f"its compress_ratios has {have}, and DeepSeek's code reads compress_ratios[{layer}] "
            "(the releases list num_hidden_layers + 1, the MTP layer's last); add that entry "
            "to the store's config.json (the release's value) to draft with it"
        )
    kinds = {0: SLIDING, 4: CSA, 128: HCA}  # (transformers' mapping of the ratios)
    ratio = int(ratios[layer])
    if ratio not in kinds:
        raise ValueError(f"DeepSeek-V4's MTP layer {layer}: compress ratio {ratio} is not known")
    return kinds[ratio]


def deepseek_v4_names(keys: list[str], prefix: str, layer: int) -> dict[str, str]:
    """Checkpoint keys of DeepSeek-V4's MTP layer (`prefix` = `mtp.{i}.`) -> names in
    DeepseekV4MTPLayer: its own tensors (mtp_deepseek_v4.OWN), the block's by transformers'
    own deepseek_v4 renames of a main layer's tensor of the same name (`attn.wq_a` ->
    `self_attn.q_a_proj`, `hc_attn_fn` -> `attn_hc.fn`, ...); copies of the embedding left
    out."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from moetier.models.mtp_deepseek_v4 import OWN, SHARED_COPIES

    transforms = get_checkpoint_conversion_mapping("deepseek_v4") or []
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    stem = f"layers.{layer}."
    names = {}
    for key in keys:
        rest = key[len(prefix) :]
        if rest in OWN:
            names[key] = OWN[rest]
        elif not rest.startswith(SHARED_COPIES):
            target, _ = rename_source_key(stem + rest, renamings, converters)
            names[key] = "block." + target.removeprefix(stem)
    return names


def _attach_deepseek_v4(
    model: Any,
    store: Store,
    mtp_file: str,
    device: torch.device,
    dtype: torch.dtype,
    keep_fp32: tuple[str, ...],
) -> None:
    """attach_mtp for DeepSeek-V4 (models/mtp_deepseek_v4.py): the store's MTP layer 0."""
    from safetensors import safe_open

    from moetier.models.deepseek_v4 import DecoderLayer
    from moetier.models.mtp_deepseek_v4 import DeepseekV4MTPLayer, block_config

    config = model.config
    layer = config.num_layers
    if mtp_file:
        raise ValueError(
            "--mtp-file is not supported for deepseek_v4: its MTP layer is an MoE block whose "
            "routed experts must be store blobs; convert a checkpoint that ships `mtp.0.*` "
            "and load it with --mtp"
        )
    prefix = store.mtp_layers.get(layer)
    if prefix is None or layer not in store.mtp_modules:
        raise ValueError(
            "this store has no DeepSeek-V4 MTP layer (no mtp.0.* tensors with routed experts): "
            "convert a checkpoint that ships one (the releases do) to draft with it"
        )
    kind = deepseek_v4_kind(store.hf_config, layer)
    with safe_open(str(store.path / DENSE_FILE), framework="pt") as f:
        keys = [k for k in f.keys() if k.startswith(prefix)]
        names = deepseek_v4_names(keys, prefix, layer)
        own_head = "head.weight" in names.values()
        with torch.device("meta"):  # every tensor comes from the store (assign below)
            block = DecoderLayer(block_config(config, kind), layer)
            mtp = DeepseekV4MTPLayer(block, config, own_head)
        state = _read_state(f, names, dtype, keep_fp32)
    missing, unexpected = mtp.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"the store's DeepSeek-V4 MTP layer ({prefix}*) does not match the model's "
            f"{kind} block (missing {missing[:4]}, unexpected {unexpected[:4]})"
        )
    model.mtp = mtp.to(device).eval().requires_grad_(False)
    model.feed_mtp((kind,))
    store.adopt_mtp_experts(layer)  # its experts join the main model's (residency, runtime)


def _read_state(
    f: Any, names: dict[str, str], dtype: torch.dtype, keep_fp32: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """The tensors `names` maps (checkpoint key -> module name) from the open safetensors
    file `f`, floating ones in `dtype` (float32 where the name ends with a `keep_fp32`
    suffix)."""
    state = {}
    for key, name in names.items():
        tensor = f.get_tensor(key)
        if tensor.is_floating_point():
            tensor = tensor.to(torch.float32 if name.endswith(keep_fp32) else dtype)
        state[name] = tensor
    return state
