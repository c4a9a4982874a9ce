"""Step time of an 8-layer slice of the MoE op (Qwen3-30B-A3B shape, q2s experts, top-8 of 128),
the dispatcher's kernels today (per-pair q2s GEMV below 512 pairs, q2s_mma at 512) against the
GEMV grouped by expert (`q2s_gemv_grouped.py`), every expert resident and with a 25% GPU
expert budget (the rest read zero-copy from pinned host rows). One JSON line per case, with
the floor measured in the same run: the distinct experts' bytes of each layer over HBM copy
speed (GPU slots) and zero-copy read speed (host rows), `moetier.residency.links`.

  python bench/studies/q2s_grouped.py                         # T = 1, 4, 16, 64
  python bench/studies/q2s_grouped.py --tokens 16,64 --block-t 4,8
  python bench/studies/q2s_grouped.py --tokens 64 --budgets 1.0 --block-t 8,16 --tiles 128x256w8

Each case: a CUDA graph of the 8 layers' calls (each layer its own pool and routing), timed as
`bench/common.graph_ms` times (median of replays); step_ms = the 8 calls. `grouped` with a
BLOCK_T given runs that many pairs a program; with none, the dispatcher's own choice
(`choose_q2s_grouped`, BLOCK_T 4 where it would not group). About 60 s on an H100.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, kernels
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import emit, graph_ms  # noqa: E402
from kernels import SHAPES, Case, ZeroCopyCase, q2s_format, weight_bytes  # noqa: E402

from moetier.kernels import moe_dispatch  # noqa: E402
from moetier.kernels.moe_dispatch import KernelChoice  # noqa: E402
from moetier.residency.links import memory_bandwidth, zero_copy_bandwidth  # noqa: E402

Choice = tuple[KernelChoice, KernelChoice]


def current_choice(shape: str, tokens: int, zero_copy: bool) -> Choice:
    """What the dispatcher ran before the grouped kernel: per-pair GEMV below 512 pairs, else
    q2s_mma."""
    hidden, inter, experts, top_k = SHAPES[shape]
    pairs = tokens * top_k
    gu, dn = (2 * inter, hidden), (hidden, inter)
    if pairs < moe_dispatch.Q2S_GEMV_MAX_PAIRS:
        return (
            moe_dispatch.choose_q2s_gemv(*gu, zero_copy, False, pairs),
            moe_dispatch.choose_q2s_gemv(*dn, zero_copy, False, pairs),
        )
    return moe_dispatch.choose_q2s_mma(pairs, experts, gu, dn)


def grouped_choice(shape: str, tokens: int, zero_copy: bool, block_t: int) -> Choice:
    hidden, inter, experts, top_k = SHAPES[shape]
    gu, dn = (2 * inter, hidden), (hidden, inter)
    chosen = moe_dispatch.choose_q2s_grouped(tokens, top_k, experts, (gu, dn), zero_copy)
    if chosen is None:
        c = replace(moe_dispatch.Q2S_GROUPED, group_pairs=block_t or 4)
        return c, c
    if block_t:
        return replace(chosen[0], group_pairs=block_t), replace(chosen[1], group_pairs=block_t)
    return chosen


def tiled(choice: Choice, tile: str) -> Choice:
    """`choice` with both launches' tiles set from "NxKwW[sS]" (see --tiles)."""
    n, rest = tile.split("x")
    k, rest = rest.split("w")
    warps, _, stages = rest.partition("s")
    fields = {"block_n": int(n), "block_k": int(k), "num_warps": int(warps)}
    if stages:
        fields["num_stages"] = int(stages)
    return replace(choice[0], **fields), replace(choice[1], **fields)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", default="1,4,16,64")
    parser.add_argument("--block-t", default="0", help="BLOCK_T values (0: the dispatcher's)")
    parser.add_argument(
        "--tiles",
        default="",
        help="grouped tiles to try, both launches: BLOCK_NxBLOCK_KwWARPS[sSTAGES],... "
        "(e.g. 64x256w4,128x128w8s2); empty: the dispatcher's",
    )
    parser.add_argument("--budgets", default="1.0,0.25", help="GPU fractions of the experts")
    args = parser.parse_args()
    fmt = q2s_format(args.shape)
    expert_bytes = weight_bytes(fmt)
    hbm = memory_bandwidth("cuda")
    zc = zero_copy_bandwidth("cuda")
    emit({"case": "links", "hbm_gbps": round(hbm / 1e9, 1), "zero_copy_gbps": round(zc / 1e9, 1),
          "device": torch.cuda.get_device_name()})  # fmt: skip
    for budget in (float(b) for b in args.budgets.split(",")):
        zero_copy = budget < 1.0
        layers = [
            ZeroCopyCase(args.shape, fmt, budget) if zero_copy else Case(args.shape, fmt, None)
            for _ in range(args.layers)
        ]
        for tokens in (int(t) for t in args.tokens.split(",")):
            routes = [layer.routings(tokens, 1, seed=100 * i + tokens)[0]
                      for i, layer in enumerate(layers)]  # fmt: skip
            floor_s = 0.0
            for layer, r in zip(layers, routes, strict=True):
                distinct = torch.unique(r["ids"])
                host = int((layer.slot_table[distinct] >= layer.experts).sum()) if zero_copy else 0
                floor_s += (distinct.numel() - host) * expert_bytes / hbm
                floor_s += host * expert_bytes / zc
            kinds: list[tuple[str, Choice]] = [
                ("current", current_choice(args.shape, tokens, zero_copy))
            ]
            for bt in (int(b) for b in args.block_t.split(",")):
                base = grouped_choice(args.shape, tokens, zero_copy, bt)
                name = f"grouped-t{bt}" if bt else "grouped"
                kinds.append((name, base))
                for tile in filter(None, args.tiles.split(",")):
                    kinds.append((f"{name}-{tile}", tiled(base, tile)))
            for name, choice in kinds:
                calls = [
                    (lambda layer=layer, r=r, c=choice: layer.call(r, c))
                    for layer, r in zip(layers, routes, strict=True)
                ]
                step_ms = graph_ms(calls) * len(calls)
                emit({"case": name, "budget": budget, "tokens": tokens,
                      "block_t": choice[0].group_pairs, "q2s_mma": choice[0].q2s_mma,
                      "tile": [choice[0].block_n, choice[0].block_k, choice[0].num_warps,
                               choice[0].num_stages],
                      "step_ms": round(step_ms, 4), "floor_ms": round(floor_s * 1e3, 4),
                      "step_over_floor": round(step_ms / (floor_s * 1e3), 3)})  # fmt: skip
        del layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
