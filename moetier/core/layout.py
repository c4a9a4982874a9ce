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
    "float8_e4m3fn": torch.float8_e4m3fn,
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


def _layout(name: str, entries: list[tuple[str, str, tuple[int, ...]]]) -> BlobFormat:
    specs, offset = [], 0
    for tensor_name, dtype, shape in entries:
        spec = TensorSpec(tensor_name, dtype, shape, offset)
        specs.append(spec)
        offset = align_up(offset + spec.nbytes, TENSOR_ALIGN)
    return BlobFormat(name, tuple(specs))


def raw_expert_format(dtype: str, hidden: int, intermediate: int, has_bias: bool) -> BlobFormat:
    """Unquantized experts in `dtype`, canonical layout (quant/store.py docstring)."""
    entries: list[tuple[str, str, tuple[int, ...]]] = [
        ("gate_up", dtype, (2 * intermediate, hidden)),
        ("down", dtype, (hidden, intermediate)),
    ]
    if has_bias:
        entries += [("gate_up_bias", dtype, (2 * intermediate,)), ("down_bias", dtype, (hidden,))]
    return _layout(dtype, entries)


def q2s_expert_format(
    hidden: int,
    intermediate: int,
    has_bias: bool,
    group: int,
    down_group: int,
    bias_dtype: str = "float32",
) -> BlobFormat:
    """q2s experts (quant/q2s.py): per matrix M in (gate_up, down)
      M.codes      [N, K // 4]      uint8, 4 codes per byte along K, code j at bits 2j..2j+1
      M.scales     [N, K // group]  float8_e4m3fn group scales
      M.row_scale  [N]              float32
      M.grid       [2]              float32 (a, b): code c decodes to (-b, -a, +a, +b)[c]
    W[n, k] = row_scale[n] * scales[n, k // group] * level[codes[n, k]]."""
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    for name, n, k, g in (
        ("gate_up", 2 * intermediate, hidden, group),
        ("down", hidden, intermediate, down_group),
    ):
        if k % g or k % 4:
            raise ValueError(f"q2s: {name} has K={k}, not divisible by its group {g}")
        entries += [
            (f"{name}.codes", "uint8", (n, k // 4)),
            (f"{name}.scales", "float8_e4m3fn", (n, k // g)),
            (f"{name}.row_scale", "float32", (n,)),
            (f"{name}.grid", "float32", (2,)),
        ]
    if has_bias:
        entries += [
            ("gate_up_bias", bias_dtype, (2 * intermediate,)),
            ("down_bias", bias_dtype, (hidden,)),
        ]
    return _layout(f"q2s-g{group}-down-g{down_group}", entries)


def fp4_expert_format(
    kind: str, hidden: int, intermediate: int, has_bias: bool, bias_dtype: str = "float32"
) -> BlobFormat:
    """NVFP4 or MXFP4 experts (quant/fp4.py): per matrix M in (gate_up, down)
    M.codes         [N, K // 2]        uint8, two E2M1 codes per byte, element 2j in the low nibble
    M.scales        [N, K // block]    nvfp4: float8_e4m3fn (block 16); mxfp4: uint8 E8M0 (block 32)
    M.tensor_scale  [1]                float32 (nvfp4 only)"""
    if kind not in ("nvfp4", "mxfp4"):
        raise ValueError(f"unknown FP4 format {kind!r}")
    block, scale_dtype = (16, "float8_e4m3fn") if kind == "nvfp4" else (32, "uint8")
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    for name, n, k in (("gate_up", 2 * intermediate, hidden), ("down", hidden, intermediate)):
        if k % block:
            raise ValueError(f"{kind}: {name} has K={k}, not divisible by the block {block}")
        entries += [
            (f"{name}.codes", "uint8", (n, k // 2)),
            (f"{name}.scales", scale_dtype, (n, k // block)),
        ]
        if kind == "nvfp4":
            entries.append((f"{name}.tensor_scale", "float32", (1,)))
    if has_bias:
        entries += [
            ("gate_up_bias", bias_dtype, (2 * intermediate,)),
            ("down_bias", bias_dtype, (hidden,)),
        ]
    return _layout(kind, entries)


def nested_expert_formats(
    hidden: int, intermediate: int, has_bias: bool, bias_dtype: str = "float32", fp4: str = "nvfp4"
) -> tuple[BlobFormat, BlobFormat]:
    """FP4 weights split bit-plane-wise (quant/fp4.py, research/quant.md §4.2 B).
    Base blob, per matrix M:
      M.codes         [N, K // 4]   uint8, 2-bit code = E2M1 sign and exponent MSB (code >> 2),
                                    4 per byte along K as in q2s
      M.scales        [N, K // 16]  float8_e4m3fn NVFP4 block scales
                      [N, K // 32]  uint8 E8M0 block scales (fp4="mxfp4", an MXFP4 source)
      M.tensor_scale  [1]           float32 (NVFP4 only)
      M.table         [4]           float32: value of each 2-bit code, in block-scale units
    Delta blob, per matrix: M.low [N, K // 4] uint8, the 2 low bits of each E2M1 code, packed
    the same way; (code << 2) | low is the FP4 code, so base + delta is the FP4 matrix exactly."""
    if fp4 not in ("nvfp4", "mxfp4"):
        raise ValueError(f"unknown FP4 format {fp4!r}")
    block, scale_dtype = (16, "float8_e4m3fn") if fp4 == "nvfp4" else (32, "uint8")
    base: list[tuple[str, str, tuple[int, ...]]] = []
    delta: list[tuple[str, str, tuple[int, ...]]] = []
    for name, n, k in (("gate_up", 2 * intermediate, hidden), ("down", hidden, intermediate)):
        if k % block:
            raise ValueError(f"nested: {name} has K={k}, not divisible by the block {block}")
        base += [
            (f"{name}.codes", "uint8", (n, k // 4)),
            (f"{name}.scales", scale_dtype, (n, k // block)),
        ]
        if fp4 == "nvfp4":
            base.append((f"{name}.tensor_scale", "float32", (1,)))
        base += [(f"{name}.table", "float32", (4,))]
        delta.append((f"{name}.low", "uint8", (n, k // 4)))
    if has_bias:
        base += [
            ("gate_up_bias", bias_dtype, (2 * intermediate,)),
            ("down_bias", bias_dtype, (hidden,)),
        ]
    base_name = "nested-base" if fp4 == "nvfp4" else "nested-mxfp4-base"
    return _layout(base_name, base), _layout("nested-delta", delta)


def format_kind(fmt: BlobFormat) -> str:
    """'raw', 'q2s', 'nvfp4', 'mxfp4', 'nested-base' (NVFP4 or MXFP4 scales) or 'nested-delta'."""
    if fmt.name in ("nested-base", "nested-delta"):
        return fmt.name
    if fmt.name == "nested-mxfp4-base":
        return "nested-base"
    kind = fmt.name.split("-")[0]
    return kind if kind in ("q2s", "nvfp4", "mxfp4") else "raw"


def has_tensor(fmt: BlobFormat, name: str) -> bool:
    return any(spec.name == name for spec in fmt.tensors)


def blob_view(blob: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A typed view of one tensor inside a blob's bytes (uint8 [nbytes], any device)."""
    raw = blob[spec.offset : spec.offset + spec.nbytes]
    return raw.view(DTYPES[spec.dtype]).view(spec.shape)
