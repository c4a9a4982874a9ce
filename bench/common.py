"""What every benchmark line carries: commit, device, versions (STYLE.md §12)."""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
from typing import Any

import torch


def git_commit() -> str:
    """Short hash of HEAD, with "+dirty" when the working tree differs from it; $MOETIER_COMMIT
    where there is no git (the device machine gets a copy of the tree without it)."""
    if os.environ.get("MOETIER_COMMIT"):
        return os.environ["MOETIER_COMMIT"]
    try:
        run: dict[str, Any] = {"capture_output": True, "text": True, "check": True}
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **run).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], **run).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def run_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "commit": git_commit(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.node(),
        "torch": torch.__version__,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    import transformers

    info["transformers"] = transformers.__version__
    return info


def emit(record: dict[str, Any], sink: list[dict[str, Any]] | None = None) -> None:
    """Print one JSON line (and keep it in `sink` for a summary)."""
    print(json.dumps(record), flush=True)
    if sink is not None:
        sink.append(record)


def copy_bandwidth(nbytes: int = 2**30, reps: int = 20, samples: int = 5) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written: the
    best of `samples` medians of `reps` copies. (One median read 4032-4214 GB/s on the H200
    within one process, warmed up or not, and every "of copy" ratio moved with it:
    docs/benchmarks.md.)"""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    best = min(time_cuda(lambda: dst.copy_(src), reps) for _ in range(samples))
    return 2 * nbytes / (best / 1e3)


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


WARM_S = 0.05  # seconds of replays before a graph is timed


def graph_ms(fn_list: list[Any]) -> float:
    """Median ms per call of the calls in fn_list, replayed as one CUDA graph, after WARM_S
    seconds of replays (identical configs timed twice in one run after 3 warm-up replays
    differed by 5-7%, the first timed the slower; after WARM_S, 0.987-1.027x on the H200:
    docs/benchmarks.md)."""
    import time

    for fn in fn_list:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fn_list:
            fn()
    start = time.perf_counter()
    while time.perf_counter() - start < WARM_S:
        graph.replay()
        torch.cuda.synchronize()
    return time_cuda(graph.replay, reps=20) / len(fn_list)


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


def time_cuda(fn: Any, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _time_host(fn: Any, reps: int = 5) -> float:
    """Median seconds of fn() on the host clock (CPU runs)."""
    import time

    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def memory_bandwidth(device: str, nbytes: int = 2**30) -> float:
    """The HBM figure of the floor, bytes/s: `copy_bandwidth` on CUDA; on CPU the same
    read-plus-write count of a host memcpy."""
    if device == "cuda":
        return copy_bandwidth(nbytes)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / _time_host(lambda: dst.copy_(src))


def h2d_bandwidth(device: str, nbytes: int = 2**28, reps: int = 20) -> float:
    """Pinned host -> device copy bandwidth in bytes/s (bytes moved once); on CPU a host memcpy
    (bytes read once)."""
    if device != "cuda":
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        return nbytes / _time_host(lambda: dst.copy_(src))
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return nbytes / (time_cuda(lambda: dst.copy_(src, non_blocking=True), reps) / 1e3)


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
        return count * blob_bytes / _time_host(run)
    return count * blob_bytes / (time_cuda(run, reps) / 1e3)


@functools.cache
def _read_host_kernel() -> Any:
    """A Triton kernel copying n int32 words from dst + offset (host memory) to dst."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_host(dst, offset, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        tl.store(dst + idx, tl.load(dst + offset + idx, mask=mask), mask=mask)

    return read_host


def zero_copy_bandwidth(device: str, nbytes: int = 2**28, reps: int = 20) -> float:
    """Bytes/s at which a Triton kernel reads pinned host memory through a signed offset from a
    device tensor (the way the MoE kernels read host-tier rows); on CPU a host memcpy."""
    if device != "cuda":
        return h2d_bandwidth(device, nbytes)
    import triton

    words = nbytes // 4
    src = torch.randint(0, 2**30, (words,), dtype=torch.int32).pin_memory()
    dst = torch.empty(words, dtype=torch.int32, device="cuda")
    offset = (src.data_ptr() - dst.data_ptr()) // 4  # int32 elements; any sign
    block = 4096

    def run() -> None:
        _read_host_kernel()[(triton.cdiv(words, block),)](dst, offset, words, BLOCK=block)

    ms = time_cuda(run, reps)
    if not torch.equal(dst.cpu(), src):
        raise RuntimeError("the zero-copy read kernel did not read the host buffer")
    return nbytes / (ms / 1e3)


def disk_bandwidth(store: Any, keys: list[Any]) -> float:
    """Bytes/s of the disk reader (O_DIRECT where the filesystem allows, parallel preads)
    reading `keys`' blobs of `store` once."""
    import time

    from moetier.residency.disk import DiskReader

    sizes = [store.blobs[k].nbytes for k in keys]
    buffers = [DiskReader.allocate(n) for n in sizes]
    with DiskReader.for_store(store) as reader:
        start = time.perf_counter()
        reader.read_blobs(store, keys, buffers)
        seconds = time.perf_counter() - start
    return sum(sizes) / seconds
