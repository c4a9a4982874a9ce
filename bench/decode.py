"""Resident decode (issue #7): tok/s of the native qwen3_moe model with every expert on the GPU,
one decode step (and its greedy feedback) replayed from a CUDA graph, next to HF transformers
(batched_mm experts) on the same shape, and achieved bandwidth on active bytes next to the copy
bandwidth measured in the same run. One JSON line per case.

  python bench/decode.py --resident --layers 8 --batch 1,4,16     # the 8-layer slice
  python bench/decode.py --resident --layers 48 --batch 1          # the full Qwen3-30B-A3B shape

Tiered decode (issue #6): batch 1 with a GPU expert budget of each --gpu-fraction of the base
blobs, every other blob in pinned host RAM (HostTier), optionally --disk-fraction of the blobs
only in the store's file (read with the disk reader). Misses are served as the cost model
(moetier/residency/cost.py) picks from the link speeds measured at the start of the run, or as
--strategy says: zero_copy (hot blobs in slots, the rest read by the kernel from pinned rows,
step replayed from a CUDA graph), prefetch (next-layer prediction, copies on a copy stream) or
blocking (copy on a miss); a fraction of 1.0 pins every expert (resident).

  python bench/decode.py --tiered --layers 8 --gpu-fraction 0.25,0.5,1.0 --disk-fraction 0,0.05
  python bench/decode.py --tiered --device cpu --layers 2 --shape tiny --steps 4   # smoke test

Per case: tok/s, ms/token, the floor = active bytes / HBM copy GB/s + missed bytes / pinned H2D
GB/s + disk bytes / disk GB/s (link speeds measured in the same run; the bytes are the budget's
under near-uniform routing: the GPU serves gpu-fraction of the active expert bytes, the rest
crosses PCIe, disk-fraction of all expert bytes from disk), ratio to the floor, the measured GPU
hit rate and bytes per token per tier.

Weights are random (synthetic store written directly in q2s form, quant/synthetic.py). Routing
(--routing, a comma list; each runs every case): `model`, the model's own router on them
(near-uniform); `trace:PATH`, each MoE layer's top-k replayed from a routing trace in token
order (bench/trace_routing.py says how a trace's layers and experts map onto the shape;
eval-moe-70m's router_trace.npz maps onto the Qwen3 shape as 4 groups of 32 experts, 2 per
group). The device machine has no ../shared: from the repo root, copy the trace into the
gitignored .carry/ and carry that folder:

  mkdir -p .carry && cp ../shared/models/eval-moe-70m/router_trace.npz .carry/   # 0.7 MB
  python bench/decode.py --tiered --layers 8 --gpu-fraction 0.25,0.5,1.0 \
      --routing model,trace:.carry/router_trace.npz

Under trace routing the floor is that of the trace rows the timed steps routed, with the best
fixed GPU set of the budget's slots for exactly those rows (hindsight; `oracle_hit_rate`); the
uniform-budget floor is printed beside it (`floor_ms_uniform`).

--prefill-tokens N (each budget below 1, each routing): one N-token prefill streamed from the
host tier (all experts off the GPU: the slots cycle through the layers), against its PCIe-bound
floor = bytes of each layer's distinct routed experts / pinned H2D GB/s (same run); beside it
the same prefill with every blob already in a GPU slot (`resident_ms`: same streamed code path,
no copies) and with every expert pinned (`pinned_ms`: no host syncs). `bound_ms` = max(floor,
resident_ms) is what full copy/compute overlap would give; `of_bound` = bound / measured. The
links line also gives `h2d_per_blob_GB/s`: blob-sized copies one call each, as the pool issues.

--accelerate-tokens N: HF transformers + accelerate offload (bf16 random checkpoint written once
under --tmp, device_map="auto" with the GPU capped at the dense bytes + the budget's share of
the bf16 expert bytes + 1 GiB; `gpu_expert_fraction`: the expert bytes it put on the GPU),
decode-only ms per token; `vs_accelerate` on the decode lines.

Active bytes per step: every dense weight (attention, routers, norms, lm_head; one embedding
row per sequence) plus, per MoE layer, the expected number of distinct experts a batch touches
under uniform routing times an expert's bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetier.config import DEFAULT_STORE, EngineConfig
from moetier.engine.static_decode import StaticDecoder
from moetier.loader.load import load_model
from moetier.quant.store import Store
from moetier.quant.synthetic import QWEN3_30B_A3B, TINY_QWEN3_MOE, write_synthetic_store
from moetier.residency.cost import (
    STRATEGIES,
    LinkSpeeds,
    TokenTraffic,
    choose,
    distinct_experts,
    floor_seconds,
    miss_costs,
)
from moetier.residency.links import (
    copy_bandwidth,
    fastest,
    link_gbps,
    measure_links,
    memory_links,
)

sys.path.insert(0, str(Path(__file__).parent))
import trace_routing  # noqa: E402
from common import emit, h2d_blob_bandwidth  # noqa: E402

from moetier.core.provenance import run_info  # noqa: E402

PROMPT = 16


def dense_bytes(store: Store, batch: int) -> int:
    """Bytes of the non-expert weights one decode step reads (bf16; one embedding row per
    sequence)."""
    from safetensors import safe_open

    cfg = store.model_config
    dense = 0
    with safe_open(str(store.path / "dense.safetensors"), framework="pt") as f:
        for key in f.keys():
            t = f.get_slice(key)
            numel = 1
            for d in t.get_shape():
                numel *= d
            if "embed_tokens" in key:
                numel = batch * cfg.hidden_size
            dense += numel * 2
    return dense


def active_bytes(store: Store, batch: int) -> int:
    cfg = store.model_config
    dense = dense_bytes(store, batch)
    expert = next(iter(store.blobs.values())).nbytes
    distinct = distinct_experts(cfg.num_experts, cfg.top_k, batch)
    return int(dense + len(store.moe_layers) * distinct * expert)


def profile_step(step: Callable[[], object], steps: int = 4) -> list[dict[str, object]]:
    """CUDA kernels of `steps` calls of `step` (eager steps, or CUDA-graph replays, whose
    kernels CUPTI reports one by one): the 25 largest by total time, per step. With
    MOETIER_TRACE set, the whole timeline (every kernel with its stream, start and end) is also
    written there as a Chrome trace (a new file per call: MOETIER_TRACE with a number)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    trace = os.environ.get("MOETIER_TRACE")
    if trace:
        n = len(list(Path(trace).parent.glob(Path(trace).name + "*")))
        prof.export_chrome_trace(f"{trace}{n}.json")
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:90], "calls_per_step": e.count / steps,
                         "us_per_step": round(us / steps, 1)})  # fmt: skip
    rows.sort(key=lambda r: -float(r["us_per_step"]))  # type: ignore[arg-type]
    total = sum(float(r["us_per_step"]) for r in rows)  # type: ignore[arg-type]
    calls = sum(float(r["calls_per_step"]) for r in rows)  # type: ignore[arg-type]
    return [{"kernel": "TOTAL", "calls_per_step": calls, "us_per_step": round(total, 1)}] + rows[
        :25
    ]


def time_native(
    store_path: Path, batch: int, steps: int, compile_step: bool, profile: bool = False
) -> dict[str, object]:
    loaded = load_model(store_path, EngineConfig(device="cuda", dtype="bfloat16", native=True))
    loaded.runtime.pin_all()
    vocab = loaded.model_config.vocab_size
    dec = StaticDecoder(
        loaded.model, batch, PROMPT + steps + 8, torch.bfloat16, "cuda", compile_step=compile_step
    )
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, PROMPT), generator=gen).tolist()
    with torch.inference_mode():
        logits = dec.prefill(prompts)
        dec.input_ids.copy_(logits.argmax(-1)[:, None])
        # eager (uncaptured) steps, for the overhead the graph removes; one first step
        # compiles the decode-shape kernels
        dec.step_static()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(8):
            dec.input_ids.copy_(dec.step_static().argmax(-1)[:, None])
            dec.positions.add_(1)
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - start) / 8 * 1e3
        kernels = profile_step(dec.step_static) if profile else None
        replay = dec.capture(greedy=True)  # one step + greedy feedback
        replays = steps - 8 - 2
        replay()
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            replay()
        end.record()
        end.synchronize()
    ms = begin.elapsed_time(end) / replays
    del replay, dec, loaded
    torch.cuda.empty_cache()
    return {"ms": ms, "eager_ms": eager_ms, "kernels": kernels}


def time_hf(shape: dict[str, Any], batch: int, new_tokens: int) -> float:
    """ms per decode step of HF transformers generate (bf16, batched_mm experts, random weights
    of config `shape`): the time of `new_tokens` tokens minus that of one (prefill + first
    token), over new_tokens - 1 steps."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**shape)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, experts_implementation="batched_mm"
        ).eval()
    ids = torch.randint(0, config.vocab_size, (batch, PROMPT), device="cuda")
    kwargs = dict(do_sample=False, pad_token_id=0)

    def run(tokens: int, model: torch.nn.Module = model) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        run(2)  # warm-up
        one = min(run(1) for _ in range(3))
        full = run(new_tokens)
    del model
    torch.cuda.empty_cache()
    return (full - one) / (new_tokens - 1) * 1e3


def time_accelerate(
    shape: dict[str, Any], gpu_fraction: float, new_tokens: int, tmp: Path, device: str
) -> dict[str, float]:
    """The issue's offload baseline: HF transformers + accelerate (`device_map="auto"`, bf16)
    with a GPU memory cap of the dense weights plus `gpu_fraction` of the bf16 expert bytes, the
    rest offloaded to CPU RAM; decode-only ms per token as in `time_hf`. The random checkpoint
    is written to `tmp` first (from_pretrained is what dispatches the offload)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**shape)
    path = tmp / f"moetier-accelerate-{shape['hidden_size']}-{shape['num_hidden_layers']}"
    if not (path / "config.json").exists():
        # random init on the GPU when there is one (seconds, not a minute of CPU init for the
        # 8-layer slice's 10 GB), written to a side folder and renamed when complete
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial)
        partial.rename(path)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    sizes = {n: p.numel() * 2 for n, p in meta.named_parameters()}
    experts = sum(v for n, v in sizes.items() if ".experts." in n)
    dense = sum(sizes.values()) - experts
    cap = int(dense + gpu_fraction * experts) + 2**30  # + activations / workspace
    max_memory: dict[Any, Any] = {"cpu": 2**40}
    if device == "cuda":
        max_memory[0] = cap
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, device_map="auto", max_memory=max_memory,
        experts_implementation="batched_mm",
    ).eval()  # fmt: skip
    placed = getattr(model, "hf_device_map", {}) or {}

    def on_gpu(name: str) -> bool:  # the device of the longest module prefix of `name`
        prefixes = [m for m in placed if name == m or name.startswith(m + ".") or m == ""]
        return bool(prefixes) and placed[max(prefixes, key=len)] not in ("cpu", "disk")

    gpu_experts = sum(v for n, v in sizes.items() if ".experts." in n and on_gpu(n))
    first = "cuda" if device == "cuda" else "cpu"
    ids = torch.randint(0, config.vocab_size, (1, PROMPT), device=first)

    def run(tokens: int, model: torch.nn.Module = model) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,  # type: ignore[operator]
                       pad_token_id=0)  # fmt: skip
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        run(2)
        # the prefill and first token's time and the whole generation's, each the best of its
        # runs so far: one slow run (a busy host) made the first exceed the second in CPU CI
        # runs, a negative time per token; up to five rounds until the difference is positive
        one = full = float("inf")
        for _ in range(5):
            one = min(one, *(run(1) for _ in range(2)))
            full = min(full, run(new_tokens))
            if full > one:
                break
    del model
    if full <= one:
        raise RuntimeError(f"{new_tokens} tokens took {full:.4f} s, one took {one:.4f} s")
    ms = (full - one) / (new_tokens - 1) * 1e3
    return {"ms": ms, "gpu_cap_bytes": float(cap if device == "cuda" else 0),
            "gpu_expert_fraction": gpu_experts / experts}  # fmt: skip


WARMUP = 4  # eager decode steps before timing (compile, counts for the hot set)


@dataclass(frozen=True)
class Routing:
    """How the MoE layers route: the model's own routers ("model"), or a routing trace mapped
    onto the shape (bench/trace_routing.py): ids / weights [MoE layers, tokens, k]."""

    name: str
    ids: np.ndarray | None = None
    weights: np.ndarray | None = None

    def install(self, model: torch.nn.Module) -> list[trace_routing.TraceRouter]:
        if self.ids is None or self.weights is None:
            return []
        return trace_routing.install(model, self.ids, self.weights)


CARRY_TRACE = (
    "mkdir -p .carry && cp ../shared/models/eval-moe-70m/router_trace.npz .carry/  # 0.7 MB"
)


def parse_routings(spec: str, store: Store) -> list[Routing]:
    """`--routing`: a comma list of `model` and `trace:PATH`."""
    cfg = store.model_config
    out = []
    for item in spec.split(","):
        if item == "model":
            out.append(Routing("model"))
        elif item.startswith("trace:"):
            path = Path(item.removeprefix("trace:"))
            if not path.is_file():
                raise SystemExit(
                    f"--routing {item}: no such file (from the repo root: {CARRY_TRACE})"
                )
            ids, probs, experts = trace_routing.load_trace(path)
            try:
                mapped = trace_routing.map_trace(
                    ids, probs, experts, len(store.moe_layers), cfg.num_experts, cfg.top_k
                )
            except ValueError as e:
                raise SystemExit(f"--routing {item}: {e}") from None
            out.append(Routing(f"trace:{path.name}", *mapped))
        else:
            raise SystemExit(f"--routing {item!r}: use model or trace:PATH")
    return out


def uniform_traffic(
    store: Store, gpu_fraction: float, disk_fraction: float, sync_s: float
) -> TokenTraffic:
    """The budget's bytes per token at batch 1 under near-uniform routing: the GPU serves
    gpu_fraction of the active expert bytes, disk_fraction of them come from disk, the rest
    crosses PCIe from host RAM."""
    cfg = store.model_config
    expert = next(iter(store.blobs.values())).nbytes
    experts = len(store.moe_layers) * cfg.top_k * expert
    disk = experts * disk_fraction
    return TokenTraffic(
        dense=dense_bytes(store, 1),
        gpu=experts * gpu_fraction,
        host=max(0.0, experts * (1 - gpu_fraction) - disk),
        disk=disk,
        sync_seconds=sync_s,
    )


def trace_traffic(
    store: Store, ids: np.ndarray, rows: range, slots: int, disk_keys: set[Any], sync_s: float
) -> TokenTraffic:
    """Bytes per token of trace `rows` if the GPU held the best fixed set of `slots` blobs for
    exactly those rows (trace_routing.oracle_hot_set): hits read from HBM, disk-only blobs
    from disk, the rest over PCIe from host RAM."""
    cfg = store.model_config
    expert = next(iter(store.blobs.values())).nbytes
    counts = trace_routing.trace_counts(ids, rows, cfg.num_experts)  # [L, E]
    hot = trace_routing.oracle_hot_set(counts, slots)
    on_disk = np.zeros(counts.shape, dtype=bool)
    for layer, e, _ in disk_keys:
        on_disk[store.moe_layers.index(layer), e] = True
    tokens = max(1, len(rows))
    gpu = counts[hot].sum() * expert / tokens
    disk = counts[~hot & on_disk].sum() * expert / tokens
    host = counts[~hot & ~on_disk].sum() * expert / tokens
    return TokenTraffic(dense=dense_bytes(store, 1), gpu=float(gpu), host=float(host),
                        disk=float(disk), sync_seconds=sync_s)  # fmt: skip


def counters(runtime: Any) -> dict[str, float]:
    """Cumulative figures of the runtime (one host read): requested pairs, pairs served from
    GPU slots, bytes over PCIe from host RAM and from disk, prefetch scores."""
    zc = runtime.zero_copy
    pool = runtime.residency
    if zc is not None:
        pairs, gpu = float(zc.counts.sum()), float(zc.gpu_pairs)
        expert = zc.blob_bytes[zc.layers[0]]
        staged = float(zc.staged_blobs)  # guesses copied in: host bytes, used or not
        return {"pairs": pairs, "gpu": gpu, "host_bytes": (pairs - gpu + staged) * expert
                + zc.promoted_bytes, "disk_bytes": 0.0, "staged": staged,
                "staged_used": float(zc.staged_pairs)}  # fmt: skip
    stats, c = pool.stats, pool.counters
    return {"pairs": float(stats.hits + stats.misses), "gpu": float(stats.hits),
            "host_bytes": float(stats.bytes_fetched - pool.disk_counters.bytes),
            "disk_bytes": float(pool.disk_counters.bytes), "issued": float(c.prefetch_issued),
            "used": float(c.prefetch_used), "needed": float(c.prefetch_needed)}  # fmt: skip


def time_tiered(
    path: Path, device: str, gpu_fraction: float, disk_keys: set[Any], strategy: str,
    steps: int, rebalance_every: int, compiled: bool, routing: Routing, profile: bool = False,
    stage: int = 0, guess_from: str = "input",
) -> dict[str, Any]:  # fmt: skip
    """Decode `steps` tokens at batch 1 under one tier configuration; ms per token, the
    eager ms per token (host-decided paths and graph warm-up), counter deltas per token and
    the trace rows the timed steps routed by (trace routing)."""
    from moetier.models.experts import router_weights
    from moetier.residency.host_tier import HostTier

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if compiled:
        # a fresh trace per case: dynamo does not guard every Python attribute of the experts
        # runtime, so a step compiled for an earlier case could skip this one's code paths
        torch._dynamo.reset()
    probe = Store(path)
    base = [k for k in probe.blobs if k[2] == "base"]
    slots = max(1, round(gpu_fraction * len(base)))
    probe.close()
    engine = EngineConfig(device=device, dtype=str(dtype).removeprefix("torch."), native=True,
                          expert_cache_slots=slots,
                          expert_reads="direct" if disk_keys else "mmap")  # fmt: skip
    loaded = load_model(path, engine)
    routers = routing.install(loaded.model)
    runtime = loaded.runtime
    store = runtime.residency.store
    if strategy == "resident":
        runtime.pin_all()
    else:
        runtime.residency.host = HostTier(
            store, [k for k in sorted(store.blobs) if k not in disk_keys]
        )
        if strategy == "zero_copy":
            runtime.enable_zero_copy(stage=stage)
            if stage:  # each step copies the next layer's guesses into staging slots
                gates, norms = router_weights(loaded.model, sorted(runtime.formats))
                runtime.enable_prefetch(gates, norms, guess_from=guess_from)
        elif strategy == "prefetch":
            runtime.enable_prefetch(*router_weights(loaded.model, sorted(runtime.formats)))
    graphed = device == "cuda" and strategy in ("resident", "zero_copy")
    dec = StaticDecoder(loaded.model, 1, PROMPT + WARMUP + steps + 8 + 8 * profile, dtype, device,
                        compile_step=compiled and graphed)  # fmt: skip
    prompt = torch.randint(0, loaded.model_config.vocab_size, (1, PROMPT),
                           generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def eager_step() -> None:
        dec.input_ids.copy_(dec.step_static().argmax(-1)[:, None])
        dec.positions.add_(1)

    with torch.inference_mode():
        dec.input_ids.copy_(dec.prefill(prompt).argmax(-1)[:, None])
        eager_step()  # first step: compilation
        sync()
        start = time.perf_counter()
        for _ in range(WARMUP):
            eager_step()
        sync()
        eager_ms = (time.perf_counter() - start) / WARMUP * 1e3
        if strategy == "zero_copy":
            runtime.zero_copy.rebalance()  # hot set from the warm-up's counts
        step: Callable[[], object] = eager_step
        if graphed:
            step = dec.capture(greedy=True)  # the eager step, replayed
            step()
        sync()
        before = counters(runtime)
        first_row = int(routers[0].cursor) if routers else 0
        start = time.perf_counter()
        for i in range(steps):
            if rebalance_every and strategy == "zero_copy" and i and i % rebalance_every == 0:
                runtime.zero_copy.rebalance()  # between replays, outside the graph
            step()
        sync()
        ms = (time.perf_counter() - start) / steps * 1e3
        after = counters(runtime)
        last_row = int(routers[0].cursor) if routers else 0
        # after the timing (and its counters): the kernels of a few more steps
        kernels = profile_step(step, 8) if profile and device == "cuda" else None
    delta = {k: (after[k] - before[k]) / steps for k in after}
    return {"ms": ms, "eager_ms": eager_ms, "per_token": delta, "slots": slots,
            "rows": range(first_row, last_row), "kernels": kernels}  # fmt: skip


def _time_prefills(
    loaded: Any, routers: list[Any], ids: list[list[int]], device: str, dtype: torch.dtype
) -> tuple[float, float, float, list[torch.Tensor]]:
    """Best seconds of 5 prefills of `ids` after a warm-up (the same tokens and, with trace
    routing, the same trace rows each time), with the host bytes moved in and the expert
    blobs requested (pairs of distinct experts per layer) by the best one, and the last-token
    logits of each of the 6 runs (host copies: residency must not change them). Five, not
    two: the streamed prefill is host-driven (a sync per layer), and on the H200 the best of
    two varied from 31.8 to 49.0 ms between processes."""
    runtime = loaded.runtime
    dec = StaticDecoder(loaded.model, 1, len(ids[0]) + 8, dtype, device)
    stats = runtime.residency.stats
    best, moved, requested = math.inf, 0.0, 0.0
    outputs = []
    with torch.inference_mode():
        for i in range(6):
            for router in routers:
                router.cursor.zero_()
            before, asked = counters(runtime)["host_bytes"], stats.hits + stats.misses
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            logits = dec.prefill(ids)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            outputs.append(logits.cpu())
            if i and seconds < best:
                best, moved = seconds, counters(runtime)["host_bytes"] - before
                requested = float(stats.hits + stats.misses - asked)
    del dec
    return best, moved, requested, outputs


def time_prefill(
    path: Path, device: str, gpu_fraction: float, tokens: int, routing: Routing
) -> dict[str, float]:
    """One prefill of `tokens` tokens (batch 1) with `gpu_fraction` of the base blobs' slots and
    every blob in a pinned host tier: calls of >= STREAM_TOKENS stream each layer's experts, the
    next chunk (or layer) copied while one computes. Seconds (best of 5 after a warm-up), the
    bytes moved host -> GPU and the expert bytes the prefill needed (each layer's distinct
    experts); then the same prefill with every blob already in a GPU slot (same streamed code
    path, no copies: its compute and host syncs) and with every expert pinned (one kernel call
    per layer, no host sync)."""
    from moetier.residency.host_tier import HostTier

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    probe = Store(path)
    n_blobs = len(probe.blobs)
    blob = next(iter(probe.blobs.values())).nbytes
    slots = max(2, round(gpu_fraction * sum(1 for k in probe.blobs if k[2] == "base")))
    prompt = torch.randint(0, probe.model_config.vocab_size, (1, tokens),
                           generator=torch.Generator().manual_seed(tokens)).tolist()  # fmt: skip
    probe.close()
    out: dict[str, float] = {"slots": float(slots)}
    logits: list[torch.Tensor] = []  # of every run: tiered, resident, pinned
    for case, cache_slots in (("tiered", slots), ("resident", n_blobs)):
        engine = EngineConfig(device=device, dtype=str(dtype).removeprefix("torch."),
                              native=True, expert_cache_slots=cache_slots)  # fmt: skip
        loaded = load_model(path, engine)
        routers = routing.install(loaded.model)
        runtime = loaded.runtime
        store = runtime.residency.store
        runtime.residency.host = HostTier(store, sorted(store.blobs))
        seconds, moved, requested, outputs = _time_prefills(loaded, routers, prompt, device,
                                                            dtype)  # fmt: skip
        logits += outputs
        if case == "tiered":
            out.update(seconds=seconds, host_bytes=moved, needed_bytes=requested * blob)
        else:
            out.update(resident_seconds=seconds, resident_host_bytes=moved)
            runtime.pin_all()  # every blob is in a slot already: no copies
            pinned = _time_prefills(loaded, routers, prompt, device, dtype)
            out["pinned_seconds"] = pinned[0]
            logits += pinned[3]
        del loaded, runtime, store, routers
        if device == "cuda":
            torch.cuda.empty_cache()
    # residency never changes numerics: streamed, resident and pinned prefills, bit for bit
    out["identical_logits"] = float(all(torch.equal(logits[0], x) for x in logits[1:]))
    return out


def failed(info: dict[str, Any], case: str, error: Exception, **what: Any) -> None:
    """A line for a case that raised (traceback on stderr); the run goes on."""
    import traceback

    traceback.print_exc()
    emit({**info, "case": case, **what, "error": f"{type(error).__name__}: {error}"[:500]})
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_tiered(args: argparse.Namespace, info: dict[str, Any]) -> None:
    device = args.device
    shape = dict(TINY_QWEN3_MOE if args.shape == "tiny" else QWEN3_30B_A3B,
                 num_hidden_layers=args.layers)  # fmt: skip
    experts = args.experts.split(",")[0]
    path = write_synthetic_store(
        args.tmp / f"moetier-tiered-{args.shape}-{experts}-{args.layers}", shape, experts,
        DEFAULT_STORE,
    )  # fmt: skip
    store = Store(path)
    routings = parse_routings(args.routing, store)
    base = sorted(k for k in store.blobs if k[2] == "base")
    blob_bytes = next(iter(store.blobs.values())).nbytes
    fractions = [float(f) for f in args.gpu_fraction.split(",")]
    if args.strategy == "auto":  # the resident case first: it measures the sync overhead the
        fractions.sort(reverse=True)  # cost model charges the host-decided strategies
    disk_fractions = [float(f) for f in args.disk_fraction.split(",")]
    for f in fractions + disk_fractions:
        if not 0 <= f <= 1:
            raise SystemExit(f"fractions are in [0, 1], got {f}")
    gen = torch.Generator().manual_seed(1)
    order = [base[i] for i in torch.randperm(len(base), generator=gen).tolist()]
    disk_sets = {d: set(order[: round(d * len(base))]) for d in disk_fractions}
    speeds = measure_links(device, store, sorted(disk_sets[max(disk_fractions)]))
    gbps = link_gbps(speeds, ("hbm", "h2d", "zero_copy", "disk"))
    # per-blob copies (as the slot pool issues them) next to the one large copy of h2d_GB/s
    per_blob = h2d_blob_bandwidth(device, blob_bytes, min(128, len(base)))
    emit({**info, "case": "links", **gbps, "h2d_per_blob_GB/s": round(per_blob / 1e9, 2),
          "blob_bytes": blob_bytes})  # fmt: skip
    common = {"device_kind": device, "layers": args.layers, "shape": args.shape,
              "experts": experts}  # fmt: skip
    for routing in routings if args.prefill_tokens else []:
        for f in fractions:
            if f >= 1:
                continue
            try:
                p = time_prefill(path, device, f, args.prefill_tokens, routing)
            except Exception as e:  # one failed case must not lose the others' lines
                failed(info, "prefill-tiered", e, routing=routing.name, gpu_fraction=f)
                continue
            # the PCIe-bound floor: each layer's needed experts cross once, at pinned H2D
            floor_s = p["needed_bytes"] / speeds.h2d
            bound_s = max(floor_s, p["resident_seconds"])  # what full overlap would give
            emit({**info, "case": "prefill-tiered", **common, "routing": routing.name,
                  "gpu_fraction": f, "gpu_slots": int(p["slots"]),
                  "tokens": args.prefill_tokens, "ms": round(p["seconds"] * 1e3, 3),
                  "tok_s": round(args.prefill_tokens / p["seconds"], 1),
                  "host_MB": round(p["host_bytes"] / 1e6, 2),
                  "needed_MB": round(p["needed_bytes"] / 1e6, 2),
                  "floor_ms": round(floor_s * 1e3, 3),
                  "of_floor": round(floor_s / p["seconds"], 3),
                  "resident_ms": round(p["resident_seconds"] * 1e3, 3),
                  "resident_host_MB": round(p["resident_host_bytes"] / 1e6, 2),
                  "pinned_ms": round(p["pinned_seconds"] * 1e3, 3),
                  "bound_ms": round(bound_s * 1e3, 3),
                  "of_bound": round(bound_s / p["seconds"], 3),
                  "identical_logits": bool(p["identical_logits"]), **gbps})  # fmt: skip
    accelerate: dict[float, float] = {}  # gpu fraction -> HF + accelerate offload tok/s
    for f in fractions if args.accelerate_tokens else []:
        if f >= 1:
            continue
        try:
            t = time_accelerate(shape, f, args.accelerate_tokens, args.tmp, device)
        except Exception as e:
            failed(info, "decode-accelerate", e, gpu_fraction=f)
            continue
        accelerate[f] = 1e3 / t["ms"]
        emit({**info, "case": "decode-accelerate", **common, "batch": 1, "gpu_fraction": f,
              "gpu_cap_GiB": round(t["gpu_cap_bytes"] / 2**30, 2),
              # share of the bf16 expert bytes accelerate placed on the GPU under the cap
              "gpu_expert_fraction": round(t["gpu_expert_fraction"], 3),
              "ms_per_token": round(t["ms"], 3), "tok_s": round(accelerate[f], 3)})  # fmt: skip
    # budget-major, so with a time limit every routing's first budget is measured first
    sync_s = {routing.name: 0.0 for routing in routings}
    for f in fractions if not args.skip_decode else []:
        for routing in routings:
            sync_s[routing.name] = run_decode_cases(
                args, info, path, store, routing, [f], disk_fractions, disk_sets, speeds, gbps,
                accelerate, sync_s[routing.name],
            )  # fmt: skip
    store.close()


def run_decode_cases(
    args: argparse.Namespace, info: dict[str, Any], path: Path, store: Store, routing: Routing,
    fractions: list[float], disk_fractions: list[float], disk_sets: dict[float, set[Any]],
    speeds: LinkSpeeds, gbps: dict[str, float], accelerate: dict[float, float], sync_s: float,
) -> float:  # fmt: skip
    """One decode line per (GPU budget, disk fraction, strategy) under `routing`. The floor is
    the budget's under near-uniform routing (model routing) or the trace rows' with the best
    fixed GPU placement (trace routing; the uniform one is printed beside it). `sync_s`: the
    host-decision overhead per token the cost model charges, measured by a resident case
    (eager minus graphed step); returned, updated when a resident case ran."""
    device = args.device
    experts = args.experts.split(",")[0]
    blob_bytes = next(iter(store.blobs.values())).nbytes
    # trace rows the timed steps will roughly use (prompt, first step, warm-up, capture): for
    # the cost model's choice before the run; the floor uses the rows actually routed
    expected = range(PROMPT + WARMUP + 2, PROMPT + WARMUP + 2 + args.steps)
    for gpu_fraction in fractions:
        for disk_fraction in disk_fractions:
            if gpu_fraction >= 1 and disk_fraction > 0:
                continue  # nothing is off the GPU
            slots = max(1, round(gpu_fraction * len(store.moe_layers)
                                 * store.model_config.num_experts))  # fmt: skip
            disk_keys = disk_sets[disk_fraction]
            uniform = uniform_traffic(store, gpu_fraction, disk_fraction, sync_s)
            traffic = uniform
            if routing.ids is not None:
                traffic = trace_traffic(store, routing.ids, expected, slots, disk_keys, sync_s)
            costs = miss_costs(traffic, speeds)
            if gpu_fraction >= 1:
                strategies = ["resident"]
            elif args.strategy == "auto":
                strategies = [choose(costs)]
            else:
                strategies = args.strategy.split(",")
            stages = [int(m) for m in args.zero_copy_stage.split(",")]
            runs = [(st, m) for st in strategies for m in (stages if st == "zero_copy" else [0])]
            for strategy, stage in runs:
                if stage and routing.ids is not None:
                    print("# staging guesses needs the model's routers: skipped", file=sys.stderr)
                    continue
                if strategy == "zero_copy" and disk_fraction > 0:
                    print("# zero_copy cannot serve blobs on disk: skipped", file=sys.stderr)
                    continue
                try:
                    compiled = args.compile != "off"
                    t = time_tiered(path, device, gpu_fraction, disk_keys, strategy, args.steps,
                                    args.rebalance_every, compiled, routing,
                                    args.profile, stage, args.guess_from)  # fmt: skip
                except Exception as e:
                    failed(info, "decode-tiered", e, routing=routing.name, strategy=strategy,
                           gpu_fraction=gpu_fraction, disk_fraction=disk_fraction)  # fmt: skip
                    continue
                if device == "cuda":
                    torch.cuda.empty_cache()
                # the links again, right after the case: the floor takes the faster of the two
                # measurements of each link (the lower floor), so a link measured slow once
                # (seen on a freshly started H200: 48.9 GB/s H2D, then 55.3) cannot flatter
                # the ratio
                case_speeds = fastest(speeds, memory_links(device, speeds.disk))
                case_gbps = {**gbps, **link_gbps(case_speeds, ("hbm", "h2d", "zero_copy"))}
                if strategy == "resident":
                    sync_s = max(0.0, (t["eager_ms"] - t["ms"]) / 1e3)
                per = t["per_token"]
                expert_bytes = per["pairs"] * blob_bytes
                floor_traffic, floor_kind = uniform, "uniform budget"
                extra: dict[str, Any] = {}
                if routing.ids is not None:
                    extra["floor_ms_uniform"] = round(floor_seconds(uniform, case_speeds) * 1e3,
                                                      6)  # fmt: skip
                    floor_traffic = trace_traffic(store, routing.ids, t["rows"], t["slots"],
                                                  disk_keys, sync_s)  # fmt: skip
                    floor_kind = "trace rows, best fixed GPU set"
                    extra["trace_rows"] = [t["rows"].start, t["rows"].stop]
                    moved = floor_traffic.gpu + floor_traffic.host + floor_traffic.disk
                    extra["oracle_hit_rate"] = round(floor_traffic.gpu / moved, 4)
                floor_s = floor_seconds(floor_traffic, case_speeds)
                rec = {**info, "case": "decode-tiered", "device_kind": device,
                       "layers": args.layers, "shape": args.shape, "batch": 1,
                       "experts": experts, "routing": routing.name,
                       "gpu_fraction": gpu_fraction, "disk_fraction": disk_fraction,
                       "gpu_slots": t["slots"], "strategy": strategy,
                       "chosen_by": "budget" if strategy == "resident" else
                                    "cost model" if args.strategy == "auto" else "flag",
                       "rebalance_every": args.rebalance_every,
                       "staging_slots_per_layer": stage,
                       "guess_from": args.guess_from if stage else None,
                       # None: the strategy cannot serve this configuration (zero_copy + disk)
                       "predicted_ms": {k: round(v * 1e3, 4) if math.isfinite(v) else None
                                        for k, v in costs.items()},
                       "ms_per_token": round(t["ms"], 6), "tok_s": round(1e3 / t["ms"], 1),
                       "eager_ms_per_token": round(t["eager_ms"], 4),
                       "floor_ms": round(floor_s * 1e3, 6), "floor_kind": floor_kind,
                       "ratio_to_floor": round(t["ms"] / (floor_s * 1e3), 3),
                       "hit_rate": round(per["gpu"] / per["pairs"], 4) if per["pairs"] else None,
                       "bytes_per_token": {"gpu": round(expert_bytes * per["gpu"] / per["pairs"]
                                                        if per["pairs"] else 0),
                                           "host": round(per["host_bytes"]),
                                           "disk": round(per["disk_bytes"])},
                       "floor_bytes_per_token": {"active": round(floor_traffic.active),
                                                 "missed": round(floor_traffic.host
                                                                 + floor_traffic.disk),
                                                 "disk": round(floor_traffic.disk)},
                       **extra, **case_gbps}  # fmt: skip
                if strategy == "resident":
                    rec["hit_rate"] = 1.0
                if gpu_fraction in accelerate and disk_fraction == 0:
                    rec["vs_accelerate"] = float(f"{1e3 / t['ms'] / accelerate[gpu_fraction]:.4g}")
                if per.get("staged"):  # zero-copy staging: guesses copied, and used
                    rec["staged_per_token"] = round(per["staged"], 2)
                    rec["staged_pairs_per_token"] = round(per["staged_used"], 2)
                if per.get("issued"):
                    rec["prefetch_precision"] = round(per["used"] / per["issued"], 3)
                    rec["prefetch_recall"] = round(per["used"] / per["needed"], 3)
                emit(rec)
                for row in t["kernels"] or []:
                    emit({**info, "case": "decode-tiered-profile", "routing": routing.name,
                          "gpu_fraction": gpu_fraction, "strategy": strategy,
                          "staging_slots_per_layer": stage, **row})  # fmt: skip
    return sync_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resident", action="store_true", help="every expert on the GPU")
    parser.add_argument(
        "--tiered", action="store_true", help="GPU expert budgets, the rest in host RAM / disk"
    )
    parser.add_argument("--gpu-fraction", default="0.25,0.5,1.0", help="tiered: GPU budgets")
    parser.add_argument("--disk-fraction", default="0", help="tiered: blobs only on disk")
    parser.add_argument(
        "--strategy",
        default="auto",
        help="tiered: auto (the cost model picks; budgets run from the largest down) or a comma "
        "list of zero_copy, prefetch, blocking (budgets run in the order given)",
    )
    parser.add_argument(
        "--zero-copy-stage",
        default="0",
        help="tiered zero_copy: comma list of staging slots per layer (0: none), one case each: "
        "each step copies the next MoE layer's best guesses into them, off the compute stream",
    )
    parser.add_argument(
        "--guess-from",
        default="input",
        choices=("input", "output"),
        help="tiered zero_copy staging: guess from each layer's MoE input (scores beside its "
        "kernel) or from its output (the residual after it; scores after the kernel)",
    )
    parser.add_argument(
        "--rebalance-every", type=int, default=0, help="tiered zero_copy: promote every N steps"
    )
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        default=0,
        help="tiered: also time one prefill of this many tokens per GPU budget (streamed from "
        "the host tier) against its PCIe-bound floor (0: skip)",
    )
    parser.add_argument(
        "--skip-decode",
        action="store_true",
        help="tiered: only the links line and the --prefill-tokens / --accelerate-tokens cases",
    )
    parser.add_argument(
        "--accelerate-tokens",
        type=int,
        default=0,
        help="tiered: also time HF + accelerate offload (bf16, GPU capped at each budget) over "
        "this many new tokens (0: skip; needs the accelerate package)",
    )
    parser.add_argument(
        "--routing",
        default="model",
        help="tiered: comma list of model (the model's own routers) and trace:PATH (each MoE "
        "layer's top-k replayed from a routing trace .npz, bench/trace_routing.py)",
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="tiered")
    parser.add_argument("--shape", default="qwen3", choices=("qwen3", "tiny"), help="tiered")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--store", type=Path, help="resident: time this converted store (e.g. eval-moe-70m)"
    )
    parser.add_argument("--batch", default="1,4,16")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--experts", default="q2s", help="q2s and/or bfloat16, comma separated")
    parser.add_argument("--hf-tokens", type=int, default=16, help="0 skips the HF baseline")
    parser.add_argument(
        "--compile",
        default="on",
        choices=("on", "off", "both"),
        help="decode step through torch.compile before the CUDA graph",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="kernel table of eager steps (resident) or of graph replays (tiered)",
    )
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    if args.resident == args.tiered:
        parser.error("choose --resident or --tiered")
    if args.tiered:
        for name in args.strategy.split(","):
            if name not in ("auto", *STRATEGIES):
                parser.error(f"--strategy {name!r}: use auto or {', '.join(STRATEGIES)}")
        if args.device == "cuda" and not torch.cuda.is_available():
            parser.error("no CUDA device: run with --device cpu --shape tiny")
        if args.steps < 1:
            parser.error("--steps must be at least 1")
        if args.accelerate_tokens:
            import importlib.util

            if args.accelerate_tokens < 2:
                parser.error("--accelerate-tokens must be at least 2 (decode-only time)")
            if importlib.util.find_spec("accelerate") is None:
                parser.error(
                    "--accelerate-tokens needs the accelerate package; with no registry, carry a "
                    "wheel: pip download accelerate==1.13.0 --no-deps -d .carry/wheels (here), "
                    "pip install --no-deps .carry/wheels/accelerate-*.whl (there)"
                )
        run_tiered(args, run_info())
        return
    if args.steps < 16:
        parser.error("--steps must be at least 16 (8 eager steps, then the timed replays)")
    info = run_info()
    copy_bw = copy_bandwidth()
    emit({**info, "case": "copy", "GB/s": round(copy_bw / 1e9, 1)})
    shape = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    if args.store:  # a converted model: its own experts format, its config for the HF baseline
        shape = json.loads((args.store / "config.json").read_text())
        shape.pop("architectures", None)
        shape.pop("transformers_version", None)
    for experts in [args.store.name] if args.store else args.experts.split(","):
        start = time.perf_counter()
        if args.store:
            path = args.store
        else:
            path = write_synthetic_store(
                args.tmp / f"moetier-decode-{experts}-{args.layers}", shape, experts, DEFAULT_STORE
            )
            print(f"# store written in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        store = Store(path)
        layers = len(store.moe_layers)
        modes = {"on": [True], "off": [False], "both": [False, True]}[args.compile]
        for batch, compiled in ((int(b), c) for b in args.batch.split(",") for c in modes):
            t = time_native(path, batch, args.steps, compiled, args.profile)
            ms = float(t["ms"])  # type: ignore[arg-type]
            nbytes = active_bytes(store, batch)
            if t["kernels"]:
                for row in t["kernels"]:  # type: ignore[union-attr]
                    emit({**info, "case": "decode-profile", "layers": layers,
                          "batch": batch, "compiled": compiled, **row})  # fmt: skip
            rec = {**info, "case": "decode-resident", "layers": layers, "batch": batch,
                   "experts": experts, "compiled": compiled, "ms_per_step": round(ms, 4),
                   "tok_s": round(batch * 1e3 / ms, 1),
                   "eager_ms_per_step": round(float(t["eager_ms"]), 3),  # type: ignore[arg-type]
                   "active_MB": round(nbytes / 1e6, 1),
                   "GB/s": round(nbytes / ms / 1e6, 1),
                   "copy_GB/s": round(copy_bw / 1e9, 1)}  # fmt: skip
            first_experts = bool(args.store) or experts == args.experts.split(",")[0]
            first = compiled == modes[-1] and first_experts
            if args.hf_tokens and first:
                hf_ms = time_hf(shape, batch, args.hf_tokens)
                rec.update(hf_batched_mm_tok_s=round(batch * 1e3 / hf_ms, 2),
                           vs_hf=round(hf_ms / ms, 1))  # fmt: skip
            emit(rec)
        store.close()


if __name__ == "__main__":
    main()
