"""`--dense auto`: the largest dense precision whose plan leaves a useful expert cache.

Precisions are tried in the order bf16 > fp8 > int4 > nvfp4 (quant/dense_formats.AUTO_ORDER),
each planned from the model's config (`planner.plan_shape`, no weights). A plan is **useful**
when its GPU expert slots, the zero-copy staging slots not counted, hold at least one token's
routed experts (MoE layers × top-k base blobs, or every blob where there are fewer): a smaller
cache cannot keep even one decode step's experts, and a cache that small evicts each expert
before the next token comes back to its layer (docs/residency.md section 2: LRU falls to a 0%
hit rate below layers × k slots). Where no precision is useful, the refusal names the option
that would be (`--embeddings host`, which frees the embedding table's bytes), else the GPU
memory the smallest needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetier.core.layout import BlobFormat
from moetier.quant.dense_formats import AUTO_ORDER, DensePolicy
from moetier.residency.planner import Plan, plan_shape, size_flag, size_text

GIB = 2**30


def needed_slots(p: Plan) -> int:
    """The expert slots a useful plan keeps besides staging: one token's routed experts."""
    return min(p.blobs_per_token, p.base_blobs)


def cached_slots(p: Plan) -> int:
    """GPU base-plane slots that cache experts (staging slots rotate guesses, not counted)."""
    return p.gpu_base_slots - p.staging


def useful(p: Plan) -> bool:
    return cached_slots(p) >= needed_slots(p)


@dataclass(frozen=True)
class Candidate:
    """One precision planned: its plan, or why it could not be planned (the dense part,
    KV cache and workspace alone over the GPU budget)."""

    kind: str
    embeddings_host: bool
    plan: Plan | None
    error: str = ""

    @property
    def useful(self) -> bool:
        return self.plan is not None and useful(self.plan)

    @property
    def option(self) -> str:
        return f"--dense {self.kind}" + (" with --embeddings host" if self.embeddings_host else "")

    def why_not(self) -> str:
        """Why this candidate is not useful, in a few words."""
        if self.plan is None:
            return f"{self.kind}: the dense part does not fit ({self.error})"
        p = self.plan
        return (
            f"{self.kind}: dense {size_text(p.dense_bytes)} leaves {cached_slots(p)} expert "
            f"slots, fewer than one token's {needed_slots(p)}"
        )

    def fits_text(self) -> str:
        """'--dense int4 with --embeddings host fits: dense ..., N expert slots ...'."""
        assert self.plan is not None
        p = self.plan
        return (
            f"{self.option} fits: dense {size_text(p.dense_bytes)} on the GPU, "
            f"{cached_slots(p)} expert slots (one token reads {needed_slots(p)})"
        )


@dataclass(frozen=True)
class DenseChoice:
    """What `--dense auto` chose: the precision, its plan, and the larger ones refused."""

    kind: str
    plan: Plan
    refused: tuple[Candidate, ...]

    def policy(self, overrides: tuple[str, ...] | list[str] = ()) -> DensePolicy:
        return DensePolicy.parse(self.kind, overrides)

    def summary(self) -> str:
        p = self.plan
        why = "; ".join(c.why_not() for c in self.refused)
        return (
            f"--dense auto chose {self.kind}: {cached_slots(p)} expert slots on the GPU, at least "
            f"one token's {needed_slots(p)} (MoE layers x top-k) needed"
            + (f" ({why})" if why else " (the largest precision)")
        )


def candidate(
    hf_config: dict[str, Any],
    kind: str,
    overrides: tuple[str, ...] | list[str] = (),
    experts: str | BlobFormat = "q2s",
    **budgets: Any,
) -> Candidate:
    """`kind` (a `--dense` format) planned under `budgets` (plan_shape's keyword arguments)."""
    policy = DensePolicy.parse(kind, overrides)
    host = bool(budgets.get("embeddings_host", False))
    try:
        p = plan_shape(hf_config, experts=experts, dense=policy, **budgets)
    except ValueError as err:
        if "--embeddings host" in str(err):  # the table does not fit the host budget
            raise
        return Candidate(kind, host, None, _short(str(err)))
    return Candidate(kind, host, p)


def choose_dense(
    hf_config: dict[str, Any],
    gpu_memory: int,
    overrides: tuple[str, ...] | list[str] = (),
    experts: str | BlobFormat = "q2s",
    **budgets: Any,
) -> DenseChoice:
    """The first of AUTO_ORDER whose plan is useful; ValueError naming what would be
    (`refusal`) when none is. `budgets`: plan_shape's other keyword arguments."""
    budgets["gpu_memory"] = gpu_memory
    refused: list[Candidate] = []
    for kind in AUTO_ORDER:
        c = candidate(hf_config, kind, overrides, experts, **budgets)
        if c.useful:
            assert c.plan is not None
            return DenseChoice(kind, c.plan, tuple(refused))
        refused.append(c)
    raise ValueError(refusal(hf_config, refused, overrides, experts, **budgets))


def suggest(
    hf_config: dict[str, Any],
    overrides: tuple[str, ...] | list[str] = (),
    experts: str | BlobFormat = "q2s",
    **budgets: Any,
) -> str:
    """The largest option that leaves a useful cache under `budgets` ('--dense fp8 fits: ...'),
    trying `--embeddings host` next where the table is on the GPU; '' when none does."""
    tries = [bool(budgets.get("embeddings_host", False))]
    if not tries[0] and budgets.get("host_memory", 0):
        tries.append(True)  # the table needs a host budget to go to
    for host in tries:
        for kind in AUTO_ORDER:
            c = candidate(
                hf_config, kind, overrides, experts, **dict(budgets, embeddings_host=host)
            )
            if c.useful:
                return c.fits_text()
    return ""


def refusal(
    hf_config: dict[str, Any],
    refused: list[Candidate],
    overrides: tuple[str, ...] | list[str] = (),
    experts: str | BlobFormat = "q2s",
    **budgets: Any,
) -> str:
    """Why `--dense auto` found nothing useful, and what would be."""
    gpu = budgets["gpu_memory"]
    lines = [
        f"--dense auto: no dense precision leaves a useful expert cache on --gpu-memory "
        f"{size_flag(gpu, up=False)} (one token's routed experts, MoE layers x top-k, besides "
        "staging): " + "; ".join(c.why_not() for c in refused)
    ]
    other = suggest(hf_config, overrides, experts, **budgets)
    if other:
        return f"{lines[0]}. {other}"
    need, kind = min(
        (min_gpu_memory(hf_config, k, overrides, experts, **budgets), k) for k in AUTO_ORDER
    )
    host = " with --embeddings host" if budgets.get("host_memory", 0) else ""
    return (
        f"{lines[0]}. The least that would do, --dense {kind}{host}, needs --gpu-memory "
        f"{size_flag(need)} or more (or a shorter --max-context)"
    )


def min_gpu_memory(
    hf_config: dict[str, Any],
    kind: str,
    overrides: tuple[str, ...] | list[str] = (),
    experts: str | BlobFormat = "q2s",
    **budgets: Any,
) -> int:
    """The least --gpu-memory in whole MiB at which `kind` is useful (the table in host RAM
    where there is a host budget for it): useful there, not 1 MiB less."""
    if budgets.get("host_memory", 0):
        budgets = dict(budgets, embeddings_host=True)
    mib = 2**20

    def ok(mibs: int) -> bool:
        budget = dict(budgets, gpu_memory=mibs * mib)
        return candidate(hf_config, kind, overrides, experts, **budget).useful

    lo, hi = 0, -(-max(int(budgets["gpu_memory"]), GIB) // mib)  # in MiB; none useful at 0
    while not ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi * mib


def _short(message: str) -> str:
    """The planner's refusal up to its advice ('the dense weights (...) ... need X GiB')."""
    return message.split(", more than --gpu-memory")[0]


def convert_expert_format(
    hf_config: dict[str, Any],
    experts: str,
    group: int = 32,
    down_group: int | None = None,
    source_fp4: str | None = None,
) -> BlobFormat:
    """The base-plane blob `moetier convert --experts EXPERTS` writes for `hf_config`, before
    per-layer overrides: q2s / int2 / affine2 (gate_up at `group`, down at `down_group`, 16 for
    q2s by default), nvfp4 / mxfp4, nested (its base plane), or source: the checkpoint's own
    FP4 codes where it has them (`source_fp4`, quant/sources.SourceQuantization.fp4), else the
    config's float dtype (FP8 experts are dequantised to it)."""
    from moetier.config import ModelConfig
    from moetier.core.layout import (
        MatrixCodec,
        coded_expert_format,
        fp4_expert_format,
        nested_expert_formats,
        raw_expert_format,
    )

    cfg = ModelConfig.from_hf(hf_config)
    hidden, inter, bias = cfg.hidden_size, cfg.expert_intermediate_size, cfg.expert_has_bias
    if experts in ("q2s", "int2", "affine2"):
        down = down_group or (16 if experts == "q2s" else group)
        return coded_expert_format(
            MatrixCodec(experts, group), MatrixCodec(experts, down), hidden, inter, bias
        )
    if experts in ("nvfp4", "mxfp4"):
        return fp4_expert_format(experts, hidden, inter, bias)
    if experts == "nested":
        return nested_expert_formats(hidden, inter, bias)[0]
    if experts != "source":
        raise ValueError(f"unknown --experts {experts!r}")
    if source_fp4 is not None:
        return fp4_expert_format(source_fp4, hidden, inter, bias)
    dtype = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16")
    return raw_expert_format(dtype, hidden, inter, bias)


def choose_for_convert(args: Any) -> DenseChoice:
    """`moetier convert --dense auto`: choose_dense over the source's config.json with the
    conversion's expert format and the budgets given beside it (args: convert's namespace)."""
    from pathlib import Path

    from moetier.config import read_json
    from moetier.quant.sources import CHECKPOINT_FIX, detect_quantization
    from moetier.residency.planner import parse_bytes

    if not args.gpu_memory:
        raise ValueError("--dense auto needs --gpu-memory (the card it will run on, e.g. 24GiB)")
    src = Path(args.hf_dir)
    config = read_json(src / "config.json", CHECKPOINT_FIX)
    config.pop("quantization_config", None)  # the store's formats are moetier's own
    source = detect_quantization(src)
    fmt = convert_expert_format(
        config, args.experts, args.group, args.down_group, source.fp4 if source else None
    )
    return choose_dense(
        config,
        parse_bytes(args.gpu_memory),
        overrides=args.dense_override,
        experts=fmt,
        host_memory=parse_bytes(args.host_memory or "0"),
        max_context=args.max_context,
        zero_copy_stage=3,
        embeddings_host=args.embeddings == "host",
    )
