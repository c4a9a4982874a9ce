"""Helpers the bench scripts share beyond the package's: a JSON line out (`emit`), ms per call
of calls replayed as one CUDA graph (`graph_ms`), host-to-GPU copies a call per blob
(`h2d_blob_bandwidth`) and the read floor of one launch (`read_floor_ms`). What every line
carries (commit, device, versions) is moetier/core/provenance.py's `run_info`; link speeds are
moetier/residency/links.py's (`moetier bench` measures them too)."""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from moetier.kernels.timing import WARM_S, graph_ms, time_cuda  # noqa: F401 (re-exported)
from moetier.residency.links import time_host


def emit(record: dict[str, Any], sink: list[dict[str, Any]] | None = None) -> None:
    """Print one JSON line (and keep it in `sink` for a summary)."""
    print(json.dumps(record), flush=True)
    if sink is not None:
        sink.append(record)


@functools.cache
def _read_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def read_words(src, out, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """Reads int32 words [0, n) of src, BLOCK a program per step, programs striding over
        them; writes each program's sum (so nothing is optimised away)."""
        acc = tl.zeros((BLOCK,), tl.int32)
        for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(src + offs, mask=offs < n, other=0)
        tl.store(out + tl.program_id(0), tl.sum(acc, axis=0))

    return read_words


def read_floor_ms(nbytes: int, l2_bytes: int = 50 * 2**20) -> float:
    """The physical floor of reading `nbytes` from HBM in one kernel launch, as a decode call
    is timed: ms per launch of a CUDA graph of launches that each read their own buffer (the
    buffers together over 4x L2, so reads come from HBM; `graph_ms`), best of a few grid and
    block sizes. At small sizes the launch and the ramp of a kernel dominate, so this is well
    under copy bandwidth: what any one-launch kernel reading these bytes could do at best."""
    import triton

    kernel = _read_kernel()
    words = max(1, nbytes // 4)
    count = max(2, min(32, -(-4 * l2_bytes // max(1, nbytes)) + 1))
    bufs = [torch.randint(0, 100, (words,), dtype=torch.int32, device="cuda")
            for _ in range(count)]  # fmt: skip
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(sms * 32, dtype=torch.int32, device="cuda")
    best = float("inf")
    for per_sm, block, warps in ((4, 2048, 4), (8, 2048, 4), (16, 1024, 4), (8, 4096, 8)):
        grid = (max(1, min(sms * per_sm, triton.cdiv(words, block))),)
        launches = [lambda b=b, g=grid, bk=block, w=warps: kernel[g](b, out, words, bk, num_warps=w)
                    for b in bufs]  # fmt: skip
        best = min(best, graph_ms(launches))
    del bufs
    return best


def h2d_blob_bandwidth(device: str, blob_bytes: int, count: int = 128, reps: int = 10) -> float:
    """Pinned host -> device bytes/s of `count` blob-sized copies, one copy call per blob
    between distinct rows (how the slot pool fetches and streams experts); on CPU host memcpys.
    Next to `h2d_bandwidth` (one large copy) it shows what per-copy overhead costs."""
    pin = device == "cuda"
    src = torch.randint(0, 255, (count, blob_bytes), dtype=torch.uint8)
    src = src.pin_memory() if pin else src
    dst = torch.empty(count, blob_bytes, dtype=torch.uint8, device=device)

    def run() -> None:
        for i in range(count):
            dst[i].copy_(src[i], non_blocking=pin)

    if device != "cuda":
        return count * blob_bytes / time_host(run)
    return count * blob_bytes / (time_cuda(run, reps) / 1e3)
