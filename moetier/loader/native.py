"""Build a native model file (models/<model_type>.py) from a moetier store.

The model is built on the meta device from the normalised DecoderConfig; its parameters are
assigned by name from the store's memory-mapped dense.safetensors (HF names verbatim; on CPU at
the checkpoint's dtype they stay views of the mapping); routed experts run through the same
ExpertsRuntime and SlotPool as the transformers path. The default where a family has one
(`EngineConfig.native`; --no-native opts out).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetier.config import DecoderConfig, EngineConfig
from moetier.loader.loaded_model import (
    LoadedModel,
    device_and_dtype,
    experts_runtime,
    load_progress,
    loaded_model,
    open_store,
)
from moetier.models import glm4_moe, glm_moe_dsa, gpt_oss, minimax_m2
from moetier.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3MoE
from moetier.models.deepseek_v4 import KEEP_FP32 as DEEPSEEK_V4_FP32
from moetier.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4MoE
from moetier.models.deepseek_v4 import setup as deepseek_v4_setup
from moetier.models.dense_linear import fuse_dense_qkv, quantize_linears
from moetier.models.experts import ExpertShard
from moetier.models.layers import Attention, RotaryEmbedding
from moetier.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock
from moetier.quant.store import DENSE_FILE, Store


@dataclass(frozen=True)
class NativeFamily:
    model_class: type[nn.Module]
    hf_rotary_class: str  # transformers' rotary module of the family: the rope's one source
    moe_block_class: type[nn.Module]  # its MoE blocks, whose `experts` the loader wires
    # parameter names ending so stay fp32 at any --dtype (transformers' keep-in-fp32 list)
    keep_fp32: tuple[str, ...] = ()
    # (config, rotary) from the HF config where DecoderConfig and one rotary do not fit
    setup: Callable[[Any], tuple[Any, nn.Module]] | None = None
    # keyword arguments of the model class beside (DecoderConfig, rotary), from the HF config
    model_kwargs: Callable[[Any], dict[str, Any]] | None = None


NATIVE_FAMILIES = {
    "qwen3_moe": NativeFamily(Qwen3MoeForCausalLM, "Qwen3MoeRotaryEmbedding", SparseMoeBlock),
    "deepseek_v3": NativeFamily(
        DeepseekV3ForCausalLM,
        "DeepseekV3RotaryEmbedding",
        DeepseekV3MoE,
        keep_fp32=("e_score_correction_bias",),
    ),
    "deepseek_v4": NativeFamily(
        DeepseekV4ForCausalLM,
        "DeepseekV4RotaryEmbedding",
        DeepseekV4MoE,
        keep_fp32=DEEPSEEK_V4_FP32,
        setup=deepseek_v4_setup,
    ),
    "glm_moe_dsa": NativeFamily(
        glm_moe_dsa.GlmMoeDsaForCausalLM,
        "GlmMoeDsaRotaryEmbedding",
        DeepseekV3MoE,
        keep_fp32=("e_score_correction_bias", "mlp.gate.weight", "indexer.weights_proj.weight"),
        model_kwargs=glm_moe_dsa.model_kwargs,
    ),
    "glm4_moe": NativeFamily(
        glm4_moe.Glm4MoeForCausalLM,
        "Glm4MoeRotaryEmbedding",
        glm4_moe.Glm4MoeMoE,
        keep_fp32=("e_score_correction_bias", "mlp.gate.weight"),
        model_kwargs=glm4_moe.model_kwargs,
    ),
    "minimax_m2": NativeFamily(
        minimax_m2.MiniMaxM2ForCausalLM,
        "MiniMaxM2RotaryEmbedding",
        minimax_m2.MiniMaxM2SparseMoeBlock,
        keep_fp32=minimax_m2.KEEP_FP32,
    ),
    "gpt_oss": NativeFamily(
        gpt_oss.GptOssForCausalLM,
        "GptOssRotaryEmbedding",
        gpt_oss.GptOssMLP,
        setup=gpt_oss.setup,
        model_kwargs=gpt_oss.model_kwargs,
    ),
}


def has_native_file(store_path: str | Path) -> bool:
    """Whether the store's model_type has a native model file."""
    from transformers import AutoConfig

    Store.check_path(store_path)  # (not Store(): the loader parses the whole index once)
    return AutoConfig.from_pretrained(store_path).model_type in NATIVE_FAMILIES


def load_native(
    store_path: str | Path,
    engine_config: EngineConfig,
    kv_positions: int | None = None,
    shard: ExpertShard | None = None,
) -> LoadedModel:
    """The native model of the store's model_type; ValueError if that family has none.
    `shard`: expert parallel, this rank's experts only (loaded_model.experts_runtime)."""
    from transformers import AutoConfig

    store = open_store(store_path, engine_config)
    device, dtype = device_and_dtype(store, engine_config)
    hf_config = AutoConfig.from_pretrained(store.path)
    family = NATIVE_FAMILIES.get(hf_config.model_type)
    if family is None:
        raise ValueError(
            f"no native model file for {hf_config.model_type!r} (native: "
            f"{', '.join(NATIVE_FAMILIES)}): run it with --no-native"
        )
    config: Any
    if family.setup is not None:
        config, rotary = family.setup(hf_config)
    else:
        config = DecoderConfig.from_transformers(hf_config)
        rotary = RotaryEmbedding(*_rope(hf_config, family))
    if set(config.moe_layers) != set(store.moe_layers):
        raise ValueError(
            f"the config's MoE layers {config.moe_layers} differ from the store's "
            f"{store.moe_layers}: convert the model again"
        )
    rotary = rotary.to(device)
    kwargs = family.model_kwargs(hf_config) if family.model_kwargs else {}
    with torch.device("meta"):
        model = family.model_class(config, rotary, **kwargs)
    model.get_submodule(
        "model"
    ).rotary_emb = rotary  # built off meta: it holds the computed frequencies
    stored = quantize_linears(model, store.dense_formats)  # quantized dense weights (#52)
    _assign_by_name(
        model,
        store.path / DENSE_FILE,
        device,
        dtype,
        config.tie_word_embeddings,
        family.keep_fp32,
        stored=frozenset(stored),
        skip=store.mtp_dense,
    )
    for module in model.modules():
        if isinstance(module, Attention) and isinstance(module.q_proj, nn.Linear):
            module.fuse_qkv()
        elif isinstance(module, Attention):  # quantized q/k/v: one GEMV where they fuse
            fused = fuse_dense_qkv([module.q_proj, module.k_proj, module.v_proj])
            object.__setattr__(module, "qkv_proj", fused)  # not registered: no second name
    model.eval()

    if engine_config.mtp or engine_config.mtp_file:  # speculative decoding's drafter
        from moetier.loader.mtp import attach_mtp

        attach_mtp(model, store, engine_config.mtp_file, device, dtype, family.keep_fp32)
    runtime = experts_runtime(store, engine_config, device, kv_positions, shard)
    for module in model.modules():
        if isinstance(module, family.moe_block_class):
            setattr(module, "experts", runtime.forward)  # noqa: B010
            setattr(module, "after_residual", runtime.after_layer)  # noqa: B010
            runtime.layer_outputs = True
    return loaded_model(model, store, runtime, engine_config, device, dtype)


def _rope(hf_config: Any, family: NativeFamily) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) as transformers' own rotary module computes them."""
    module = importlib.import_module(
        f"transformers.models.{hf_config.model_type}.modeling_{hf_config.model_type}"
    )
    with torch.device("cpu"):
        hf_rotary = getattr(module, family.hf_rotary_class)(config=hf_config)
    return hf_rotary.inv_freq, float(hf_rotary.attention_scaling)


def _assign_by_name(
    model: nn.Module,
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    tied: bool,
    keep_fp32: tuple[str, ...] = (),
    stored: frozenset[str] = frozenset(),
    skip: frozenset[str] = frozenset(),
) -> None:
    """Every parameter from the file tensor of the same name (cast to `dtype` if floating, to
    fp32 if its name ends with one of `keep_fp32`; those in `stored`, quantized dense weights
    and their scales, as they are); ValueError for a file tensor the model lacks
    or a parameter the file lacks. File tensors in `skip` (MTP layers') are left alone."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    done: set[str] = set()
    with safe_open(str(path), framework="pt") as f:
        for key in load_progress(list(f.keys()), "loading weights"):
            if key in skip:
                continue
            if key not in params:
                raise ValueError(
                    f"{path.name} holds {key}, which the native model does not have: "
                    "convert the model again with this moetier version"
                )
            tensor = f.get_tensor(key)  # a view of the memory-mapped file
            if tensor.is_floating_point() and key not in stored:
                tensor = tensor.to(torch.float32 if key.endswith(keep_fp32) else dtype)
            _set_param(model, key, nn.Parameter(tensor.to(device), requires_grad=False))
            done.add(key)
    if tied and "lm_head.weight" not in done:
        _set_param(model, "lm_head.weight", model.get_parameter("model.embed_tokens.weight"))
        done.add("lm_head.weight")
    missing = sorted(set(params) - done)
    if missing:
        raise ValueError(
            f"{path.name} lacks {len(missing)} tensor(s), e.g. {missing[:4]}: "
            "the store is incomplete, convert the model again"
        )


def _set_param(model: nn.Module, name: str, param: nn.Parameter) -> None:
    owner_name, _, leaf = name.rpartition(".")
    model.get_submodule(owner_name)._parameters[leaf] = param
