"""HBM read rate of the q2s decode GEMV's access pattern, without its decode: the ceiling a
GEMV kernel of this shape can reach (H200), one JSON line per case next to the copy bandwidth
measured in the same run.

  python bench/hbm_pattern.py

Each program walks a region of REGION_ROWS rows of ROW_BYTES, one tile (rows x chunk bytes per
row) at a time with the next tile's loads issued before the current one is used (the GEMV's
hand-made prefetch), and does EXTRA dependent integer multiply-adds per 32-bit word (the
GEMV's decode does ~10 integer instructions per word of 16 codes). tile_major 1 reads the same
bytes with each tile contiguous (a blob layout the GEMV does not have).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, emit, run_info, time_cuda  # noqa: E402


@triton.jit
def _pattern_kernel(src, out, ROW_WORDS: tl.constexpr, REGION_ROWS: tl.constexpr,
                    ROWS: tl.constexpr, CW: tl.constexpr, EXTRA: tl.constexpr,
                    TILE_MAJOR: tl.constexpr):  # fmt: skip
    base = src + tl.program_id(0).to(tl.int64) * REGION_ROWS * ROW_WORDS
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, CW)[None, :]
    NCB: tl.constexpr = ROW_WORDS // CW
    TILES: tl.constexpr = (REGION_ROWS // ROWS) * NCB
    acc = tl.zeros((ROWS, CW), tl.int32)
    if TILE_MAJOR:
        nxt = tl.load(base + r * CW + c)
    else:
        nxt = tl.load(base + r * ROW_WORDS + c)
    for i in range(1, TILES):
        cur = nxt
        if TILE_MAJOR:
            nxt = tl.load(base + i * (ROWS * CW) + r * CW + c)
        else:
            nxt = tl.load(base + ((i // NCB) * ROWS + r) * ROW_WORDS + (i % NCB) * CW + c)
        for _ in tl.static_range(EXTRA):
            cur = cur * 1664525 + 1013904223
        acc ^= cur
    acc ^= nxt
    tl.store(out + tl.program_id(0), tl.xor_sum(tl.reshape(acc, (ROWS * CW,)), axis=0))


def read_pattern(
    src: torch.Tensor,
    out: torch.Tensor,
    row_words: int,
    region_rows: int,
    rows: int,
    cw: int,
    extra: int,
    tile_major: int,
    warps: int = 4,
) -> None:
    """One launch: out[p] = the XOR of all words of region p's tiles, each tile but the last
    through EXTRA multiply-adds first (int32 words)."""
    _pattern_kernel[(out.numel(),)](src, out, row_words, region_rows, rows, cw, extra,
                                    tile_major, num_warps=warps)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row-bytes", type=int, default=2048)
    parser.add_argument("--region-rows", type=int, default=128)
    parser.add_argument("--tile-kb", default="16,32")
    parser.add_argument("--chunk-bytes", default="32,128,512,2048")
    parser.add_argument("--extra", default="0,10")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--gb", type=float, default=0.5, help="bytes read per case, GB")
    args = parser.parse_args()
    info = run_info()
    copy = copy_bandwidth()
    emit({**info, "case": "copy", "GB/s": round(copy / 1e9, 1)})
    row_words = args.row_bytes // 4
    region = args.region_rows * args.row_bytes
    grid = int(args.gb * 1e9) // region
    src = torch.randint(-(2**31), 2**31 - 1, (grid * region // 4,), dtype=torch.int32,
                        device="cuda")  # fmt: skip
    out = torch.empty(grid, dtype=torch.int32, device="cuda")
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    cases = [
        (tile_kb, chunk, extra, warps, tile_major)
        for tile_kb, chunk, extra, warps in itertools.product(
            ints(args.tile_kb), ints(args.chunk_bytes), ints(args.extra), ints(args.warps)
        )
        for tile_major in ((0, 1) if extra else (0,))
        if row_words % (chunk // 4) == 0 and 1 <= tile_kb * 1024 // chunk <= args.region_rows
    ]
    for tile_kb, chunk, extra, warps, tile_major in cases:
        rows = tile_kb * 1024 // chunk
        launch = functools.partial(read_pattern, src, out, row_words, args.region_rows, rows,
                                   chunk // 4, extra, tile_major, warps)  # fmt: skip
        ms = time_cuda(launch, reps=20)
        gbs = grid * region / ms / 1e6
        emit({**info, "case": "hbm-pattern", "row_B": args.row_bytes,
              "region_rows": args.region_rows, "tile_KB": tile_kb, "chunk_B": chunk,
              "rows": rows, "extra": extra, "warps": warps, "tile_major": tile_major,
              "GB/s": round(gbs, 1), "copy_GB/s": round(copy / 1e9, 1),
              "of_copy": round(gbs * 1e9 / copy, 3)})  # fmt: skip


if __name__ == "__main__":
    main()
