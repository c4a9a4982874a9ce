"""The placement planner: byte arithmetic against hand-computed values, refusals, and the
engine's --gpu-memory sizing the expert cache without changing numerics."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open

from moetier.config import EngineConfig
from moetier.core.layout import TENSOR_ALIGN, align_up
from moetier.loader.load import load_model
from moetier.quant.store import DENSE_FILE, Store
from moetier.residency.planner import WORKSPACE_BYTES, parse_bytes, plan

MIB = 2**20


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2**30 == parse_bytes("24g")
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5MiB") == 3 * 2**19
    assert parse_bytes("0") == 0
    with pytest.raises(ValueError, match="not a memory size: write e.g. 24GiB"):
        parse_bytes("lots")


@pytest.fixture()
def store(tiny):
    return Store(tiny.store("qwen3_moe"))


def test_split_by_hand(store):
    cfg = store.model_config
    with safe_open(str(store.path / DENSE_FILE), framework="pt") as f:
        dense = 2 * sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    kv = cfg.num_layers * cfg.kv_width * 256 * 2 * 2  # 256 tokens, batch 2, bf16
    slot = align_up(max(e.nbytes for e in store.blobs.values()), TENSOR_ALIGN)
    gpu = dense + kv + WORKSPACE_BYTES + 5 * slot + slot // 2  # room for 5 slots
    p = plan(store, gpu, host_memory=3 * slot, max_context=256, batch=2)
    assert (p.dense_bytes, p.kv_bytes, p.slot_bytes) == (dense, kv, slot)
    assert (p.gpu_base_slots, p.gpu_delta_slots, p.host_blobs) == (5, 0, 3)
    assert p.blobs_per_token == len(store.moe_layers) * cfg.top_k
    pcie, disk = p.traffic_per_token(0.5)
    assert pcie == pytest.approx(p.blobs_per_token * 0.5 * slot)
    off_gpu = p.base_blobs - 5
    assert disk == pytest.approx(pcie * (1 - 3 / off_gpu))
    assert p.traffic_per_token(1.0) == (0, 0)
    assert "5 of 16 base blobs" in p.render()
    everything = plan(store, gpu + 100 * slot, max_context=256, batch=2)
    assert "no expert traffic" in everything.render()
    # zero-copy staging: at most a quarter of the GPU slots (here 8 of the 16 base blobs' slots,
    # 2 MoE layers: 1 per layer), none without a host tier or when every expert is pinned
    big = gpu + 3 * slot
    staged = plan(store, big, host_memory=3 * slot, max_context=256, batch=2, zero_copy_stage=3)
    assert staged.gpu_base_slots == 8 and (staged.stage, staged.staging) == (1, 2)
    assert "2 of the expert slots stage the next layer's guessed experts" in staged.render()
    no_host = plan(store, big, max_context=256, batch=2, zero_copy_stage=3)
    assert no_host.staging == 0 and "stage" not in no_host.render()
    pinned = plan(store, gpu + 100 * slot, host_memory=3 * slot, max_context=256, batch=2,
                  zero_copy_stage=3)  # fmt: skip
    assert pinned.staging == 0


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_kv_width_is_what_the_model_caches(tiny, model_type):
    """The planner's KV bytes per token and layer equal the native model's static cache (GQA:
    keys and values per KV head; MLA: the latent plus the rope key, as transformers caches)."""
    loaded = load_model(
        tiny.store(model_type), EngineConfig(device="cpu", dtype="float32", native=True)
    )
    cache = loaded.model.new_cache(1, 8, torch.float32, "cpu")
    per_token_layer = cache.numel() // (loaded.model_config.num_layers * 8)
    assert loaded.model_config.kv_width == per_token_layer


def test_refuses_when_dense_does_not_fit(store):
    with pytest.raises(ValueError, match="more than --gpu-memory .*: raise --gpu-memory"):
        plan(store, 64 * MIB)


def test_gpu_memory_sizes_the_cache_and_keeps_numerics(store, capsys):
    p = plan(store, WORKSPACE_BYTES + 8 * MIB)
    budget = p.dense_bytes + p.kv_bytes + WORKSPACE_BYTES + 4 * p.slot_bytes
    loaded = load_model(
        store.path,
        EngineConfig(native=False, device="cpu", dtype="float32", gpu_memory=f"{budget}b"),
    )
    assert loaded.runtime.residency.capacity == 4
    assert "expert slots" in capsys.readouterr().err
    ids = torch.randint(1, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    full = load_model(store.path, EngineConfig(native=False, device="cpu", dtype="float32"))
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, full.model(ids).logits)


def test_bad_engine_settings_fail_before_loading(store):
    from moetier.loader.load import check_engine_config

    with pytest.raises(ValueError, match="unknown cache policy 'fifo'"):
        check_engine_config(store.path, EngineConfig(cache_policy="fifo"))
    with pytest.raises(ValueError, match="not a memory size"):
        check_engine_config(store.path, EngineConfig(gpu_memory="plenty"))
    # negative sizes and counts (accepted before: --expert-cache-mb -5 ran)
    for field, flag in (("expert_cache_mb", "--expert-cache-mb -5: give 0 (room for every"),
                        ("expert_cache_slots", "--expert-cache-slots -5: give 0 (no cap)"),
                        ("zero_copy_stage", "--zero-copy-stage -5: give 0 (off)"),
                        ("cpu_threads", "--cpu-threads -5: give 0 (every core)")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(flag)):
            check_engine_config(store.path, EngineConfig(**{field: -5}))
    with pytest.raises(ValueError, match="raise --gpu-memory"):
        load_model(store.path, EngineConfig(native=False, device="cpu", gpu_memory="64MiB"))


def test_the_servers_kv_pages_come_out_of_the_gpu_budget(store):
    """`moetier serve` reserves its page pool's positions (kv_positions) in the --gpu-memory
    plan: more KV positions leave fewer expert slots, and a pool that cannot fit fails before
    loading."""
    from moetier.loader.load import check_engine_config

    small = plan(store, WORKSPACE_BYTES + 8 * MIB, max_context=256, batch=1)
    budget = small.dense_bytes + small.kv_bytes + WORKSPACE_BYTES + 6 * small.slot_bytes
    config = EngineConfig(native=False, device="cpu", dtype="float32", gpu_memory=f"{budget}b")
    few = load_model(store.path, config, kv_positions=256)
    per_position = small.kv_bytes // 256
    more = 2 * small.slot_bytes // per_position + 256  # two slots' worth of positions more
    fewer = load_model(store.path, config, kv_positions=more)
    assert few.runtime.residency.capacity == 6
    assert fewer.runtime.residency.capacity == 4
    with pytest.raises(ValueError, match="raise --gpu-memory"):
        check_engine_config(store.path, config, kv_positions=100 * more)
