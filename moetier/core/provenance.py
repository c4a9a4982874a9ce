"""What every benchmark line carries: the commit, the device and the library versions."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def git_commit() -> str:
    """Short hash of the moetier checkout's HEAD, with "+dirty" when its working tree differs
    from it; $MOETIER_COMMIT where there is no git (the device machine gets a copy of the tree
    without it); "unknown" for an installed package."""
    if os.environ.get("MOETIER_COMMIT"):
        return os.environ["MOETIER_COMMIT"]
    run: dict[str, Any] = {
        "capture_output": True,
        "text": True,
        "check": True,
        "cwd": Path(__file__).parent,
        "timeout": 10,
    }
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **run).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], **run).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def cpu_name() -> str:
    """The CPU's model name with its core count (Linux: /proc/cpuinfo), else the host's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.partition(':')[2].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.node()


def run_info() -> dict[str, Any]:
    """{"commit", "device" (the GPU's name, else the CPU's), "torch", "triton" (where
    installed), "transformers"}."""
    info: dict[str, Any] = {
        "commit": git_commit(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name(),
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
