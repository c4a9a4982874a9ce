"""bench/hbm_pattern.py's kernel reads every word of each region once, in either tile order
(on CPU in Triton's interpreter, which conftest turns on): its result against the same
reduction in torch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
hbm_pattern = pytest.importorskip("hbm_pattern")


def expected(src: torch.Tensor, regions: int, row_words: int, region_rows: int, rows: int,
             cw: int, extra: int, tile_major: bool) -> torch.Tensor:  # fmt: skip
    out = []
    for p in range(regions):
        region = src[p * region_rows * row_words : (p + 1) * region_rows * row_words].long()
        if tile_major:
            tiles = region.view(-1, rows, cw)
        else:
            grid = region.view(region_rows // rows, rows, row_words // cw, cw)
            tiles = grid.permute(0, 2, 1, 3).reshape(-1, rows, cw)
        acc = torch.zeros(rows, cw, dtype=torch.long)
        for i, tile in enumerate(tiles):
            if i < len(tiles) - 1:
                for _ in range(extra):
                    tile = (tile * 1664525 + 1013904223) & 0xFFFFFFFF
            acc ^= tile & 0xFFFFFFFF
        total = 0
        for v in acc.flatten().tolist():
            total ^= v
        out.append(total - 2**32 if total >= 2**31 else total)
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("tile_major", [0, 1])
def test_pattern_kernel_reads_every_word(tile_major):
    gen = torch.Generator().manual_seed(0)
    regions, row_words, region_rows, rows, cw = 3, 16, 8, 4, 8
    src = torch.randint(-(2**31), 2**31 - 1, (regions * region_rows * row_words,),
                        dtype=torch.int32, generator=gen)  # fmt: skip
    out = torch.zeros(regions, dtype=torch.int32, device=DEVICE)
    hbm_pattern.read_pattern(src.to(DEVICE), out, row_words, region_rows, rows, cw, 2, tile_major)
    want = expected(src, regions, row_words, region_rows, rows, cw, 2, bool(tile_major))
    assert torch.equal(out.cpu(), want)
