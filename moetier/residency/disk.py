"""The disk tier: reads expert blobs from the store's experts.bin into host buffers.

Reads bypass the page cache with O_DIRECT where the filesystem allows it, and run as parallel
preads from a thread pool (`queue_depth` in flight; NVMe reaches its bandwidth at a queue depth
of about 8 or more). O_DIRECT needs the file offset, the length and the buffer address aligned
to the device's logical block: blobs start on 4 KiB boundaries (store.BLOB_ALIGN), reads are
rounded up to 4 KiB, and buffers must be 4 KiB aligned with room for the rounded-up length
(`DiskReader.allocate` makes such buffers, pinned when CUDA is available, so a copy to the GPU
can run asynchronously). Where O_DIRECT is refused (tmpfs, some network filesystems) the reader
warns once and falls back to buffered preads, with the same buffer contract.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from moetier.core.layout import align_up
from moetier.quant.store import BLOB_ALIGN, EXPERTS_FILE, Store

DIRECT_ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; 0 elsewhere (buffered only)


def read_size(nbytes: int) -> int:
    """Bytes a read of an `nbytes` blob transfers (and its buffer must hold)."""
    return align_up(nbytes, DIRECT_ALIGN)


class DiskReader:
    """Parallel preads of byte ranges of one file into caller-provided host buffers.

    `direct=None` tries O_DIRECT and falls back (one warning); False never tries it."""

    def __init__(
        self,
        path: str | Path,
        queue_depth: int = 16,
        chunk_bytes: int = 2 << 20,
        direct: bool | None = None,
    ) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        if chunk_bytes < DIRECT_ALIGN or chunk_bytes % DIRECT_ALIGN:
            raise ValueError(f"chunk_bytes must be a multiple of {DIRECT_ALIGN}, got {chunk_bytes}")
        self.path = Path(path)
        self.queue_depth = queue_depth
        self.chunk_bytes = chunk_bytes
        self.size = self.path.stat().st_size
        self.direct = False
        self._fd = -1
        self._lock = threading.Lock()
        self._retired: list[int] = []
        if direct is not False and O_DIRECT:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | O_DIRECT)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._warn_fallback(e)
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_RDONLY)
        self._pool = ThreadPoolExecutor(queue_depth, thread_name_prefix="moetier-disk")
        self.bytes_read = 0

    @classmethod
    def for_store(
        cls,
        store: Store,
        queue_depth: int = 16,
        chunk_bytes: int = 2 << 20,
        direct: bool | None = None,
    ) -> DiskReader:
        """A reader of `store`'s experts file."""
        return cls(store.path / EXPERTS_FILE, queue_depth, chunk_bytes, direct)

    @staticmethod
    def allocate(nbytes: int, pin: bool | None = None) -> torch.Tensor:
        """A uint8 host buffer for a read of `nbytes`: 4 KiB aligned, read_size(nbytes) long,
        page-locked when `pin` (default: when CUDA is available)."""
        if pin is None:
            pin = torch.cuda.is_available()
        size = read_size(nbytes)
        raw = torch.empty(size + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=pin)
        start = (-raw.data_ptr()) % DIRECT_ALIGN
        return raw[start : start + size]

    def _warn_fallback(self, error: OSError) -> None:
        warnings.warn(
            f"O_DIRECT is refused for {self.path} ({error.strerror}); reading through the page "
            "cache instead. Put the store on a local disk filesystem (ext4, xfs) for direct I/O.",
            RuntimeWarning,
            stacklevel=3,
        )

    def _check_buffer(self, buffer: torch.Tensor, nbytes: int) -> None:
        if buffer.dtype != torch.uint8 or buffer.device.type != "cpu" or buffer.dim() != 1:
            raise ValueError("buffers must be 1-D uint8 CPU tensors (use DiskReader.allocate)")
        if not buffer.is_contiguous() or buffer.data_ptr() % DIRECT_ALIGN:
            raise ValueError(
                f"buffers must be contiguous and {DIRECT_ALIGN}-byte aligned for direct I/O "
                "(use DiskReader.allocate)"
            )
        if buffer.numel() < read_size(nbytes):
            raise ValueError(
                f"a buffer of {buffer.numel()} bytes cannot take a read of {nbytes} bytes rounded "
                f"up to {read_size(nbytes)} (use DiskReader.allocate)"
            )

    def _pread(self, view: memoryview, offset: int, needed: int) -> int:
        """Fill `view` from `offset`; at least `needed` bytes must come back (EOF may cut the
        rounded-up tail)."""
        done = 0
        while done < len(view):
            fd = self._fd
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as e:
                # EINVAL from an O_DIRECT descriptor: switch (or, if another thread already
                # switched, just retry on the buffered one)
                if e.errno != errno.EINVAL or (not self.direct and fd == self._fd):
                    raise
                self._to_buffered(e)
                continue
            if got == 0:
                break
            done += got
        if done < needed:
            raise OSError(f"{self.path}: short read at {offset} ({done} of {needed} bytes)")
        return done

    def _to_buffered(self, error: OSError) -> None:
        """A filesystem that accepted O_DIRECT at open but refuses the reads."""
        with self._lock:
            if self.direct:
                old = self._fd
                self._fd = os.open(self.path, os.O_RDONLY)
                self.direct = False
                self._warn_fallback(error)
                self._retired.append(old)  # other threads may still be reading through it

    def submit(self, offset: int, nbytes: int, buffer: torch.Tensor) -> list[Future[int]]:
        """Start reading bytes [offset, offset + nbytes) into buffer[:nbytes]; returns one
        future per chunk. `offset` must be 4 KiB aligned."""
        if offset % DIRECT_ALIGN:
            raise ValueError(f"offset {offset} is not {DIRECT_ALIGN}-byte aligned")
        if offset + nbytes > self.size:
            raise ValueError(f"bytes {offset}..{offset + nbytes} lie past the end of {self.path}")
        self._check_buffer(buffer, nbytes)
        view = buffer.numpy().data  # a memoryview over the tensor's bytes
        futures = []
        total = read_size(nbytes)
        for start in range(0, total, self.chunk_bytes):
            length = min(self.chunk_bytes, total - start)
            needed = max(0, min(length, nbytes - start))
            futures.append(
                self._pool.submit(self._pread, view[start : start + length], offset + start, needed)
            )
        self.bytes_read += nbytes
        return futures

    def read(self, ranges: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Read every (offset, nbytes, buffer) of `ranges`, all in flight together; blocks."""
        futures = [
            f for offset, nbytes, buffer in ranges for f in self.submit(offset, nbytes, buffer)
        ]
        for f in futures:
            f.result()

    def read_blobs(
        self, store: Store, keys: Sequence[tuple[int, int, str]], buffers: Sequence[torch.Tensor]
    ) -> None:
        """Blob `keys[i]` of `store` into `buffers[i]` (its first `nbytes` bytes)."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} blobs but {len(buffers)} buffers")
        entries = [store.blobs[key] for key in keys]
        for entry in entries:
            if entry.offset % BLOB_ALIGN:
                raise ValueError(f"blob {entry} is not {BLOB_ALIGN}-byte aligned")
        self.read([(e.offset, e.nbytes, b) for e, b in zip(entries, buffers, strict=True)])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in [self._fd, *self._retired]:
            if fd >= 0:
                os.close(fd)
        self._fd, self._retired = -1, []

    def __enter__(self) -> DiskReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
