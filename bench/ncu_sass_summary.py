"""Summary of an Nsight Compute source page: per kernel, the share of executed instructions and
of warp-stall samples by opcode, and the most-stalled SASS lines with their main stall reasons.
One JSON line per kernel.

  ncu --clock-control none --section SourceCounters --section WarpStateStats \\
      -k regex:_q2s_gemv_kernel --launch-skip 8 --launch-count 2 -o prof \\
      python3 bench/kernels.py --eager deepseek-v3:8
  ncu --import prof.ncu-rep --page source --print-source sass --csv > src.csv
  python3 bench/ncu_sass_summary.py src.csv
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
from pathlib import Path


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def kernels(rows: list[list[str]]) -> list[tuple[list[str], list[list[str]]]]:
    """(header, SASS rows) per kernel: each kernel's table starts with a row holding "Address";
    rows shorter than it (each kernel's "Kernel Name" row, before the next table) are not SASS."""
    out: list[tuple[list[str], list[list[str]]]] = []
    for row in rows:
        if "Address" in row[:2]:
            out.append((row, []))
        elif out and len(row) >= len(out[-1][0]):
            out[-1][1].append(row)
    return out


def summary(header: list[str], rows: list[list[str]], top: int) -> dict:  # type: ignore[type-arg]
    col = {name: i for i, name in enumerate(header)}
    src, ex = col["Source"], col["Instructions Executed"]
    st = col["Warp Stall Sampling (All Samples)"]
    reasons = [i for i, name in enumerate(header) if name.startswith("stall_") and "(" not in name]
    by_op: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for row in rows:
        words = [w for w in row[src].split() if not w.startswith("@")]
        op = words[0].split(".")[0] if words else "?"
        by_op[op][0] += number(row[ex])
        by_op[op][1] += number(row[st])
    executed = sum(v[0] for v in by_op.values()) or 1.0
    samples = sum(v[1] for v in by_op.values()) or 1.0
    ops = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
    lines = []
    for row in sorted(rows, key=lambda r: -number(r[st]))[:top]:
        main = [i for i in sorted(reasons, key=lambda i: -number(row[i]))[:2] if number(row[i])]
        lines.append({"sass": row[src].strip(), "executed": number(row[ex]),
                      "stall_share": round(number(row[st]) / samples, 4),
                      "reasons": {header[i]: number(row[i]) for i in main}})  # fmt: skip
    return {
        "sass_lines": len(rows),
        "warp_instructions": executed,
        "stall_samples": samples,
        "ops": {
            op: {"executed": round(e / executed, 4), "stalls": round(s / samples, 4)}
            for op, (e, s) in ops
        },  # fmt: skip
        "top_stalls": lines,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path, help="ncu --page source --print-source sass --csv")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    with args.csv.open(newline="") as f:
        rows = list(csv.reader(f))
    for i, (header, body) in enumerate(kernels(rows)):
        print(json.dumps({"kernel": i, **summary(header, body, args.top)}))


if __name__ == "__main__":
    main()
