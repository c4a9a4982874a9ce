"""What every benchmark line carries: commit, device, versions (STYLE.md §12)."""

from __future__ import annotations

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


def copy_bandwidth(nbytes: int = 2**30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return 2 * nbytes / (time_cuda(lambda: dst.copy_(src), reps) / 1e3)


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
