"""MoE kernel benchmark (H200): achieved GB/s of the experts op next to measured copy bandwidth
and a bf16 baseline (torch._grouped_mm on dequantised weights), one JSON line per case.

  python bench/kernels.py                    # all shapes, tokens 1..4096
  python bench/kernels.py --tune             # also sweep tile configs, write configs/<gpu>.json

Bytes counted per call: each distinct expert's blob read once (codes, scales, row scales; the
delta blob too for experts with a delta pair), the hidden states read, the gate_up partials
written and read back once, the per-pair outputs written. Every call in a timed graph uses a
different routing, and the sets together exceed L2, so expert weights come from HBM.

The calls' routings are fixed, written by no launch in the graph, so by default each call's
first launch starts while the call before ends (`moe_slots_triton`'s first_pdl: the kernels'
throughput back to back). `--first-launch after` times them as the op runs in a model, whose
routing the kernels just before write: that launch starts once the kernel before has ended.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path

import torch
import torch.nn.functional as F

from moetier.config import ExpertActivation
from moetier.core.layout import (
    BlobFormat,
    fp4_expert_format,
    q2s_expert_format,
    raw_expert_format,
)
from moetier.kernels import moe_dispatch
from moetier.kernels import tune as tuning
from moetier.kernels.blob_decode import matrix_spec
from moetier.kernels.moe_dispatch import KernelChoice
from moetier.kernels.moe_triton import moe_slots_triton
from moetier.kernels.q2s_gemv import q2s_gemv_supports
from moetier.kernels.tune import (  # noqa: F401 (L2_BYTES, weight_bytes: the studies' too)
    GEMV_FIELDS,
    L2_BYTES,
    ExpertsCase,
    config_entry,
    routing_count,
    time_case,
    weight_bytes,
)
from moetier.quant.synthetic import random_blob

sys.path.insert(0, str(Path(__file__).parent))
from common import emit, graph_ms, read_floor_ms  # noqa: E402

from moetier.core.provenance import run_info  # noqa: E402
from moetier.residency.links import copy_bandwidth  # noqa: E402

SHAPES = {  # name: (hidden, expert intermediate, experts, top-k)
    "deepseek-v3": (7168, 2048, 256, 8),
    "deepseek-v4-flash": (4096, 2048, 256, 6),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "eval-moe-70m": (512, 256, 32, 4),
}
TOKENS = [1, 2, 4, 8, 16, 64, 512, 4096]


def q2s_format(shape: str) -> BlobFormat:
    """The q2s expert format every case of this shape uses (gate_up groups of 32, down of 16)."""
    hidden, inter, _, _ = SHAPES[shape]
    return q2s_expert_format(hidden, inter, False, 32, 16)


class Case(ExpertsCase):
    """All experts of one layer of `shape` in a GPU pool (`ExpertsCase`: routings, the call),
    q2s blobs with the b = 3a grid (what the converter writes) or a fitted grid (b != 3a: the
    format allows it; the kernel's second pass over the words for the high bits' sums)."""

    def __init__(
        self,
        shape: str,
        fmt: BlobFormat,
        delta: BlobFormat | None,
        distinct: int = 4,
        fitted_grid: bool = False,
        device: str = "cuda",
    ):
        _, _, experts, top_k = SHAPES[shape]

        def blob(f: BlobFormat, gen: torch.Generator) -> torch.Tensor:
            return random_blob(f, gen, fitted_grid=fitted_grid)

        super().__init__(fmt, delta, experts, top_k, blob, distinct, device)

    def bytes_per_call(
        self, r: dict[str, torch.Tensor], split_k: int, int8: bool = False, quant_in: bool = False
    ) -> tuple[int, int]:
        """(bytes without the delta, delta bytes) moved by one call on routing `r`; split_k 0
        means the q2s GEMV kernel (activations h [P, I] written and read, no partials); int8:
        its activations rounded to int8 words first (x and h read once more, 1.5 bytes per
        column of int8 + scale + sum written and read; with quant_in gate_up rounds x itself, so
        only h's words are)."""
        distinct = int(torch.unique(r["ids"]).numel())
        tokens, pairs = r["ids"].shape[0], r["ids"].numel()
        io = tokens * self.hidden * 2 + pairs * self.hidden * 4
        if split_k:
            io += 2 * split_k * pairs * 2 * self.inter * 4  # gate_up partials written, read
        else:
            io += 2 * pairs * self.inter * 4
        if int8:
            io += pairs * self.inter * (4 + 3) + (0 if quant_in else tokens * self.hidden * 5)
        delta = distinct * weight_bytes(self.delta) if self.delta else 0
        return distinct * weight_bytes(self.fmt) + io, delta


class ZeroCopyCase(Case):
    """A q2s case whose experts are in GPU slots (a random `gpu_fraction` of them) or read by the
    kernel from pinned host rows (zero-copy decode, `zero_copy=True`: the PCIe-tuned configs)."""

    def __init__(self, shape: str, fmt: BlobFormat, gpu_fraction: float):
        super().__init__(shape, fmt, None)
        self.gpu_fraction = gpu_fraction
        self.host = self.pool.cpu().pin_memory()
        offsets = torch.arange(2 * self.experts, dtype=torch.int64) % self.experts
        offsets *= self.slot_bytes
        offsets[self.experts :] += self.host.data_ptr() - self.pool.data_ptr()
        self.offsets = offsets.cuda()
        gen = torch.Generator().manual_seed(1)
        on_gpu = torch.randperm(self.experts, generator=gen)[: round(gpu_fraction * self.experts)]
        table = torch.arange(self.experts, dtype=torch.int32) + self.experts
        table[on_gpu] = on_gpu.to(torch.int32)
        self.slot_table = table.cuda()

    def host_bytes(self, r: dict[str, torch.Tensor]) -> int:
        """Bytes of the distinct experts of routing `r` read from host rows."""
        distinct = torch.unique(r["ids"])
        return int((self.slot_table[distinct] >= self.experts).sum()) * weight_bytes(self.fmt)

    def call(self, r: dict[str, torch.Tensor], choice: tuple[KernelChoice, KernelChoice] | None):
        moe_slots_triton(
            r["x"], r["ids"], r["w"], self.slot_table, self.pool, self.fmt, ExpertActivation(),
            r["out"], slot_offsets=self.offsets, choice=choice, zero_copy=True,
            first_pdl=self.first_pdl,
        )  # fmt: skip


class HotCase(Case):
    """q2s with every expert in one of `slots` slots (expert e in slot e % slots), few enough
    that their blobs stay in L2 after the first call, so a call reads no weights from HBM. Its
    time is what the call's launches, lookups and decode cost without HBM's bandwidth and
    latency: the floor of this kernel structure (its "GB/s" counts the bytes the pairs'
    distinct experts would have been). One slot has every pair read the same lines; more
    spread the reads over L2."""

    def __init__(self, shape: str, fmt: BlobFormat, slots: int = 1):
        super().__init__(shape, fmt, None)
        self.slot_table = self.slot_table % slots


def hot_slots(fmt: BlobFormat) -> int:
    """The most slots whose blobs fill at most 60% of L2 (at least 1)."""
    return max(1, int(0.6 * L2_BYTES) // weight_bytes(fmt))


FORMATS = ("q2s", "q2s-fitted", "q2s+nvfp4", "q2s-hot", "q2s-hot-spread")


def make_case(name: str, shape: str) -> Case:
    """The case of format `name` (of FORMATS) at this shape: each a pool of all its experts,
    so only the cases a run times or tunes are made."""
    hidden, inter, _, _ = SHAPES[shape]
    q2s = q2s_format(shape)
    if name == "q2s-fitted":
        return Case(shape, q2s, None, fitted_grid=True)
    if name == "q2s+nvfp4":
        return Case(shape, q2s, fp4_expert_format("nvfp4", hidden, inter, False))
    if name == "q2s-hot":
        return HotCase(shape, q2s)
    if name == "q2s-hot-spread":
        return HotCase(shape, q2s, hot_slots(q2s))
    return Case(shape, q2s, None)


class GroupedMM:
    """bf16 baseline: tokens sorted by expert, torch._grouped_mm over dequantised weights."""

    def __init__(self, shape: str):
        self.hidden, self.inter, self.experts, self.top_k = SHAPES[shape]
        # [E, K, N] views of [E, N, K] storage (the layout grouped_mm wants for mat_b)
        self.w_gu = torch.randn(self.experts, 2 * self.inter, self.hidden, device="cuda",
                                dtype=torch.bfloat16).mul_(0.02).transpose(1, 2)  # fmt: skip
        self.w_down = torch.randn(self.experts, self.hidden, self.inter, device="cuda",
                                  dtype=torch.bfloat16).mul_(0.02).transpose(1, 2)  # fmt: skip

    def call(self, r: dict[str, torch.Tensor]) -> None:
        ids = r["ids"].reshape(-1)
        order = torch.argsort(ids, stable=True)
        counts = torch.zeros(self.experts, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, ids, torch.ones_like(ids))  # bincount would sync the host
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs = r["x"][order // self.top_k]
        h = torch._grouped_mm(xs, self.w_gu, offs=offs)  # [P, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.w_down, offs=offs)  # [P, H]
        r["out"].view(-1, self.hidden)[order] = y.float() * r["w"].reshape(-1)[order, None]

    def bytes_per_call(self, r: dict[str, torch.Tensor]) -> int:
        distinct = int(torch.unique(r["ids"]).numel())
        return distinct * 3 * self.hidden * self.inter * 2 + r["ids"].shape[0] * self.hidden * 2


def time_config(case: Case, tokens: int, c_gu: KernelChoice, c_dn: KernelChoice) -> float:
    """ms per call with these (gate_up, down) configs, said on stderr; inf for a config the
    compiler rejects (e.g. out of shared memory)."""
    return tuning.time_config(
        case, tokens, c_gu, c_dn, log=lambda line: print(line, file=sys.stderr)
    )


def _search(case: Case, job: tuning.Job) -> dict[str, dict]:  # type: ignore[type-arg]
    """The job's best entries, every candidate timed on `case` (no time bound)."""
    result = tuning.search(job, lambda _, t, gu, dn: time_config(case, t, gu, dn), math.inf)
    assert result is not None
    return result.entries


def _launches(case: Case) -> tuple[tuple[int, int], tuple[int, int]]:
    gu, dn = matrix_spec(case.fmt, "gate_up"), matrix_spec(case.fmt, "down")
    assert gu is not None and dn is not None
    return (gu.n, gu.k), (dn.n, dn.k)


def tune(case: Case, tokens: int) -> dict[str, dict]:  # type: ignore[type-arg]
    """Best (gate_up, down) configs of the generic kernel for this case (`tuning.generic_job`).
    Returns {config key: fields}."""
    gu, dn = _launches(case)
    return _search(case, tuning.generic_job(gu, dn, [tokens], case.experts, case.top_k))


def tune_q2s_gemv(case: Case, tokens: list[int], suffix: str = "") -> dict[str, dict]:  # type: ignore[type-arg]
    """Best q2s GEMV kernel configs (`tuning.q2s_gemv_job`: tiles for gate_up, then down, then
    options one launch at a time) for all of `tokens` at once (one config serves every decode
    size, or with a `suffix` `:p<P>` the calls of at most P pairs: the score is the sum over
    them of each time over the first pair's); for a ZeroCopyCase the `q2s-gemv-zc:` configs
    (reads over PCIe: whole rows per K tile are among the candidates), for a case with a delta
    plane the `q2s-gemv-delta:` ones (depth 1; pipe_x and prefetch_l2 per launch)."""
    gu, dn = _launches(case)
    sm90 = moe_dispatch._capability() == (9, 0)
    zero_copy, delta = isinstance(case, ZeroCopyCase), case.delta is not None
    job = tuning.q2s_gemv_job(gu, dn, tokens, case.top_k, suffix, zero_copy, delta, sm90)
    return _search(case, job)


def sweep_joint(case: Case, shape: str, tokens: int, info: dict, keep: int = 8):  # type: ignore[no-untyped-def, type-arg]
    """A study of the q2s GEMV's two launches together (`--sweep-joint`): the tuner picks
    gate_up, then down, then options one at a time, but a launch's registers and programs decide
    how many of the other's programs share an SM with it (a timeline, bench/studies/timeline.py: at
    1-2 tokens down programs that found no room before gate_up ended ran as a second wave).
    Every gate_up candidate (58) is timed against three downs, then the `keep` best against
    every down candidate (28); then prefetch_l2 toggled on the best five (`joint_search`).
    (Gluon launches streaming their words through a cp.async ring, pipe 2-3, measured
    1.01-1.19x the time as variants of the H200's 1-2 token configs, and 1.01-1.29x with the
    ring carrying their group scales too, docs/benchmarks.md: not candidates.)
    One JSON line per pair, time over the dispatcher's in the same run (`of_dispatcher`).
    -> the best pair."""
    hidden, inter, _, top_k = SHAPES[shape]
    pairs = tokens * top_k
    base = replace(moe_dispatch.Q2S_GEMV, int8_act=True)
    gu_cands = [
        replace(base, block_n=bn, block_k=bk, num_warps=w, quant_in=qi, quant_pdl=not qi,
                pipe_x=px, row_tiles=rt)
        for bn, bk, w in [(32, 512, 4), (32, 1024, 4), (64, 512, 4), (64, 512, 8), (64, 1024, 8),
                          (128, 512, 8)]
        for qi in (True, False) for px in (False, True) for rt in (1, 2)
    ] + [
        replace(base, block_n=bn, block_k=bk, num_warps=w, quant_in=qi, quant_pdl=not qi,
                gluon=True)
        for bn, bk, w in [(32, 512, 4), (32, 1024, 4), (64, 512, 4), (64, 512, 8), (128, 512, 8)]
        for qi in (True, False)
    ]  # fmt: skip
    dn_cands = [
        replace(base, block_n=bn, block_k=bk, num_warps=w, group_acc=ga, row_tiles=rt)
        for bn, bk, w in [(32, 512, 4), (64, 512, 4), (64, 1024, 4), (64, 1024, 8),
                          (128, 512, 8), (32, 1024, 4)]
        for ga in (False, True) for rt in (1, 2)
    ] + [
        replace(base, block_n=bn, block_k=bk, num_warps=w, gluon=True)
        for bn, bk, w in [(32, 512, 4), (64, 512, 4), (64, 512, 8), (128, 512, 8)]
    ]  # fmt: skip
    disp = variant_choices(hidden, inter, pairs, {}, "both")
    ref = time_config(case, tokens, *disp)
    emit({**info, "case": "sweep-joint", "shape": shape, "tokens": tokens, "which": "dispatcher",
          "ms": round(ref, 5), "gu": asdict(disp[0]), "dn": asdict(disp[1])})  # fmt: skip

    def run(c_gu: KernelChoice, c_dn: KernelChoice, which: str) -> float:
        ms = time_config(case, tokens, c_gu, c_dn)
        emit({**info, "case": "sweep-joint", "shape": shape, "tokens": tokens,
              "which": which, "ms": round(ms, 5), "of_dispatcher": round(ms / ref, 3),
              "gu": _short(c_gu), "dn": _short(c_dn)})  # fmt: skip
        return ms

    probes = [
        disp[1],
        replace(disp[1], row_tiles=2),
        replace(base, block_n=128, block_k=512, num_warps=8),
    ]
    (c, d), timed = joint_search(gu_cands, dn_cands, probes, run, keep)
    ms = timed[(c, d)]
    again = time_config(case, tokens, c, d)  # the winner and the dispatcher once more
    ref2 = time_config(case, tokens, *disp)
    emit({**info, "case": "sweep-joint", "shape": shape, "tokens": tokens, "which": "best",
          "ms": round(ms, 5), "of_dispatcher": round(ms / ref, 3), "again_ms": round(again, 5),
          "dispatcher_again_ms": round(ref2, 5), "gu": asdict(c), "dn": asdict(d)})  # fmt: skip
    return c, d


def joint_search(
    gu_cands: list[KernelChoice],
    dn_cands: list[KernelChoice],
    probes: list[KernelChoice],
    run,  # type: ignore[no-untyped-def]
    keep: int = 8,
    top: int = 5,
) -> tuple[tuple[KernelChoice, KernelChoice], dict[tuple[KernelChoice, KernelChoice], float]]:
    """`sweep_joint`'s search, over `run(gate_up, down, stage) -> ms` (each pair run once):
    every gate_up against the `probes` downs (its best of them), the `keep` best gate_ups
    against every down, then prefetch_l2 toggled on each Triton launch of the `top` best
    pairs (the Gluon kernel has no such option). -> (the best pair, every pair's time)."""
    timed: dict[tuple[KernelChoice, KernelChoice], float] = {}

    def once(c_gu: KernelChoice, c_dn: KernelChoice, stage: str) -> float:
        if (c_gu, c_dn) not in timed:
            timed[(c_gu, c_dn)] = run(c_gu, c_dn, stage)
        return timed[(c_gu, c_dn)]

    score = {c: min(once(c, d, "gu") for d in probes) for c in gu_cands}
    for c in sorted(gu_cands, key=lambda c: score[c])[:keep]:
        for d in dn_cands:
            once(c, d, "pair")
    for c, d in sorted(timed, key=lambda k: timed[k])[:top]:
        if not c.gluon:
            once(replace(c, prefetch_l2=not c.prefetch_l2), d, "prefetch-gu")
        if not d.gluon:
            once(c, replace(d, prefetch_l2=not d.prefetch_l2), "prefetch-dn")
    return min(timed, key=lambda k: timed[k]), timed


def _short(c: KernelChoice) -> dict[str, object]:
    """The fields of c that differ from the q2s GEMV's defaults."""
    ref = asdict(replace(moe_dispatch.Q2S_GEMV, int8_act=True))
    return {k: v for k, v in asdict(c).items() if v != ref[k]}


def tune_q2s_mma(case: Case, tokens: int) -> dict[str, dict]:  # type: ignore[type-arg]
    """Best q2s prefill kernel (`q2s_mma.py`) configs (`tuning.q2s_mma_job`)."""
    gu, dn = _launches(case)
    return _search(case, tuning.q2s_mma_job(gu, dn, tokens, case.experts, case.top_k))


def parse_variant(spec: str) -> tuple[str, dict[str, int | bool], str]:
    """`--variant depth=2,prefetch_l2=1` -> (the spec, {"depth": 2, "prefetch_l2": True},
    "both"); a `gu:` or `dn:` prefix forces the fields on that launch only; `gu:...+dn:...`
    forces each launch's own (-> (the spec, {"gu": {...}, "dn": {...}}, "each"))."""
    if "+" in spec:
        parts = [parse_variant(part) for part in spec.split("+")]
        if sorted(launch for _, _, launch in parts) != ["dn", "gu"]:
            raise SystemExit(f"--variant {spec!r}: joined by +, one gu: part and one dn: part")
        return spec, {launch: fields for _, fields, launch in parts}, "each"  # type: ignore[misc]
    types = {f.name: f.type for f in dataclass_fields(KernelChoice)}
    launch, _, body = spec.rpartition(":")
    if launch not in ("", "gu", "dn"):
        raise SystemExit(f"--variant {spec!r}: the prefix is gu: or dn:, not {launch!r}")
    out: dict[str, int | bool] = {}
    for item in body.split(","):
        name, _, value = item.partition("=")
        if name not in types or not value:
            raise SystemExit(f"--variant {spec!r}: {name!r} is not a KernelChoice field=value")
        out[name] = bool(int(value)) if types[name] in (bool, "bool") else int(value)
    return spec, out, launch or "both"


def variant_choices(
    hidden: int, inter: int, pairs: int, fields: dict[str, int | bool], launch: str, delta=False
) -> tuple[KernelChoice, KernelChoice]:
    """The dispatcher's q2s GEMV (gate_up, down) configs for a call of `pairs` pairs (with a
    delta plane: its `q2s-gemv-delta:` ones), with `fields` forced on `launch` (gu, dn or
    both)."""
    c_gu = moe_dispatch.choose_q2s_gemv(2 * inter, hidden, delta=delta, pairs=pairs)
    c_dn = moe_dispatch.choose_q2s_gemv(hidden, inter, delta=delta, pairs=pairs)
    if launch == "each":  # {"gu": fields, "dn": fields}
        gu, dn = fields["gu"], fields["dn"]
        return replace(c_gu, **gu), replace(c_dn, **dn)  # type: ignore[arg-type]
    if launch in ("gu", "both"):
        c_gu = replace(c_gu, **fields)  # type: ignore[arg-type]
    if launch in ("dn", "both"):
        c_dn = replace(c_dn, **fields)  # type: ignore[arg-type]
    return c_gu, c_dn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--tune", action="store_true", help="sweep configs first")
    parser.add_argument("--tune-tokens", default="1,4096")
    parser.add_argument(
        "--tune-mma", default="", help="tokens to tune the q2s prefill kernel at (e.g. 512,4096)"
    )
    parser.add_argument(
        "--tune-delta",
        default="",
        help="tokens to tune the q2s GEMV's configs for calls with an NVFP4 delta plane at "
        "(e.g. 1,16; q2s-gemv-delta: entries)",
    )
    parser.add_argument(
        "--tune-small",
        default="",
        help="tokens to tune a second q2s GEMV config at, for calls of at most the largest of "
        "them (e.g. 1,2: q2s-gemv:NxK:p<2 top_k> entries; the others keep --tune's)",
    )
    parser.add_argument(
        "--routing",
        choices=("random", "distinct"),
        default="random",
        help="distinct: a call's pairs on different experts (up to the expert count), a study "
        "of what duplicate experts cost the q2s GEMV",
    )
    parser.add_argument(
        "--first-launch",
        choices=("pdl", "after"),
        default="pdl",
        help="pdl: each call's first launch starts while the call before ends (fixed routing: "
        "the kernels back to back); after: once it has ended, as in a model (the op's way)",
    )
    parser.add_argument(
        "--sweep-joint",
        default="",
        help="tokens at which to time gate_up and down configs together (one line per pair, "
        "`sweep_joint`); nothing else is timed, and only --sweep-write writes configs",
    )
    parser.add_argument(
        "--sweep-write",
        action="store_true",
        help="with --sweep-joint: write each size's best pair into kernels/configs/<gpu>.json "
        "as its q2s-gemv:NxK:p<pairs> entries",
    )
    parser.add_argument("--configs-out", type=Path, help="where --tune writes the tuned JSON")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--formats",
        default="q2s,q2s-fitted,q2s+nvfp4",
        help="the formats to time (of q2s, q2s-fitted, q2s+nvfp4, q2s-hot: every expert in one "
        "slot, its blob in L2, q2s-hot-spread: in as many slots as fit in 60%% of L2; "
        "q2s+nvfp4's prediction needs q2s too)",
    )
    parser.add_argument(
        "--read-floor",
        action="store_true",
        help="with each q2s line, the time one kernel launch takes to read the same bytes at "
        "best (read_floor_ms; of_read_floor: that time over the call's)",
    )
    parser.add_argument(
        "--zero-copy",
        type=float,
        default=0.0,
        help="also time q2s with only this fraction of the experts in GPU slots, the rest read "
        "from pinned host rows (e.g. 0.25); with --tune, tune its q2s-gemv-zc configs too",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="also time the q2s GEMV (decode sizes) with these KernelChoice fields forced on "
        "both launches' dispatcher configs, e.g. depth=2 or prefetch_l2=1,depth=2, or on one "
        "launch, e.g. dn:split_k=2 (q2s+nvfp4: on its q2s-gemv-delta configs); repeatable (a "
        "same-run A/B without retuning)",
    )
    parser.add_argument(
        "--variant-formats",
        default="q2s,q2s-hot,q2s+nvfp4",
        help="the formats (of --formats) whose cases are timed with each --variant too",
    )
    parser.add_argument(
        "--eager",
        metavar="SHAPE:TOKENS",
        help="only run that q2s case's call 12 times, eagerly, 6 routings twice, with the first "
        "--variant's fields if one is given (a target for Nsight Compute: ncu -k "
        "regex:_q2s_gemv_kernel --launch-skip 8 --launch-count 2), and exit",
    )
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    Case.first_pdl = args.first_launch == "pdl"
    if args.eager:
        shape, tokens = args.eager.split(":")
        case = Case(shape, q2s_format(shape), None)
        hidden, inter, _, top_k = SHAPES[shape]
        choice = None
        if variants:
            _, fields, launch = variants[0]
            choice = variant_choices(hidden, inter, int(tokens) * top_k, fields, launch)
        for r in case.routings(int(tokens), 6, seed=int(tokens)) * 2:
            case.call(r, choice)
        torch.cuda.synchronize()
        return
    Case.routing = args.routing
    info = run_info()
    if args.routing != "random":
        info["routing"] = args.routing
    info["first_launch"] = args.first_launch
    if args.sweep_joint:
        tuned_now: dict[str, dict] = dict(moe_dispatch.tuned_configs(moe_dispatch._device_name()))  # type: ignore[type-arg]
        for shape in args.shapes.split(","):
            case = make_case("q2s", shape)
            hidden, inter, _, top_k = SHAPES[shape]
            for tokens in (int(t) for t in args.sweep_joint.split(",")):
                c_gu, c_dn = sweep_joint(case, shape, tokens, info)
                for (n, k), c in (((2 * inter, hidden), c_gu), ((hidden, inter), c_dn)):
                    tuned_now[f"q2s-gemv:{n}x{k}:p{tokens * top_k}"] = config_entry(c, GEMV_FIELDS)
        if args.sweep_write:  # each size's winners as its `:p<pairs>` entries
            path = moe_dispatch.CONFIG_DIR / f"{moe_dispatch._device_name()}.json"
            path.write_text(json.dumps(tuned_now, indent=1, sort_keys=True) + "\n")
            moe_dispatch.tuned_configs.cache_clear()
        return
    copy_bw = copy_bandwidth()
    emit({**info, "case": "copy", "GB/s": round(copy_bw / 1e9, 1)})
    tokens_list = [int(t) for t in args.tokens.split(",")]
    tuned: dict[str, dict] = dict(moe_dispatch.tuned_configs(moe_dispatch._device_name()))  # type: ignore[type-arg]
    for shape in args.shapes.split(","):
        hidden, inter, experts, top_k = SHAPES[shape]
        q2s = q2s_format(shape)
        bf16 = raw_expert_format("bfloat16", hidden, inter, False)
        timed = set(args.formats.split(","))
        needed = timed | {"q2s"} | ({"q2s+nvfp4"} if args.tune_delta else set())
        cases = {name: make_case(name, shape) for name in FORMATS if name in needed}
        zc_name = f"q2s-zero-copy-{args.zero_copy:g}"
        if args.zero_copy:
            cases[zc_name] = ZeroCopyCase(shape, q2s, args.zero_copy)
        if args.tune or args.tune_mma or args.tune_delta or args.tune_small:
            tune_tokens = [int(t) for t in args.tune_tokens.split(",")] if args.tune else []
            decode = [t for t in tune_tokens if t * top_k < moe_dispatch.GEMM_MIN_PAIRS]
            if decode:  # the q2s GEMV: one config for all of them
                tuned.update(tune_q2s_gemv(cases["q2s"], decode))
            for t in tune_tokens:
                if t not in decode:
                    tuned.update(tune(cases["q2s"], t))
            if args.tune and args.zero_copy:  # at the first tuned size (decode: 1 token)
                tuned.update(tune_q2s_gemv(cases[zc_name], tune_tokens[:1]))
            if args.tune_small:
                small = [int(t) for t in args.tune_small.split(",")]
                tuned.update(tune_q2s_gemv(cases["q2s"], small, f":p{max(small) * top_k}"))
            if args.tune_delta:
                delta_tokens = [int(t) for t in args.tune_delta.split(",")]
                tuned.update(tune_q2s_gemv(cases["q2s+nvfp4"], delta_tokens))
            for t in (int(t) for t in args.tune_mma.split(",") if t):
                tuned.update(tune_q2s_mma(cases["q2s"], t))
            moe_dispatch.tuned_configs.cache_clear()
            path = moe_dispatch.CONFIG_DIR / f"{moe_dispatch._device_name()}.json"
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps(tuned, indent=1, sort_keys=True))
            if args.configs_out:
                args.configs_out.write_text(path.read_text())
        cases = {name: c for name, c in cases.items() if name in timed or name == zc_name}
        cases["bf16-kernel"] = Case(shape, bf16, None, distinct=2)
        baseline = None if args.no_baseline else GroupedMM(shape)
        for tokens in tokens_list:
            base_bw = base_ms = None
            for name, case in cases.items():
                ms, r = time_case(case, tokens)
                pairs = tokens * top_k
                gu = moe_dispatch.choose(pairs, experts, 2 * inter, hidden)
                split = gu.split_k if not gu.grouped else 1
                specs = [matrix_spec(case.fmt, m) for m in ("gate_up", "down")]
                dspecs = [matrix_spec(case.delta, m) if case.delta else None
                          for m in ("gate_up", "down")]  # fmt: skip
                if pairs < moe_dispatch.Q2S_GEMV_MAX_PAIRS and q2s_gemv_supports(*specs, *dspecs):  # type: ignore[arg-type]
                    split = 0
                zero_copy = isinstance(case, ZeroCopyCase)
                gu_choice = moe_dispatch.choose_q2s_gemv(2 * inter, hidden, zero_copy,
                                                         pairs=pairs)  # fmt: skip
                int8 = split == 0 and gu_choice.int8_act
                quant_in = int8 and gu_choice.quant_in and case.delta is None
                nbytes, dbytes = case.bytes_per_call(r, split, int8, quant_in)
                gbs = (nbytes + dbytes) / ms / 1e6
                rec = {**info, "case": "moe", "shape": shape, "tokens": tokens, "format": name,
                       "ms": round(ms, 5), "MB": round((nbytes + dbytes) / 1e6, 2),
                       "GB/s": round(gbs, 1), "copy_GB/s": round(copy_bw / 1e9, 1),
                       "of_copy": round(gbs * 1e9 / copy_bw, 3), "int8_act": int8}  # fmt: skip
                if zero_copy:  # its own line: the host rows' bytes over PCIe
                    host = case.host_bytes(r)  # type: ignore[attr-defined]
                    rec["host_MB"] = round(host / 1e6, 3)
                    rec["host_GB/s"] = round(host / ms / 1e6, 2)
                    rec["gpu_fraction"] = args.zero_copy
                if name == "q2s":
                    base_bw, base_ms = nbytes / ms, ms
                    if args.read_floor:  # one launch reading the same bytes, at best
                        floor = read_floor_ms(nbytes + dbytes, L2_BYTES)
                        rec["read_floor_ms"] = round(floor, 5)
                        floor_bw = (nbytes + dbytes) / (floor / 1e3)  # bytes/s
                        rec["read_floor_of_copy"] = round(floor_bw / copy_bw, 3)
                        rec["of_read_floor"] = round(floor / ms, 3)
                elif name.startswith("q2s-hot") and base_ms:
                    rec["vs_q2s"] = round(ms / base_ms, 3)
                elif name == "q2s+nvfp4" and base_bw:
                    rec["vs_predicted"] = round(ms / ((nbytes + dbytes) / base_bw), 3)
                emit(rec)
                if name not in args.variant_formats.split(",") or split != 0:
                    continue
                for label, fields, launch in variants:  # the same case with forced fields
                    choice = variant_choices(hidden, inter, pairs, fields, launch,
                                             case.delta is not None)  # fmt: skip
                    try:
                        ms_v = time_case(case, tokens, choice)[0]
                    except (ValueError, RuntimeError) as exc:  # a config this shape cannot run
                        emit({**rec, "format": f"{name}[{label}]", "error": str(exc)[:200]})
                        continue
                    gbs_v = (nbytes + dbytes) / ms_v / 1e6
                    rec.pop("vs_q2s", None)
                    if "vs_predicted" in rec and base_bw:
                        rec["vs_predicted"] = round(ms_v / ((nbytes + dbytes) / base_bw), 3)
                    emit({**rec, "format": f"{name}[{label}]", "ms": round(ms_v, 5),
                          "GB/s": round(gbs_v, 1), "of_copy": round(gbs_v * 1e9 / copy_bw, 3),
                          "vs_dispatcher": round(ms_v / ms, 3)})  # fmt: skip
            if baseline is not None:
                r = cases["q2s"].routings(tokens, 1, seed=tokens)[0]
                sets = [r] + cases["q2s"].routings(
                    tokens, routing_count(tokens, cases["q2s"]) - 1, 7
                )
                try:
                    ms = graph_ms([lambda r=r, b=baseline: b.call(r) for r in sets])
                except RuntimeError as exc:
                    emit({**info, "case": "moe", "shape": shape, "tokens": tokens,
                          "format": "bf16-grouped_mm", "error": str(exc)[:200]})  # fmt: skip
                    continue
                nbytes = baseline.bytes_per_call(r)
                q2s_ms = time_case(cases["q2s"], tokens)[0]
                emit({**info, "case": "moe", "shape": shape, "tokens": tokens,
                      "format": "bf16-grouped_mm", "ms": round(ms, 5),
                      "GB/s": round(nbytes / ms / 1e6, 1), "copy_GB/s": round(copy_bw / 1e9, 1),
                      "q2s_throughput_vs_bf16": round(ms / q2s_ms, 3)})  # fmt: skip
        del cases, baseline
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
