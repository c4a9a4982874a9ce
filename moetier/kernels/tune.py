"""Tuning the experts kernels on the card that runs them (`moetier tune`, `bench/kernels.py
--tune`; docs/kernels.md, "Tuning").

A `Job` is one table entry pair (gate_up's and down's config) for one call size: the pair the
dispatcher takes today is timed first, then, one at a time, gate_up's candidate tiles (with the
best down), down's (with the best gate_up), then options toggled on one launch (greedy: kept
where the pair gets faster). Candidates come in the order they most often won (the H200's
tables), so a search cut short by its time keeps the likeliest gains. `tune` runs jobs in the
order given (the caller's: most valuable first, decode at 1 token before 2, 4, 8, then prefill)
within a time bound, each a share of what is left by its weight, and returns the best pair of
each job it started. The timing function is a parameter (`Timer`): on the GPU `GpuTimer` (CUDA
graphs of calls over routings whose experts exceed L2), in tests a fake one.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat
from moetier.kernels import moe_dispatch, tuned_tables
from moetier.kernels.blob_decode import matrix_spec
from moetier.kernels.moe_dispatch import KernelChoice, config_key

# the KernelChoice fields a table entry holds, per kernel
GEMV_FIELDS = ("block_n", "block_k", "num_warps", "int8_act", "group_acc", "prefetch_l2",
               "quant_in", "quant_pdl", "depth", "pipe", "pipe_x", "split_k", "pairs",
               "row_tiles", "maxnreg", "next_l2", "next_l2_at", "unroll", "gluon",
               "prime", "delta_ahead", "wait_first")  # fmt: skip
MMA_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
GENERIC_FIELDS = ("grouped", "use_dot", "block_m", "block_n", "block_k", "split_k", "num_warps",
                  "num_stages")  # fmt: skip
# options that only do something on sm_90 (Gluon, PDL, L2 prefetch): not tried elsewhere
SM90_ONLY = ("prefetch_l2", "next_l2", "gluon", "wait_first", "quant_pdl")
DECODE_TOKENS = (1, 2, 4, 8)
PREFILL_TOKENS = (512, 4096)
L2_BYTES = 50 * 2**20  # reads of routings over 4x this come from HBM


def config_entry(c: KernelChoice, fields: tuple[str, ...]) -> dict[str, Any]:
    """A tuned table entry: these fields of c."""
    return {f: getattr(c, f) for f in fields}


def q2s_gemv_tiles(zero_copy: bool = False, delta: bool = False) -> list[KernelChoice]:
    """The q2s GEMV's tile candidates (rows per program, BLOCK_K, warps; int8 activations only:
    the float path lost every shape by 2-3x, docs/benchmarks.md), the tiles that won most
    often on the H200 first; with sums per q2s group (half the accumulators, so 32 words and
    rows per thread fit); zero_copy: whole rows per K tile too (reads over PCIe); without a
    delta plane each also with activations and scales through shared memory (pipe_x: it
    changes registers and stalls enough to reorder the tiles; H200: it won DeepSeek-V3 6-11%)."""
    base = moe_dispatch.Q2S_GEMV
    cands = [
        replace(base, block_n=bn, block_k=bk, num_warps=w, int8_act=True)
        for bn, bk, w in [(64, 512, 4), (32, 1024, 4), (32, 512, 4), (64, 512, 8),
                          (128, 512, 8), (128, 512, 4), (64, 256, 4), (128, 256, 4),
                          (64, 1024, 4), (32, 256, 2)]
    ] + [
        replace(base, block_n=bn, block_k=bk, num_warps=w, group_acc=True)
        for bn, bk, w in [(64, 512, 4), (128, 512, 8), (64, 1024, 8), (64, 1024, 4),
                          (128, 512, 4), (128, 1024, 8)]
        + ([(32, 1024, 4), (32, 2048, 4), (32, 2048, 8), (64, 2048, 8)] if zero_copy else [])
    ]  # fmt: skip
    return cands if delta else cands + [replace(c, pipe_x=True) for c in cands]


def q2s_gemv_options(delta: bool = False, sm90: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """The q2s GEMV's options, each on one launch ("gu" or "dn"), tried one at a time on the best
    pair: the Gluon kernel (sm_90, no delta plane; gate_up rounding x itself or reading the
    rounding launch's words; a tile it cannot run raises, which scores inf) and gate_up waiting
    before it reads anything (wait_first: a no-op back to back, `first_pdl`) first, the H200's
    largest gains; rows asked for in L2 first; more K tiles of weights in flight (depth 2 or
    pipe 3-4; with a delta, pipe_x); split_k 2, two pairs of an expert a program (pairs 2: not
    with a delta plane); gate_up rounding x itself (quant_in), the rounding launches with PDL
    (quant_pdl); two row tiles a program with registers capped at 128; gate_up asking L2 for
    down's weights when done or 1-2 K tiles before (next_l2); gate_up's loop unrolled twice;
    the second K tile asked for before the wait (prime); sums per q2s group; with a delta,
    the delta's next K tile loaded ahead. `sm90`: False leaves out what only sm_90 runs."""
    options: list[tuple[str, dict[str, Any]]] = []
    if not delta:
        options += [("gu", {"gluon": True, "quant_in": True}), ("gu", {"gluon": True}),
                    ("dn", {"gluon": True})]  # fmt: skip
    options += [("gu", {"wait_first": True})]
    options += [("gu", {"prefetch_l2": True}), ("dn", {"prefetch_l2": True})]
    ahead = ({"pipe_x": True},) if delta else ({"depth": 2}, {"pipe": 3}, {"pipe": 4})
    options += [(launch, a) for launch in ("gu", "dn") for a in ahead]
    two = ("split_k",) if delta else ("split_k", "pairs")
    options += [(launch, {f: 2}) for launch in ("gu", "dn") for f in two]
    options += [] if delta else [("gu", {"quant_in": True}), ("gu", {"quant_pdl": True})]
    options += [(launch, {"row_tiles": 2, "maxnreg": 128}) for launch in ("gu", "dn")]
    options += [("gu", {"next_l2": True, "next_l2_at": at}) for at in (0, 1, 2)]
    options += [("gu", {"unroll": 2})] + [(launch, {"prime": True}) for launch in ("gu", "dn")]
    options += [(launch, {"group_acc": True}) for launch in ("gu", "dn")]
    if delta:
        options += [(launch, {"delta_ahead": True}) for launch in ("gu", "dn")]
    if not sm90:
        options = [(l, o) for l, o in options if not any(k in SM90_ONLY for k in o)]  # noqa: E741
    return options


def q2s_mma_tiles(rows: int) -> list[KernelChoice]:
    """The q2s prefill kernel's tiles (BLOCK_M at most twice the mean rows per expert)."""
    return [
        replace(moe_dispatch.Q2S_MMA, block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                num_stages=st)
        for bm, bn, bk, w, st in [
            (64, 64, 64, 4, 3), (128, 64, 64, 4, 3), (32, 128, 64, 4, 3), (32, 64, 128, 4, 3),
            (64, 128, 64, 8, 3), (128, 128, 64, 8, 3), (16, 64, 64, 4, 3), (16, 128, 64, 4, 3),
            (32, 64, 64, 4, 3), (64, 64, 128, 4, 3), (128, 64, 64, 8, 3), (64, 64, 64, 4, 4),
        ]
        if bm <= max(16, 2 * rows)
    ]  # fmt: skip


def generic_tiles(start: KernelChoice) -> list[KernelChoice]:
    """The generic kernel's candidates: for the GEMV mode (few pairs) its tiles and split-K,
    and a few grouped tl.dot ones; for the grouped mode its tiles."""
    if not start.grouped:
        return [
            replace(start, block_n=bn, block_k=bk, split_k=sk)
            for bn in (16, 32, 64) for bk in (128, 256) for sk in (1, 2, 4, 8)
            if bn * bk <= 8192
        ] + [
            replace(moe_dispatch.GEMM, block_m=16, block_n=bn, block_k=bk, split_k=sk)
            for bn, bk, sk in [(64, 128, 1), (64, 128, 4), (32, 256, 2)]
        ]  # fmt: skip
    return [
        replace(start, block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st)
        for bm, bn, bk, w, st in [
            (64, 128, 32, 4, 4), (64, 64, 32, 4, 3), (32, 64, 32, 4, 3), (16, 64, 32, 4, 3),
            (64, 128, 32, 8, 3), (128, 128, 32, 8, 3), (128, 64, 32, 4, 4), (32, 128, 32, 4, 4),
        ]
    ]  # fmt: skip


@dataclass
class Job:
    """One (gate_up, down) table entry pair to tune: `kind` "q2s-gemv" (with a delta plane or
    zero-copy its own keys), "q2s-mma" or "generic"; scored over `tokens` (the sum of each
    size's time over the start pair's)."""

    label: str
    kind: str
    keys: tuple[str, str]
    fields: tuple[str, ...]
    tokens: tuple[int, ...]
    start: tuple[KernelChoice, KernelChoice]
    gu_cands: list[KernelChoice]
    dn_cands: list[KernelChoice]
    options: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    weight: float = 1.0
    shape: Any = None  # what the timer needs to run a call (`TuneShape` for GpuTimer)

    def compatible(self, c_gu: KernelChoice, c_dn: KernelChoice) -> bool:
        """Whether a call runs these two launches together (both walk the same pairs)."""
        if self.kind == "q2s-mma":
            return c_gu.block_m == c_dn.block_m
        if self.kind == "generic":
            return (c_gu.grouped, c_gu.use_dot, c_gu.block_m) == (
                c_dn.grouped, c_dn.use_dot, c_dn.block_m)  # fmt: skip
        return c_gu.int8_act == c_dn.int8_act

    def partner(self, c_gu: KernelChoice, c_dn: KernelChoice) -> KernelChoice:
        """The down launch that runs with gate_up `c_gu`: `c_dn`, or the nearest it can."""
        if self.compatible(c_gu, c_dn):
            return c_dn
        if self.kind == "q2s-mma":
            return replace(c_dn, block_m=c_gu.block_m)
        if self.kind == "generic":
            return replace(c_gu, split_k=1) if c_gu.grouped else self.start[1]
        return replace(c_dn, int8_act=c_gu.int8_act)

    @property
    def size(self) -> int:
        """Pairs timed at most."""
        return 1 + len(self.gu_cands) + len(self.dn_cands) + len(self.options)

    def entries(self, c_gu: KernelChoice, c_dn: KernelChoice) -> dict[str, dict[str, Any]]:
        if self.kind == "generic":
            c_dn = replace(c_dn, split_k=1)
        return {self.keys[0]: config_entry(c_gu, self.fields),
                self.keys[1]: config_entry(c_dn, self.fields)}  # fmt: skip


def _dedupe(cands: Iterable[KernelChoice]) -> list[KernelChoice]:
    return list(dict.fromkeys(cands))


def q2s_gemv_job(
    gu_nk: tuple[int, int], dn_nk: tuple[int, int], tokens: Sequence[int], top_k: int,
    suffix: str = "", zero_copy: bool = False, delta: bool = False, sm90: bool = True,
    label: str = "", shape: Any = None, weight: float = 1.0,
) -> Job:  # fmt: skip
    """The q2s GEMV's job at `tokens` (one entry serves them all; `suffix` ":p<P>": calls of at
    most P pairs), started from the dispatcher's pair for the largest size."""
    key = "q2s-gemv-zc" if zero_copy else "q2s-gemv-delta" if delta else "q2s-gemv"
    pairs = max(tokens) * top_k
    start = tuple(moe_dispatch.choose_q2s_gemv(n, k, zero_copy, delta, pairs)
                  for n, k in (gu_nk, dn_nk))  # fmt: skip
    tiles = q2s_gemv_tiles(zero_copy, delta)
    return Job(label or key, "q2s-gemv",
               (f"{key}:{gu_nk[0]}x{gu_nk[1]}{suffix}", f"{key}:{dn_nk[0]}x{dn_nk[1]}{suffix}"),
               GEMV_FIELDS, tuple(tokens), (start[0], start[1]), tiles, tiles,
               q2s_gemv_options(delta, sm90), weight, shape)  # fmt: skip


def q2s_mma_job(
    gu_nk: tuple[int, int], dn_nk: tuple[int, int], tokens: int, experts: int, top_k: int,
    label: str = "", shape: Any = None, weight: float = 1.0,
) -> Job:  # fmt: skip
    """The q2s prefill kernel's job at `tokens` (its entries serve the mean rows' bucket)."""
    pairs = tokens * top_k
    rows = moe_dispatch.mean_rows(pairs, experts)
    start = moe_dispatch.choose_q2s_mma(pairs, experts, gu_nk, dn_nk)
    tiles = q2s_mma_tiles(rows)
    keys = tuple(f"q2s-mma:{n}x{k}:m{rows}" for n, k in (gu_nk, dn_nk))
    return Job(label or keys[0], "q2s-mma", (keys[0], keys[1]), MMA_FIELDS, (tokens,), start,
               tiles, tiles, [], weight, shape)  # fmt: skip


def generic_job(
    gu_nk: tuple[int, int], dn_nk: tuple[int, int], tokens: Sequence[int], experts: int,
    top_k: int, label: str = "", shape: Any = None, weight: float = 1.0,
) -> Job:  # fmt: skip
    """The generic kernel's job (formats but q2s) at `tokens`, all of one config key (the GEMV
    mode's few pairs, or one bucket of the grouped mode's mean rows)."""
    pairs = max(tokens) * top_k
    start = moe_dispatch.choose_pair(pairs, experts, gu_nk, dn_nk)
    tiles = generic_tiles(start[0])
    downs = _dedupe(replace(c, split_k=1) for c in tiles)
    keys = tuple(config_key(pairs, experts, n, k) for n, k in (gu_nk, dn_nk))
    return Job(label or keys[0], "generic", (keys[0], keys[1]), GENERIC_FIELDS, tuple(tokens),
               start, tiles, downs, [], weight, shape)  # fmt: skip


# (job, tokens, gate_up config, down config) -> ms a call (inf: the config does not run)
Timer = Callable[[Job, int, KernelChoice, KernelChoice], float]


class _OutOfTime(Exception):
    pass


@dataclass
class JobResult:
    job: Job
    best: tuple[KernelChoice, KernelChoice]
    speedup: float  # the start pair's score over the best's (1.0: the start stayed best)
    timed: int  # pairs timed
    complete: bool  # every candidate timed (else the time bound stopped it)

    @property
    def entries(self) -> dict[str, dict[str, Any]]:
        return self.job.entries(*self.best)


def search(
    job: Job, timer: Timer, deadline: float, clock: Callable[[], float] = time.monotonic,
    progress: Callable[[int], object] | None = None,
) -> JobResult | None:  # fmt: skip
    """The job's best pair found before `clock()` passes `deadline` (checked before each pair
    is timed); None when the deadline had passed before the start pair was timed."""
    timed: dict[tuple[KernelChoice, KernelChoice], float] = {}
    ref: dict[int, float] = {}

    def score(c_gu: KernelChoice, c_dn: KernelChoice) -> float:
        if (c_gu, c_dn) in timed:
            return timed[(c_gu, c_dn)]
        if clock() >= deadline:
            raise _OutOfTime
        times = [timer(job, t, c_gu, c_dn) for t in job.tokens]
        for t, ms in zip(job.tokens, times, strict=True):
            if t not in ref and math.isfinite(ms) and ms > 0:
                ref[t] = ms
        timed[(c_gu, c_dn)] = sum(ms / ref[t] if t in ref else math.inf
                                  for t, ms in zip(job.tokens, times, strict=True))  # fmt: skip
        if progress is not None:
            progress(1)
        return timed[(c_gu, c_dn)]

    best = job.start
    try:
        first = best_score = score(*best)
    except _OutOfTime:
        return None
    complete = False
    try:
        for c in job.gu_cands:
            pair = (c, job.partner(c, best[1]))
            if (got := score(*pair)) < best_score:
                best, best_score = pair, got
        for d in job.dn_cands:
            if job.compatible(best[0], d) and (got := score(best[0], d)) < best_score:
                best, best_score = (best[0], d), got
        for launch, option in job.options:
            c_gu = replace(best[0], **option) if launch == "gu" else best[0]
            c_dn = replace(best[1], **option) if launch == "dn" else best[1]
            if (got := score(c_gu, c_dn)) < best_score:
                best, best_score = (c_gu, c_dn), got
        complete = True
    except _OutOfTime:
        pass
    speedup = first / best_score if math.isfinite(best_score) and best_score > 0 else 1.0
    return JobResult(job, best, speedup, len(timed), complete)


def tune(
    jobs: Sequence[Job], timer: Timer, budget_s: float,
    clock: Callable[[], float] = time.monotonic, progress: Callable[[int], object] | None = None,
) -> list[JobResult]:  # fmt: skip
    """Runs `jobs` in order within `budget_s` seconds of `clock`: each job may take its weight's
    share of the time left (time a job leaves unused goes to the later ones). -> the result of
    every job started (a job whose time ran out keeps its best pair so far)."""
    end = clock() + budget_s
    results = []
    for i, job in enumerate(jobs):
        now = clock()
        if now >= end:
            break
        weights = sum(j.weight for j in jobs[i:])
        got = search(job, timer, now + (end - now) * job.weight / weights, clock, progress)
        if got is not None:
            results.append(got)
    return results


@dataclass(frozen=True)
class TuneShape:
    """One MoE layer's experts as the tuner times them: the base plane's format, the delta
    plane's (or None), expert count and top-k."""

    label: str
    fmt: BlobFormat
    delta: BlobFormat | None
    experts: int
    top_k: int

    def launches(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """[n, k] of gate_up and of down."""
        gu, dn = matrix_spec(self.fmt, "gate_up"), matrix_spec(self.fmt, "down")
        if gu is None or dn is None:
            raise ValueError(f"the experts kernels do not run {self.fmt.name}: nothing to tune")
        return (gu.n, gu.k), (dn.n, dn.k)


def jobs_for(
    shapes: Sequence[TuneShape], decode_tokens: Sequence[int] = DECODE_TOKENS,
    prefill_tokens: Sequence[int] = PREFILL_TOKENS, sm90: bool = True,
) -> list[Job]:  # fmt: skip
    """The jobs of these shapes, most valuable first: decode at 1 token of every shape (the
    most common call, weight 4), then 2, 4, 8 tokens (3, 2, 2), each a `:p<pairs>` entry of its
    own (it replaces the shipped entry of its size); calls with a delta plane (1); prefill
    buckets (1). q2s runs the q2s GEMV and the q2s prefill kernel, other formats the generic
    kernel (one decode entry for all sizes). Entries start from what the dispatcher takes now
    (inside `moe_dispatch.using_table({})`: the generic defaults)."""
    weights = {1: 4.0, 2: 3.0}
    decode: list[Job] = []
    later: list[Job] = []
    for shape in shapes:
        gu, dn = shape.launches()
        q2s = shape.fmt.name.startswith("q2s")
        if not q2s:
            tokens = [t for t in decode_tokens if t * shape.top_k < moe_dispatch.GEMM_MIN_PAIRS]
            if tokens:
                decode.append(generic_job(gu, dn, tokens, shape.experts, shape.top_k,
                                          f"{shape.label} decode", shape, 4.0))  # fmt: skip
            for t in prefill_tokens:
                later.append(generic_job(gu, dn, [t], shape.experts, shape.top_k,
                                         f"{shape.label} prefill {t}", shape))  # fmt: skip
            continue
        for t in decode_tokens:
            if t * shape.top_k >= moe_dispatch.Q2S_GEMV_MAX_PAIRS:
                continue
            decode.append(q2s_gemv_job(gu, dn, [t], shape.top_k, f":p{t * shape.top_k}",
                                       sm90=sm90, label=f"{shape.label} decode {t}",
                                       shape=shape, weight=weights.get(t, 2.0)))  # fmt: skip
        if shape.delta is not None:
            later.append(q2s_gemv_job(gu, dn, list(decode_tokens), shape.top_k, delta=True,
                                      sm90=sm90, label=f"{shape.label} decode with delta",
                                      shape=shape))  # fmt: skip
        for t in prefill_tokens:
            if t * shape.top_k >= moe_dispatch.Q2S_GEMV_MAX_PAIRS:
                later.append(q2s_mma_job(gu, dn, t, shape.experts, shape.top_k,
                                         f"{shape.label} prefill {t}", shape))  # fmt: skip
    decode.sort(key=lambda j: j.tokens[0])  # 1 token of every shape first (a stable sort)
    return decode + later


class ExpertsCase:
    """All experts of one layer in a pool on `device` (base slots, then delta slots), a few
    distinct blobs from `make_blob(fmt, generator)` copied into every slot. Routings are each
    token's top-k of random scores, or with `routing = "distinct"` a call's pairs all on
    different experts while there are enough of them (a study: the q2s GEMV reads and decodes
    an expert once per pair, so duplicates cost it about as much as distinct ones)."""

    routing = "random"
    # each call's first launch starts while the call before ends (`moe_slots_triton`'s
    # first_pdl: the kernels back to back; False: as in a model, after the kernel before)
    first_pdl = True

    def __init__(
        self, fmt: BlobFormat, delta: BlobFormat | None, experts: int, top_k: int,
        make_blob: Callable[[BlobFormat, torch.Generator], torch.Tensor], distinct: int = 4,
        device: str = "cuda",
    ) -> None:  # fmt: skip
        gu, dn = matrix_spec(fmt, "gate_up"), matrix_spec(fmt, "down")
        if gu is None or dn is None:
            raise ValueError(f"the experts kernels do not run {fmt.name}")
        self.hidden, self.inter, self.experts, self.top_k = gu.k, dn.k, experts, top_k
        self.fmt, self.delta, self.device = fmt, delta, device
        slot = max(fmt.nbytes, delta.nbytes if delta else 0)
        self.slot_bytes = (slot + 4095) // 4096 * 4096
        n = self.experts * (2 if delta else 1)
        self.pool = torch.empty(n, self.slot_bytes, dtype=torch.uint8, device=device)
        gen = torch.Generator().manual_seed(0)
        base = [make_blob(fmt, gen).to(device) for _ in range(distinct)]
        for e in range(self.experts):
            self.pool[e, : fmt.nbytes] = base[e % distinct]
        if delta:
            dblobs = [make_blob(delta, gen).to(device) for _ in range(distinct)]
            for e in range(self.experts):
                self.pool[self.experts + e, : delta.nbytes] = dblobs[e % distinct]
        self.slot_table = torch.arange(self.experts, dtype=torch.int32, device=device)
        self.delta_table = self.slot_table + self.experts if delta else None
        # the slots' byte offsets, made once and passed to every call as the public op passes
        # the residency manager's (made per call by a default, they were two more launches)
        self.offsets = torch.arange(n, dtype=torch.int64, device=device) * self.slot_bytes

    def routings(self, tokens: int, count: int, seed: int) -> list[dict[str, torch.Tensor]]:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        sets = []
        dev = self.device
        for _ in range(count):
            scores = torch.rand(tokens, self.experts, device=dev, generator=gen)
            ids = scores.topk(self.top_k, dim=1).indices
            if self.routing == "distinct" and tokens * self.top_k <= self.experts:
                perm = torch.randperm(self.experts, device=dev, generator=gen)
                ids = perm[: tokens * self.top_k].view(tokens, self.top_k)
            sets.append(
                dict(
                    x=torch.randn(tokens, self.hidden, device=dev, dtype=torch.bfloat16),
                    ids=ids,
                    w=torch.rand(tokens, self.top_k, device=dev, generator=gen),
                    mask=torch.ones(tokens, self.top_k, dtype=torch.bool, device=dev),
                    out=torch.empty(tokens, self.top_k, self.hidden, device=dev),
                )
            )
        return sets

    def call(
        self, r: dict[str, torch.Tensor], choice: tuple[KernelChoice, KernelChoice] | None
    ) -> None:
        from moetier.kernels.moe_triton import moe_slots_triton

        moe_slots_triton(
            r["x"], r["ids"], r["w"], self.slot_table, self.pool, self.fmt, ExpertActivation(),
            r["out"], delta_mask=r["mask"] if self.delta else None,
            delta_table=self.delta_table, delta_fmt=self.delta, slot_offsets=self.offsets,
            choice=choice, first_pdl=self.first_pdl,
        )  # fmt: skip


def weight_bytes(fmt: BlobFormat) -> int:
    return sum(t.nbytes for t in fmt.tensors)


def routing_count(tokens: int, case: ExpertsCase) -> int:
    """Routings a timed graph cycles through: their experts together over 4x L2 (2 to 32)."""
    active = min(case.experts, tokens * case.top_k) * weight_bytes(case.fmt)
    return max(2, min(32, 4 * L2_BYTES // max(1, active) + 1))


def time_case(
    case: ExpertsCase, tokens: int, choice: tuple[KernelChoice, KernelChoice] | None = None,
    max_sets: int = 32,
) -> tuple[float, dict[str, torch.Tensor]]:  # fmt: skip
    """(ms a call, the first routing): on CUDA a graph of calls over different routings
    (`graph_ms`); elsewhere (Triton's interpreter) the host clock over one call each."""
    sets = case.routings(tokens, min(max_sets, routing_count(tokens, case)), seed=tokens)
    if case.device == "cuda":
        from moetier.kernels.timing import graph_ms

        return graph_ms([functools.partial(case.call, r, choice) for r in sets]), sets[0]
    case.call(sets[0], choice)
    start = time.perf_counter()
    for r in sets:
        case.call(r, choice)
    return (time.perf_counter() - start) * 1e3 / len(sets), sets[0]


def time_config(
    case: ExpertsCase, tokens: int, c_gu: KernelChoice, c_dn: KernelChoice,
    log: Callable[[str], object] | None = None, max_sets: int = 8,
) -> float:  # fmt: skip
    """ms a call with these (gate_up, down) configs; inf for a config the compiler or the
    launcher rejects (e.g. out of shared memory, a tile the shape does not divide)."""
    try:
        ms = time_case(case, tokens, (c_gu, c_dn), max_sets=max_sets)[0]
    except Exception as exc:  # noqa: BLE001
        if log is not None:
            log(f"# skip {c_gu} / {c_dn}: {type(exc).__name__}")
        return math.inf
    if log is not None:
        log(f"# {tokens} {ms:.4f} ms {c_gu} / {c_dn}")
    return ms


class GpuTimer:
    """A `Timer` over `ExpertsCase`s of each job's `TuneShape` (one kept at a time: a layer's
    experts of a large model take GBs), blobs from `make_blob`."""

    def __init__(
        self, make_blob: Callable[[BlobFormat, torch.Generator], torch.Tensor],
        device: str = "cuda", max_sets: int = 8,
    ) -> None:  # fmt: skip
        self.make_blob, self.device, self.max_sets = make_blob, device, max_sets
        self.key: tuple[TuneShape, BlobFormat | None] | None = None
        self.case: ExpertsCase | None = None

    def __call__(self, job: Job, tokens: int, c_gu: KernelChoice, c_dn: KernelChoice) -> float:
        shape: TuneShape = job.shape
        delta = shape.delta if job.keys[0].startswith("q2s-gemv-delta") else None
        if self.case is None or self.key != (shape, delta):
            self.case = None
            if self.device == "cuda":
                torch.cuda.empty_cache()
            self.case = ExpertsCase(shape.fmt, delta, shape.experts, shape.top_k,
                                    self.make_blob, device=self.device)  # fmt: skip
            self.key = (shape, delta)
        return time_config(self.case, tokens, c_gu, c_dn, max_sets=self.max_sets)


@dataclass
class TuneReport:
    path: Path  # the table written
    results: list[JobResult]
    jobs: int  # jobs asked for (those past the time bound have no result)
    wall_s: float


def run_tune(
    shapes: Sequence[TuneShape], budget_s: float, timer: Timer, *, card: str | None = None,
    from_defaults: bool = False, decode_tokens: Sequence[int] = DECODE_TOKENS,
    prefill_tokens: Sequence[int] = PREFILL_TOKENS, sm90: bool | None = None,
    path: Path | None = None, progress: bool = True, clock: Callable[[], float] = time.monotonic,
) -> TuneReport:  # fmt: skip
    """`moetier tune`: the jobs of `shapes` (`jobs_for`) started from the dispatcher's pairs of
    now (the user's table, shipped, same architecture; `from_defaults`: the generic defaults),
    tuned within `budget_s`, the winners merged into this card's user table (`path`, default
    `tuned_tables.user_table_path`), which the dispatcher reads from then on."""
    from tqdm import tqdm

    card = card or moe_dispatch._device_name()
    if sm90 is None:
        sm90 = moe_dispatch._capability() == (9, 0)
    with moe_dispatch.using_table({} if from_defaults else None):
        jobs = jobs_for(shapes, decode_tokens, prefill_tokens, sm90)
    start = clock()
    bar = tqdm(total=sum(j.size for j in jobs), unit="config", disable=not progress,
               desc=f"tuning ({budget_s:.0f} s at most)")  # fmt: skip
    with bar:
        results = tune(jobs, timer, budget_s, clock, bar.update)
    wall = clock() - start
    path = path or tuned_tables.user_table_path(card)
    entries: dict[str, dict[str, Any]] = {}
    for result in results:
        entries.update(result.entries)
    about = {"card": card, "driver": tuned_tables.driver_version(),
             "triton": tuned_tables.triton_version(), "budget_s": budget_s,
             "from": "generic defaults" if from_defaults else "the tables before",
             "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "shapes": [s.label for s in shapes]}  # fmt: skip
    tuned_tables.write_user_table(path, entries, about)
    moe_dispatch.tuned_configs.cache_clear()
    return TuneReport(path, results, len(jobs), wall)
