"""Build a runnable model from a moetier store: the engine config checked before any weight is
read, then the native model file of its model_type (`--native`, native.py) or the transformers
model class (hf_model.py)."""

from __future__ import annotations

from pathlib import Path

from moetier.config import EngineConfig
from moetier.loader.hf_model import load_transformers
from moetier.loader.loaded_model import LoadedModel
from moetier.loader.native import load_native
from moetier.quant.store import Store
from moetier.residency.slot_pool import make_policy


def load_model(store_path: str | Path, engine_config: EngineConfig | None = None) -> LoadedModel:
    """The model of a store: the transformers model class, or with `engine_config.native` the
    native model file of its model_type (loader/native.py)."""
    engine_config = engine_config or EngineConfig()
    check_engine_config(store_path, engine_config)
    if engine_config.native:
        return load_native(store_path, engine_config)
    return load_transformers(store_path, engine_config)


def check_engine_config(store_path: str | Path, engine_config: EngineConfig) -> None:
    """Fail on a bad cache policy or a --gpu-memory the dense part does not fit, before any
    weight is loaded."""
    make_policy(engine_config.cache_policy)
    if engine_config.expert_reads not in ("mmap", "direct"):
        raise ValueError(f"--expert-reads {engine_config.expert_reads!r}: use mmap or direct")
    if engine_config.gpu_memory or engine_config.host_memory:
        from moetier.residency.planner import parse_bytes, plan

        host = parse_bytes(engine_config.host_memory) if engine_config.host_memory else 0
        if engine_config.gpu_memory:
            plan(Store(store_path), parse_bytes(engine_config.gpu_memory), host)
