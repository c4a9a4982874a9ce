"""Store integrity: `verify_store` (what `moetier verify` runs) checks the index, every blob's
crc32 and dense.safetensors' checksums; `FirstReadCheck` verifies a blob the first time a tier
reads it (residency/host_tier.py, residency/slot_pool.py), and `check_files` dense.safetensors at
load (loader/load.py), so a corrupted blob or dense weight is an error naming it, never a wrong
answer.

A blob's checksum is zlib's crc32 of its bytes, written by the converter into experts.json
(quant/store.py); dense.safetensors' are the crc32 of each FILE_CHUNK bytes (the index's
"files"; stores converted before have none, and their dense bytes cannot be checked). zlib
releases the GIL on buffers of more than a few KiB, so checks of several blobs or chunks run
side by side on a small thread pool.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetier.quant.store import (
    BLOB_ALIGN,
    CHECKSUMMED_FILES,
    DENSE_FILE,
    EXPERTS_FILE,
    BlobEntry,
    Store,
    crc32,
    damaged_advice,
    file_crc,
    safetensors_header,
)

BlobKey = tuple[int, int, str]
# checks of fewer bytes than this run on the calling thread (a pool hand-off costs more)
PARALLEL_BYTES = 1 << 20


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class CorruptBlob(ValueError):
    """A blob whose bytes do not match its index checksum."""

    def __init__(self, path: Path, entry: BlobEntry, got: int) -> None:
        self.entry = entry
        self.got = got
        super().__init__(
            f"corrupted expert blob: layer {entry.layer}, expert {entry.expert}, plane "
            f"{entry.plane}, file {path / EXPERTS_FILE}, offset {entry.offset} ({entry.nbytes} "
            f"bytes): crc32 {got:#010x}, the index says {entry.crc32:#010x}. Run `moetier "
            f"verify {path}`; convert the model again or restore the file"
        )


class CorruptFile(ValueError):
    """A weights file (dense.safetensors) whose bytes do not match the index's checksums."""

    def __init__(
        self, store_path: Path, name: str, begin: int, end: int, got: int, want: int
    ) -> None:
        super().__init__(
            f"corrupted {name}: file {store_path / name}, bytes {begin} to {end}: crc32 "
            f"{got:#010x}, the index says {want:#010x}. Run `moetier verify {store_path}`; "
            "convert the model again or restore the file"
        )


@dataclass
class VerifyReport:
    """What `verify_store` found: one line per problem (none: the store is sound); `files`, the
    weights files whose checksums were checked, `unchecked` those the index has none of (a
    store written before the converter recorded them)."""

    path: Path
    blobs: int = 0
    bytes: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)  # name -> bytes checked
    unchecked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def index_problems(store: Store) -> list[str]:
    """What is wrong with `store`'s index, without reading a blob: blobs outside experts.bin,
    unaligned or overlapping, sizes that disagree with their format, missing experts or planes,
    an unreadable dense.safetensors header."""
    problems = []
    size = (store.path / EXPERTS_FILE).stat().st_size
    entries = sorted(store.all_blobs.values(), key=lambda e: e.offset)
    cfg = store.model_config
    end = 0
    for e in entries:
        where = f"layer {e.layer}, expert {e.expert}, plane {e.plane} (offset {e.offset})"
        fmt = store.formats.get(e.format)
        if fmt is None:
            problems.append(f"{where}: format {e.format!r} is not in the index's formats")
        elif fmt.nbytes != e.nbytes:
            problems.append(f"{where}: {e.nbytes} bytes, its format {e.format} has {fmt.nbytes}")
        if e.offset % BLOB_ALIGN:
            problems.append(f"{where}: not {BLOB_ALIGN}-byte aligned")
        if e.offset + e.nbytes > size:
            problems.append(f"{where}: ends past experts.bin ({size} bytes)")
        if e.offset < end:
            problems.append(f"{where}: overlaps the blob before it (which ends at {end})")
        end = max(end, e.offset + e.nbytes)
    for layer in store.expert_layers:
        planes = {k[2] for k in store.all_blobs if k[0] == layer}
        for plane in sorted(planes | {"base"}):
            missing = [
                x for x in range(cfg.num_experts) if (layer, x, plane) not in store.all_blobs
            ]
            if missing:
                problems.append(
                    f"layer {layer}, plane {plane}: no blob for experts {_short(missing)}"
                )
    problems += _dense_problems(store.path / DENSE_FILE)
    return problems


def _dense_problems(path: Path) -> list[str]:
    """What keeps dense.safetensors from loading, without reading its tensors: a missing file,
    a header that cannot be read (its length field checked against the file's size first),
    tensors past the end, or anything else safetensors refuses in the header."""
    try:
        safetensors_header(path)
    except ValueError as err:
        return [str(err)]
    from safetensors import safe_open

    try:  # what the loaders open it with: their own checks of the header (offsets, dtypes)
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as err:  # safetensors' SafetensorError, an Exception only
        return [f"{path}: safetensors cannot read it ({err})"]
    return []


def dense_problem(store_path: str | Path) -> str | None:
    """What keeps a store's dense.safetensors from loading (`_dense_problems`), with what to
    do; None when its header reads. Cheap: the loaders check it before reading any weight."""
    problems = _dense_problems(Path(store_path) / DENSE_FILE)
    if not problems:
        return None
    return f"{problems[0]}: {damaged_advice(store_path)}"


def _short(values: list[int]) -> str:
    more = f" and {len(values) - 8} more" if len(values) > 8 else ""
    return ", ".join(map(str, values[:8])) + more


def file_problems(
    store: Store,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[ValueError]:
    """Each weights file of the index's "files" checked against its record: its size, then the
    crc32 of each chunk, `workers` chunks at a time; an error per mismatch (CorruptFile names
    the byte range), saying what to do. `progress(nbytes)` is called after each chunk."""
    problems: list[ValueError] = []
    for name, record in store.files.items():
        path = store.path / name
        if not _well_formed(record):
            problems.append(
                ValueError(
                    f"the index's checksums of {name} are malformed: convert the model again"
                )
            )
            continue
        want_size, chunk = int(record["bytes"]), int(record["chunk_bytes"])
        size = path.stat().st_size if path.is_file() else -1
        if size != want_size:
            what = "is missing" if size < 0 else f"is {size} bytes"
            problems.append(
                ValueError(
                    f"{path} {what}, the index says {want_size}: {damaged_advice(store.path)}"
                )
            )
            continue
        sums = _chunk_sums(path, size, chunk, workers, progress)
        for begin, got, want in zip(range(0, size, chunk), sums, record["crc32"], strict=True):
            if got != want:
                end = min(begin + chunk, size)
                problems.append(CorruptFile(store.path, name, begin, end, got, want))
    return problems


def _well_formed(record: dict[str, Any]) -> bool:
    """Whether a "files" record has a size, a chunk size and one crc32 per chunk."""
    size, chunk, sums = record.get("bytes"), record.get("chunk_bytes"), record.get("crc32")
    if not (isinstance(size, int) and isinstance(chunk, int) and chunk > 0):
        return False
    return isinstance(sums, list) and len(sums) == len(range(0, size, chunk))


def _chunk_sums(
    path: Path, size: int, chunk: int, workers: int | None, progress: Callable[[int], None] | None
) -> list[int]:
    """The crc32 of each `chunk` bytes of the `size`-byte file `path`, `workers` at a time."""
    fd = os.open(path, os.O_RDONLY)

    def one(begin: int) -> int:
        got = file_crc(fd, begin, min(chunk, size - begin))
        if progress is not None:
            progress(min(chunk, size - begin))
        return got

    try:
        starts = range(0, size, chunk)
        if len(starts) < 2:
            return [one(begin) for begin in starts]
        with ThreadPoolExecutor(min(workers or _workers(), len(starts))) as pool:
            return list(pool.map(one, starts))
    finally:
        os.close(fd)


def unchecked_files(store: Store) -> list[str]:
    """The weights files of `store` the index has no checksum of (an older store)."""
    return [n for n in CHECKSUMMED_FILES if (store.path / n).is_file() and n not in store.files]


def check_files(store: Store | str | Path, workers: int | None = None) -> float:
    """At load (`--verify`, the default): raise the first problem `file_problems` finds, with
    what to do (CorruptFile, or a ValueError for a file whose size changed); else the seconds
    it took. Nothing to check in a store written before the index recorded checksums. The
    loaders pass the Store they opened (its index is parsed once); a path is opened here."""
    start = time.perf_counter()
    if isinstance(store, Store):
        problems = file_problems(store, workers)
    else:
        opened = Store(store)
        try:
            problems = file_problems(opened, workers)
        finally:
            opened.close()
    if problems:
        raise problems[0]
    return time.perf_counter() - start


def verify_store(
    path: str | Path,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check `path`'s index and every blob's crc32 (the MTP layers' too), `workers` blobs at a
    time. `progress(nbytes)` is called after each blob."""
    report = VerifyReport(Path(path))
    start = time.perf_counter()
    try:
        store = Store(path)
    except (ValueError, OSError, KeyError) as err:
        report.problems.append(f"{path}: {err}")
        return report
    try:
        report.problems += index_problems(store)
        report.problems += [str(err) for err in file_problems(store, workers, progress)]
        report.files = {name: record["bytes"] for name, record in store.files.items()}
        report.unchecked = unchecked_files(store)
        size = (store.path / EXPERTS_FILE).stat().st_size
        entries = [e for e in store.all_blobs.values() if e.offset + e.nbytes <= size]
        fd = os.open(store.path / EXPERTS_FILE, os.O_RDONLY)
        try:

            def check(entry: BlobEntry) -> tuple[BlobEntry, int]:
                got = file_crc(fd, entry.offset, entry.nbytes)
                if progress is not None:
                    progress(entry.nbytes)
                return entry, got

            with ThreadPoolExecutor(workers or _workers()) as pool:
                for entry, got in pool.map(check, sorted(entries, key=lambda e: e.offset)):
                    report.blobs += 1
                    report.bytes += entry.nbytes
                    if got != entry.crc32:
                        report.problems.append(str(CorruptBlob(store.path, entry, got)))
        finally:
            os.close(fd)
    finally:
        store.close()
    report.seconds = time.perf_counter() - start
    return report


class FirstReadCheck:
    """Verifies each blob of `store` once, the first time a tier reads it: `check(items)`
    computes the crc32 of the (key, bytes) pairs not verified yet and raises `CorruptBlob` on
    the first mismatch (that blob stays unverified, so every later read of it fails too).
    Thread-safe; `seconds` and `bytes` count the work done."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.seconds = 0.0
        self.bytes = 0
        self._verified: set[BlobKey] = set()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def __contains__(self, key: object) -> bool:
        return key in self._verified

    def check(self, items: Sequence[tuple[BlobKey, torch.Tensor]]) -> None:
        todo = [(key, data) for key, data in items if key not in self._verified]
        if not todo:
            return
        start = time.perf_counter()
        total = sum(data.numel() for _, data in todo)
        datas = [data for _, data in todo]
        if len(todo) > 1 and total >= PARALLEL_BYTES:
            sums = list(self._executor().map(crc32, datas))
        else:
            sums = [crc32(data) for data in datas]
        entries = self.store.all_blobs
        good = []
        bad: tuple[BlobEntry, int] | None = None
        for (key, _), got in zip(todo, sums, strict=True):
            entry = entries[key]
            if got == entry.crc32:
                good.append(key)
            elif bad is None:
                bad = (entry, got)
        with self._lock:
            self._verified.update(good)
            self.seconds += time.perf_counter() - start
            self.bytes += total
        if bad is not None:
            raise CorruptBlob(self.store.path, *bad)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_workers(), thread_name_prefix="moetier-verify")
            return self._pool
