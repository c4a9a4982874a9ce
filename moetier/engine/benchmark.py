"""`moetier bench`'s measurement: one case per batch size, run through the serving engine
(engine/engine.py) the way `moetier serve` and `moetier generate` run (same engine config, same
decode path: the compiled, graphed step where it applies), with the floor of the decode step
from link speeds measured in the same run.

A case: `warmup` untimed runs of the same shape on other prompts (they fill the expert cache
and move the zero-copy hot set; the engine compiled and captured its decode steps when it was
built), then one timed run of `rows` random prompts of `prompt_tokens` tokens each, greedy, for
exactly `new_tokens` tokens a row (end-of-sequence tokens included), every row queued at once
(`time_rows`). The prefill runs until every row has its first token; the decode from there to
the end. The residency counters are read where the decode starts and where it ends.

The floor of a decode step (residency/cost.py `floor_seconds`): the bytes it must read under
uniform routing, at the measured link speeds: every dense weight (an untied embedding: one row
per sequence) and each MoE layer's expected distinct experts, at memory-copy speed; of those
experts, the share that this budget's expert cache cannot hold crosses from host RAM at the
pinned-copy speed, or, beyond what the host tier holds, from the store's file at the disk
speed. KV-cache reads are left out. On CPU the memory figures are host memcpys.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moetier.engine.engine import Engine
from moetier.engine.runner import PagedRunner
from moetier.engine.sampler import SamplingParams
from moetier.engine.timing import GenerationTiming
from moetier.loader.loaded_model import LoadedModel
from moetier.residency.cost import (
    LinkSpeeds,
    TokenTraffic,
    distinct_experts,
    floor_seconds,
    zero_copy_floor_seconds,
)
from moetier.residency.telemetry import served_bytes

FLOOR_KIND = (
    "uniform routing over this expert budget: active bytes at memory-copy speed + missed bytes "
    "at pinned host-to-GPU copy speed (CPU: a host copy) + disk bytes at disk speed; KV cache "
    "not counted"
)


@dataclass(frozen=True)
class BenchCase:
    rows: int  # sequences decoded together
    prompt_tokens: int  # per row
    new_tokens: int  # per row; the first comes from the prefill


def random_prompts(rows: int, tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`rows` prompts of `tokens` token ids drawn uniformly from the vocabulary (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (rows, tokens), generator=generator).tolist()


def decode_path(engine: Engine) -> str:
    """How the engine decodes: the transformers model class, or the native model file eagerly
    or replayed from CUDA graphs (compiled or not; experts pinned, or zero-copy from host
    RAM; the packed prefill steps compiled or not)."""
    runner = engine.runner
    if not isinstance(runner, PagedRunner):
        return "transformers"
    if not runner.use_graphs:
        return "native"
    compiled = ", compiled" if engine.loaded.engine_config.compile_decode else ""
    zero_copy = engine.loaded.runtime.zero_copy is not None
    prefill = ", prefill compiled" if runner.prefill is not None else ""
    return (
        f"native, CUDA graphs{compiled}, "
        + ("zero-copy" if zero_copy else "experts pinned")
        + prefill
    )


_RUNS = itertools.count()


def time_rows(
    engine: Engine,
    prompts: list[list[int]],
    new_tokens: int,
    on_step: Callable[[], object] = lambda: None,
    on_decode: Callable[[], object] = lambda: None,
) -> GenerationTiming:
    """Queue every prompt at once, greedy, exactly `new_tokens` tokens each, and step the
    engine to the end; -> the timing (engine/timing.py's figures). `on_step` after each step;
    `on_decode` once, when every row has its first token (the decode starts)."""
    greedy = SamplingParams(temperature=0, max_new_tokens=new_tokens)
    run = next(_RUNS)
    timing = GenerationTiming(len(prompts), sum(len(p) for p in prompts))
    start = time.perf_counter()
    requests = [
        engine.add(f"bench-{run}-{i}", prompt, greedy, max_tokens=new_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts)
    ]
    decode_began: float | None = None
    while engine.has_work:
        engine.step()  # its sampled tokens are on the host when it returns
        on_step()
        now = time.perf_counter()
        if decode_began is None:
            if all(r.output for r in requests):
                decode_began = now
                timing.prefill_seconds = now - start
                timing.steps = 1
                on_decode()
        else:
            timing.steps += 1
            timing.decode_seconds = now - decode_began
    timing.new_tokens = sum(len(r.output) for r in requests)
    return timing


def dense_step_bytes(model: nn.Module, rows: int) -> int:
    """Bytes of the non-expert weights one decode step of `rows` rows reads: every parameter
    (tied ones once) at its stored size, but an embedding table that is not also the output head
    gives one row per sequence."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    elsewhere = {
        id(p)
        for m in model.modules()
        if not isinstance(m, nn.Embedding)
        for p in m.parameters(recurse=False)
    }
    total = 0
    for p in model.parameters():
        if id(p) in embeddings and id(p) not in elsewhere:
            total += rows * p.shape[-1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def decode_traffic(loaded: LoadedModel, rows: int) -> TokenTraffic:
    """The bytes of one decode step of `rows` rows by tier, under uniform routing and the best
    placement this budget allows (the floor's traffic; see the module docstring)."""
    runtime, store, cfg = loaded.runtime, loaded.store, loaded.model_config
    planes = runtime.planes() if runtime.delta_threshold == 0 else ["base"]
    keys = [k for k in store.blobs if k[2] in planes]
    per_expert = sum(store.blobs[k].nbytes for k in keys) / (len(keys) / len(planes))
    experts = len(store.moe_layers) * distinct_experts(cfg.num_experts, cfg.top_k, rows)
    expert_bytes = experts * per_expert
    pool = runtime.residency
    held = 1.0 if runtime.pinned else min(1.0, pool.capacity / len(keys))
    in_host = sum(1 for k in keys if k in pool.host) / len(keys) if pool.host is not None else 0.0
    host = min(1.0 - held, in_host)
    return TokenTraffic(
        dense=dense_step_bytes(loaded.model, rows),
        gpu=held * expert_bytes,
        host=host * expert_bytes,
        disk=(1.0 - held - host) * expert_bytes,
    )


def run_case(
    engine: Engine,
    case: BenchCase,
    speeds: LinkSpeeds | None,
    warmup: int = 1,
    on_step: Callable[[], object] = lambda: None,
) -> dict[str, Any]:
    """Time one case (module docstring); the figures of its JSON line. `speeds`: the link
    speeds for the floor (None: no floor). `on_step` is called after every step, warm-up
    included (a progress bar)."""
    loaded = engine.loaded
    runtime = loaded.runtime
    vocab = loaded.model_config.vocab_size
    for i in range(warmup):
        prompts = random_prompts(case.rows, case.prompt_tokens, vocab, seed=1000 + i)
        time_rows(engine, prompts, case.new_tokens, on_step)
    marks: list[Any] = []
    timing = time_rows(
        engine,
        random_prompts(case.rows, case.prompt_tokens, vocab, seed=0),
        case.new_tokens,
        on_step,
        on_decode=lambda: marks.append(runtime.telemetry()),
    )
    decode_start = marks[0]
    counters = runtime.telemetry().since(decode_start)
    spec = engine.spec_stats()
    decode_steps = timing.steps - 1
    cache = runtime.residency.tier_name
    requests = counters[cache].hits + counters[cache].misses
    blobs = [b.nbytes for k, b in loaded.store.blobs.items() if k[2] in runtime.planes()]
    served = served_bytes(counters, cache, sum(blobs) / len(blobs))
    tokens = max(1, timing.decode_tokens)
    ms_per_step = timing.decode_seconds / decode_steps * 1e3 if decode_steps else None
    record: dict[str, Any] = {
        "batch": case.rows,
        "prompt_tokens": case.prompt_tokens,
        "new_tokens": case.new_tokens,
        "warmup_runs": warmup,
        "tokens_in": timing.prompt_tokens,
        "tokens_out": timing.new_tokens,
        "prefill_s": _sig(timing.prefill_seconds),
        "ttft_ms": _sig(timing.prefill_seconds * 1e3),
        "prefill_tok_s": _sig(timing.prefill_tok_s),
        "decode_s": _sig(timing.decode_seconds),
        "decode_tokens": timing.decode_tokens,
        "decode_tok_s": _sig(timing.decode_tok_s) if decode_steps else None,
        "ms_per_step": _sig(ms_per_step) if ms_per_step else None,
        "cache_tier": cache,
        "hit_rate": round(counters[cache].hits / requests, 4) if requests else None,
        "bytes_per_token": {tier: round(n / tokens) for tier, n in served.items()},
    }
    if spec is not None:  # the acceptance over the engine's life (warm-up runs included)
        record["speculative"] = {
            "k": engine.speculative,
            "drafted_by_position": spec.drafted,
            "accepted_by_position": spec.accepted,
            "acceptance": round(spec.acceptance, 4),
            "mean_accepted": round(spec.mean_accepted, 4),
        }
        runner = engine.runner  # where verify steps and drafting ran: graphed or not
        drafter = getattr(runner, "drafter", None)
        if isinstance(runner, PagedRunner) and drafter is not None:
            record["speculative"] |= {
                "verify_graphed": runner.verify_graphed,
                "verify_packed": runner.verify_packed,
                "drafts_graphed": drafter.graphed,
                "drafts_eager": drafter.eager,
            }
    record.update(floor_fields(loaded, case.rows, speeds, ms_per_step))
    return record


def _sig(x: float, digits: int = 5) -> float:
    """`x` to `digits` significant digits (figures from microseconds to minutes)."""
    return float(f"{x:.{digits}g}")


def floor_fields(
    loaded: LoadedModel, rows: int, speeds: LinkSpeeds | None, ms_per_step: float | None
) -> dict[str, Any]:
    """The floor of a decode step of `rows` rows, its tok/s and the measured step's ratio to it
    (None without link speeds)."""
    if speeds is None:
        return {"floor_ms_per_step": None, "floor_tok_s": None, "ratio_to_floor": None}
    traffic = decode_traffic(loaded, rows)
    floor_ms = floor_seconds(traffic, speeds) * 1e3
    fields = {
        "floor_ms_per_step": _sig(floor_ms),
        "floor_tok_s": _sig(rows * 1e3 / floor_ms),
        "ratio_to_floor": _sig(ms_per_step / floor_ms, 4) if ms_per_step else None,
        "floor_kind": FLOOR_KIND,
        "floor_bytes_per_step": {
            "active": round(traffic.active),
            "missed": round(traffic.host + traffic.disk),
            "disk": round(traffic.disk),
        },
    }
    zero_copy = zero_copy_floor_seconds(traffic, speeds)
    if traffic.host > 0 and zero_copy is not None:  # misses read by the kernels from host RAM
        fields["floor_zero_copy_ms_per_step"] = _sig(zero_copy * 1e3)
        if ms_per_step:
            fields["ratio_to_zero_copy_floor"] = _sig(ms_per_step / (zero_copy * 1e3), 4)
    return fields
