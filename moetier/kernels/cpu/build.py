"""Builds the C CPU kernels (q2s_experts.c) with the host's C compiler at first use and loads them.

`cc -O3 -march=native -fopenmp`: the compiler picks the host's vector instructions (AVX-512 VNNI,
AVX2, or plain C), so the library is built on, and for, the machine that runs it, into a cache
keyed by the source, the flags and the CPU's feature flags (`MOETIER_CPU_CACHE`, default
~/.cache/moetier/cpu). Written to a temporary name and renamed, so concurrent processes
(pytest workers) never load a half-written file. Without a compiler, `load` returns None and the
callers use numba or torch instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from moetier.core.paths import cache_root

SOURCE = Path(__file__).with_name("q2s_experts.c")
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11"]


def _compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor()


def cache_dir() -> Path:
    return Path(os.environ.get("MOETIER_CPU_CACHE") or cache_root() / "cpu")


@functools.cache
def load(march: str = "native") -> ctypes.CDLL | None:
    """The compiled kernel library (built if needed), or None where no C compiler works.
    `march`: the -march target (tests build "haswell" and "x86-64" to check the AVX2 and scalar
    paths on an AVX-512 host)."""
    compiler = _compiler()
    if compiler is None:
        return None
    flags = [f"-march={march}", *FLAGS]
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join([compiler, *flags]).encode() + _cpu_flags().encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"q2s_experts_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", tmp, "-lm"],
                check=True,
                capture_output=True,
                text=True,
            )
            os.replace(tmp, target)
        except (subprocess.CalledProcessError, OSError):
            Path(tmp).unlink(missing_ok=True)
            return None
    lib = ctypes.CDLL(str(target))
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.mt_q2s_pairs.restype = ctypes.c_int
    lib.mt_q2s_pairs.argtypes = [i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, ptr,
                                 ctypes.c_int, f32, f32, i64, ctypes.c_int, ptr]  # fmt: skip
    lib.mt_host_pairs.restype = None
    lib.mt_host_pairs.argtypes = [ptr]
    lib.mt_read_sum.restype = i64
    lib.mt_read_sum.argtypes = [ptr, i64, ctypes.c_int]
    lib.mt_last_team.restype = ctypes.c_int
    lib.mt_path.restype = ctypes.c_int
    return lib


def vector_path(march: str = "native") -> str:
    """Which instructions the built kernel uses: "avx512-vnni", "avx2", "scalar", or "none"
    (not built)."""
    lib = load(march)
    if lib is None:
        return "none"
    return {3: "avx512-vnni", 2: "avx2"}.get(lib.mt_path(), "scalar")
