"""The breadth path: a store's model as its transformers model class.

The class is built from the store's config on the meta device; dense tensors are assigned from
the memory-mapped `dense.safetensors` (on CPU at the checkpoint's dtype they stay views of the
mapping: no second host copy); the experts modules lose their 3-D parameters (never
materialised) and call moetier's experts op instead.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from moetier.config import EngineConfig
from moetier.loader.loaded_model import (
    LoadedModel,
    device_and_dtype,
    experts_runtime,
    load_progress,
    loaded_model,
    open_store,
)
from moetier.models.dense_linear import quantize_linears
from moetier.models.experts import (
    IMPLEMENTATION_NAME,
    ExpertsHandle,
    register_experts_implementation,
)
from moetier.quant.experts_probe import check_model_experts
from moetier.quant.store import DENSE_FILE, Store

EXPERT_PARAMS = (
    "gate_up_proj",
    "down_proj",
    "gate_up_proj_bias",
    "down_proj_bias",
    "up_proj",
    "up_proj_bias",
)


def load_transformers(
    store_path: str | Path, engine_config: EngineConfig, kv_positions: int | None = None
) -> LoadedModel:
    """The store's model as its transformers model class, moetier's experts op wired in."""
    from transformers import AutoConfig, AutoModelForCausalLM

    store = open_store(store_path, engine_config)
    device, dtype = device_and_dtype(store, engine_config)

    register_experts_implementation()
    hf_config = AutoConfig.from_pretrained(store.path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.set_experts_implementation(IMPLEMENTATION_NAME)
    model.eval()
    # the store may come from another moetier or transformers: check its experts compute again
    config = store.model_config
    check_model_experts(model, config.activation, config.expert_has_bias)

    experts_modules = _detach_experts(model, store)
    quantize_linears(model, store.dense_formats)  # quantized dense weights, stored dtypes (#52)
    _assign_dense(model, store.path / DENSE_FILE, device, dtype, skip=store.mtp_dense)
    _init_non_persistent_buffers(model, device)
    _check_nothing_on_meta(model)

    runtime = experts_runtime(store, engine_config, device, kv_positions)
    for layer, module in experts_modules.items():
        setattr(module, "moetier_experts", ExpertsHandle(runtime, layer))  # noqa: B010

    return loaded_model(model, store, runtime, engine_config, device, dtype)


def cache_argument(model: Any) -> str:
    """The name the transformers model's forward takes its KV cache by: transformers 5.24 renamed
    `past_key_values` to `cache` (the old name warns on every call); earlier releases of the
    supported range take only the old one."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _detach_experts(model: torch.nn.Module, store: Store) -> dict[int, torch.nn.Module]:
    """Remove the (meta) 3-D expert parameters; returns layer -> experts module."""
    modules = {}
    for layer, path in store.moe_modules.items():
        try:
            module = model.get_submodule(path)
        except AttributeError as err:
            raise ValueError(
                f"store names experts module {path} which the model does not have: "
                "convert the model again with this moetier version"
            ) from err
        for name in EXPERT_PARAMS:
            if name in module._parameters:
                del module._parameters[name]
        modules[layer] = module
    found = {name for name, m in model.named_modules() if hasattr(m, "is_concatenated")}
    if found != set(store.moe_modules.values()):
        raise ValueError(
            f"experts modules of the model {sorted(found)} differ from the store's "
            f"{sorted(store.moe_modules.values())}: convert the model again"
        )
    return modules


def _dtype_rule(model: Any, dtype: torch.dtype) -> Any:
    """key -> dtype for a floating tensor, as from_pretrained decides: the model's keep-in-fp32
    plan for this dtype first, else the dtype of the meta tensor built by from_config."""
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype)
    meta = model.state_dict()
    alternation, by_group, _ = build_glob_alternation(list(plan)) if plan else (None, {}, None)

    def rule(key: str) -> torch.dtype:
        match = alternation.search(key) if alternation is not None else None
        if match is None or match.lastgroup is None:
            return meta[key].dtype
        return plan[by_group[match.lastgroup]]

    return rule


def _assign_dense(
    model: torch.nn.Module,
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    skip: frozenset[str] = frozenset(),
) -> None:
    """Every tensor of the file but `skip` (the MTP layers', which the model has no place for)."""
    from safetensors import safe_open

    # Tied parameters are one Parameter under several names: assign it once, to all of them.
    aliases: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases[id(param)].append(name)
    names_of = {name: names for names in aliases.values() for name in names}
    state_names = set(model.state_dict())
    dtype_of = _dtype_rule(model, dtype)
    done: set[str] = set()
    with safe_open(str(path), framework="pt") as f:
        for key in load_progress(list(f.keys()), "loading weights"):
            if key in skip:
                continue
            if key not in state_names:
                raise ValueError(
                    f"{path.name} holds {key}, which the model does not have: "
                    "convert the model again with this moetier version"
                )
            tensor = f.get_tensor(key)  # a view of the memory-mapped file
            if tensor.is_floating_point():
                tensor = tensor.to(dtype_of(key))
            tensor = tensor.to(device)
            if key in names_of:
                param = torch.nn.Parameter(tensor, requires_grad=False)
                for alias in names_of[key]:
                    _set(model, alias, param, is_param=True)
                    done.add(alias)
            else:
                _set(model, key, tensor, is_param=False)
                done.add(key)
    missing = [n for n in names_of if n not in done] + [
        n for n in state_names if n not in names_of and n not in done
    ]
    if missing:
        raise ValueError(
            f"{path.name} lacks {len(missing)} tensor(s), e.g. {missing[:4]}: "
            "the store is incomplete, convert the model again"
        )


def _set(model: torch.nn.Module, name: str, value: torch.Tensor, *, is_param: bool) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if is_param:
        owner._parameters[leaf] = value  # type: ignore[assignment]
    else:
        owner._buffers[leaf] = value


def _init_non_persistent_buffers(model: Any, device: torch.device) -> None:
    """Non-persistent buffers (rotary inv_freq ...) are not in any checkpoint: recompute them
    with transformers' own initialiser, on modules that own no parameters."""
    owners: dict[str, list[str]] = defaultdict(list)
    for name, _ in model.named_non_persistent_buffers():
        owner_name, _, leaf = name.rpartition(".")
        owners[owner_name].append(leaf)
    for owner_name, leaves in owners.items():
        owner = model.get_submodule(owner_name) if owner_name else model
        if any(True for _ in owner.parameters()):
            raise ValueError(f"cannot initialise buffers of {owner_name}: it owns parameters")
        for leaf in leaves:
            buf = owner._buffers[leaf]
            owner._buffers[leaf] = torch.empty_like(buf, device=device)
        with torch.no_grad():
            model._init_weights(owner)


def _check_nothing_on_meta(model: torch.nn.Module) -> None:
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{len(left)} tensor(s) were never loaded, e.g. {left[:4]}")
