"""What the first-read crc32 check costs at load: load a store and read every expert blob into its
tiers once, with the check (default) and with `--no-verify`, alternating, and print one JSON line
per configuration with the median seconds and the overhead in percent. With the check on,
load_model also checks dense.safetensors against the index's checksums; that check is timed on
its own too (`dense_check_seconds`, against load_model without the checks).

    PYTHONPATH=. python bench/verify_cost.py [STORE ...] [--shape qwen3-30b-a3b --layers 2]
        [--host-memory 8GiB] [--repeat 3] [--device auto]

"Load" here is `load_model` plus placing every expert blob of the store in the GPU slot pool
(which the first requests would otherwise do): the time from a command to a model with every
blob read once, the reads the check rides on. Without a STORE it measures the demo model; with
`--shape` a synthetic store of that shape (random q2s experts) written to a temporary folder
first. Each configuration runs once untimed first (the page cache and imports warm)."""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import emit  # noqa: E402

from moetier.config import DEFAULT_STORE, EngineConfig  # noqa: E402
from moetier.core.provenance import run_info  # noqa: E402


def load_and_fill(store: Path, config: EngineConfig) -> tuple[float, float, float]:
    """(seconds to a loaded model with every blob read, of which load_model, of which the
    check's crc32 work)."""
    import torch

    from moetier.loader.load import load_model

    start = time.perf_counter()
    loaded = load_model(store, config)
    loaded_at = time.perf_counter()
    pool = loaded.runtime.residency
    keys = sorted(loaded.store.blobs)
    for begin in range(0, len(keys), pool.capacity):  # all of them when they fit
        pool.place(keys[begin : begin + pool.capacity])
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    check = pool.check
    crc = check.seconds if check is not None else 0.0
    del loaded, pool
    gc.collect()
    return end - start, loaded_at - start, crc


def dense_check_seconds(store: Path, repeat: int) -> float | None:
    """The median seconds of the load's check of dense.safetensors' checksums (check_files),
    the file in the page cache as the runs before left it; None where the index has none."""
    from moetier.quant.store import Store
    from moetier.quant.verify import check_files

    s = Store(store)
    has = bool(s.files)
    s.close()
    if not has:
        return None
    return statistics.median(check_files(store) for _ in range(repeat))


def measure(store: Path, args: argparse.Namespace, label: str) -> dict[str, Any]:
    from moetier.quant.store import Store

    s = Store(store)
    base = dict(device=args.device, host_memory=args.host_memory)
    configs = {True: EngineConfig(**base, verify=True), False: EngineConfig(**base, verify=False)}
    for config in configs.values():
        load_and_fill(store, config)  # warm
    times: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for _ in range(args.repeat):
        for verify, config in configs.items():
            times[verify].append(load_and_fill(store, config))
    on = statistics.median(t[0] for t in times[True])
    off = statistics.median(t[0] for t in times[False])
    dense = dense_check_seconds(store, args.repeat)
    load = statistics.median(t[1] for t in times[False])
    return {
        "bench": "verify_cost",
        "store": label,
        "expert_bytes": s.expert_bytes,
        "blobs": len(s.blobs),
        "host_memory": args.host_memory,
        "repeat": args.repeat,
        "seconds_verify": round(on, 4),
        "seconds_no_verify": round(off, 4),
        "load_model_seconds": round(load, 4),
        # dense.safetensors' checksums, checked in load_model with the check on (None: a store
        # whose index has none)
        "dense_bytes": sum(r["bytes"] for r in s.files.values()) if s.files else None,
        "dense_check_seconds": None if dense is None else round(dense, 4),
        "dense_check_pct_of_load_model": None if dense is None else round(100 * dense / load, 2),
        "crc_seconds": round(statistics.median(t[2] for t in times[True]), 4),
        "overhead_pct": round(100 * (on - off) / off, 2),
        # the best runs (least disturbed by other work on the machine) and the check's own share
        "min_verify": round(min(t[0] for t in times[True]), 4),
        "min_no_verify": round(min(t[0] for t in times[False]), 4),
        "crc_pct_of_load": round(100 * statistics.median(t[2] for t in times[True]) / off, 2),
        "runs_verify": [round(t[0], 4) for t in times[True]],
        "runs_no_verify": [round(t[0], 4) for t in times[False]],
        **run_info(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stores", nargs="*", help="stores to measure (default: the demo model)")
    parser.add_argument("--shape", help="also a synthetic store of this shape (quant/synthetic)")
    parser.add_argument("--layers", type=int, default=2, help="MoE layers of the --shape store")
    parser.add_argument("--host-memory", default="", help="a host tier of this budget")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    stores = [Path(s) for s in args.stores] or ([] if args.shape else [DEFAULT_STORE])
    for store in stores:
        emit(measure(store, args, store.name))
    if args.shape:
        from moetier.quant.synthetic import shape, write_synthetic_store

        with tempfile.TemporaryDirectory(prefix="moetier-verify-") as tmp:
            path = Path(tmp) / args.shape
            write_synthetic_store(path, shape(args.shape, args.layers), "q2s", DEFAULT_STORE)
            emit(measure(path, args, f"{args.shape} x{args.layers} layers (synthetic q2s)"))


if __name__ == "__main__":
    main()
