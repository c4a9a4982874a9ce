"""Build a runnable model from a moetier store: the engine config checked before any weight is
read, then the native model file of its model_type (`--native`, native.py) or the transformers
model class (hf_model.py)."""

from __future__ import annotations

from pathlib import Path

from moetier.config import EngineConfig
from moetier.loader.hf_model import load_transformers
from moetier.loader.loaded_model import LoadedModel, check_tokenizer, kv_plan_arguments
from moetier.loader.native import has_native_file, load_native
from moetier.models.experts import ExpertShard
from moetier.quant.store import Store
from moetier.quant.verify import dense_problem
from moetier.residency.slot_pool import make_policy


def load_model(
    store_path: str | Path,
    engine_config: EngineConfig | None = None,
    kv_positions: int | None = None,
    shard: ExpertShard | None = None,
) -> LoadedModel:
    """The model of a store: with `engine_config.native` (the default) the native model file of
    its model_type where it has one (loader/native.py), else the transformers model class.
    kv_positions: the KV cache the --gpu-memory plan sets aside (default: one 4096-token
    sequence; the server's page pool). shard: expert parallel (moetier/parallel), this rank's
    experts only; native model files only. With `engine_config.verify`, dense.safetensors'
    bytes are checked against the index's checksums before any weight loads (open_store)."""
    engine_config = engine_config or EngineConfig()
    ranks = shard.ranks if shard is not None else 1
    check_engine_config(store_path, engine_config, kv_positions, ranks)
    if engine_config.native and has_native_file(store_path):
        return load_native(store_path, engine_config, kv_positions, shard)
    if shard is not None:
        raise ValueError(
            "expert parallel (--gpus N) runs native model files: this store's family has none "
            "(or --no-native was given); run it with --gpus 1"
        )
    return load_transformers(store_path, engine_config, kv_positions)


def check_engine_config(
    store_path: str | Path,
    engine_config: EngineConfig,
    kv_positions: int | None = None,
    ranks: int = 1,
) -> None:
    """Fail on a path that is not a store, a dense.safetensors whose header cannot be read, a
    store without tokenizer files, a --device this machine lacks, a --dtype the model cannot
    compute in, a negative cache size, slot cap, staging or thread count, a bad cache policy or
    a --gpu-memory the dense part and `kv_positions` of KV cache do not fit (on each of `ranks`
    GPUs), before any weight is loaded."""
    Store.check_path(store_path)
    for flag, value, zero in (
        ("--expert-cache-mb", engine_config.expert_cache_mb, "room for every expert"),
        ("--expert-cache-slots", engine_config.expert_cache_slots, "no cap"),
        ("--zero-copy-stage", engine_config.zero_copy_stage, "off"),
        ("--cpu-threads", engine_config.cpu_threads, "every core"),
    ):
        if value < 0:
            raise ValueError(f"{flag} {value:g}: give 0 ({zero}) or more")
    engine_config.check_device_and_dtype()
    native_only = engine_config.native_only_flags()
    if native_only and not (engine_config.native and has_native_file(store_path)):
        how = "--no-native" if not engine_config.native else "this family has no native file"
        raise ValueError(
            f"{', '.join(native_only)}: only the native model files read "
            f"{'it' if len(native_only) == 1 else 'them'}, and this run uses the transformers "
            f"model class ({how}, docs/models.md): drop {'it' if len(native_only) == 1 else 'them'}"
        )
    problem = dense_problem(store_path)  # (safetensors' own error would be a traceback)
    if problem is not None:
        raise ValueError(problem)
    check_tokenizer(store_path)  # (also where it loads: here before any weight is read)
    make_policy(engine_config.cache_policy)
    if engine_config.expert_reads not in ("mmap", "direct"):
        raise ValueError(f"--expert-reads {engine_config.expert_reads!r}: use mmap or direct")
    if engine_config.gpu_memory or engine_config.host_memory:
        from moetier.residency.planner import parse_bytes, plan

        host = parse_bytes(engine_config.host_memory) if engine_config.host_memory else 0
        if engine_config.gpu_memory:
            kv = kv_plan_arguments(kv_positions)
            embeddings_host = engine_config.embeddings == "host"
            plan(Store(store_path), parse_bytes(engine_config.gpu_memory), host, **kv,
                 embeddings_host=embeddings_host, ranks=ranks)  # fmt: skip
