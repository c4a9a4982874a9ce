"""Expert parallel (#49 item 4): decode tok/s at batch 1 and 16 on one GPU against two, on the
Qwen3-30B-A3B and DeepSeek-V4-Flash synthetic shapes, each GPU's expert cache a quarter of the
model's experts (so two GPUs cache half of them), the rest in host RAM; and, from the planner,
the per-GPU memory that keeps every expert of a model on the GPUs, one GPU against two.

Each measurement is `moetier bench --shape S --layers L --batch 1,16 --json
--expert-cache-slots Q --host-memory 1TiB [--gpus 2]` in a child process (Q: a quarter of the
slice's base blobs, per GPU). Expert parallel runs eager steps, so one GPU is measured twice:
with its CUDA graph (the default path) and with --no-cuda-graph (the same step kind as the two
GPUs'). One JSON line per (shape, run, batch) with the bench line's figures, then a line per
(shape, batch) with the ratios; `--servable` lines: planned, not measured.

    python3 bench/multi_gpu.py                       # 2 GPUs (nvidia-h200-x2 / h100-x2)
    python3 bench/multi_gpu.py --smoke               # CPU, two gloo processes, the tiny shape
    python3 bench/multi_gpu.py --servable-only       # the planner's lines alone (any machine)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit  # noqa: E402

from moetier.core.provenance import run_info  # noqa: E402
from moetier.quant.synthetic import shape  # noqa: E402
from moetier.residency.planner import plan_shape  # noqa: E402

SHAPES = ("qwen3-30b-a3b", "deepseek-v4-flash")
SHARE = 0.25  # of the slice's base blobs, in each GPU's expert cache
# (name, --gpus, extra bench flags)
RUNS = (("1gpu-graph", 1, []), ("1gpu-eager", 1, ["--no-cuda-graph"]), ("2gpu", 2, []))
# models whose all-resident per-GPU memory `--servable` plans (q2s experts, bf16 dense)
SERVABLE = ("qwen3-30b-a3b", "deepseek-v4-flash", "qwen3-235b-a22b", "glm-5", "deepseek-v3")


def quarter_slots(hf_config: dict[str, Any], share: float) -> int:
    """`share` of the model's base blobs: each GPU's --expert-cache-slots."""
    whole = plan_shape(hf_config, 2**50, 2**50)
    return max(1, int(whole.base_blobs * share))


def bench(
    name: str, layers: int, gpus: int, flags: list[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One `moetier bench` run in a child process -> its JSON lines."""
    slots = quarter_slots(shape(name, layers), SHARE)
    command = [sys.executable, "-m", "moetier", "bench", "--shape", name, "--layers", str(layers),
               "--batch", args.batch, "--prompt-tokens", str(args.prompt_tokens),
               "--new-tokens", str(args.new_tokens), "--json", "--expert-cache-slots",
               str(slots), "--host-memory", "1TiB", "--gpus", str(gpus), *flags,
               *args.bench_args.split()]  # fmt: skip
    print(f"multi_gpu: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    out = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    if out.returncode != 0:
        raise SystemExit(f"`moetier bench` failed ({out.returncode}):\n{out.stderr[-4000:]}")
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    for line in lines:
        line["expert_cache_slots_per_gpu"] = slots
    return lines


def servable(models: tuple[str, ...], gpu_memory: int) -> None:
    """Per model, the per-GPU memory its dense part, a 4096-token KV cache, the workspace and
    every expert (q2s) need on one GPU and on each of two; whether `gpu_memory` holds it."""
    for name in models:
        config = shape(name)
        for ranks in (1, 2):
            p = plan_shape(config, 2**50, 0, ranks=ranks)
            need = p.dense_bytes + p.kv_bytes + p.workspace_bytes + p.base_blobs * p.slot_bytes
            emit({
                **run_info(), "case": "multi_gpu_servable", "shape": name, "gpus": ranks,
                "per_gpu_gib_all_experts_resident": round(need / 2**30, 2),
                "fits_gpu_gib": round(gpu_memory / 2**30, 1), "fits": need <= gpu_memory,
                "how": "planned (residency/planner.py plan_shape, q2s experts, bf16 dense), "
                       "not measured",
            })  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, the tiny shape")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of each slice")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bench-args", default="", help="more `moetier bench` flags")
    parser.add_argument("--servable-only", action="store_true")
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=139.0,
        help="the servable lines' per-GPU memory (default: an H200's usable 139 GiB)",
    )
    args = parser.parse_args()
    runs = RUNS
    if args.smoke:
        args.shapes, args.layers, args.batch = "tiny", 2, "1,4"
        args.prompt_tokens, args.new_tokens = 8, 4
        args.bench_args = (args.bench_args + " --device cpu --warmup 0").strip()
        runs = (("1gpu-eager", 1, []), ("2gpu", 2, []))  # (no CUDA graph on CPU)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    servable(SERVABLE if not args.smoke else ("tiny",), int(args.gpu_memory_gib * 2**30))
    if args.servable_only:
        return 0
    for name in args.shapes.split(","):
        tok_s: dict[tuple[str, int], float] = {}
        for run, gpus, flags in runs:
            for line in bench(name, args.layers, gpus, flags, args):
                tok_s[(run, line["batch"])] = line["decode_tok_s"]
                emit({**line, "case": "multi_gpu", "run": run, "gpus": gpus,
                      "share_per_gpu": SHARE})  # fmt: skip
        for batch in sorted({b for _, b in tok_s}):
            two = tok_s.get(("2gpu", batch))
            ratios = {
                f"2gpu_over_{run}": round(two / tok_s[(run, batch)], 3)
                for run, _, _ in runs
                if run != "2gpu" and two and tok_s.get((run, batch))
            }
            emit({**run_info(), "case": "multi_gpu_ratio", "shape": name, "layers": args.layers,
                  "batch": batch, "decode_tok_s": {r: v for (r, b), v in tok_s.items()
                                                   if b == batch}, **ratios})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
