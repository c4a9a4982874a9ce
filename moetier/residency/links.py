"""Link speeds measured on this machine: what the floors and the miss cost model
(residency/cost.py) divide bytes by.

Four links, each in bytes/s: GPU memory (a device-to-device copy, read plus written bytes),
pinned host -> GPU copies, a kernel reading pinned host memory (zero-copy), and the store's file
(the disk reader). On CPU the memory figures are host memcpys. Measure them in the same run as
the figure they bound: one read can vary by several percent from one process to the next.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from moetier.kernels.timing import time_cuda
from moetier.quant.store import Store
from moetier.residency.cost import LinkSpeeds
from moetier.residency.disk import DiskReader

LINKS = ("hbm", "h2d", "zero_copy", "disk")


def time_host(fn: Callable[[], object], reps: int = 5) -> float:
    """Median seconds of fn() on the host clock (CPU runs), after one call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


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


def memory_bandwidth(device: str, nbytes: int = 2**30) -> float:
    """The HBM figure of the floor, bytes/s: `copy_bandwidth` on CUDA; on CPU the same
    read-plus-write count of a host memcpy."""
    if device == "cuda":
        return copy_bandwidth(nbytes)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_host(lambda: dst.copy_(src))


def h2d_bandwidth(device: str, nbytes: int = 2**28, reps: int = 20) -> float:
    """Pinned host -> device copy bandwidth in bytes/s (bytes moved once); on CPU a host memcpy
    (bytes read once)."""
    if device != "cuda":
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        return nbytes / time_host(lambda: dst.copy_(src))
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return nbytes / (time_cuda(lambda: dst.copy_(src, non_blocking=True), reps) / 1e3)


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


def disk_bandwidth(store: Store, keys: list[Any]) -> float:
    """Bytes/s of the disk reader (O_DIRECT where the filesystem allows, parallel preads)
    reading `keys`' blobs of `store` once."""
    sizes = [store.blobs[k].nbytes for k in keys]
    buffers = [DiskReader.allocate(n) for n in sizes]
    with DiskReader.for_store(store) as reader:
        start = time.perf_counter()
        reader.read_blobs(store, keys, buffers)
        seconds = time.perf_counter() - start
    return sum(sizes) / seconds


def measure_links(device: str, store: Store, disk_keys: list[Any] | None = None) -> LinkSpeeds:
    """The floor's and the cost model's link speeds, measured now (bytes/s); the disk rate from
    reading `disk_keys` (default: the store's first 64 blobs)."""
    probe = disk_keys or sorted(store.blobs)[: min(64, len(store.blobs))]
    return memory_links(device, disk_bandwidth(store, probe))


def memory_links(device: str, disk: float) -> LinkSpeeds:
    """HBM, H2D and zero-copy read rates measured now, beside a disk rate measured before
    (measure_links; measured again the store would mostly be read from the page cache)."""
    big = device == "cuda"
    return LinkSpeeds(
        hbm=memory_bandwidth(device, 2**30 if big else 2**26),
        h2d=h2d_bandwidth(device, 2**28 if big else 2**24),
        zero_copy=zero_copy_bandwidth(device, 2**28 if big else 2**24),
        disk=disk,
    )


def fastest(a: LinkSpeeds, b: LinkSpeeds) -> LinkSpeeds:
    """Each link at the faster of two measurements (the lower floor: a link measured slow once
    cannot flatter a ratio to the floor)."""
    return LinkSpeeds(*(max(getattr(a, n), getattr(b, n)) for n in LINKS))


def link_gbps(speeds: LinkSpeeds, names: tuple[str, ...] = LINKS) -> dict[str, float]:
    """{"<link>_GB/s": rate} to 4 significant digits (a tiny CPU smoke store's disk reads can
    be well under 0.01 GB/s)."""
    return {f"{name}_GB/s": float(f"{getattr(speeds, name) / 1e9:.4g}") for name in names}
