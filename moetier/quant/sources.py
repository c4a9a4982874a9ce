"""Quantized Hugging Face checkpoints as converter input (docs/formats.md, "Source checkpoints").

A quantized weight is stored as several checkpoint tensors (codes and scales); here they are
folded into one logical `SourceTensor` under the weight's own name, with the dtype and shape of
the dequantised weight, so that name mapping and shape checks see an ordinary checkpoint.
`TensorReader` then hands out either the dequantised weight (each producer's own formula) or,
for FP4, the codes and block scales themselves in the store's layout (quant/fp4.py).

Supported (`SUPPORTED`):
  fp8    DeepSeek-V3 block FP8: `weight` float8_e4m3fn [N, K], `weight_scale_inv` float32
         [ceil(N/b0), ceil(K/b1)]; W = fp8 * scale_inv of its b0 x b1 tile
  mxfp4  gpt-oss: `X_blocks` uint8 [E, N, K/32, 16], `X_scales` uint8 E8M0 [E, N, K/32], element
         2j in the low nibble; W[e] = (e2m1 * 2^(s - 127)), transposed to transformers' [E, K, N]
  nvfp4  compressed-tensors `nvfp4-pack-quantized`: `weight_packed` uint8 [N, K/2], `weight_scale`
         float8_e4m3fn [N, K/16], `weight_global_scale` float32 [1]; W = e2m1 * (scale / global)
         ModelOpt NVFP4: `weight` uint8 [N, K/2], `weight_scale` float8_e4m3fn [N, K/16],
         `weight_scale_2` float32 []; W = e2m1 * (scale * scale_2)
Activation scales (`input_scale`, `input_global_scale`) are dropped: moetier runs activations in
the compute dtype.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetier.config import read_json
from moetier.core.layout import DTYPES
from moetier.kernels.moe_ref import e2m1_values, unpack_fp4

SUPPORTED = (
    "FP8 block-scaled (quant_method 'fp8', DeepSeek-V3 layout), MXFP4 (quant_method 'mxfp4', "
    "gpt-oss layout), NVFP4 (compressed-tensors format 'nvfp4-pack-quantized', or ModelOpt "
    "quant_algo 'NVFP4')"
)
# what to do about a damaged checkpoint file (config.json, an index): read_json's advice
CHECKPOINT_FIX = "the checkpoint is damaged; download that file again"
ACTIVATION_SCALES = (".input_scale", ".input_global_scale")


class ConvertError(ValueError):
    """A checkpoint that cannot be converted; the message says what to do."""


class SourceReadError(ConvertError, OSError):
    """A shard that failed to read in the middle of a conversion (an I/O error, a read cut
    short): an OSError too, so that the converters keep their work folder as for any I/O
    failure. The rerun resumes, or starts afresh where the shard changed meanwhile (its size
    and time are in the work folder's settings)."""


@dataclass
class SourceTensor:
    """One checkpoint tensor, or (`quant` set) one quantized weight folded from its `parts`;
    `dtype` and `shape` are then those of the dequantised weight."""

    file: Path
    key: str
    dtype: str
    shape: tuple[int, ...]
    quant: str | None = None  # "fp8", "mxfp4", "nvfp4"
    parts: dict[str, SourceTensor] = field(default_factory=dict)


@dataclass(frozen=True)
class SourceQuantization:
    method: str  # "fp8", "mxfp4", "nvfp4"
    producer: str  # "deepseek-fp8", "gpt-oss", "compressed-tensors", "modelopt"
    block: tuple[int, int] = (128, 128)  # fp8 tile

    @property
    def fp4(self) -> str | None:
        """The store format that holds this source's codes as they are (None: not FP4)."""
        return self.method if self.method in ("nvfp4", "mxfp4") else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "producer": self.producer}
        if self.method == "fp8":
            out["weight_block_size"] = list(self.block)
        return out


def detect_quantization(src: Path) -> SourceQuantization | None:
    """The checkpoint's quantization from config.json (or ModelOpt's hf_quant_config.json);
    None for an unquantized checkpoint. Raises for a method moetier does not read."""
    if not (src / "config.json").is_file():
        raise ConvertError(f"{src}/config.json not found: point at a Hugging Face model directory")
    config = read_json(src / "config.json", CHECKPOINT_FIX)
    qc = config.get("quantization_config")
    modelopt_file = src / "hf_quant_config.json"
    if qc is None and modelopt_file.is_file():
        modelopt = read_json(modelopt_file, CHECKPOINT_FIX)
        qc = {"quant_method": "modelopt", **modelopt["quantization"]}
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8" and qc.get("weight_block_size"):
        block = qc["weight_block_size"]
        return SourceQuantization("fp8", "deepseek-fp8", (int(block[0]), int(block[1])))
    if method == "mxfp4":
        return SourceQuantization("mxfp4", "gpt-oss")
    if method == "compressed-tensors" and qc.get("format") == "nvfp4-pack-quantized":
        return SourceQuantization("nvfp4", "compressed-tensors")
    if method == "modelopt" and qc.get("quant_algo") == "NVFP4":
        return SourceQuantization("nvfp4", "modelopt")
    detail = qc.get("format") or qc.get("quant_algo") or qc.get("weight_block_size")
    raise ConvertError(
        f"{src}: quantization {method!r} ({detail}) is not supported as converter input. "
        f"Supported: {SUPPORTED}. Convert from the bf16 release, or dequantise first."
    )


def fold_quantized(
    tensors: list[SourceTensor], quant: SourceQuantization | None, dtype: str
) -> tuple[list[SourceTensor], list[str]]:
    """Fold each quantized weight's stored pieces into one logical tensor of `dtype`.

    Returns (tensors, dropped activation-scale keys). Raises on an orphan piece or an FP8/FP4
    tensor in a checkpoint whose config does not declare that quantization."""
    by_key = {t.key: t for t in tensors}
    keys = set(by_key)
    used: set[str] = set()
    out: list[SourceTensor] = []
    dropped: list[str] = []

    def take(key: str, piece: str) -> SourceTensor:
        if key not in by_key:
            raise ConvertError(f"quantized tensor {piece} has no {key} in the checkpoint")
        used.add(key)
        return by_key[key]

    for t in tensors:
        if t.key in used:
            continue
        logical = _fold_one(t, quant, dtype, take, keys) if quant is not None else None
        if logical is not None:
            used.add(t.key)
            out.append(logical)
        elif quant is not None and t.key.endswith(ACTIVATION_SCALES):
            dropped.append(t.key)
        else:
            out.append(t)
    # A scale met before its weight was passed through above; it belongs to the weight now.
    out = [t for t in out if t.quant is not None or t.key not in used]
    for t in out:
        if t.quant is None and t.dtype == "float8_e4m3fn":
            raise ConvertError(
                f"FP8 tensor {t.key} has no scale the converter knows: config.json declares "
                f"{quant.method if quant else 'no'} quantization. Supported: {SUPPORTED}"
            )
    return out, dropped


def _fold_one(  # type: ignore[no-untyped-def]
    t: SourceTensor, quant: SourceQuantization, dtype: str, take, keys: set[str]
) -> SourceTensor | None:
    if quant.method == "fp8" and t.key.endswith(".weight") and t.dtype == "float8_e4m3fn":
        scale = take(t.key + "_scale_inv", t.key)
        return SourceTensor(t.file, t.key, dtype, t.shape, "fp8", {"weight": t, "scale": scale})
    if quant.method == "mxfp4" and t.key.endswith("_blocks"):
        base = t.key[: -len("_blocks")]
        scales = take(base + "_scales", t.key)
        experts, rows, groups, nbytes = t.shape
        # transformers' dequantised gpt-oss experts are [E, K, N] (transposed)
        shape = (experts, groups * nbytes * 2, rows)
        return SourceTensor(t.file, base, dtype, shape, "mxfp4", {"blocks": t, "scales": scales})
    if quant.producer == "compressed-tensors" and t.key.endswith(".weight_packed"):
        prefix = t.key[: -len("weight_packed")]
        if prefix + "weight_zero_point" in keys:
            raise ConvertError(f"{prefix}: asymmetric NVFP4 (a zero point) is not supported")
        parts = {
            "packed": t,
            "scale": take(prefix + "weight_scale", t.key),
            "global_scale": take(prefix + "weight_global_scale", t.key),
        }
        unpacked = (t.shape[0], t.shape[1] * 2)
        return SourceTensor(t.file, prefix + "weight", dtype, unpacked, "nvfp4", parts)
    if quant.producer == "modelopt" and t.key.endswith(".weight") and t.dtype == "uint8":
        prefix = t.key[: -len("weight")]
        parts = {
            "packed": t,
            "scale": take(prefix + "weight_scale", t.key),
            "scale_2": take(prefix + "weight_scale_2", t.key),
        }
        unpacked = (t.shape[0], t.shape[1] * 2)
        return SourceTensor(t.file, t.key, dtype, unpacked, "nvfp4", parts)
    return None


@dataclass
class FP4Weight:
    """FP4 codes and scales in the store's layout (core/layout.fp4_expert_format)."""

    codes: torch.Tensor  # [N, K // 2] uint8, element 2j in the low nibble
    scales: torch.Tensor  # [N, K // 16] float8_e4m3fn (nvfp4) or [N, K // 32] uint8 E8M0 (mxfp4)
    tensor_scale: torch.Tensor | None  # [1] float32 (nvfp4)


class TensorReader:
    """Hands out tensors of the shards, quantized ones dequantised; `index` selects one entry
    along dim 0 (one expert of a fused tensor). Reads with explicit preads, not mmap: the
    converter's resident memory stays at the tensor in hand, whatever the checkpoint size
    (bench/convert_rss.py)."""

    def __init__(self, quant: SourceQuantization | None = None) -> None:
        self.quant = quant
        self._files: dict[Path, tuple[int, int, dict[str, Any]]] = {}  # fd, data start, header

    def raw(self, t: SourceTensor, index: int | None = None) -> torch.Tensor:
        try:
            if t.file not in self._files:  # shards were checked whole when the plan was made
                with open(t.file, "rb") as f:
                    (header_len,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(header_len))
                self._files[t.file] = (os.open(t.file, os.O_RDONLY), 8 + header_len, header)
            fd, data_start, header = self._files[t.file]
            begin, end = header[t.key]["data_offsets"]
            shape = tuple(t.shape)
            if index is not None:  # entry `index` of dim 0: a contiguous run of its bytes
                entry = (end - begin) // shape[0]
                begin, end, shape = begin + index * entry, begin + (index + 1) * entry, shape[1:]
            out = torch.empty(end - begin, dtype=torch.uint8)
            view, done = out.numpy().data, 0
            while done < end - begin:
                n = os.preadv(fd, [view[done:]], data_start + begin + done)
                if n <= 0:
                    raise SourceReadError(
                        f"{t.file}: short read of {t.key}; download the shard again"
                    )
                done += n
        except (OSError, struct.error, KeyError, ValueError) as err:
            if isinstance(err, ConvertError):
                raise
            raise SourceReadError(
                f"{t.file}: reading {t.key} failed ({type(err).__name__}: {err}); the shard "
                "changed or is damaged since the conversion started: download it again"
            ) from None
        return out.view(DTYPES[t.dtype]).view(shape)

    def close(self) -> None:
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def __call__(self, t: SourceTensor, index: int | None = None) -> torch.Tensor:
        if t.quant is None:
            return self.raw(t, index)
        if t.quant == "fp8":
            if self.quant is None:
                raise ValueError("TensorReader(quant) needs the FP8 source's tile size")
            w, scale = self.raw(t.parts["weight"], index), self.raw(t.parts["scale"], index)
            return dequant_fp8_block(w, scale, self.quant.block).to(DTYPES[t.dtype])
        fp4 = self._fp4_parts(t, index)
        w = e2m1_decode(fp4.codes, fp4.block_scale).to(DTYPES[t.dtype])
        if t.quant == "mxfp4":
            return w.transpose(-1, -2)  # [E, N, K] -> transformers' [E, K, N]
        return w

    def fp4(self, t: SourceTensor, index: int | None = None) -> FP4Weight:
        """The stored codes and scales of an FP4 weight, as the store keeps them: [N, K/2]."""
        if t.quant == "mxfp4":
            blocks = self.raw(t.parts["blocks"], index)  # [N, K/32, 16]
            return FP4Weight(
                blocks.reshape(blocks.shape[0], -1), self.raw(t.parts["scales"], index), None
            )
        if t.quant != "nvfp4":
            raise ValueError(f"{t.key} holds no FP4 codes")
        packed = self.raw(t.parts["packed"], index)
        scale = self.raw(t.parts["scale"], index)
        if "global_scale" in t.parts:
            # compressed-tensors divides by its global scale; the store multiplies.
            tensor_scale = 1.0 / self.raw(t.parts["global_scale"], index).float().reshape(1)
        else:
            tensor_scale = self.raw(t.parts["scale_2"], index).float().reshape(1)
        return FP4Weight(packed, scale, tensor_scale)

    def _fp4_parts(self, t: SourceTensor, index: int | None) -> _Decodable:
        """Codes and the float32 scale of each block, in the producer's own arithmetic."""
        if t.quant == "mxfp4":
            blocks = self.raw(t.parts["blocks"], index)  # [..., N, K/32, 16]
            codes = blocks.reshape(*blocks.shape[:-2], -1)
            scales = self.raw(t.parts["scales"], index)  # E8M0: 2^(s - 127), exact in float32
            return _Decodable(codes, torch.exp2(scales.float() - 127))
        packed = self.raw(t.parts["packed"], index)
        scale = self.raw(t.parts["scale"], index).float()
        if "global_scale" in t.parts:
            return _Decodable(packed, scale / self.raw(t.parts["global_scale"], index).float())
        return _Decodable(packed, scale * self.raw(t.parts["scale_2"], index).float())


@dataclass
class _Decodable:
    codes: torch.Tensor  # [..., N, K // 2] uint8
    block_scale: torch.Tensor  # [..., N, K // block] float32


def e2m1_decode(codes: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """codes [..., N, K/2] uint8 (element 2j low nibble), block_scale [..., N, K/b] float32
    -> [..., N, K] float32 = e2m1 * block_scale."""
    values = e2m1_values(unpack_fp4(codes))
    block = values.shape[-1] // block_scale.shape[-1]
    return values * block_scale.repeat_interleave(block, dim=-1)


def dequant_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn, scale_inv [ceil(N/b0), ceil(K/b1)] float32 -> [N, K] float32,
    W = fp8 * scale_inv of its b0 x b1 tile (edge tiles may be partial)."""
    n, k = weight.shape[-2:]
    block_n, block_k = block
    if tuple(scale_inv.shape[-2:]) != (-(-n // block_n), -(-k // block_k)):
        raise ConvertError(
            f"FP8 weight [{n}, {k}] with weight_block_size {list(block)} needs a "
            f"[{-(-n // block_n)}, {-(-k // block_k)}] scale grid, got {list(scale_inv.shape)}"
        )
    full = scale_inv.float().repeat_interleave(block_n, -2).repeat_interleave(block_k, -1)
    return weight.float() * full[..., :n, :k]
