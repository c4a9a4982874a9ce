"""The disk tier reader: bytes identical to the store's, direct and buffered, many in flight."""

from __future__ import annotations

import errno
import os
import threading
import time
import warnings

import pytest
import torch

from moetier.quant.store import EXPERTS_FILE, Store
from moetier.residency import disk
from moetier.residency.disk import DIRECT_ALIGN, DiskReader, read_size


@pytest.fixture()
def store(tiny):
    return Store(tiny.store("qwen3_moe"))


def direct_io_allowed(path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | disk.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return bool(disk.O_DIRECT)


def read_all(reader, store):
    keys = sorted(store.blobs)
    buffers = [DiskReader.allocate(store.blobs[k].nbytes) for k in keys]
    reader.read_blobs(store, keys, buffers)
    return keys, buffers


def test_blobs_match_the_store(store):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning where O_DIRECT works
        if not direct_io_allowed(store.path / EXPERTS_FILE):
            warnings.simplefilter("ignore")
        reader = DiskReader.for_store(store, queue_depth=8)
    with reader:
        assert reader.direct == direct_io_allowed(store.path / EXPERTS_FILE)
        keys, buffers = read_all(reader, store)
        for key, buf in zip(keys, buffers, strict=True):
            blob = store.blob(*key)
            assert buf.data_ptr() % DIRECT_ALIGN == 0 and buf.numel() == read_size(blob.numel())
            assert torch.equal(buf[: blob.numel()], blob), key
        assert reader.bytes_read == sum(e.nbytes for e in store.blobs.values())


def test_refused_direct_io_falls_back_with_one_warning(store, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & disk.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(disk, "O_DIRECT", os.O_DIRECT if hasattr(os, "O_DIRECT") else 0o40000)
    monkeypatch.setattr(disk.os, "open", refusing_open)
    with pytest.warns(RuntimeWarning, match="O_DIRECT is refused") as record:
        reader = DiskReader.for_store(store)
    with reader:
        assert not reader.direct
        keys, buffers = read_all(reader, store)
        for key, buf in zip(keys, buffers, strict=True):
            assert torch.equal(buf[: store.blobs[key].nbytes], store.blob(*key)), key
    assert len(record) == 1


def test_many_reads_in_flight(tmp_path, monkeypatch):
    # A file of 64 blobs of awkward sizes at 4 KiB-aligned offsets; the last one ends the file
    # mid-block, so its rounded-up read is cut short by EOF.
    sizes = [1 + (i * 7919) % 20000 for i in range(64)]
    offsets, data, pos = [], bytearray(), 0
    for n in sizes:
        pos = -(-pos // 4096) * 4096
        offsets.append(pos)
        data.extend(b"\0" * (pos - len(data)))
        data.extend(os.urandom(n))
        pos += n
    path = tmp_path / "blobs.bin"
    path.write_bytes(bytes(data))

    in_flight = peak = 0
    lock = threading.Lock()
    real_preadv = os.preadv

    def slow_preadv(fd, views, offset):
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        time.sleep(0.01)
        try:
            return real_preadv(fd, views, offset)
        finally:
            with lock:
                in_flight -= 1

    monkeypatch.setattr(disk.os, "preadv", slow_preadv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tmp_path may be tmpfs
        reader = DiskReader(path, queue_depth=8, chunk_bytes=8192)
    with reader:
        buffers = [DiskReader.allocate(n, pin=False) for n in sizes]
        reader.read(list(zip(offsets, sizes, buffers, strict=True)))
    assert peak == 8
    for off, n, buf in zip(offsets, sizes, buffers, strict=True):
        assert bytes(buf[:n].numpy()) == bytes(data[off : off + n])


def test_buffer_contract(store):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reader = DiskReader.for_store(store)
    entry = store.blobs[(0, 0, "base")]
    with reader:
        aligned = DiskReader.allocate(entry.nbytes + DIRECT_ALIGN, pin=False)
        with pytest.raises(ValueError, match="aligned"):
            reader.read([(entry.offset, entry.nbytes, aligned[1:])])
        with pytest.raises(ValueError, match="cannot take a read"):
            reader.read([(entry.offset, entry.nbytes, aligned[: entry.nbytes - 1])])
        with pytest.raises(ValueError, match="not 4096-byte aligned"):
            reader.read([(entry.offset + 1, 10, aligned)])
        with pytest.raises(ValueError, match="past the end"):
            reader.read([(0, reader.size + 1, DiskReader.allocate(reader.size + 1, pin=False))])
