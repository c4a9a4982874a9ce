"""Disk tier bandwidth: raw O_DIRECT sequential reads vs the reader's expert-sized reads.

    PYTHONPATH=. python bench/disk.py --dir DIR [--file-gib 2] [--queue-depth 16]

Writes a file of --file-gib GiB in DIR (a local disk filesystem: /tmp is tmpfs on many
machines, check with `stat -f -c %T DIR`), then prints one JSON line each for
  raw      large sequential aligned O_DIRECT preads (--raw-chunk-mib), at queue depth 1 and
           --queue-depth
  reader   DiskReader reading expert-sized blobs at 4 KiB-aligned offsets in random order, in
           batches of --batch blobs (all in flight together), for each --blob-bytes
Every pass reads the whole file once; passes of all configurations alternate, --repeat rounds,
and each line gives the median with min and max. The best raw line is the ceiling the reader is
compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from moetier.core.layout import align_up
from moetier.residency.disk import DIRECT_ALIGN, O_DIRECT, DiskReader

sys.path.insert(0, str(Path(__file__).parent))
from common import git_commit  # noqa: E402

# Eval-moe-70m expert in bf16; a Qwen3-30B-A3B expert at 2.25 bpw; a DeepSeek-V3 one at 2.25 bpw.
DEFAULT_BLOBS = [3 * 512 * 256 * 2, 3 * 2048 * 768 * 9 // 32, 3 * 7168 * 2048 * 9 // 32]


def write_file(path: Path, nbytes: int) -> None:
    block = os.urandom(64 << 20)
    with open(path, "wb") as f:
        for start in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - start)])
        f.flush()
        os.fsync(f.fileno())


def raw_pass(path: Path, size: int, queue_depth: int, chunk: int = 16 << 20) -> float:
    """Seconds to read the file with O_DIRECT preads of `chunk`, `queue_depth` in flight."""
    fd = os.open(path, os.O_RDONLY | O_DIRECT)
    local = threading.local()  # one buffer per reading thread

    def read(i: int) -> int:
        if not hasattr(local, "buffer"):
            local.buffer = DiskReader.allocate(chunk, pin=False)
        return os.preadv(fd, [local.buffer.numpy().data], i * chunk)

    n = -(-size // chunk)
    start = time.perf_counter()
    if queue_depth == 1:
        for i in range(n):
            read(i)
    else:
        with ThreadPoolExecutor(queue_depth) as pool:
            list(pool.map(read, range(n)))
    seconds = time.perf_counter() - start
    os.close(fd)
    return seconds


def reader_pass(reader: DiskReader, offsets: list[int], blob: int, batch: int) -> float:
    buffers = [DiskReader.allocate(blob) for _ in range(batch)]
    order = list(offsets)
    random.Random(0).shuffle(order)
    reader.read([(o, blob, b) for o, b in zip(order[:batch], buffers, strict=False)])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(order), batch):
        part = order[i : i + batch]
        reader.read([(o, blob, b) for o, b in zip(part, buffers, strict=False)])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--file-gib", type=float, default=2.0)
    parser.add_argument("--queue-depth", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32, help="blobs per read() call")
    parser.add_argument("--blob-bytes", type=int, nargs="+", default=DEFAULT_BLOBS)
    parser.add_argument("--raw-chunk-mib", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the test file")
    args = parser.parse_args(argv)
    if not O_DIRECT:
        raise SystemExit("this platform has no O_DIRECT")
    path = args.dir / "moetier-disk-bench.bin"
    size = int(args.file_gib * 2**30) // DIRECT_ALIGN * DIRECT_ALIGN
    if not path.exists() or path.stat().st_size != size:
        write_file(path, size)
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(args.dir)], capture_output=True, text=True)
    base = {
        "bench": "disk",
        "commit": git_commit(),
        "dir": str(args.dir),
        "filesystem": fs.stdout.strip(),
        "file_bytes": size,
        "torch": torch.__version__,
        "pinned": torch.cuda.is_available(),
    }
    # Each round measures every configuration once, so drift of a shared disk hits them alike;
    # the figure is the median over rounds, the spread is reported beside it.
    configs: list[tuple[dict[str, object], int, Callable[[], float]]] = []
    reader = DiskReader(path, queue_depth=args.queue_depth)
    for chunk in (mib << 20 for mib in args.raw_chunk_mib):
        for qd in sorted({1, args.queue_depth}):
            what = {"what": "raw O_DIRECT sequential", "chunk_bytes": chunk, "queue_depth": qd}
            configs.append((what, size, partial(raw_pass, path, size, qd, chunk)))
    for blob in args.blob_bytes:
        stride = align_up(blob, DIRECT_ALIGN)
        offsets = list(range(0, size - stride + 1, stride))
        what = {"what": "DiskReader experts, random order", "direct": reader.direct}
        what |= {"blob_bytes": blob, "batch": args.batch, "queue_depth": args.queue_depth}
        what |= {"chunk_bytes": reader.chunk_bytes}
        configs.append(
            (what, len(offsets) * blob, partial(reader_pass, reader, offsets, blob, args.batch))
        )
    try:
        raw_pass(path, min(size, 256 << 20), args.queue_depth)  # warm-up
        gbps: list[list[float]] = [[] for _ in configs]
        for _ in range(args.repeat):
            for i, (_, nbytes, measure) in enumerate(configs):
                gbps[i].append(nbytes / measure() / 1e9)
        for (what, _, _), figures in zip(configs, gbps, strict=True):
            line = {**base, **what, "gbps": round(statistics.median(figures), 3)}
            line |= {"gbps_min": round(min(figures), 3), "gbps_max": round(max(figures), 3)}
            print(json.dumps(line), flush=True)
    finally:
        reader.close()
        if not args.keep:
            path.unlink()


if __name__ == "__main__":
    sys.exit(main())
