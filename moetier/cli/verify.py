"""`moetier verify STORE`: the store's index, every expert blob's crc32 and dense.safetensors'
(quant/verify.py); one line per problem, naming layer, expert, plane, file and offset (a file's
byte range); exit status 1 on any. A store converted before the index recorded dense.safetensors'
checksums says that file is not checked."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", help="a moetier store (output of `moetier convert`)")
    parser.add_argument(
        "--workers", type=int, default=0, help="blobs checked at a time (default: up to 8)"
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from moetier.quant.store import EXPERTS_FILE, INDEX_FILE
    from moetier.quant.verify import verify_store

    experts = Path(args.store) / EXPERTS_FILE
    total = experts.stat().st_size if experts.is_file() else 0
    try:  # and the weights files the index has checksums of (the bar's total only)
        files = json.loads((Path(args.store) / INDEX_FILE).read_text()).get("files", {})
        total += sum(int(record["bytes"]) for record in files.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # (verify_store says what is wrong with the index)
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
    for name in report.unchecked:  # (a store written before the index recorded checksums)
        print(
            f"{Path(args.store) / name}: not checked: the index has no checksum of it (a store "
            "converted before moetier recorded one); convert the model again to have it checked"
        )
    checked = [f"{report.blobs} blobs ({mib:,.1f} MiB)"]
    checked += [f"{name} ({n / 2**20:,.1f} MiB)" for name, n in report.files.items()]
    what = ", ".join(["index", *checked[:-1]]) + " and " + checked[-1]
    if report.unchecked:
        print(
            f"{args.store}: {what} ok, checked in {report.seconds:.1f} s; "
            f"{', '.join(report.unchecked)} not checked (no checksum)"
        )
    else:
        print(f"{args.store}: ok, {what} checked in {report.seconds:.1f} s")
    return 0
