"""bench/launch_chain.py's link kernel (on CPU in Triton's interpreter, which conftest turns on):
each program adds a value it read before the wait to the launch before's output, as the
docstring says, so the chain really depends on the launch before."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
launch_chain = pytest.importorskip("launch_chain")


def test_link_reads_the_launch_before():
    n = grid = 64
    src = torch.arange(2 * n, dtype=torch.float32, device=DEVICE)
    dst = torch.zeros(2 * n, device=DEVICE)
    launch_chain._link[(grid,)](src, dst, n, False)
    want = torch.zeros(2 * n)
    for pid in range(grid):
        want[pid % n] = src[pid % n].item() + src[(pid * 7919 + 13) % n + n].item()
    assert torch.equal(dst.cpu(), want)
