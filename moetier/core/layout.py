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


MATRICES = ("gate_up", "down")
CODEC_KINDS = ("q2s", "int2", "affine2", "nvfp4", "mxfp4")
FP4_BLOCKS = {"nvfp4": 16, "mxfp4": 32}


@dataclass(frozen=True)
class MatrixCodec:
    """How one expert matrix W [N, K] is coded; its tensors are `M.part` in the blob.

    q2s-g{G}      codes uint8 [N, K/4] (2-bit, 4 per byte along K, code j at bits 2j..2j+1),
                  scales float8_e4m3fn [N, K/G], row_scale float32 [N], grid float32 [2] (a, b):
                  W = row_scale · scales · (−b, −a, +a, +b)[code]            (quant/q2s.py)
    int2-g{G}     codes as q2s, scales float16 [N, K/G]:  W = (code − 2) · scale,
                  i.e. {−2, −1, 0, 1} · absmax/2, round to nearest          (quant/baselines.py)
    affine2-g{G}  codes as q2s, scales and zeros float16 [N, K/G]:  W = (code − zero) · scale,
                  zero refined HQQ-style                                     (quant/baselines.py)
    nvfp4         codes uint8 [N, K/2] (two E2M1 per byte, element 2j low), scales
                  float8_e4m3fn [N, K/16], tensor_scale float32 [1]         (quant/fp4.py)
    mxfp4         codes as nvfp4, scales uint8 E8M0 [N, K/32]               (quant/fp4.py)
    """

    kind: str
    group: int  # weights per scale along K (the FP4 block for nvfp4 / mxfp4)

    def __post_init__(self) -> None:
        if self.kind not in CODEC_KINDS:
            raise ValueError(f"unknown matrix format {self.kind!r}: {CODEC_HELP}")
        if self.kind in FP4_BLOCKS and self.group != FP4_BLOCKS[self.kind]:
            raise ValueError(f"{self.kind} has blocks of {FP4_BLOCKS[self.kind]}, not {self.group}")
        if self.group < 4 or self.group % 4:
            raise ValueError(f"{self.kind}: group {self.group} must be a multiple of 4")

    @property
    def name(self) -> str:
        return self.kind if self.kind in FP4_BLOCKS else f"{self.kind}-g{self.group}"

    @classmethod
    def parse(cls, text: str) -> MatrixCodec:
        """'q2s-g16', 'int2-g32', 'affine2-g64', 'nvfp4' or 'mxfp4'."""
        if text in FP4_BLOCKS:
            return cls(text, FP4_BLOCKS[text])
        kind, sep, group = text.partition("-g")
        if not sep or kind not in CODEC_KINDS or not group.isdigit():
            raise ValueError(f"unknown matrix format {text!r}: {CODEC_HELP}")
        return cls(kind, int(group))

    def entries(self, matrix: str, n: int, k: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """The (name, dtype, shape) of each tensor of matrix `matrix` [n, k]."""
        if k % self.group:
            raise ValueError(f"{self.name}: {matrix} has K={k}, not divisible by {self.group}")
        groups: tuple[int, ...] = (n, k // self.group)
        packed: tuple[int, ...] = (n, k // 2 if self.kind in FP4_BLOCKS else k // 4)
        out: list[tuple[str, str, tuple[int, ...]]] = [(f"{matrix}.codes", "uint8", packed)]
        if self.kind in FP4_BLOCKS:
            if self.kind == "nvfp4":
                return out + [
                    (f"{matrix}.scales", "float8_e4m3fn", groups),
                    (f"{matrix}.tensor_scale", "float32", (1,)),
                ]
            return out + [(f"{matrix}.scales", "uint8", groups)]
        if self.kind == "q2s":
            return out + [
                (f"{matrix}.scales", "float8_e4m3fn", groups),
                (f"{matrix}.row_scale", "float32", (n,)),
                (f"{matrix}.grid", "float32", (2,)),
            ]
        out.append((f"{matrix}.scales", "float16", groups))
        if self.kind == "affine2":
            out.append((f"{matrix}.zeros", "float16", groups))
        return out

    def bits_per_weight(self, n: int, k: int) -> float:
        """Codes + scales + tables of an [n, k] matrix, per weight (no alignment padding)."""
        nbytes = 0
        for _, dtype, shape in self.entries("m", n, k):
            numel = 1
            for d in shape:
                numel *= d
            nbytes += numel * DTYPES[dtype].itemsize
        return 8 * nbytes / (n * k)


CODEC_HELP = "use q2s-gN, int2-gN, affine2-gN (N a multiple of 4 dividing K), nvfp4 or mxfp4"
BIAS_SUFFIX = "+bias"


def coded_format_name(gate_up: MatrixCodec, down: MatrixCodec, has_bias: bool) -> str:
    """'q2s-g32-down-g16' (q2s always names both groups), 'nvfp4' or 'int2-g32' when both
    matrices share a codec, 'int2-g32-down-g16' when only the group differs, otherwise
    'q2s-g32-down-nvfp4'; '+bias' when the blob also holds biases (gpt-oss)."""
    if gate_up.kind == down.kind and (gate_up.kind == "q2s" or gate_up != down):
        name = f"{gate_up.name}-down-g{down.group}"
    elif gate_up == down:
        name = gate_up.name
    else:
        name = f"{gate_up.name}-down-{down.name}"
    return name + (BIAS_SUFFIX if has_bias else "")


def matrix_codecs(fmt: BlobFormat) -> dict[str, MatrixCodec] | None:
    """The codec of each matrix of a coded blob format (by its name); None for unquantized and
    nested formats."""
    name = fmt.name.removesuffix(BIAS_SUFFIX)
    head, sep, tail = name.partition("-down-")
    try:
        gate_up = MatrixCodec.parse(head)
        if not sep:
            return {"gate_up": gate_up, "down": gate_up}
        if tail.startswith("g") and tail[1:].isdigit():
            return {"gate_up": gate_up, "down": MatrixCodec(gate_up.kind, int(tail[1:]))}
        return {"gate_up": gate_up, "down": MatrixCodec.parse(tail)}
    except ValueError:
        return None


def coded_expert_format(
    gate_up: MatrixCodec,
    down: MatrixCodec,
    hidden: int,
    intermediate: int,
    has_bias: bool,
    bias_dtype: str = "float32",
) -> BlobFormat:
    """One expert plane with each matrix coded by its MatrixCodec (gate_up [2I, H], down
    [H, I]), then the biases (gpt-oss) in `bias_dtype`. docs/formats.md lists the layouts."""
    entries = gate_up.entries("gate_up", 2 * intermediate, hidden)
    entries += down.entries("down", hidden, intermediate)
    if has_bias:
        entries += [
            ("gate_up_bias", bias_dtype, (2 * intermediate,)),
            ("down_bias", bias_dtype, (hidden,)),
        ]
    return _layout(coded_format_name(gate_up, down, has_bias), entries)


def q2s_expert_format(
    hidden: int,
    intermediate: int,
    has_bias: bool,
    group: int,
    down_group: int,
    bias_dtype: str = "float32",
) -> BlobFormat:
    """q2s experts (quant/q2s.py), gate_up with group `group`, down with `down_group`."""
    return coded_expert_format(
        MatrixCodec("q2s", group),
        MatrixCodec("q2s", down_group),
        hidden,
        intermediate,
        has_bias,
        bias_dtype,
    )


def fp4_expert_format(
    kind: str, hidden: int, intermediate: int, has_bias: bool, bias_dtype: str = "float32"
) -> BlobFormat:
    """NVFP4 or MXFP4 experts (quant/fp4.py), both matrices."""
    if kind not in FP4_BLOCKS:
        raise ValueError(f"unknown FP4 format {kind!r}")
    codec = MatrixCodec.parse(kind)
    return coded_expert_format(codec, codec, hidden, intermediate, has_bias, bias_dtype)


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
    """'raw', 'nested-base' (NVFP4 or MXFP4 scales), 'nested-delta', the codec kind shared by
    both matrices of a coded format ('q2s', 'int2', 'affine2', 'nvfp4', 'mxfp4'), or 'mixed'."""
    if fmt.name in ("nested-base", "nested-delta"):
        return fmt.name
    if fmt.name == "nested-mxfp4-base":
        return "nested-base"
    codecs = matrix_codecs(fmt)
    if codecs is None:
        return "raw"
    kinds = {c.kind for c in codecs.values()}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def has_tensor(fmt: BlobFormat, name: str) -> bool:
    return any(spec.name == name for spec in fmt.tensors)


def blob_view(blob: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A typed view of one tensor inside a blob's bytes (uint8 [nbytes], any device)."""
    raw = blob[spec.offset : spec.offset + spec.nbytes]
    return raw.view(DTYPES[spec.dtype]).view(spec.shape)
