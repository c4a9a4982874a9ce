"""bench/common.py's read-floor kernel (on CPU in Triton's interpreter, which conftest turns on):
it reads every word of its buffer once, whatever the grid, so the floor it times is the read of
exactly those bytes (the sums of its programs add up to the buffer's sum)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
common = pytest.importorskip("common")


@pytest.mark.parametrize(("n", "grid", "block"), [(1000, 3, 64), (4096, 4, 256), (77, 8, 16)])
def test_read_kernel_reads_every_word_once(n, grid, block):
    gen = torch.Generator().manual_seed(n)
    src = torch.randint(-1000, 1000, (n,), dtype=torch.int32, generator=gen).to(DEVICE)
    out = torch.zeros(grid, dtype=torch.int32, device=DEVICE)
    common._read_kernel()[(grid,)](src, out, n, block)
    assert int(out.sum()) == int(src.sum())
