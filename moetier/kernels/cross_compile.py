"""Compile moetier's Triton kernels for GPUs this machine does not have (#51): inside
`compile_for(cap)`, every Triton launch compiles for `GPUTarget("cuda", cap, 32)` with Triton's
bundled ptxas instead of running, and is recorded with the resources its cubin uses (registers,
stack / spills, shared memory: `cuobjdump --dump-resource-usage`, also bundled). The launching
code runs as on a GPU of that capability (`torch.cuda.get_device_capability` and
`get_device_name` answer for it), on CPU tensors of the real shapes; what the kernels would
write is never written. Needs Triton in compiled mode (not TRITON_INTERPRET=1).

    with compile_for(120) as compiled:
        dense_gemv_triton(x, weight, scale, None, "fp8", 128, 128)
    compiled.records -> [Compiled(kernel, cap, registers, stack, local, shared, ...)]
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

# the capabilities the users' GPUs have: A100, RTX 30xx, RTX 40xx / L40, H100 / H200, B200,
# RTX 50xx / RTX PRO 6000
TARGETS = (80, 86, 89, 90, 100, 120)
NAMES = {80: "NVIDIA A100", 86: "NVIDIA GeForce RTX 3090", 89: "NVIDIA GeForce RTX 4090",
         90: "NVIDIA H100", 100: "NVIDIA B200", 120: "NVIDIA GeForce RTX 5090"}  # fmt: skip


@dataclass(frozen=True)
class Compiled:
    """One launch compiled: the kernel's name, the target, and its cubin's resources."""

    kernel: str
    cap: int
    registers: int
    stack: int  # bytes of stack per thread (spills land here)
    local: int  # bytes of local memory per thread
    shared: int  # bytes of shared memory (static + Triton's)
    num_warps: int
    constants: str  # the launch's constexpr values, for telling variants apart


@dataclass
class Session:
    cap: int
    records: list[Compiled] = field(default_factory=list)


def resources(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the cubin's function (cuobjdump, bundled with Triton)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text.split("Function", 1)[-1]))
    return {k: int(v) for k, v in found.items()}


@contextmanager
def compile_for(cap: int) -> Iterator[Session]:
    """Triton launches compile for sm_`cap` and are recorded instead of run (module docstring)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_for needs Triton in compiled mode: unset TRITON_INTERPRET")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    session = Session(cap)
    target = GPUTarget("cuda", cap, 32)
    backend = make_backend(target)

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kwargs.setdefault("debug", False)
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound, specialization, options
        )
        kernel = compile(ASTSource(self, signature, constexprs, attrs), target=target,
                         options=options.__dict__)  # fmt: skip
        used = resources(kernel.asm["cubin"])
        shown = {k[0] if isinstance(k, tuple) and len(k) == 1 else k: v
                 for k, v in constexprs.items()}  # fmt: skip
        session.records.append(
            Compiled(kernel.metadata.name, cap, used.get("REG", 0), used.get("STACK", 0),
                     used.get("LOCAL", 0), used.get("SHARED", 0) + kernel.metadata.shared,
                     kernel.metadata.num_warps, repr(sorted(shown.items(), key=str)))
        )  # fmt: skip
        return kernel

    from moetier.kernels import moe_dispatch

    major, minor = divmod(cap, 10)
    name = NAMES.get(cap, f"sm_{cap}")
    moe_dispatch.tuned_configs.cache_clear()
    try:
        with (
            mock.patch.object(JITFunction, "run", run),
            mock.patch.object(torch.cuda, "get_device_capability", lambda *_: (major, minor)),
            mock.patch.object(torch.cuda, "get_device_name", lambda *_: name),
            # the dispatcher's tuned tables as that card would find them
            mock.patch.object(moe_dispatch, "_device_name", lambda: name.replace(" ", "_")),
            mock.patch.object(moe_dispatch, "_capability", lambda: (major, minor)),
        ):
            yield session
    finally:
        moe_dispatch.tuned_configs.cache_clear()
