"""What a loaded model is (`LoadedModel`, as the engine takes it) and the parts both model paths
(the transformers class in hf_model.py, a native model file in native.py) build it from: the
device and dtype, the experts runtime over the slot pool, the store's tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetier.config import COMPUTE_DTYPES, EngineConfig, ModelConfig
from moetier.core.layout import DTYPES
from moetier.models.experts import ExpertShard, ExpertsRuntime
from moetier.models.host_embedding import embeddings_to_host
from moetier.quant.store import Store, tokenizer_files
from moetier.quant.verify import FirstReadCheck, check_files
from moetier.residency.disk import DiskReader
from moetier.residency.slot_pool import SlotPool, make_policy


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel
    tokenizer: Any  # a transformers tokenizer
    store: Store
    runtime: ExpertsRuntime
    model_config: ModelConfig
    engine_config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    name: str


def loaded_model(
    model: Any,
    store: Store,
    runtime: ExpertsRuntime,
    engine_config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> LoadedModel:
    """A built model with its store's tokenizer, as the engine takes it; with
    `--embeddings host` its embedding table moved into pinned host RAM first."""
    from transformers import AutoTokenizer

    if engine_config.embeddings == "host":
        embeddings_to_host(model, device)
    elif engine_config.embeddings != "gpu":
        raise ValueError(f"--embeddings {engine_config.embeddings!r}: use gpu or host")

    if runtime.gate is not None and runtime.gate.needs_router:  # --delta entropy / margin
        from moetier.models.experts import router_weights

        runtime.gate.set_routers(router_weights(model, store.moe_layers)[0])
    check_tokenizer(store.path)
    tokenizer = AutoTokenizer.from_pretrained(store.path)
    return LoadedModel(
        model,
        tokenizer,
        store,
        runtime,
        store.model_config,
        engine_config,
        device,
        dtype,
        store.path.name,
    )


def open_store(store_path: str | Path, engine_config: EngineConfig) -> Store:
    """The store the loaders read, its dense.safetensors checked against the index's checksums
    first with `engine_config.verify` (the load reads all its bytes anyway)."""
    store = Store(store_path)
    if engine_config.verify:
        seconds = check_files(store)
        logging.getLogger(__name__).debug("dense weights' checksums checked in %.3f s", seconds)
    return store


def check_tokenizer(store_path: str | Path) -> None:
    """ValueError naming the store and what to do where it has no tokenizer files: transformers
    would build an empty tokenizer from tokenizer_config.json alone (every prompt "empty", a
    server answering nothing)."""
    if not tokenizer_files(Path(store_path)):
        raise ValueError(
            f"{store_path} has no tokenizer files (tokenizer.json, tokenizer.model, *.tiktoken, "
            "vocab.json or vocab.txt): copy the original model's into it, or convert the model "
            "again with --tokenizer PATH naming a folder that has them"
        )


def load_progress(items: list[Any], desc: str) -> Any:
    """`items`, iterated under a progress bar on stderr where it is a terminal (cleared when
    done)."""
    import sys

    from tqdm import tqdm

    return tqdm(items, desc=desc, leave=False, disable=not sys.stderr.isatty())


def device_and_dtype(store: Store, engine_config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The device and compute dtype the model loads on (--device, --dtype; ValueError for one
    this machine lacks or a dtype the model cannot compute in)."""
    device = torch.device(engine_config.resolved_device())
    dtype_name = engine_config.resolved_dtype(store.source_dtype)
    if dtype_name not in COMPUTE_DTYPES:  # auto: the store's dtype, which should be one
        raise ValueError(
            f"{store.path}: its dtype {dtype_name!r} is not one the model computes in: give "
            f"--dtype {' or '.join(COMPUTE_DTYPES)}"
        )
    return device, DTYPES[dtype_name]


def experts_runtime(
    store: Store,
    engine_config: EngineConfig,
    device: torch.device,
    kv_positions: int | None = None,
    shard: ExpertShard | None = None,
) -> ExpertsRuntime:
    """The slot pool (sized by the engine config's budget, after `kv_positions` of KV cache:
    default the planner's one 4096-token sequence) and the experts runtime over it. `shard`
    (expert parallel): this rank's experts only, in its slots and host tier; budgets per rank."""
    budget = int(engine_config.expert_cache_mb * 2**20)
    ranks = shard.ranks if shard is not None else 1
    if engine_config.gpu_memory:
        import sys

        from moetier.residency.planner import parse_bytes, plan

        host_budget = parse_bytes(engine_config.host_memory) if engine_config.host_memory else 0
        placement = plan(
            store,
            parse_bytes(engine_config.gpu_memory),
            host_budget,
            **kv_plan_arguments(kv_positions),
            embeddings_host=engine_config.embeddings == "host",
            ranks=ranks,
        )
        print(placement.render(), file=sys.stderr)
        budget = max(1, placement.gpu_expert_bytes)
    # each blob's crc32 checked the first time a tier reads it (quant/verify.py)
    check = FirstReadCheck(store) if engine_config.verify else None
    host = None
    if engine_config.host_memory:
        from moetier.residency.host_tier import HostTier
        from moetier.residency.planner import parse_bytes

        host = HostTier.for_budget(
            store,
            parse_bytes(engine_config.host_memory),
            exclude=_not_owned(store, shard),
            check=check,
            progress=load_progress,
        )
    max_slots = engine_config.expert_cache_slots
    if shard is not None:  # room for this rank's blobs at most
        owned = len(store.blobs) - len(_not_owned(store, shard))
        max_slots = min(max_slots, owned) if max_slots > 0 else owned
    residency = SlotPool.for_budget(
        store,
        device,
        budget,
        max_slots,
        make_policy(engine_config.cache_policy, len(store.moe_layers)),
        DiskReader.for_store(store) if engine_config.expert_reads == "direct" else None,
        host,
        check,
    )
    formats = {layer: store.blob_format(layer) for layer in store.moe_layers}
    delta_formats = (
        {layer: store.blob_format(layer, "delta") for layer in store.moe_layers}
        if store.has_plane("delta")
        else {}
    )
    runtime = ExpertsRuntime(
        residency,
        formats,
        store.model_config.activation,
        delta_formats,
        engine_config.delta_threshold(),
    )
    if shard is not None:
        runtime.set_shard(shard)
    rule = engine_config.delta_rule()
    if rule is not None and not rule.everywhere and runtime.delta_threshold is not None:
        # every rule but all / none, weight:T too: forced rows (grammar-constrained output,
        # the quality meter's twin) take the delta whatever the rule
        from moetier.gate.state import Gate

        runtime.gate = Gate(rule, store.path, str(device), moe_layers=list(runtime.formats))
    share = engine_config.cpu_share()
    if share is not None:  # hybrid misses (--cpu-experts)
        import sys

        from moetier.residency.hybrid_split import describe

        hybrid = runtime.enable_hybrid(None if share < 0 else share, engine_config.cpu_threads)
        if hybrid.speeds is not None:
            print(describe(hybrid.speeds), file=sys.stderr)
    return runtime


def _not_owned(store: Store, shard: ExpertShard | None) -> set[tuple[int, int, str]]:
    """The store's blobs of experts another rank owns (none without a shard)."""
    if shard is None:
        return set()
    owned = {layer: set(experts) for layer, experts in shard.owned.items()}
    return {key for key in store.blobs if key[1] not in owned.get(key[0], ())}


def kv_plan_arguments(kv_positions: int | None) -> dict[str, int]:
    """The planner's KV arguments for a cache of `kv_positions` positions (None: its default)."""
    return {} if kv_positions is None else {"max_context": kv_positions, "batch": 1}
