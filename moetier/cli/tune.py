"""`moetier tune [STORE | --shape NAME] [--time-budget S] [--from-defaults]`: times the experts
kernels' candidate configurations on this GPU at the store's (or a synthetic shape's) expert
shapes and formats, decode at 1-8 tokens and prefill buckets, within a time bound, and keeps the
winners in the user's cache, where `serve`, `generate` and `bench` find them on this card, driver
and Triton version (moetier/kernels/tune.py; docs/kernels.md, "Tuning")."""

from __future__ import annotations

import argparse
import sys
from typing import Any

NEEDS_GPU = (
    "moetier tune: error: tuning times the kernels on the GPU that will run them, and this "
    "machine has no CUDA GPU (torch.cuda.is_available() is False). Run `moetier tune` on the "
    "machine with the GPU; without a GPU moetier runs the experts on the CPU, which has "
    "nothing to tune."
)


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moetier.quant.synthetic import SHAPES

    parser.add_argument("store", nargs="?", help="a moetier store: its experts' shapes, formats")
    parser.add_argument(
        "--shape",
        help=f"tune for a synthetic model shape instead of a store: {' or '.join(SHAPES)}",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="stop after this long, keeping the best configuration found so far (default: "
        "300); the most valuable calls (decode at 1 token) are tuned first",
    )
    parser.add_argument(
        "--decode-tokens",
        type=_ints,
        default=[1, 2, 4, 8],
        metavar="T,...",
        help="decode call sizes (tokens) to tune, one table entry each (default: 1,2,4,8)",
    )
    parser.add_argument(
        "--prefill-tokens",
        type=_ints,
        default=[512, 4096],
        metavar="T,...",
        help="prefill call sizes (tokens) to tune, one table entry per bucket (default: "
        "512,4096; empty: none)",
    )
    parser.add_argument(
        "--from-defaults",
        action="store_true",
        help="start from the generic defaults rather than the tables this card reads now (the "
        "user's, the shipped one, its architecture's)",
    )
    parser.add_argument(
        "--out", help="write the table here instead of the user's cache (MOETIER_CACHE)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def shapes_of(args: argparse.Namespace) -> list[Any]:
    """The distinct expert shapes and formats to tune: the store's layers' or the synthetic
    shape's (q2s)."""
    from moetier.config import ModelConfig
    from moetier.kernels.tune import TuneShape

    if args.shape:
        from moetier.quant.synthetic import expert_format, shape

        hf = shape(args.shape)
        cfg = ModelConfig.from_hf(hf)
        return [TuneShape(args.shape, expert_format(hf), None, cfg.num_experts, cfg.top_k)]
    from moetier.quant.store import Store

    store = Store(args.store)
    cfg = store.model_config
    # each layer's delta plane's format, where any of its experts has one
    deltas = {layer: store.formats[entry.format]
              for (layer, _, plane), entry in store.blobs.items() if plane == "delta"}  # fmt: skip
    found: dict[tuple[str, str | None], TuneShape] = {}
    for layer in store.expert_layers:
        fmt = store.blob_format(layer)
        dfmt = deltas.get(layer)
        key = (fmt.name, dfmt.name if dfmt else None)
        label = f"{fmt.name}" + (f"+{dfmt.name}" if dfmt else "")
        found.setdefault(key, TuneShape(label, fmt, dfmt, cfg.num_experts, cfg.top_k))
    store.close()
    return list(found.values())


def run(args: argparse.Namespace) -> int:
    import torch

    if bool(args.store) == bool(args.shape):
        print("moetier tune: error: give a STORE or --shape NAME (one of them)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(NEEDS_GPU, file=sys.stderr)
        return 1
    from pathlib import Path

    from moetier.kernels import moe_dispatch
    from moetier.kernels.tune import GpuTimer, run_tune
    from moetier.quant.synthetic import random_blob

    shapes = shapes_of(args)

    def blob(fmt: Any, gen: torch.Generator) -> torch.Tensor:  # b = 3a: what convert writes
        return random_blob(fmt, gen, fitted_grid=False)

    card = moe_dispatch._device_name()
    print(f"moetier tune: {card}, {', '.join(s.label for s in shapes)}: "
          f"{args.time_budget:.0f} s at most", file=sys.stderr)  # fmt: skip
    report = run_tune(
        shapes,
        args.time_budget,
        GpuTimer(blob),
        card=card,
        from_defaults=args.from_defaults,
        decode_tokens=args.decode_tokens,
        prefill_tokens=args.prefill_tokens,
        path=Path(args.out) if args.out else None,
        progress=not args.no_progress,
    )
    for r in report.results:
        state = "" if r.complete else f" (time bound: {r.timed} of {r.job.size} timed)"
        print(f"  {r.job.label}: {r.speedup:.2f}x the starting configuration's speed{state}",
              file=sys.stderr)  # fmt: skip
    left = report.jobs - len(report.results)
    if left:
        print(f"  {left} call sizes not reached within the time bound (they keep the tables "
              "they had; a larger --time-budget tunes them)", file=sys.stderr)  # fmt: skip
    print(f"moetier tune: {report.wall_s:.0f} s; wrote {report.path}", file=sys.stderr)
    return 0
