"""`moetier plan --predict`'s link measurement, in seconds: GPU memory copy and pinned host to
GPU copies and zero-copy reads where CUDA is present (residency/links.py), and an O_DIRECT read
of a temporary file in `--disk DIR`. A link not measured (no CUDA, no --disk) takes the cost
model's default (residency/speed.py DEFAULT_LINKS), and the result says which."""

from __future__ import annotations

import errno
import mmap
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from moetier.residency.cost import LinkSpeeds

DISK_BYTES = 256 * 2**20  # the temporary file: large enough for NVMe to reach its rate
DISK_CHUNK = 4 * 2**20  # one read; several in flight (NVMe wants a queue depth of ~8+)
DISK_QUEUE = 8


@dataclass(frozen=True)
class DiskRead:
    """A disk measurement: bytes/s, whether O_DIRECT was used (else buffered reads after
    dropping the file's pages), bytes read."""

    bytes_per_s: float
    direct: bool
    nbytes: int


def disk_read_bandwidth(
    directory: str | Path,
    nbytes: int = DISK_BYTES,
    chunk: int = DISK_CHUNK,
    queue: int = DISK_QUEUE,
) -> DiskRead:
    """Write `nbytes` to a temporary file in `directory` (synced, removed afterwards), then
    read it back in `chunk`-byte reads, `queue` in flight, with O_DIRECT where the filesystem
    allows it (else buffered, after asking the kernel to drop the file's cached pages)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"--disk {directory}: not a directory")
    if chunk % 4096 or nbytes < chunk:
        raise ValueError("the disk read needs 4 KiB-multiple chunks and at least one of them")
    nbytes -= nbytes % chunk
    block = os.urandom(chunk)  # incompressible
    fd, name = tempfile.mkstemp(prefix=".moetier-plan-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            for _ in range(nbytes // chunk):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        direct = True
        try:
            rfd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            direct = hasattr(os, "O_DIRECT")
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            rfd, direct = os.open(name, os.O_RDONLY), False
        try:
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_DONTNEED)
            buffers = [mmap.mmap(-1, chunk) for _ in range(queue)]  # page-aligned

            def read(i: int) -> int:
                buf = buffers[i % queue]
                done = 0
                for offset in range(i * chunk, nbytes, queue * chunk):
                    done += os.preadv(rfd, [buf], offset)
                return done

            start = time.perf_counter()
            with ThreadPoolExecutor(queue) as pool:
                done = sum(pool.map(read, range(queue)))
            seconds = time.perf_counter() - start
        finally:
            os.close(rfd)
    finally:
        os.unlink(name)
    if done != nbytes:
        raise RuntimeError(f"the disk read returned {done} of {nbytes} bytes")
    return DiskRead(nbytes / seconds, direct, nbytes)


@dataclass(frozen=True)
class MeasuredLinks:
    """Link speeds for the cost model; `measured`: link -> how it was measured, or absent
    where the default was taken."""

    speeds: LinkSpeeds
    measured: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def not_measured(self) -> list[str]:
        return [n for n in ("hbm", "h2d", "zero_copy", "disk") if n not in self.measured]

    def describe(self) -> str:
        from moetier.residency.speed import DEFAULT_LINKS_SOURCE

        rates = ", ".join(
            f"{name} {getattr(self.speeds, name) / 1e9:,.4g} GB/s"
            + (f" ({self.measured[name]})" if name in self.measured else " (default)")
            for name in ("hbm", "h2d", "zero_copy", "disk")
        )
        missing = self.not_measured()
        note = (
            f"; not measured here: {', '.join(missing)} (the cost model's defaults, the "
            f"{DEFAULT_LINKS_SOURCE})"
            if missing
            else ""
        )
        return f"links: {rates}{note}"


def measure(
    disk: str | Path | None = None,
    cuda: bool | None = None,
    say: Callable[[str], None] | None = None,
    disk_bytes: int | None = None,
) -> MeasuredLinks:
    """This machine's links, a few seconds in all (a progress line each on `say`, default
    stderr); defaults for those it cannot measure."""
    import torch

    from moetier.residency.speed import DEFAULT_LINKS

    say = say or (lambda m: print(f"moetier plan: {m}", file=sys.stderr, flush=True))
    cuda = torch.cuda.is_available() if cuda is None else cuda
    start = time.perf_counter()
    rates = {n: getattr(DEFAULT_LINKS, n) for n in ("hbm", "h2d", "zero_copy", "disk")}
    how: dict[str, str] = {}
    if cuda:
        from moetier.residency import links

        say("measuring GPU memory copy, pinned host->GPU copies and zero-copy reads")
        rates["hbm"] = links.copy_bandwidth(2**28, reps=10, samples=2)
        rates["h2d"] = links.h2d_bandwidth("cuda", 2**27, reps=10)
        rates["zero_copy"] = links.zero_copy_bandwidth("cuda", 2**27, reps=10)
        how.update(hbm="device copy", h2d="pinned copy", zero_copy="kernel read of pinned RAM")
        torch.cuda.empty_cache()
    else:
        say("no CUDA device: GPU memory, host->GPU and zero-copy links not measured")
    if disk is not None:
        disk_bytes = disk_bytes or DISK_BYTES
        say(f"measuring disk reads in {disk} ({disk_bytes / 2**20:.0f} MiB temporary file)")
        read = disk_read_bandwidth(disk, disk_bytes)
        rates["disk"] = read.bytes_per_s
        how["disk"] = "O_DIRECT read" if read.direct else "buffered read (O_DIRECT refused)"
    return MeasuredLinks(LinkSpeeds(**rates), how, time.perf_counter() - start)
