"""Hybrid misses (issue #54): the cost model's split against brute force and the physical model,
and tiny models whose misses are partly computed by the host's cores against the HF forward (the
oracle tests' tolerance, 16 greedy tokens identical). On a CPU-only run the "GPU path" is the
normal experts op over the slot pool, so the split is real there too."""

from __future__ import annotations

import itertools
import random
import shutil

import pytest
import torch
from test_oracle import GREEDY, hf_greedy, hf_reference, prompt

from moetier.config import EngineConfig
from moetier.engine.generate import Generator
from moetier.loader.load import load_model
from moetier.residency.hybrid_split import (
    HybridSpeeds,
    Split,
    fetch_share,
    split_cost,
    split_misses,
)
from moetier.residency.telemetry import render_prometheus

GB = 1e9


def test_one_pair_misses_split_as_the_bandwidths():
    """With one pair per miss and no sync, the best split sends BW_PCIe / (BW_PCIe + BW_CPU)
    of the misses over PCIe (research/offload.md §3.1): 6 of 9 at PCIe = 2 x CPU."""
    speeds = HybridSpeeds(gpu_path=50 * GB, cpu=25 * GB)
    split = split_misses(dict.fromkeys(range(9), 1), 10**6, speeds)
    assert (len(split.gpu), len(split.cpu)) == (6, 3)
    assert fetch_share(speeds) == pytest.approx(6 / 9)
    assert split.seconds == pytest.approx(6 * 10**6 / (50 * GB))
    assert split.fetch_only == pytest.approx(9 * 10**6 / (50 * GB))


def test_more_tokens_shrink_the_cpu_share():
    speeds = HybridSpeeds(gpu_path=50 * GB, cpu=25 * GB, pair_cost=1.0)
    one = split_misses(dict.fromkeys(range(12), 1), 10**6, speeds)
    four = split_misses(dict.fromkeys(range(12), 4), 10**6, speeds)
    assert len(four.cpu) < len(one.cpu)
    # experts with fewer pairs go to the CPU first
    mixed = split_misses({0: 5, 1: 1, 2: 3, 3: 1, 4: 2, 5: 4}, 10**6, speeds)
    assert mixed.cpu == [1, 3]


def test_sync_cost_keeps_misses_on_the_gpu_path():
    speeds = HybridSpeeds(gpu_path=50 * GB, cpu=25 * GB, sync=1e-3)
    split = split_misses(dict.fromkeys(range(4), 1), 10**6, speeds)
    assert split.cpu == [] and split.seconds == split.fetch_only


def test_forced_share_takes_the_fewest_pairs():
    speeds = HybridSpeeds(gpu_path=1.0, cpu=1.0)
    split = split_misses({7: 3, 2: 1, 5: 1, 9: 2}, 100, speeds, share=0.5)
    assert split == Split(gpu=[7, 9], cpu=[2, 5], seconds=split.seconds, fetch_only=400.0)
    assert split_misses({1: 1}, 100, speeds, share=0.0).cpu == []
    with pytest.raises(ValueError):
        split_misses({1: 1}, 100, speeds, share=1.5)


def test_split_is_the_best_of_every_subset():
    """Against brute force over every subset of up to 7 misses (random speeds and pairs): the
    prefix by pairs is optimal, and never worse than fetch-only."""
    rng = random.Random(0)
    for _ in range(60):
        speeds = HybridSpeeds(
            gpu_path=rng.uniform(5, 60) * GB,
            cpu=rng.uniform(5, 100) * GB,
            sync=rng.choice([0.0, rng.uniform(0, 2e-4)]),
            pair_cost=rng.uniform(0, 1.5),
        )
        misses = {e: rng.randint(1, 4) for e in range(rng.randint(1, 7))}
        blob = rng.randint(10**5, 2 * 10**6)
        split = split_misses(misses, blob, speeds)
        best = min(
            split_cost(
                [misses[e] for e in misses if e not in cpu], [misses[e] for e in cpu], blob, speeds
            )  # fmt: skip
            for n in range(len(misses) + 1)
            for cpu in itertools.combinations(misses, n)
        )
        assert split.seconds == pytest.approx(best, rel=1e-12)
        assert split.seconds <= split.fetch_only


def _hybrid_config(cpu_experts: str, **extra) -> EngineConfig:
    return EngineConfig(native=False, device="cpu", dtype="float32", expert_cache_slots=2,
                        host_memory="1GiB", cpu_experts=cpu_experts, **extra)  # fmt: skip


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("cpu_experts", ["share:0.5", "share:1", "auto"])
def test_forced_split_matches_hf(tiny, model_type, cpu_experts):
    """A 2-slot GPU cache above a host tier: each layer's misses split (half, all, or by the
    measured cost model) between the experts op and the CPU kernel, against the HF forward."""
    loaded = load_model(tiny.store(model_type), _hybrid_config(cpu_experts))
    ref = hf_reference(tiny.checkpoint(model_type))
    ids = prompt(loaded.model_config.vocab_size)
    with torch.no_grad():
        ours, theirs = loaded.model(ids).logits, ref(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert Generator(loaded).generate(ids[0].tolist(), GREEDY).token_ids == hf_greedy(ref, ids[:1])
    hybrid = loaded.runtime.hybrid
    assert hybrid is not None and hybrid.calls > 0 and hybrid.gpu_misses + hybrid.cpu_misses > 0
    # totals, not a record per call (a server's runtime makes millions of calls)
    assert all(isinstance(v, (int, float)) for k, v in vars(hybrid).items()
               if k not in ("speeds", "share", "executor"))  # fmt: skip
    if cpu_experts != "auto":  # the CPU really computed pairs (auto may find it too slow here)
        assert hybrid.pairs > 0 and hybrid.bytes > 0
    if cpu_experts == "share:1":  # then every miss in the host tier went to the CPU
        assert hybrid.gpu_misses == 0 and hybrid.cpu_misses > 0
    cpu = loaded.runtime.telemetry()["cpu"]  # /metrics' tier="cpu"
    assert (cpu.hits, cpu.bytes) == (hybrid.pairs, hybrid.bytes)
    if hybrid.pairs:
        assert cpu.busy_seconds > 0 and cpu.gbps > 0
        text = render_prometheus(loaded.runtime.telemetry())
        assert f'moetier_residency_hits_total{{tier="cpu"}} {hybrid.pairs}' in text


def test_q2s_store_through_the_c_kernel(tiny, tmp_path):
    """A q2s store: every miss computed by the C kernel (int8 activation words, as the GPU's q2s
    GEMV) against the same store without hybrid misses (float activations on CPU): the logits
    within 2% of their range and 16 greedy tokens identical."""
    from moetier.kernels.cpu.experts import choose_backend
    from moetier.quant.requantize import requantize_experts

    store = tmp_path / "q2s"
    shutil.copytree(tiny.store("qwen3_moe"), store)
    requantize_experts(store, "q2s", progress=False)
    plain = load_model(store, EngineConfig(native=False, device="cpu", dtype="float32"))
    layer = plain.store.moe_layers[0]
    if choose_backend(plain.store.blob_format(layer)) != "c":
        pytest.skip("no C compiler: the CPU part runs the torch twin")
    hybrid = load_model(store, _hybrid_config("share:1"))
    ids = prompt(plain.model_config.vocab_size)
    with torch.no_grad():
        a, b = plain.model(ids).logits, hybrid.model(ids).logits
    assert (a - b).abs().max().item() <= 0.02 * a.abs().max().item()
    assert (a - b).abs().max().item() > 0  # the int8 words really ran
    greedy = Generator(plain).generate(ids[0].tolist(), GREEDY).token_ids
    assert Generator(hybrid).generate(ids[0].tolist(), GREEDY).token_ids == greedy
    assert hybrid.runtime.hybrid is not None and hybrid.runtime.hybrid.pairs > 0


def test_cpu_experts_flag_is_checked():
    with pytest.raises(ValueError, match="cpu-experts"):
        EngineConfig(cpu_experts="share:2").cpu_share()
    assert EngineConfig().cpu_share() is None
    assert EngineConfig(cpu_experts="auto").cpu_share() == -1.0


def test_hybrid_keeps_steps_eager(tiny):
    """Experts that do not all fit and --cpu-experts on a format without a C kernel (the
    graph step's host node runs only the C kernel): no zero-copy graph step, eager steps whose
    misses are split (tests/engine/test_hybrid_graph.py: the graph step's split)."""
    from moetier.engine.graph_placement import place_for_graphs

    loaded = load_model(tiny.store("qwen3_moe"), _hybrid_config("share:0.5"))
    assert place_for_graphs(loaded) is False
    assert loaded.runtime.zero_copy is None and not loaded.runtime.pinned


def test_hybrid_needs_a_host_tier(tiny):
    with pytest.raises(ValueError, match="host-memory"):
        load_model(tiny.store("qwen3_moe"),
                   EngineConfig(native=False, device="cpu", cpu_experts="auto"))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("cpu_experts", ["share:0.5", "auto"])
def test_cuda_hybrid_matches_hf(tiny, cpu_experts):
    """On CUDA the CPU part runs on a thread beside the GPU's fetches and kernels."""
    config = EngineConfig(native=False, device="cuda", dtype="float32", expert_cache_slots=2,
                          host_memory="1GiB", cpu_experts=cpu_experts)  # fmt: skip
    loaded = load_model(tiny.store("qwen3_moe"), config)
    ref = hf_reference(tiny.checkpoint("qwen3_moe"), device="cuda")
    ids = prompt(loaded.model_config.vocab_size, device="cuda")
    with torch.no_grad():
        ours, theirs = loaded.model(ids).logits, ref(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert Generator(loaded).generate(ids[0].tolist(), GREEDY).token_ids == hf_greedy(ref, ids[:1])
    assert loaded.runtime.hybrid is not None
    if cpu_experts != "auto":
        assert loaded.runtime.hybrid.pairs > 0
