"""`moetier plan STORE --gpu-memory 24GiB [--host-memory 64GiB]`: what would go where."""

from __future__ import annotations

import argparse

from moetier.config import DEFAULT_STORE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", nargs="?", default=str(DEFAULT_STORE), help="a moetier store")
    parser.add_argument("--gpu-memory", required=True, help="GPU budget, e.g. 24GiB")
    parser.add_argument("--host-memory", default="0", help="pinned host RAM budget, e.g. 64GiB")
    parser.add_argument("--max-context", type=int, default=4096, help="KV cache tokens per row")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument(
        "--zero-copy-stage",
        type=int,
        default=3,
        help="staging slots per MoE layer in zero-copy decode (as generate/serve; 0 = off)",
    )


def run(args: argparse.Namespace) -> int:
    from moetier.quant.store import Store
    from moetier.residency.planner import parse_bytes, plan

    store = Store(args.store)
    result = plan(
        store,
        parse_bytes(args.gpu_memory),
        parse_bytes(args.host_memory),
        max_context=args.max_context,
        batch=args.batch,
        zero_copy_stage=args.zero_copy_stage,
    )
    print(result.render())
    return 0
