"""Predicted prefill and decode speed of a plan, and the auto-planner's ranking of candidate
configurations (`moetier plan --predict`, the recipes).

A decode step of B rows reads, by the planner's uniform-access model (residency/planner.py):
the dense weights once (an embedding table that is not the head: one row per sequence), and
per MoE layer B x top-k (token, expert) pairs, each read once by the per-pair kernels (the
grouped kernel, which reads an expert once for all its pairs, runs from GROUPED_FROM rows).
A share `hit` = GPU base slots / base blobs of those reads finds its expert in a GPU slot; of
the rest, the host tier serves the share it holds, the store's file the remainder. The cost
model (residency/cost.py `miss_costs`) turns those bytes into seconds: zero-copy where the host
tier holds every miss (the native CUDA-graph step reads them in place), else blocking fetches of
the distinct missed experts. A fixed time per decoder layer (launches, attention, norms; what a
byte count misses) comes on top.

A prefill chunk of t tokens (B rows x P prompt tokens in chunks of at most `chunk_tokens`)
computes 2 x active parameters x t FLOPs, reads the dense weights and the layer's distinct
experts from GPU memory and moves the missing ones from host RAM or disk (streamed,
overlapped with compute: the larger of the two counts), plus a fixed time per layer.

The fixed times and the prefill compute rate are not links this machine can measure in a few
seconds; they come from one measured run (DEFAULT_STEP, with where each figure comes from), as
do the link speeds used where a link is not measured (DEFAULT_LINKS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from moetier.config import ModelConfig
from moetier.core.layout import BlobFormat
from moetier.quant.dense_formats import AUTO_ORDER
from moetier.residency.cost import LinkSpeeds, TokenTraffic, distinct_experts, miss_costs
from moetier.residency.planner import Plan

# The H100 link speeds of docs/results/models-dense-budget-h100.jsonl (code of 9fb19a1, the
# 25% budget lines of `moetier bench --shape qwen3-30b-a3b --layers 8`): HBM copy 2,992 GB/s,
# pinned H2D 54.79 GB/s, zero-copy read 34.35 GB/s, the store's disk 1.399 GB/s.
DEFAULT_LINKS = LinkSpeeds(hbm=2992e9, h2d=54.79e9, zero_copy=34.35e9, disk=1.399e9)
DEFAULT_LINKS_SOURCE = "H100 of docs/results/models-dense-budget-h100.jsonl (9fb19a1)"

# rows from which the MoE op groups pairs by expert (reads each distinct expert once);
# kernels/moe_dispatch.py takes the grouped kernel at 64 tokens resident (006f082)
GROUPED_FROM = 64


@dataclass(frozen=True)
class StepCosts:
    """What byte counts miss: seconds per decoder layer of a decode step and of a prefill
    chunk, and the prefill's effective compute rate (FLOP/s)."""

    decode_layer_s: float
    prefill_layer_s: float
    prefill_flops: float
    source: str = ""


# From docs/results/bench-verb-qwen3-8l-h100.jsonl and models-dense-budget-h100.jsonl (H100,
# the 8-layer Qwen3-30B-A3B slice, experts pinned, CUDA graphs, bf16 dense):
#   decode: 0.63904 ms a step at one row against 0.14332 ms of bytes at HBM speed (its floor):
#     (0.63904 - 0.14332) / 8 layers = 62 us a layer;
#   prefill: 18.0 ms to first token for 128 tokens (bytes and FLOPs under 0.2 ms): 2.2 ms a
#     layer; 8 rows x 128 tokens took 21.906 ms against one row's 18.847 ms: 896 more tokens x
#     56.6 M active parameters a layer x 2 x 8 layers in 3.06 ms = 265 TFLOP/s.
# Other families (GLM-5, DeepSeek-V4: eager native steps at 9fb19a1) took longer; not modelled.
DEFAULT_STEP = StepCosts(
    decode_layer_s=62e-6,
    prefill_layer_s=2.2e-3,
    prefill_flops=265e12,
    source="Qwen3-30B-A3B 8-layer slice on the H100 (docs/results/bench-verb-qwen3-8l-h100.jsonl, "
    "models-dense-budget-h100.jsonl)",
)


@dataclass(frozen=True)
class ModelCounts:
    """What the speed model needs of a model beyond its plan: decoder layers, experts, top-k,
    hidden size, the parameters of one routed expert, the dense matmul parameters a token uses
    (embedding table left out), and the embedding table's bytes counted on the GPU where a
    step reads only its rows (0: tied to the head or in host RAM)."""

    layers: int
    experts: int
    top_k: int
    hidden: int
    expert_params: int
    dense_params: int
    embed_gpu_bytes: int


def model_counts(
    hf_config: dict[str, Any], embeddings_host: bool = False, dtype_bytes: int = 2
) -> ModelCounts:
    """ModelCounts of `hf_config` from the planner's meta-device tensors (no weights)."""
    from moetier.quant.dense_formats import dense_class
    from moetier.residency.planner import _shape_tensors

    cfg = ModelConfig.from_hf(hf_config)
    tensors, _ = _shape_tensors(hf_config)
    dense = embed = 0
    for name, (shape, _, floating) in tensors.items():
        numel = math.prod(shape)
        if not floating or len(shape) < 2:
            continue
        if dense_class(name, len(shape)) == "embed":
            embed += numel
        else:
            dense += numel
    tied = bool(hf_config.get("tie_word_embeddings", False))
    embed_gpu = 0 if (embeddings_host or tied) else embed * dtype_bytes
    if tied:
        dense += embed  # the table is also the head: every step reads it whole
    inter = cfg.expert_intermediate_size
    return ModelCounts(
        layers=cfg.num_layers,
        experts=cfg.num_experts,
        top_k=cfg.top_k,
        hidden=cfg.hidden_size,
        expert_params=3 * cfg.hidden_size * inter,
        dense_params=dense,
        embed_gpu_bytes=embed_gpu,
    )


@dataclass(frozen=True)
class Shares:
    """Of the expert reads, the share served by GPU slots, host RAM and the disk."""

    gpu: float
    host: float
    disk: float


def shares(plan: Plan) -> Shares:
    if plan.gpu_base_slots >= plan.base_blobs:
        return Shares(1.0, 0.0, 0.0)
    hit = plan.gpu_base_slots / plan.base_blobs
    off = plan.base_blobs - plan.gpu_base_slots
    held = min(1.0, plan.host_blobs / off)
    return Shares(hit, (1 - hit) * held, (1 - hit) * (1 - held))


@dataclass(frozen=True)
class Prediction:
    """Predicted speeds of one plan: decode tok/s and ms a step, prefill tok/s, per batch
    size, and how decode serves its misses."""

    decode_tok_s: dict[int, float]
    decode_ms: dict[int, float]
    prefill_tok_s: dict[int, float]
    strategy: str
    shares: Shares


def decode_seconds(
    plan: Plan,
    counts: ModelCounts,
    rows: int,
    speeds: LinkSpeeds,
    step: StepCosts = DEFAULT_STEP,
    zero_copy: bool = True,
) -> tuple[float, str]:
    """(seconds of one decode step of `rows` rows, strategy); `zero_copy`: the engine can read
    misses in place (the native CUDA step)."""
    s = shares(plan)
    moe_layers = plan.blobs_per_token // max(1, counts.top_k)
    blob = plan.slot_bytes
    dense = plan.dense_bytes - counts.embed_gpu_bytes + rows * counts.hidden * 2
    distinct = distinct_experts(counts.experts, counts.top_k, rows)
    reads = distinct if rows >= GROUPED_FROM else rows * counts.top_k
    expert = moe_layers * reads * blob
    overhead = counts.layers * step.decode_layer_s
    if s.gpu == 1.0:
        return (dense + expert) / speeds.hbm + overhead, "resident"
    in_place = TokenTraffic(dense, expert * s.gpu, expert * s.host, expert * s.disk)
    fetched = moe_layers * distinct * blob  # blocking: each distinct missed expert copied once
    blocking = TokenTraffic(dense, expert * s.gpu, fetched * s.host, fetched * s.disk)
    costs = miss_costs(in_place, speeds)
    if zero_copy and math.isfinite(costs["zero_copy"]):
        return costs["zero_copy"] + overhead, "zero_copy"
    return miss_costs(blocking, speeds)["blocking"] + overhead, "blocking"


def prefill_seconds(
    plan: Plan,
    counts: ModelCounts,
    tokens: int,
    speeds: LinkSpeeds,
    step: StepCosts = DEFAULT_STEP,
    chunk_tokens: int = 2048,
) -> float:
    """Seconds to prefill `tokens` prompt tokens in chunks of `chunk_tokens`."""
    s = shares(plan)
    moe_layers = plan.blobs_per_token // max(1, counts.top_k)
    total = 0.0
    left = tokens
    while left > 0:
        t = min(left, chunk_tokens)
        left -= t
        active = counts.dense_params + moe_layers * counts.top_k * counts.expert_params
        compute = 2 * active * t / step.prefill_flops
        experts = moe_layers * distinct_experts(counts.experts, counts.top_k, t) * plan.slot_bytes
        dense = plan.dense_bytes - counts.embed_gpu_bytes
        moved = experts * (s.host + s.disk) / speeds.h2d + experts * s.disk / speeds.disk
        reads = (dense + experts) / speeds.hbm
        total += max(compute, reads + moved) + counts.layers * step.prefill_layer_s
    return total


def predict(
    plan: Plan,
    counts: ModelCounts,
    speeds: LinkSpeeds,
    batches: tuple[int, ...] = (1, 16),
    prompt_tokens: int = 128,
    step: StepCosts = DEFAULT_STEP,
    zero_copy: bool = True,
) -> Prediction:
    """Decode and prefill speed of `plan` at each batch size (`prompt_tokens` a row)."""
    decode_tok_s, decode_ms, prefill = {}, {}, {}
    strategy = "resident"
    for b in batches:
        seconds, strategy = decode_seconds(plan, counts, b, speeds, step, zero_copy)
        decode_ms[b] = seconds * 1e3
        decode_tok_s[b] = b / seconds
        tokens = b * prompt_tokens
        prefill[b] = tokens / prefill_seconds(plan, counts, tokens, speeds, step)
    return Prediction(decode_tok_s, decode_ms, prefill, strategy, shares(plan))


@dataclass(frozen=True)
class Option:
    """One candidate configuration: dense format, where the embedding table lives, its plan
    and predicted speeds."""

    dense: str
    embeddings: str
    plan: Plan
    prediction: Prediction
    notes: tuple[str, ...] = field(default=())

    @property
    def key(self) -> str:
        return f"dense {self.dense}, embeddings {self.embeddings}"


# a candidate within this share of the fastest batch-1 decode counts as fast enough: the most
# precise of those is chosen (a few percent of predicted speed do not buy a coarser format)
NEAR_BEST = 0.10


def candidates(
    hf_config: dict[str, Any],
    gpu_memory: int,
    host_memory: int,
    max_context: int,
    speeds: LinkSpeeds,
    experts: str | BlobFormat = "q2s",
    dense_kinds: tuple[str, ...] | None = None,
    step: StepCosts = DEFAULT_STEP,
    prompt_tokens: int = 128,
    zero_copy: bool = True,
    overrides: tuple[str, ...] | list[str] = (),
) -> tuple[list[Option], list[str]]:
    """Every (dense format, embeddings place) whose plan fits and is useful (one token's
    routed experts in GPU slots: residency/dense_choice.py), predicted; and one line per
    candidate refused, saying why."""
    from moetier.residency import dense_choice

    kinds = dense_kinds or AUTO_ORDER
    places = ("gpu", "host") if host_memory else ("gpu",)
    options: list[Option] = []
    refused: list[str] = []
    for place in places:
        counts = model_counts(hf_config, embeddings_host=place == "host")
        for kind in kinds:
            budgets = dict(
                gpu_memory=gpu_memory,
                host_memory=host_memory,
                max_context=max_context,
                batch=1,
                zero_copy_stage=3,
                embeddings_host=place == "host",
            )
            try:
                c = dense_choice.candidate(hf_config, kind, overrides, experts, **budgets)
            except ValueError as err:
                refused.append(f"dense {kind}, embeddings {place}: {err}")
                continue
            if not c.useful:
                refused.append(f"dense {kind}, embeddings {place}: {c.why_not()}")
                continue
            assert c.plan is not None
            p = predict(c.plan, counts, speeds, step=step, prompt_tokens=prompt_tokens,
                        zero_copy=zero_copy)  # fmt: skip
            options.append(Option(kind, place, c.plan, p))
    return options, refused


def store_candidates(
    store: Any,
    gpu_memory: int,
    host_memory: int,
    max_context: int,
    speeds: LinkSpeeds,
    step: StepCosts = DEFAULT_STEP,
    prompt_tokens: int = 128,
) -> tuple[list[Option], list[str]]:
    """`candidates` for a converted store (quant/store.py Store): its formats are fixed, so
    only the embedding table's place varies; planned from its index (`planner.plan`)."""
    import json

    from moetier.residency.dense_choice import useful
    from moetier.residency.planner import plan

    hf_config = json.loads((store.path / "config.json").read_text())
    hf_config.pop("quantization_config", None)
    dense = ",".join(sorted({f.name for f in store.dense_formats.values()})) or "bf16"
    options: list[Option] = []
    refused: list[str] = []
    for place in ("gpu", "host") if host_memory else ("gpu",):
        try:
            p = plan(store, gpu_memory, host_memory, max_context, 1, zero_copy_stage=3,
                     embeddings_host=place == "host")  # fmt: skip
        except ValueError as err:
            refused.append(f"embeddings {place}: {err}")
            continue
        if not useful(p):
            refused.append(f"embeddings {place}: fewer expert slots than one token's experts")
            continue
        counts = model_counts(hf_config, embeddings_host=place == "host")
        pred = predict(p, counts, speeds, step=step, prompt_tokens=prompt_tokens)
        options.append(Option(dense, place, p, pred))
    return options, refused


def best(options: list[Option]) -> Option:
    """The most precise option (list order: dense bf16 > fp8 > int4 > nvfp4, the table on the
    GPU before host RAM) whose batch-1 decode is within NEAR_BEST of the fastest."""
    if not options:
        raise ValueError("no configuration fits these budgets")

    fastest = max(o.prediction.decode_tok_s[1] for o in options)
    order = sorted(
        options,
        key=lambda o: (
            AUTO_ORDER.index(o.dense) if o.dense in AUTO_ORDER else 99,
            o.embeddings != "gpu",
        ),  # fmt: skip
    )
    return next(o for o in order if o.prediction.decode_tok_s[1] >= (1 - NEAR_BEST) * fastest)
