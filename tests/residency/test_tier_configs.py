"""Residency never changes numerics: the same tiny model under every tier configuration gives
bit-identical logits (STYLE.md §13). On CPU the "GPU" tier is the slot pool in host memory; the
`gpu` variant runs the same configurations on CUDA (pinned host tier, copy stream, zero-copy
reads by the Triton kernel)."""

from __future__ import annotations

import shutil

import pytest
import torch

from moetier.config import EngineConfig
from moetier.loader.load import load_model
from moetier.models.experts import router_weights

CONFIGS = {
    "2 slots": dict(expert_cache_slots=2),
    "host tier only": dict(expert_cache_slots=2, host_memory="64MiB"),
    "zero-copy, every blob in host rows": dict(expert_cache_slots=2, host_memory="64MiB"),
    "zero-copy, 4 hot blobs": dict(expert_cache_slots=4, host_memory="64MiB"),
    "streamed prefill": dict(expert_cache_slots=6, host_memory="64MiB"),
    "prefetch": dict(expert_cache_slots=10),
    "disk, temporary directory": dict(expert_cache_slots=2, expert_reads="direct"),
}


def run_configs(store, device: str) -> dict[str, tuple[torch.Tensor, object]]:
    """name -> (logits of a 2 x 12 prompt and of 4 one-token calls, concatenated; runtime)."""
    ids = torch.randint(1, 300, (2, 12), generator=torch.Generator().manual_seed(8)).to(device)
    results = {}
    for name, engine in {"every expert resident": {}, **CONFIGS}.items():
        loaded = load_model(
            store, EngineConfig(native=False, device=device, dtype="float32", **engine)
        )
        runtime = loaded.runtime
        if name.startswith("zero-copy"):
            runtime.enable_zero_copy(hot=[] if "every blob" in name else None)
        runtime.stream_tokens = 8 if name == "streamed prefill" else 0
        if name == "prefetch":
            runtime.enable_prefetch(*router_weights(loaded.model, sorted(runtime.formats)))
        with torch.no_grad():
            prompt = loaded.model(ids).logits
            # decode-shaped calls (one token each, no KV cache): where prefetch acts
            tokens = [loaded.model(ids[:, i : i + 1]).logits for i in range(4)]
        results[name] = (torch.cat([prompt, *tokens], dim=1), runtime)
    return results


def check_identical(results) -> None:
    full = results["every expert resident"][0]
    for name, (logits, _) in results.items():
        assert torch.equal(logits, full), name


def test_tier_configurations_are_bit_identical(tiny, tmp_path):
    store = shutil.copytree(tiny.store("qwen3_moe"), tmp_path / "store")
    results = run_configs(store, "cpu")
    check_identical(results)
    # each configuration took the path it names
    host_only = results["host tier only"][1].telemetry()
    assert host_only["host"].hits > 0 and host_only["disk"].hits == 0
    zero_copy = results["zero-copy, every blob in host rows"][1]
    assert int(zero_copy.zero_copy.gpu_pairs) == 0 and int(zero_copy.zero_copy.counts.sum()) > 0
    assert results["streamed prefill"][1].residency.stats.hits > 0
    disk = results["disk, temporary directory"][1].residency
    assert disk.disk is not None and disk.disk.bytes_read >= disk.stats.bytes_fetched > 0
    prefetch = results["prefetch"][1].residency.counters  # the pool tier's
    assert prefetch.prefetch_issued > 0 and prefetch.prefetch_used > 0


@pytest.mark.gpu
def test_tier_configurations_are_bit_identical_on_gpu(tiny, tmp_path):
    store = shutil.copytree(tiny.store("qwen3_moe"), tmp_path / "store")
    results = run_configs(store, "cuda")
    check_identical(results)
    zero_copy = results["zero-copy, every blob in host rows"][1]
    assert zero_copy.residency.host.pinned
    assert int(zero_copy.zero_copy.gpu_pairs) == 0 and int(zero_copy.zero_copy.counts.sum()) > 0
