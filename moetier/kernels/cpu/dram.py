"""DRAM read bandwidth of this host with all (or `threads`) cores: the rate the CPU expert kernel
is held against and the hybrid cost model divides CPU-side bytes by.

A STREAM-like read: every thread sums its share of a buffer far larger than the last-level cache
(the C kernels' OpenMP loop over int64 words, the same threads as the expert kernel; torch's
threaded float32 sum where there is no C compiler, or beside it). Only reads are counted, as the
expert kernel only reads its weights.
"""

from __future__ import annotations

import os
import time

import torch

from moetier.kernels.cpu.build import load

DEFAULT_BYTES = 2**31  # 2 GiB: well past any last-level cache (480 MiB on some Xeons)


def host_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


_threads = 0  # set_threads' count (0: every core)


def set_threads(threads: int) -> int:
    """Threads the CPU kernels use from now on, whichever thread calls them (each call names
    its team's size: OpenMP's own default is per calling thread): `threads`, or every core for
    0. Returns the count."""
    global _threads
    _threads = max(0, threads)
    return get_threads()


def get_threads() -> int:
    """The threads a CPU kernel call uses now."""
    return _threads if _threads > 0 else host_cores()


def dram_read_bandwidth(nbytes: int = DEFAULT_BYTES, reps: int = 5, backend: str = "auto") -> float:
    """Bytes/s the host's cores read from DRAM (best of `reps` full passes over an `nbytes`
    buffer, after one warm pass), with the threads `set_threads` gave (torch: its own). backend:
    "c", "torch", or "auto" (c where a compiler built it)."""
    lib = load()
    if backend == "auto":
        backend = "c" if lib is not None else "torch"
    words = torch.ones(nbytes // 8, dtype=torch.int64)
    if backend == "c":
        if lib is None:
            raise ValueError("no C compiler built the CPU kernels")

        def run() -> None:
            lib.mt_read_sum(words.data_ptr(), words.numel(), get_threads())

    elif backend == "torch":
        floats = words.view(torch.float32)

        def run() -> None:
            floats.sum()

    else:
        raise ValueError(f"backend is c, torch or auto, not {backend!r}")
    run()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return nbytes / best
