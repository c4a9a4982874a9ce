"""Expert-cache hit rate of each replacement policy on recorded routing traces.

    PYTHONPATH=. python bench/replay.py [--scope global layer] [--sizes 0.1 0.25 0.5 0.75]

One JSON line per (trace, policy, scope, size). Traces (formats in shared/data/README.md and
shared/models/eval-moe-70m/NOTES.md):
  eval-moe-70m          router_trace.npz: 16,384 held-out tokens x 5 layers, 32 experts, top-4
  mixtral-humaneval     2 problems' generated tokens x 32 layers, 8 experts, top-2
  mixtral-gsm8k         same, GSM8K
  qwen1.5-moe           layers 0/8/12/18/23 of 60 experts, top-4, one vLLM run per layer; the
                        warm-up records are dropped and the runs aligned record by record
  olmoe                 layer 0 only, 64 experts, top-8; warm-up records dropped
The first --calibration fraction of each trace's tokens fits the static hot set and warms every
cache; the hit rate is counted on the rest (moetier/residency/replay.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from moetier.core.provenance import git_commit
from moetier.residency.replay import POLICIES, SCOPES, Request, Trace, replay

SHARED = Path(__file__).resolve().parents[2] / "shared"
EVAL_MODEL = SHARED / "models" / "eval-moe-70m"
DATA = SHARED / "data"


def load_router_trace(path: Path, name: str = "eval-moe-70m") -> Trace:
    data = np.load(path)
    ids = data["expert_ids"]  # [L, T, k] uint8
    probs = data["router_probs"].astype(np.float32)  # [L, T, k]
    layers, tokens, _ = ids.shape
    requests = [
        Request(
            t, layer, tuple(int(e) for e in ids[layer, t]), tuple(float(p) for p in probs[layer, t])
        )
        for t in range(tokens)
        for layer in range(layers)
    ]
    num_experts = 32 if ids.max() < 32 else int(ids.max()) + 1
    return Trace(name, num_experts, tuple(range(layers)), tuple(requests))


def load_mixtral(path: Path, name: str) -> Trace:
    """Generated tokens of each problem in order, problems one after another."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records.sort(key=lambda r: (r["problem_id"], r["token_idx"], r["layer"]))
    token_ids: dict[tuple[int, int], int] = {}
    requests = []
    for r in records:
        token = token_ids.setdefault((r["problem_id"], r["token_idx"]), len(token_ids))
        requests.append(Request(token, r["layer"], tuple(r["experts"]), tuple(r["gating_probs"])))
    layers = tuple(sorted({r.layer for r in requests}))
    return Trace(name, 8, layers, tuple(requests))


def vllm_routes(path: Path, warmup: int) -> list[dict]:
    lines = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    routes = [r for r in lines if r.get("type") == "route"]
    return routes[warmup:]


def load_qwen(directory: Path) -> Trace:
    layer_files = {
        int(p.stem.removeprefix("moe_layer")): p for p in directory.glob("moe_layer*.jsonl")
    }
    runs = {layer: vllm_routes(path, warmup=8448) for layer, path in sorted(layer_files.items())}
    n = min(len(r) for r in runs.values())
    requests = [
        Request(t, layer, tuple(runs[layer][t]["topk_ids"]), tuple(runs[layer][t]["topk_weights"]))
        for t in range(n)
        for layer in sorted(runs)
    ]
    return Trace("qwen1.5-moe-a2.7b", 60, tuple(sorted(runs)), tuple(requests))


def load_olmoe(path: Path) -> Trace:
    routes = vllm_routes(path, warmup=2048)
    requests = [
        Request(t, 0, tuple(r["topk_ids"]), tuple(r["topk_weights"])) for t, r in enumerate(routes)
    ]
    return Trace("olmoe-1b-7b", 64, (0,), tuple(requests))


def load_traces() -> list[Trace]:
    mixtral = DATA / "traces-mixtral-8x7b"
    return [
        load_router_trace(EVAL_MODEL / "router_trace.npz"),
        load_mixtral(mixtral / "humaneval_2_routing.jsonl", "mixtral-8x7b-humaneval"),
        load_mixtral(mixtral / "gsm8k_2_routing.jsonl", "mixtral-8x7b-gsm8k"),
        load_qwen(DATA / "traces-qwen1.5-moe-a2.7b"),
        load_olmoe(DATA / "traces-olmoe-1b-7b" / "moe_routes.jsonl"),
    ]


def markdown_table(path: Path) -> str:
    """The hit-rate table of docs/residency.md from this script's JSON lines."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        key = (r["trace"], r["scope"], r["size"], r["capacity"], r["of"])
        cells.setdefault(key, {})[r["policy"].split("(")[0]] = r["hit_rate"]
    out = [
        "| trace | scope | size | slots | " + " | ".join(POLICIES) + " |",
        "|---|---|---|---|" + "---|" * len(POLICIES),
    ]
    for (trace, scope, size, capacity, of), by_policy in cells.items():
        rates = " | ".join(f"{by_policy[p]:.3f}" if p in by_policy else "" for p in POLICIES)
        out.append(f"| {trace} | {scope} | {size:.0%} | {capacity}/{of} | {rates} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.1, 0.25, 0.5, 0.75])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--scope", nargs="+", default=["global"], choices=SCOPES)
    parser.add_argument("--calibration", type=float, default=0.25)
    parser.add_argument("--half-life", type=float, default=128.0, help="tokens, LFU decay")
    parser.add_argument("--traces", nargs="*", help="only traces whose name contains one of these")
    parser.add_argument("--table", type=Path, help="print the markdown table of a JSON-lines file")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table(args.table))
        return
    commit = git_commit()
    for trace in load_traces():
        if args.traces and not any(t in trace.name for t in args.traces):
            continue
        for scope in args.scope:
            for size in args.sizes:
                for policy in args.policies:
                    start = time.perf_counter()
                    r = replay(trace, policy, size, scope, args.calibration, args.half_life)
                    print(
                        json.dumps(
                            {
                                "bench": "replay",
                                "commit": commit,
                                "trace": r.trace,
                                "layers": len(trace.layers),
                                "experts": trace.num_experts,
                                "top_k": trace.top_k,
                                "scope": r.scope,
                                "size": size,
                                "capacity": r.capacity,
                                "of": r.total_experts,
                                "policy": r.policy,
                                "calibration_tokens": r.calibration_tokens,
                                "eval_tokens": r.eval_tokens,
                                "hits": r.hits,
                                "misses": r.misses,
                                "hit_rate": round(r.hit_rate, 4),
                                "seconds": round(time.perf_counter() - start, 2),
                            }
                        ),
                        flush=True,
                    )


if __name__ == "__main__":
    sys.exit(main())
