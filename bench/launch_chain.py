"""The launch chain's floor (H200): what a call of K dependent launches costs when the kernels do
almost nothing, one JSON line per (PDL, grid, K).

  python bench/launch_chain.py

Each call is K launches of a trivial Triton kernel (each program: one load it issues before it
waits for the launch before, one load of that launch's output, one store), the calls chained
in one CUDA graph of 32 calls, as bench/kernels.py times the MoE op. With `pdl` the launches use
programmatic dependent launch as the q2s GEMV does (each lets the next start, then waits for
the one before); without it each launch starts when the one before has ended. The q2s decode
call is K = 3 launches (activation rounding, gate_up, down): this is the part of its time that
no change inside the kernels removes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).parent))
from common import emit, run_info  # noqa: E402

CALLS = 32  # calls a graph
SIZE = 1 << 15


@triton.jit
def _link(src, dst, n, PDL: tl.constexpr):
    """One link of the chain: dst[pid % n] = src[pid % n] + a value read before the wait."""
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    early = tl.load(src + (pid * 7919 + 13) % n + n)  # (not the launch before's output)
    if PDL:
        gdc_wait()
    tl.store(dst + pid % n, tl.load(src + pid % n) + early)


def call_us(kernels: int, grid: int, pdl: bool) -> float:
    """Median µs per call of `kernels` chained launches of `grid` programs."""
    bufs = [torch.zeros(2 * SIZE, device="cuda") for _ in range(kernels + 1)]

    def call() -> None:
        for i in range(kernels):
            _link[(grid,)](bufs[i], bufs[i + 1], SIZE, pdl, launch_pdl=pdl)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call()
    start = time.perf_counter()
    while time.perf_counter() - start < 0.1:  # clocks up before timing
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(21):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1000 / CALLS)
    return sorted(times)[len(times) // 2]


def main() -> None:
    info = run_info()
    for pdl in (True, False):
        for grid in (1, 132, 384, 1024):
            for kernels in (1, 2, 3):
                us = call_us(kernels, grid, pdl)
                emit({**info, "case": "launch_chain", "pdl": pdl, "grid": grid,
                      "kernels": kernels, "us_per_call": round(us, 2)})  # fmt: skip


if __name__ == "__main__":
    main()
