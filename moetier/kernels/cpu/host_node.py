"""CUDA host functions through the driver API: `cuLaunchHostFunc` (libcuda, ctypes) queues a C
function on a stream; on a stream being captured into a CUDA graph it becomes the graph's host
node, run by a driver thread at each replay. The function must be C (a pointer into a compiled
library), not a Python callback: a host function may not call CUDA, and a driver thread taking
the GIL could deadlock against a Python thread waiting on the stream.

`capture_works` checks once that a graph with a host node on a forked side stream captures and
replays here (driver, torch), so a caller can fall back before capturing its real steps.
"""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchHostFunc.restype = ctypes.c_int
    lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def launch_host_func(stream: torch.cuda.Stream, function: int, data: int) -> None:
    """Queue the C function at address `function` with `data` (a pointer) on `stream`."""
    status = _driver().cuLaunchHostFunc(stream.cuda_stream, function, data)
    if status != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed (CUresult {status})")


def capture_works(function: int, data: int, device: torch.device) -> str | None:
    """None if a CUDA graph whose side stream (forked and joined by events) holds a host node
    calling `function(data)` captures and replays on `device`; else why not. `function` must
    accept being run (e.g. with nothing to do) by the check."""
    try:
        with torch.cuda.device(device):
            x = torch.zeros(4, device=device)
            side = torch.cuda.Stream(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    launch_host_func(side, function, data)
                    x.add_(1)
                torch.cuda.current_stream().wait_stream(side)
                x.mul_(2)
            graph.replay()
            torch.cuda.synchronize(device)
            if x.tolist() != [2.0] * 4:
                return f"the test graph computed {x.tolist()}, not [2.0] * 4"
    except Exception as exc:  # noqa: BLE001 (any failure means: no host nodes here)
        return f"{type(exc).__name__}: {exc}"
    return None
