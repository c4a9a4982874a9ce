"""How the kernels read an expert blob: the kind of each matrix in it (constexpr in the kernels),
where it lives and how it decodes (`MatrixSpec`, `matrix_spec`), which (base, delta) format
pairs the kernels decode (`supports`), and the Triton helpers the generic kernel
(`moe_triton._moe_kernel`), the q2s GEMV (`q2s_gemv`) and the q2s prefill kernel (`q2s_mma`)
share: a slot's blob pointers (`_blob_ptrs`), element and tile decoders (`_decode`,
`_decode_nested_full`, `_row_factor`), biases (`_bias`, `_bias_kind`) and the experts'
activations (`_activation`, `ACTIVATIONS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moetier.core.layout import BlobFormat, format_kind, has_tensor, matrix_codecs

# Kinds of a matrix inside a blob (constexpr in the kernels).
NONE, RAW_F32, RAW_BF16, RAW_F16, Q2S, NVFP4, MXFP4, NESTED, NESTED_DELTA = range(-1, 8)
_RAW_KINDS = {"float32": RAW_F32, "bfloat16": RAW_BF16, "float16": RAW_F16}
_BIAS_KINDS = {"float32": 1, "bfloat16": 2, "float16": 3}
ACTIVATIONS = {"silu": 0, "silu_clamped": 1, "gpt_oss": 2}


@dataclass(frozen=True)
class MatrixSpec:
    """Where one matrix of a blob lives and how it decodes (byte offsets inside the blob)."""

    kind: int
    n: int
    k: int
    codes: int = 0  # codes (or the raw matrix, or the nested delta's low bits)
    scales: int = 0
    row_scale: int = 0  # q2s row scale
    aux: int = 0  # q2s grid (a, b) or nested table [4]
    tensor_scale: int = 0  # nvfp4 / nested
    group: int = 1  # elements per scale along K


def matrix_spec(fmt: BlobFormat | None, name: str) -> MatrixSpec | None:
    """The kernel's view of matrix `name` of `fmt`; None when the kernels cannot decode it
    (int2 / affine2 baselines and nested planes with MXFP4 scales run on the reference path)."""
    if fmt is None or fmt.name == "nested-mxfp4-base":
        return None
    kind = format_kind(fmt)
    if kind == "raw":
        spec = fmt.tensor(name)
        if spec.dtype not in _RAW_KINDS:
            return None
        n, k = spec.shape
        return MatrixSpec(_RAW_KINDS[spec.dtype], n, k, codes=spec.offset)

    def off(part: str) -> int:
        return fmt.tensor(f"{name}.{part}").offset

    if kind == "nested-delta":
        n, k4 = fmt.tensor(f"{name}.low").shape
        return MatrixSpec(NESTED_DELTA, n, 4 * k4, codes=off("low"))
    codes = fmt.tensor(f"{name}.codes")
    scales = fmt.tensor(f"{name}.scales")
    n = codes.shape[0]
    if kind == "nested-base":
        k = 4 * codes.shape[1]
        return MatrixSpec(NESTED, n, k, codes.offset, scales.offset, aux=off("table"),
                          tensor_scale=off("tensor_scale"), group=k // scales.shape[1])  # fmt: skip
    codecs = matrix_codecs(fmt)
    codec = codecs[name].kind if codecs is not None else None
    if codec == "q2s":
        k = 4 * codes.shape[1]
        return MatrixSpec(Q2S, n, k, codes.offset, scales.offset, off("row_scale"), off("grid"),
                          group=k // scales.shape[1])  # fmt: skip
    if codec in ("nvfp4", "mxfp4"):
        k = 2 * codes.shape[1]
        return MatrixSpec(NVFP4 if codec == "nvfp4" else MXFP4, n, k, codes.offset, scales.offset,
                          tensor_scale=off("tensor_scale") if codec == "nvfp4" else 0,
                          group=k // scales.shape[1])  # fmt: skip
    return None


def supports(fmt: BlobFormat, delta_fmt: BlobFormat | None) -> bool:
    """Whether these kernels decode this (base, delta) pair of formats, both matrices."""
    for name in ("gate_up", "down"):
        base = matrix_spec(fmt, name)
        if base is None or base.kind == NESTED_DELTA:
            return False
        if delta_fmt is None:
            continue
        delta = matrix_spec(delta_fmt, name)
        # a nested delta completes only a nested base; an additive delta is any decodable format
        if delta is None or (delta.kind == NESTED_DELTA) != (base.kind == NESTED):
            return False
    return True


def _bias_kind(fmt: BlobFormat) -> tuple[int, int, int]:
    if not has_tensor(fmt, "gate_up_bias"):
        return 0, 0, 0
    gu, down = fmt.tensor("gate_up_bias"), fmt.tensor("down_bias")
    return _BIAS_KINDS[gu.dtype], gu.offset, down.offset


_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _blob_ptrs(pool, slot_offsets, slot, dslot, use_delta, DKIND: tl.constexpr):
    """(base blob, delta blob) pointers of a slotted pair; the delta's is the base's when the
    pair does not use it. Slots start on TENSOR_ALIGN (256-byte) boundaries: say so, so loads
    vectorize."""
    bptr = pool + tl.multiple_of(tl.load(slot_offsets + slot), 256)
    dptr = bptr
    if DKIND >= 0:
        if use_delta:
            dptr = pool + tl.multiple_of(tl.load(slot_offsets + dslot), 256)
    return bptr, dptr


# --------------------------------------------------------------------------------------------
# Tile decoders: rows [BN] and cols [BK] index the matrix; each returns a float32 [BN, BK] tile
# WITHOUT the per-row factor (`_row_factor`), which the caller applies once after the K loop.


@triton.jit
def _f32_at(ptr, offset):
    return tl.load((ptr + offset).to(tl.pointer_type(tl.float32)))


@triton.jit
def _e4m3(byte):
    """E4M3 (uint8) -> float32 through FP16's bit layout, on every architecture (float8e4nv
    does not exist before sm_89: the kernels did not compile for sm_80 / sm_86): sign to bit
    15, exponent and mantissa shifted into FP16's places; FP16's exponent bias is 8 above
    E4M3's, so the FP16 value times 2^8 is the E4M3 value, subnormals included (E4M3 has no
    infinities; its NaN, never a scale, decodes as 480)."""
    b = byte.to(tl.uint16)
    half = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * 256.0


@triton.jit
def _e2m1(code):
    """E2M1 code (int32, 0..15) -> float32 by building the float's bits (no table, no exp2)."""
    m = code & 7
    e = m >> 1
    normal = ((e + 126) << 23) | ((m & 1) << 22)
    bits = tl.where(m >= 2, normal, tl.where(m == 1, 126 << 23, 0)) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _codes2(ptr, offset, rows, cols, K, mask):
    """2-bit codes, 4 per byte along K, code j at bits 2j -> int32 [BN, BK]."""
    byte = tl.load(ptr + offset + rows[:, None] * (K // 4) + cols[None, :] // 4, mask=mask, other=0)
    return (byte.to(tl.int32) >> ((cols[None, :] % 4) * 2)) & 3


@triton.jit
def _codes4(ptr, offset, rows, cols, K, mask):
    """E2M1 codes, 2 per byte along K, element 2j in the low nibble -> int32 [BN, BK]."""
    byte = tl.load(ptr + offset + rows[:, None] * (K // 2) + cols[None, :] // 2, mask=mask, other=0)
    return (byte.to(tl.int32) >> ((cols[None, :] % 2) * 4)) & 15


@triton.jit
def _group_scale(ptr, offset, rows, cols, K, GROUP: tl.constexpr, mask, E8M0: tl.constexpr):
    byte = tl.load(
        ptr + offset + rows[:, None] * (K // GROUP) + cols[None, :] // GROUP, mask=mask, other=0
    )
    if E8M0:
        return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127)
    return _e4m3(byte)


@triton.jit
def _decode(ptr, KIND: tl.constexpr, codes, scales, aux, rows, cols, K, GROUP: tl.constexpr, mask):
    if KIND == 0:  # RAW_F32
        w = tl.load((ptr + codes).to(tl.pointer_type(tl.float32)) + rows[:, None] * K
                    + cols[None, :], mask=mask, other=0.0)  # fmt: skip
    elif KIND == 1:  # RAW_BF16
        w = tl.load((ptr + codes).to(tl.pointer_type(tl.bfloat16)) + rows[:, None] * K
                    + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    elif KIND == 2:  # RAW_F16
        w = tl.load((ptr + codes).to(tl.pointer_type(tl.float16)) + rows[:, None] * K
                    + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    elif KIND == 3:  # Q2S: level (-b, -a, a, b)[c] times the group scale
        c = _codes2(ptr, codes, rows, cols, K, mask)
        a = _f32_at(ptr, aux)
        b = _f32_at(ptr, aux + 4)
        mag = tl.where((c == 1) | (c == 2), a, b)
        w = tl.where(c >= 2, mag, -mag) * _group_scale(ptr, scales, rows, cols, K, GROUP, mask, 0)
    elif KIND == 4:  # NVFP4
        w = _e2m1(_codes4(ptr, codes, rows, cols, K, mask)) * _group_scale(
            ptr, scales, rows, cols, K, GROUP, mask, 0
        )
    elif KIND == 5:  # MXFP4
        w = _e2m1(_codes4(ptr, codes, rows, cols, K, mask)) * _group_scale(
            ptr, scales, rows, cols, K, GROUP, mask, 1
        )
    else:  # NESTED base only: table[c] times the block scale
        c = _codes2(ptr, codes, rows, cols, K, mask)
        t0 = _f32_at(ptr, aux)
        t1 = _f32_at(ptr, aux + 4)
        t2 = _f32_at(ptr, aux + 8)
        t3 = _f32_at(ptr, aux + 12)
        level = tl.where(c == 0, t0, tl.where(c == 1, t1, tl.where(c == 2, t2, t3)))
        w = level * _group_scale(ptr, scales, rows, cols, K, GROUP, mask, 0)
    return w


@triton.jit
def _decode_nested_full(bptr, codes, scales, dptr, low, rows, cols, K, GROUP: tl.constexpr, mask):
    """NVFP4 rebuilt from both planes: ((base code << 2) | low) decoded with the base's scales."""
    code = (_codes2(bptr, codes, rows, cols, K, mask) << 2) | _codes2(
        dptr, low, rows, cols, K, mask
    )
    return _e2m1(code) * _group_scale(bptr, scales, rows, cols, K, GROUP, mask, 0)


@triton.jit
def _row_factor(ptr, KIND: tl.constexpr, row_scale, tensor_scale, rows, nmask):
    """Per-row factor [BN] the decoded tile is multiplied by after the K loop."""
    if KIND == 3:
        f = tl.load((ptr + row_scale).to(tl.pointer_type(tl.float32)) + rows, mask=nmask, other=0.0)
    elif (KIND == 4) or (KIND == 6):
        f = tl.zeros(rows.shape, tl.float32) + _f32_at(ptr, tensor_scale)
    else:
        f = tl.full(rows.shape, 1.0, tl.float32)
    return f


@triton.jit
def _bias(ptr, BIAS: tl.constexpr, offset, idx, mask):
    if BIAS == 1:
        b = tl.load((ptr + offset).to(tl.pointer_type(tl.float32)) + idx, mask=mask, other=0.0)
    elif BIAS == 2:
        b = tl.load((ptr + offset).to(tl.pointer_type(tl.bfloat16)) + idx, mask=mask, other=0.0)
    else:
        b = tl.load((ptr + offset).to(tl.pointer_type(tl.float16)) + idx, mask=mask, other=0.0)
    return b.to(tl.float32)


@triton.jit
def _activation(g, u, ACT: tl.constexpr, limit, alpha):
    if ACT == 0:
        y = g * tl.sigmoid(g) * u
    elif ACT == 1:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = g * tl.sigmoid(g) * u
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = (u + 1) * (g * tl.sigmoid(g * alpha))
    return y
