"""Byte layouts shared by the store writer (quant) and the kernels that read the bytes.

A blob is one expert's plane; a BlobFormat says which tensors it holds and where. Kernels read
weights through these specs, so what the converter writes is exactly what they decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

TENSOR_ALIGN = 256

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorSpec:
    """One tensor inside a blob: `offset` bytes from the blob start."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class BlobFormat:
    """The byte layout of one expert plane: which tensors, where."""

    name: str
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        last = self.tensors[-1]
        return last.offset + last.nbytes

    def tensor(self, name: str) -> TensorSpec:
        for spec in self.tensors:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {"tensors": [[t.name, t.dtype, list(t.shape), t.offset] for t in self.tensors]}

    @classmethod
    def from_json(cls, name: str, d: dict[str, Any]) -> BlobFormat:
        return cls(name, tuple(TensorSpec(n, dt, tuple(s), o) for n, dt, s, o in d["tensors"]))


def raw_expert_format(dtype: str, hidden: int, intermediate: int, has_bias: bool) -> BlobFormat:
    """Unquantized experts in `dtype`, canonical layout (module docstring)."""
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("gate_up", (2 * intermediate, hidden)),
        ("down", (hidden, intermediate)),
    ]
    if has_bias:
        shapes += [("gate_up_bias", (2 * intermediate,)), ("down_bias", (hidden,))]
    specs, offset = [], 0
    for name, shape in shapes:
        spec = TensorSpec(name, dtype, shape, offset)
        specs.append(spec)
        offset = align_up(offset + spec.nbytes, TENSOR_ALIGN)
    return BlobFormat(dtype, tuple(specs))


def blob_view(blob: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A typed view of one tensor inside a blob's bytes (uint8 [nbytes], any device)."""
    raw = blob[spec.offset : spec.offset + spec.nbytes]
    return raw.view(DTYPES[spec.dtype]).view(spec.shape)
