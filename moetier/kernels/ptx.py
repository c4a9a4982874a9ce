"""Inline PTX the kernels share, and where it may run. IDP4A and PRMT (`_dp4a`, `_prmt`: plain
integer ops under Triton's interpreter, which has no inline assembly); sm_90's L2 prefetch
(`_prefetch_l2`) and the spans of a blob the q2s GEMVs (Triton and Gluon) ask for with it
(`_prefetch_rows`, `_prefetch_share`); the global timer and SM id a study's programs stamp
(`_trace_store`, the kernels' `TRACE`). `_inline_asm` and `_sm_at_least` say whether compiled
PTX runs (not the interpreter), on a GPU of at least a given compute capability.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _inline_asm() -> bool:
    """Under TRITON_INTERPRET=1 (the CPU tests) there is no inline assembly: `_dp4a` then uses
    plain integer ops."""
    return os.environ.get("TRITON_INTERPRET") != "1"


def _sm_at_least(device: torch.device, major: int, minor: int = 0) -> bool:
    """Compiled PTX (not Triton's interpreter) on a CUDA device of at least this compute
    capability: where the kernels' sm-specific instructions may be used."""
    return (
        _inline_asm()
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= (major, minor)
    )


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + Σ_j a.u8[j] · b.s8[j] per int32 lane (one IDP4A; plain integer ops under the
    interpreter, which has no inline assembly)."""
    if ASM:
        y = tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        y = c
        for j in tl.static_range(4):
            y += ((a >> (8 * j)) & 0xFF) * ((b << (24 - 8 * j)) >> 24)
    return y


@triton.jit
def _prmt(a, b, sel, ASM: tl.constexpr):
    """PRMT: byte i of the result is byte (nibble i of sel) & 7 of the 8 bytes (a, then b), or
    that byte's sign replicated (0x00 / 0xFF) when the nibble's bit 3 is set (plain integer ops
    under the interpreter)."""
    if ASM:
        y = tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        y = tl.zeros(sel.shape, tl.int32)
        for i in tl.static_range(4):
            nib = (sel >> (4 * i)) & 0xF
            idx = nib & 7
            byte = tl.where(idx < 4, (a >> (8 * (idx & 3))) & 0xFF, (b >> (8 * (idx & 3))) & 0xFF)
            byte = tl.where(nib >= 8, tl.where(byte >= 128, 0xFF, 0), byte)
            y = y | (byte << (8 * i))
    return y


@triton.jit
def _globaltimer():
    """The GPU's global nanosecond timer (sm_90 PTX; `TRACE` only)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _smid():
    """The SM this program runs on (`TRACE` only)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _trace_store(trace, program, t_start, t_pre, t_post):
    """A program's stamps (`TRACE`): start, before and after its wait, now (its end) and its SM
    at trace[program] (the Gluon kernel's too)."""
    t_end = _globaltimer()
    at = trace + program * 8
    tl.store(at, t_start)
    tl.store(at + 1, t_pre)
    tl.store(at + 2, t_post)
    tl.store(at + 3, t_end)
    tl.store(at + 4, _smid().to(tl.int64))


@triton.jit
def _prefetch_l2(ptr, nbytes):
    """Ask for bytes [ptr, ptr + nbytes) in L2 (sm_90 `cp.async.bulk.prefetch.L2`, issued by the
    program's first thread; the range shrunk to whole 16-byte units, as the instruction wants).
    A hint: loads stay correct whatever it does, but each program's rows are requested at once
    instead of one K tile at a time."""
    start = (ptr.to(tl.int64) + 15) & -16
    size = (((ptr.to(tl.int64) + nbytes) & -16) - start).to(tl.int32)
    tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .u32 t;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        setp.gt.and.s32 p, $2, 0, p;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""",
        "=r,l,r", [start, size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _prefetch_rows(bptr, codes, scales, first, count, row_words, row_groups):
    """Ask L2 (`_prefetch_l2`) for rows [first, first + count) of the matrix whose words and
    group scale bytes start at byte offsets codes and scales of the blob at bptr: the rows'
    words, then their scale bytes (each a contiguous span)."""
    _prefetch_l2(bptr + codes + first * row_words * 4, count * row_words * 4)
    _prefetch_l2(bptr + scales + first * row_groups, count * row_groups)


@triton.jit
def _prefetch_share(pool, slot_offsets, slot, pool_bytes, lo, nbytes):
    """Ask L2 (`_prefetch_l2`) for this program's share of bytes [lo, lo + nbytes) of the blob
    in `slot`, when that blob is in the GPU pool: the range split in 256-byte multiples over
    the launch's programs of one pair (program ids 1 and 2)."""
    slot_off = tl.load(slot_offsets + slot)
    if (slot_off >= 0) & (slot_off < pool_bytes):
        count = tl.num_programs(1) * tl.num_programs(2)
        pid = tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)
        share = (tl.cdiv(nbytes, count) + 255) // 256 * 256
        first = pid * share
        _prefetch_l2(pool + slot_off + lo + first, tl.minimum(share, nbytes - first))
