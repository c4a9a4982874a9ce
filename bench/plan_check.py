"""`moetier plan`'s decode prediction against `moetier bench`'s measurement on the Qwen3-30B-A3B
shape slice, for three expert budgets: every expert resident; half of the base blobs in GPU slots
with the rest in (pinned) host RAM; a quarter in GPU slots, the rest in host RAM.

For each budget: the links measured the way `moetier plan --predict` measures them
(cli/plan_links.py), the prediction of residency/speed.py for the plan of that budget, then
`moetier bench --shape qwen3-30b-a3b --layers N --batch 1,16 --json` in a child process with
the same budget (`--expert-cache-slots S --host-memory 1TiB`). One JSON line per (budget, batch
size): predicted and measured decode tok/s and their ratio (measured / predicted), also at the
link speeds the bench measured in its own run (`_at_bench_links`), which separates the model's
error from the links' variation between processes.

    python3 bench/plan_check.py                      # the GPU check (issue #48: within ±25%)
    python3 bench/plan_check.py --layers 1 --new-tokens 4 --prompt-tokens 8 --batch 1 \\
        --bench-args "--device cpu"                  # a CPU smoke run (figures meaningless)
    python3 bench/plan_check.py --from-lines docs/results/models-dense-budget-h100.jsonl
                                                     # predictions for bench lines already run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit  # noqa: E402

from moetier.cli import plan_links  # noqa: E402
from moetier.core.provenance import run_info  # noqa: E402
from moetier.quant.synthetic import shape  # noqa: E402
from moetier.residency import speed  # noqa: E402
from moetier.residency.cost import LinkSpeeds  # noqa: E402
from moetier.residency.planner import Plan, plan_shape  # noqa: E402
from moetier.residency.zero_copy import staging_slots  # noqa: E402

SHAPE = "qwen3-30b-a3b"
# (name, share of the base blobs in GPU slots; None: every expert resident, no budget flags)
CONFIGS = (("resident", None), ("gpu-50%", 0.5), ("gpu-25%", 0.25))


def budget_plan(hf_config: dict[str, Any], share: float | None, stage: int = 3) -> Plan:
    """The plan of a budget: every expert on the GPU, or `share` of the base blobs in GPU
    slots (as `--expert-cache-slots` caps them) and the rest in host RAM."""
    whole = plan_shape(hf_config, 2**50, 2**50, zero_copy_stage=stage)
    if share is None:
        return whole
    slots = slots_for(whole, share)
    layers = whole.blobs_per_token // int(hf_config["num_experts_per_tok"])
    per_layer = staging_slots(stage, slots, layers)
    return dataclasses.replace(
        whole,
        gpu_base_slots=slots,
        host_blobs=whole.base_blobs - slots,
        staging=per_layer * layers,
        stage=per_layer,
    )


def slots_for(whole: Plan, share: float) -> int:
    return max(1, round(whole.base_blobs * share))


def bench(args: argparse.Namespace, slots: int | None) -> list[dict[str, Any]]:
    """`moetier bench`'s JSON lines for this budget (a child process)."""
    cmd = [sys.executable, "-m", "moetier", "bench", "--shape", SHAPE, "--layers",
           str(args.layers), "--batch", args.batch, "--json", "--new-tokens",
           str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens),
           *shlex.split(args.bench_args)]  # fmt: skip
    if slots is not None:
        cmd += ["--expert-cache-slots", str(slots), "--host-memory", "1TiB"]
    print(f"plan_check: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"moetier bench failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def bench_links(line: dict[str, Any]) -> LinkSpeeds | None:
    try:
        return LinkSpeeds(*(line[f"{n}_GB/s"] * 1e9 for n in ("hbm", "h2d", "zero_copy", "disk")))
    except (KeyError, TypeError, ValueError):
        return None


def from_lines(path: Path) -> None:
    """A JSON line per `moetier bench` line of the Qwen3-30B-A3B shape (bf16 dense) in `path`:
    its measured decode and prefill beside the prediction at its own links and budget."""
    for text in path.read_text().splitlines():
        line = json.loads(text)
        if line.get("shape") != SHAPE or line.get("dense_formats") or line.get("case") != "bench":
            continue
        links = bench_links(line)
        if links is None:
            continue
        hf_config = shape(SHAPE, int(line["moe_layers"]))
        slots = line.get("engine", {}).get("expert_cache_slots")
        whole = budget_plan(hf_config, None)
        p = budget_plan(hf_config, None if slots is None else slots / whole.base_blobs)
        b = int(line["batch"])
        pred = speed.predict(p, speed.model_counts(hf_config), links, (b,), line["prompt_tokens"])
        emit({
            "case": "plan_check_lines", "source": path.name, "commit": line.get("commit"),
            "device": line.get("device"), "layers": line["moe_layers"],
            "gpu_slots": p.gpu_base_slots, "expert_blobs": p.base_blobs, "batch": b,
            "measured_decode_tok_s": line["decode_tok_s"],
            "predicted_decode_tok_s": round(pred.decode_tok_s[b], 2),
            "ratio": _sig(line["decode_tok_s"] / pred.decode_tok_s[b]),
            "measured_prefill_tok_s": line["prefill_tok_s"],
            "predicted_prefill_tok_s": round(pred.prefill_tok_s[b], 1),
            "prefill_ratio": _sig(line["prefill_tok_s"] / pred.prefill_tok_s[b]),
        })  # fmt: skip


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the slice")
    parser.add_argument("--batch", default="1,16", help="batch sizes (default: 1,16)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument(
        "--configs", default=",".join(c for c, _ in CONFIGS), help="which budgets, by name"
    )
    parser.add_argument("--bench-args", default="", help="more flags for moetier bench")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per bench run")
    parser.add_argument(
        "--from-lines",
        metavar="JSONL",
        help="no bench run: predict the decode and prefill of the Qwen3-30B-A3B bf16-dense "
        "`moetier bench` lines in this file, at each line's own link speeds",
    )
    args = parser.parse_args()
    if args.from_lines:
        from_lines(Path(args.from_lines))
        return

    hf_config = shape(SHAPE, args.layers)
    info = run_info()
    links = plan_links.measure()
    batches = tuple(int(b) for b in args.batch.split(","))
    wanted = set(args.configs.split(","))
    for name, share in CONFIGS:
        if name not in wanted:
            continue
        p = budget_plan(hf_config, share)
        counts = speed.model_counts(hf_config)
        predicted = speed.predict(p, counts, links.speeds, batches, args.prompt_tokens)
        slots = None if share is None else p.gpu_base_slots
        for line in bench(args, slots):
            b = int(line["batch"])
            measured = line.get("decode_tok_s")
            at_bench = bench_links(line)
            again = (
                speed.predict(p, counts, at_bench, (b,), args.prompt_tokens) if at_bench else None
            )
            record = {
                **info,
                "case": "plan_check",
                "shape": SHAPE,
                "layers": args.layers,
                "config": name,
                "gpu_slots": p.gpu_base_slots,
                "expert_blobs": p.base_blobs,
                "batch": b,
                "decode": predicted.strategy,
                "predicted_decode_tok_s": round(predicted.decode_tok_s[b], 2),
                "measured_decode_tok_s": measured,
                "ratio": _sig(measured / predicted.decode_tok_s[b]) if measured else None,
                "predicted_prefill_tok_s": round(predicted.prefill_tok_s[b], 1),
                "measured_prefill_tok_s": line.get("prefill_tok_s"),
                "predicted_at_bench_links": round(again.decode_tok_s[b], 2) if again else None,
                "ratio_at_bench_links": (
                    _sig(measured / again.decode_tok_s[b]) if again and measured else None
                ),
                "measured_hit_rate": line.get("hit_rate"),
                "predicted_gpu_share": round(predicted.shares.gpu, 4),
                "links": {k: v for k, v in line.items() if k.endswith("_GB/s")},
                "plan_links_measured": sorted(links.measured),
                "bench_path": line.get("path"),
            }
            emit(record)


if __name__ == "__main__":
    main()
