"""Study: per-pair scores for the confidence gate at a per-call budget (docs/quality.md, "The
confidence gate"): how much of the base-to-everywhere KLD gap a pair-level score could close,
and how much of it cheap predictors keep. Each variant picks the best `--budget` of each
experts call's pairs by its score; mean KLD against the reference on `--chunks` chunks.

  oracle    ||w (f_delta(x) - f_base(x))||^2, the pair's exact output change (k + 1 expert
            passes per call: a ceiling, not a policy)
  sketch-R  w^2 ||S x||^2, S the top-R singular directions (R = 0: all) of the expert's
            gate_up delta: the first projection's change alone
  fit-R     w^2 ||x A||^2, A [H, H] least squares of the pair's output change on x (ridge),
            fitted per (layer, expert) on `--calibration` text (R > 0: its rank-R truncation)
  down-R    w^2 ||S h||^2, h the expert's base hidden activation silu(G x) * (U x), S the down
            delta's top-R singular directions (R = 0: all): what a kernel deciding after its
            base gate_up could see (qwen3_moe's silu)
  inkernel-R  down-R plus sketch-R
  weight    w (the routing weight)

  PYTHONPATH=. python bench/studies/gate_pair_scores.py STORE REFERENCE TEXT \\
      [--calibration TEXT] [--variants weight,oracle,sketch-0,fit-0] [--budget 0.25]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from moetier.config import DeltaRule, EngineConfig
from moetier.engine.quality import chunks, compare
from moetier.gate.policies import budget_mask
from moetier.kernels.moe_ref import expert_matrix, expert_matrix_with_delta
from moetier.loader.load import load_model

Score = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _Gate:
    """A gate stand-in: the mask from a function of (layer, hidden, ids, weights)."""

    rule = DeltaRule.parse("weight:0")

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def decide(self, layer: int, hidden: Any, ids: Any, w: Any, resident: Any = None) -> Any:
        return self.fn(layer, hidden, ids, w)


def pair_changes(
    runtime: Any, forward: Any, layer: int, hidden: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The call's base output [T, H] and, per slot j, w_j (f_delta - f_base) [T, H]."""  # fmt: skip
    runtime.gate = _Gate(lambda *_: torch.zeros(ids.shape, dtype=torch.bool))
    base = forward(layer, hidden, ids, w).float()
    changes = []
    for j in range(ids.shape[1]):
        mask = torch.zeros(ids.shape, dtype=torch.bool)
        mask[:, j] = True
        runtime.gate = _Gate(lambda *_, m=mask: m)
        changes.append(forward(layer, hidden, ids, w).float() - base)
    return base, changes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("reference")
    parser.add_argument("text")
    parser.add_argument("--calibration", help="text the fit-R predictors are fitted on")
    parser.add_argument("--variants", default="weight,oracle,sketch-0,fit-0")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--ridge", type=float, default=1e-2)
    args = parser.parse_args()
    loaded = load_model(args.store, EngineConfig(delta="all", native=False, dtype="float32"))
    reference = AutoModelForCausalLM.from_pretrained(
        args.reference, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    runtime, store = loaded.runtime, loaded.store
    forward = runtime.forward
    experts = store.model_config.num_experts
    budget = args.budget

    def gate_up_delta(layer: int) -> torch.Tensor:  # [E, 2I, H]
        fmt, dfmt = store.blob_format(layer, "base"), store.blob_format(layer, "delta")
        out = []
        for e in range(experts):
            b, d = store.read_blob(layer, e, "base"), store.read_blob(layer, e, "delta")
            out.append(expert_matrix_with_delta(b, fmt, d, dfmt, "gate_up")
                       - expert_matrix(b, fmt, "gate_up"))  # fmt: skip
        return torch.stack(out)

    def oracle(layer: int, hidden: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Any:
        saved = runtime.gate
        _, changes = pair_changes(runtime, forward, layer, hidden, ids, w)
        runtime.gate = saved
        return budget_mask(torch.stack([c.pow(2).sum(-1) for c in changes], 1), budget)

    def by_map(maps: dict[tuple[int, int], torch.Tensor]) -> Score:
        def score(layer: int, hidden: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Any:
            values = torch.zeros(ids.shape)
            for e in ids.unique().tolist():
                a = maps.get((layer, e))
                if a is not None:
                    energy = (hidden.float() @ a).pow(2).sum(-1, keepdim=True)  # [T, 1]
                    values = torch.where(ids == e, energy.expand_as(values), values)
            return budget_mask(w.float().pow(2) * values, budget)

        return score

    def sketch(rank: int) -> Score:
        maps = {}
        for layer in sorted(runtime.formats):
            delta = gate_up_delta(layer)
            if rank > 0:
                _, s, vh = torch.linalg.svd(delta, full_matrices=False)
                delta = s[:, :rank, None] * vh[:, :rank, :]
            for e in range(experts):
                maps[(layer, e)] = delta[e].t()  # x @ [H, R]
        return by_map(maps)

    def inkernel(rank: int, with_gate_up: bool) -> Score:
        """w^2 (||S_gu x||^2 + ||S_d h||^2), h = silu(G x) * (U x) the expert's base hidden
        activation (what a kernel that ran the base gate_up first would hold): S_d the down
        delta's top `rank` singular directions (0: all); with_gate_up False: that term alone."""
        per: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for layer in sorted(runtime.formats):
            fmt, dfmt = store.blob_format(layer, "base"), store.blob_format(layer, "delta")
            dgu = gate_up_delta(layer)
            for e in range(experts):
                b, d = store.read_blob(layer, e, "base"), store.read_blob(layer, e, "delta")
                ddown = expert_matrix_with_delta(b, fmt, d, dfmt, "down") - expert_matrix(
                    b, fmt, "down"
                )  # fmt: skip  [H, I]
                sgu, sd = dgu[e], ddown
                if rank > 0:
                    _, s1, v1 = torch.linalg.svd(sgu, full_matrices=False)
                    sgu = s1[:rank, None] * v1[:rank]
                    _, s2, v2 = torch.linalg.svd(sd, full_matrices=False)
                    sd = s2[:rank, None] * v2[:rank]
                per[(layer, e)] = (expert_matrix(b, fmt, "gate_up"), sgu, sd)

        def score(layer: int, hidden: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Any:
            values = torch.zeros(ids.shape)
            x = hidden.float()
            for e in ids.unique().tolist():
                gu, sgu, sd = per[(layer, e)]
                gate, up = (x @ gu.t()).chunk(2, dim=-1)
                h = torch.nn.functional.silu(gate) * up
                energy = (h @ sd.t()).pow(2).sum(-1, keepdim=True)
                if with_gate_up:
                    energy = energy + (x @ sgu.t()).pow(2).sum(-1, keepdim=True)
                values = torch.where(ids == e, energy.expand_as(values), values)
            return budget_mask(w.float().pow(2) * values, budget)

        return score

    fitted: dict[tuple[int, int], torch.Tensor] = {}

    def fit(rank: int) -> Score:
        if not fitted:
            fitted.update(fit_maps(loaded, forward, args.calibration, args.ridge))
        maps = {}
        for key, a in fitted.items():
            if rank > 0:
                u, s, _ = torch.linalg.svd(a, full_matrices=False)
                a = u[:, :rank] * s[:rank]
            maps[key] = a
        return by_map(maps)

    def weight(layer: int, hidden: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Any:
        return budget_mask(w.float(), budget)

    ids = loaded.tokenizer.encode(open(args.text).read(), add_special_tokens=False)
    token_chunks = chunks(ids, 512, args.chunks)
    cache: dict[Any, torch.Tensor] = {}

    def theirs(batch: torch.Tensor) -> torch.Tensor:
        key = (batch.data_ptr(), tuple(batch.shape))
        if key not in cache:
            cache[key] = reference(batch).logits
        return cache[key]

    for variant in args.variants.split(","):
        kind, _, rank = variant.partition("-")
        if kind == "sketch":
            fn = sketch(int(rank))
        elif kind in ("inkernel", "down"):
            fn = inkernel(int(rank), with_gate_up=kind == "inkernel")
        elif kind == "fit":
            fn = fit(int(rank))
        else:
            fn = {"oracle": oracle, "weight": weight}[kind]
        runtime.gate = _Gate(fn)
        with torch.inference_mode():
            report = compare(lambda b: loaded.model(b).logits, theirs, token_chunks, 4)
        print(json.dumps({"variant": variant, "budget": budget, "chunks": args.chunks,
                          "mean_kld": round(report.mean_kld, 6),
                          "same_top1": round(report.same_top1, 4)}), flush=True)  # fmt: skip


def fit_maps(loaded: Any, forward: Any, text: str | None, ridge: float) -> dict:
    """Per (layer, expert): A [H, H] minimising ||x A - (f_delta - f_base)(x)||^2 over the
    expert's pairs in 8 chunks of `text` (ridge: `ridge` x the mean diagonal of X^T X)."""
    if text is None:
        raise SystemExit("fit-R needs --calibration TEXT")
    runtime = loaded.runtime
    xtx: dict[tuple[int, int], torch.Tensor] = {}
    xty: dict[tuple[int, int], torch.Tensor] = {}

    def collect(layer: int, hidden: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Any:
        base, changes = pair_changes(runtime, forward, layer, hidden, ids, w)
        for j, change in enumerate(changes):
            unweighted = (change / w[:, j : j + 1].float().clamp_min(1e-6)).double()
            for e in ids[:, j].unique().tolist():
                rows = ids[:, j] == e
                x = hidden[rows].double()
                if (layer, e) not in xtx:
                    xtx[(layer, e)] = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
                    xty[(layer, e)] = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
                xtx[(layer, e)] += x.t() @ x
                xty[(layer, e)] += x.t() @ unweighted[rows]
        return base

    runtime.forward = collect
    ids = loaded.tokenizer.encode(open(text).read(), add_special_tokens=False)
    with torch.inference_mode():
        calibration = chunks(ids, 512, 8)
        for i in range(0, calibration.shape[0], 4):
            loaded.model(calibration[i : i + 4])
    runtime.forward = forward
    out = {}
    for key, m in xtx.items():
        h = m.shape[0]
        regular = ridge * m.trace() / h * torch.eye(h, dtype=torch.float64)
        out[key] = torch.linalg.solve(m + regular, xty[key]).float()
    return out


if __name__ == "__main__":
    main()
