"""`moetier verify STORE`: the store's index and every expert blob's crc32 (quant/verify.py);
one line per problem, naming layer, expert, plane, file and offset; exit status 1 on any."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", help="a moetier store (output of `moetier convert`)")
    parser.add_argument(
        "--workers", type=int, default=0, help="blobs checked at a time (default: up to 8)"
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from moetier.quant.store import EXPERTS_FILE
    from moetier.quant.verify import verify_store

    experts = Path(args.store) / EXPERTS_FILE
    total = experts.stat().st_size if experts.is_file() else 0
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="verify", disable=not sys.stderr.isatty()
    ) as bar:
        report = verify_store(args.store, args.workers or None, progress=bar.update)
    for problem in report.problems:
        print(problem)
    mib = report.bytes / 2**20
    if not report.ok:
        print(
            f"{args.store}: {len(report.problems)} problem(s); {report.blobs} blobs "
            f"({mib:,.1f} MiB) checked",
            file=sys.stderr,
        )
        return 1
    print(
        f"{args.store}: ok, index and {report.blobs} blobs ({mib:,.1f} MiB) checked in "
        f"{report.seconds:.1f} s"
    )
    return 0
