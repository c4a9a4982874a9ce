"""Which q2s GEMV decode structure reaches HBM bandwidth in Triton? A study, not the engine.

Each variant computes y[e, n] = Σ_k W_e[n, k] x[k] for a few experts of one q2s matrix
(layout of core/layout.q2s_expert_format, linear grid b = 3a so every variant may use it) and
is checked against a torch reference before it is timed. One JSON line per (variant, config):
GB/s over the codes + scales + row scales read, next to the copy bandwidth.

  python bench/q2s_gemv_variants.py [--n 1536 --k 2048 --experts 8]
  TRITON_INTERPRET=1 python bench/q2s_gemv_variants.py --check-only --n 64 --k 256 --experts 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, emit, run_info, time_cuda  # noqa: E402

GROUP = 32


@triton.jit
def _e4m3(byte):
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def bf16_gemv(w_ptr, x_ptr, y_ptr, N, K, ITER_SUM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr):  # fmt: skip
    """Baseline: bf16 weights [E, N, K]; ITER_SUM reduces over K every tile (as the engine's
    kernel does) instead of once at the end."""
    e = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    acc2 = tl.zeros((BN, BK), tl.float32)
    acc = tl.zeros((BN,), tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + e * N * K + rows[:, None] * K + cols[None, :]).to(tl.float32)
        x = tl.load(x_ptr + cols)
        if ITER_SUM:
            acc += tl.sum(w * x[None, :], axis=1)
        else:
            acc2 += w * x[None, :]
    if not ITER_SUM:
        acc = tl.sum(acc2, axis=1)
    tl.store(y_ptr + e * N + rows, acc)


@triton.jit
def q2s_gather(codes, scales, rs, x_ptr, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """Per-element decode: each weight's byte and scale gathered (L1 serves repeats), the
    level as 2a(c - 1.5) with a = 0.5, accumulated in a [BN, BK] tile, reduced once."""
    e = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    acc2 = tl.zeros((BN, BK), tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        byte = tl.load(codes + e * N * (K // 4) + rows[:, None] * (K // 4) + cols[None, :] // 4)
        c = (byte.to(tl.int32) >> ((cols[None, :] % 4) * 2)) & 3
        sc = tl.load(scales + e * N * (K // 32) + rows[:, None] * (K // 32) + cols[None, :] // 32)
        x = tl.load(x_ptr + cols)
        acc2 += (c.to(tl.float32) - 1.5) * _e4m3(sc) * x[None, :]
    tl.store(y_ptr + e * N + rows, tl.sum(acc2, axis=1) * tl.load(rs + e * N + rows))


@triton.jit
def q2s_bytes3d(codes, scales, rs, x_ptr, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """Bytes loaded contiguously [BN, BK/4], codes expanded to [BN, BK/4, 4] by shifts, the
    scale gathered per byte, the float 1 + c/4 built from bits, accumulated in 3-D."""
    e = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    BYTES: tl.constexpr = BK // 4
    j = tl.arange(0, 4)
    acc3 = tl.zeros((BN, BYTES, 4), tl.float32)
    for k0 in range(0, K, BK):
        b = k0 // 4 + tl.arange(0, BYTES)
        byte = tl.load(codes + e * N * (K // 4) + rows[:, None] * (K // 4) + b[None, :])
        sc = _e4m3(
            tl.load(scales + e * N * (K // 32) + rows[:, None] * (K // 32) + b[None, :] // 8)
        )
        lv = (((byte.to(tl.int32)[:, :, None] << (21 - 2 * j)[None, None, :]) & (3 << 21))
              | 0x3F800000).to(tl.float32, bitcast=True)  # fmt: skip
        x = tl.load(x_ptr + b[:, None] * 4 + j[None, :])  # [BYTES, 4]
        acc3 += (lv - 1.375) * sc[:, :, None] * x[None, :, :]
    acc = tl.sum(tl.sum(acc3, axis=2), axis=1) * 4.0  # 2a(c - 1.5) = 4(1 + c/4 - 1.375) a=.5
    tl.store(y_ptr + e * N + rows, acc * tl.load(rs + e * N + rows))


@triton.jit
def q2s_words(codes, scales, rs, x_ptr, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """int32 words (16 codes) loaded [BN, BK/16], expanded to [BN, BK/16, 16]; one scale per
    word pair (group 32 = 2 words) gathered per word; accumulated in 3-D."""
    e = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    WORDS: tl.constexpr = BK // 16
    j = tl.arange(0, 16)
    acc3 = tl.zeros((BN, WORDS, 16), tl.float32)
    base = (codes + e * N * (K // 4)).to(tl.pointer_type(tl.int32))
    for k0 in range(0, K, BK):
        wd = k0 // 16 + tl.arange(0, WORDS)
        word = tl.load(base + rows[:, None] * (K // 16) + wd[None, :])
        sc = _e4m3(
            tl.load(scales + e * N * (K // 32) + rows[:, None] * (K // 32) + wd[None, :] // 2)
        )
        c = (word[:, :, None] >> (2 * j)[None, None, :]) & 3
        x = tl.load(x_ptr + wd[:, None] * 16 + j[None, :])  # [WORDS, 16]
        acc3 += (c.to(tl.float32) - 1.5) * sc[:, :, None] * x[None, :, :]
    acc = tl.sum(tl.sum(acc3, axis=2), axis=1)
    tl.store(y_ptr + e * N + rows, acc * tl.load(rs + e * N + rows))


@triton.jit
def q2s_dot16(codes, scales, rs, x_ptr, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """Tensor cores at batch 1: x padded to 16 rows, weights decoded per element to bf16
    (gathered bytes and scales) and fed to tl.dot."""
    e = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    m = tl.arange(0, 16)
    acc = tl.zeros((16, BN), tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        byte = tl.load(codes + e * N * (K // 4) + rows[:, None] * (K // 4) + cols[None, :] // 4)
        c = (byte.to(tl.int32) >> ((cols[None, :] % 4) * 2)) & 3
        sc = tl.load(scales + e * N * (K // 32) + rows[:, None] * (K // 32) + cols[None, :] // 32)
        w = ((c.to(tl.float32) - 1.5) * _e4m3(sc)).to(tl.bfloat16)
        x = tl.where(m[:, None] == 0, tl.load(x_ptr + cols)[None, :], 0.0)  # [16, BK]
        acc += tl.dot(x.to(tl.bfloat16), tl.trans(w))
    y = tl.sum(acc, axis=0)  # only row 0 is non-zero
    tl.store(y_ptr + e * N + rows, y * tl.load(rs + e * N + rows))


VARIANTS = {
    "q2s_gather": q2s_gather,
    "q2s_bytes3d": q2s_bytes3d,
    "q2s_words": q2s_words,
    "q2s_dot16": q2s_dot16,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64, help="distinct experts (> L2)")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--quick", action="store_true", help="four tile configs, not 18")
    args = parser.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    e, n, k = args.experts, args.n, args.k
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (e, n, k // 4), generator=gen, dtype=torch.uint8).to(dev)
    scales = (torch.rand(e, n, k // GROUP, generator=gen) + 0.5).to(torch.float8_e4m3fn).to(dev)
    rs = (torch.rand(e, n, generator=gen) + 0.5).to(dev)
    x = torch.randn(k, generator=gen).to(dev)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=dev)
    c = ((codes[..., None] >> shifts) & 3).reshape(e, n, k).float()
    w = (c - 1.5) * scales.float().repeat_interleave(GROUP, dim=2) * rs[..., None]
    ref = torch.einsum("enk,k->en", w, x)
    w_bf16 = w.to(torch.bfloat16)
    ref_bf16 = torch.einsum("enk,k->en", w_bf16.float(), x)
    q2s_bytes = codes.numel() + scales.numel() + rs.numel() * 4
    info = run_info()
    copy_bw = copy_bandwidth() if dev == "cuda" else float("nan")
    configs = [(bn, bk, warps) for bn in (16, 32, 64) for bk in (64, 128, 256) for warps in (4, 8)]
    if args.quick:
        configs = [(32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8)]
    if args.check_only:
        configs = [(16, 64, 4)]
    y = torch.empty(e, n, device=dev)
    cases = [(f"bf16_{'iter' if it else 'acc'}", it) for it in (0, 1)] + list(VARIANTS.items())
    for name, kernel_or_flag in cases:
        for bn, bk, warps in configs:
            if bn * bk > 16384 or n % bn or k % bk:
                continue
            grid = (e, n // bn)
            if name.startswith("bf16"):

                def call(bn=bn, bk=bk, warps=warps, it=kernel_or_flag, grid=grid):  # type: ignore[no-untyped-def]
                    bf16_gemv[grid](w_bf16, x, y, n, k, it, bn, bk, num_warps=warps)

                expected, nbytes = ref_bf16, w_bf16.numel() * 2
            else:

                def call(bn=bn, bk=bk, warps=warps, kern=kernel_or_flag, grid=grid):  # type: ignore[no-untyped-def]
                    kern[grid](codes, scales, rs, x, y, n, k, bn, bk, num_warps=warps)

                expected, nbytes = ref, q2s_bytes
            y.fill_(float("nan"))
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - a config the compiler rejects
                emit({**info, "variant": name, "BN": bn, "BK": bk, "warps": warps,
                      "error": f"{type(exc).__name__}: {str(exc)[:120]}"})  # fmt: skip
                continue
            err = float((y - expected).norm() / expected.norm())
            rec = {**info, "variant": name, "BN": bn, "BK": bk, "warps": warps,
                   "rel_err": round(err, 7)}  # fmt: skip
            if dev == "cuda" and err < 1e-2:
                ms = time_cuda(call, reps=30)
                rec.update(ms=round(ms, 5), GBps=round(nbytes / ms / 1e6, 1),
                           copy_GBps=round(copy_bw / 1e9, 1))  # fmt: skip
            emit(rec)


if __name__ == "__main__":
    main()
