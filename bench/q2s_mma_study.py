"""Can q2s prefill run on int8 tensor cores? A study, not the engine (issue #4's prefill point).

One q2s matrix W [N, K] (groups of 32 columns, b = 3a or a fitted grid) times M tokens, as one
expert sees them in a prefill. Variants, each checked against float64 torch first:

  bf16          torch matmul on the dequantised weights: the baseline throughput
  q2s_bf16_dot  codes decoded per element to bf16 tiles, tl.dot (what the engine's grouped kernel
                does today)
  q2s_int8_mma  activations rounded to int8 per 32 columns, codes decoded per element to int8
                levels 2c - 3 (and the fitted grid's o = [c=3] - [c=0]), one int8 tl.dot per
                group into int32, scaled per (token, group) x (row, group) in float

One JSON line per (variant, M, tile): ms and throughput against bf16 in the same run.

  python bench/q2s_mma_study.py                                  # H200: M = 64, 256, 1024
  TRITON_INTERPRET=1 python bench/q2s_mma_study.py --check-only --n 64 --k 128 --m 32
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from common import emit, run_info, time_cuda  # noqa: E402

from moetier.kernels.moe_ref import dequant_q2s_ref  # noqa: E402

GROUP = 32


@triton.jit
def _e4m3(byte):
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _codes(codes, rn, k0, K, BN: tl.constexpr, BK: tl.constexpr):
    """2-bit codes of rows rn, columns k0..k0+BK: int32 [BN, BK]."""
    cols = k0 + tl.arange(0, BK)
    byte = tl.load(codes + rn[:, None] * (K // 4) + cols[None, :] // 4)
    return (byte.to(tl.int32) >> ((cols[None, :] % 4) * 2)) & 3


@triton.jit
def q2s_bf16_dot(x, codes, scales, rs, grid, y, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                 BF16: tl.constexpr):  # fmt: skip
    """Per-element decode to bf16 levels times the group scale, one bf16 tl.dot per group
    (BF16 off: float32, for Triton's interpreter, whose bf16 dot is wrong)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    a = tl.load(grid)
    b = tl.load(grid + 1)
    acc = tl.zeros((BM, BN), tl.float32)
    for g in range(0, K // 32):
        c = _codes(codes, rn, g * 32, K, BN, 32)
        mag = tl.where((c == 1) | (c == 2), a, b)
        sw = _e4m3(tl.load(scales + rn * (K // 32) + g))
        w = tl.where(c >= 2, mag, -mag) * sw[:, None]
        xt = tl.load(x + rm[:, None] * K + g * 32 + tl.arange(0, 32)[None, :])
        if BF16:
            w = w.to(tl.bfloat16)
        else:
            xt = xt.to(tl.float32)
        acc += tl.dot(xt, tl.trans(w))
    acc = acc * tl.load(rs + rn)[None, :]
    tl.store(y + rm[:, None] * N + rn[None, :], acc)


@triton.jit
def q2s_int8_mma(xq, xs, codes, scales, rs, grid, y, M, N, K, CORR: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """int8 activations (scale per 32 columns) times int8 levels: L = a(2c - 3) + (b - 3a)o."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    a = tl.load(grid)
    corr = tl.load(grid + 1) - 3 * a
    acc = tl.zeros((BM, BN), tl.float32)
    acc_o = tl.zeros((BM, BN), tl.float32)
    for g in range(0, K // 32):
        c = _codes(codes, rn, g * 32, K, BN, 32)
        xt = tl.load(xq + rm[:, None] * K + g * 32 + tl.arange(0, 32)[None, :])
        f = (
            tl.load(xs + rm * (K // 32) + g)[:, None]
            * _e4m3(tl.load(scales + rn * (K // 32) + g))[None, :]
        )
        d = tl.dot(xt, tl.trans((2 * c - 3).to(tl.int8)), out_dtype=tl.int32)
        acc += d.to(tl.float32) * f
        if CORR:
            o = ((c == 3).to(tl.int32) - (c == 0).to(tl.int32)).to(tl.int8)
            acc_o += tl.dot(xt, tl.trans(o), out_dtype=tl.int32).to(tl.float32) * f
    acc = (a * acc + corr * acc_o) * tl.load(rs + rn)[None, :]
    tl.store(y + rm[:, None] * N + rn[None, :], acc)


def quant32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], scale float32 [M, K/32]): absmax / 127 per 32 columns."""
    m, k = x.shape
    v = x.float().reshape(m, k // 32, 32)
    amax = v.abs().amax(dim=2, keepdim=True)
    q = torch.where(amax > 0, torch.floor(v * (127 / amax.clamp_min(1e-30)) + 0.5), 0.0)
    return q.to(torch.int8).reshape(m, k), (amax / 127).reshape(m, k // 32)


def make_call(name: str, t: dict[str, torch.Tensor], fitted: bool, bm: int, bn: int, warps: int):  # type: ignore[no-untyped-def]
    """A closure launching variant `name` on the tensors `t` (x, xq, xs, codes, scales, rs,
    grid, y on the device)."""
    m, k = t["x"].shape
    n = t["y"].shape[1]
    launch = (m // bm, n // bn)
    weights = (t["codes"], t["scales"], t["rs"], t["grid"])

    def call() -> None:
        if name == "q2s_bf16_dot":
            q2s_bf16_dot[launch](t["x"], *weights, t["y"], m, n, k, bm, bn, t["x"].is_cuda,
                                 num_warps=warps)  # fmt: skip
        else:
            q2s_int8_mma[launch](t["xq"], t["xs"], *weights, t["y"], m, n, k, fitted, bm, bn,
                                 num_warps=warps)  # fmt: skip

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--m", default="64,256,1024", help="tokens (rows of x)")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    args = parser.parse_args()
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    n, k = args.n, args.k
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (n, k // 4), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // GROUP, generator=gen) + 0.5).to(torch.float8_e4m3fn)
    rs = torch.rand(n, generator=gen) + 0.5
    grids = {"b=3a": torch.tensor([0.5, 1.5]), "fitted": torch.tensor([0.45, 1.6])}
    info = run_info()
    tiles = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8)]
    if args.check_only:
        tiles = [(32, 32, 4)]
    for m in (int(v) for v in args.m.split(",")):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        xq, xs = quant32(x)
        for grid_name, grid in grids.items():
            w = dequant_q2s_ref(codes, scales, rs, grid)  # [N, K] float32
            refs = {
                "q2s_bf16_dot": x.double() @ w.double().T,
                "q2s_int8_mma": (xq.double() * xs.double().repeat_interleave(32, dim=1))
                @ w.double().T,
            }
            host = dict(
                x=x if dev == "cuda" else x.float(),  # the interpreter's bf16 dot is wrong
                xq=xq, xs=xs, codes=codes,
                scales=scales.view(torch.uint8),  # as bytes, as blobs hold them
                rs=rs, grid=grid, w=w.to(torch.bfloat16), y=torch.empty(m, n),
            )  # fmt: skip
            t = {name: v.to(dev) for name, v in host.items()}
            bf16_ms = float("nan")
            if dev == "cuda":
                bf16_ms = time_cuda(functools.partial(torch.matmul, t["x"], t["w"].T))
            emit({**info, "variant": "bf16", "grid": grid_name, "M": m, "N": n, "K": k,
                  "ms": round(bf16_ms, 5)})  # fmt: skip
            for name in ("q2s_bf16_dot", "q2s_int8_mma"):
                for bm, bn, warps in tiles:
                    if m % bm or n % bn:
                        continue
                    call = make_call(name, t, grid_name == "fitted", bm, bn, warps)
                    t["y"].fill_(float("nan"))
                    rec = {**info, "variant": name, "grid": grid_name, "M": m, "N": n, "K": k,
                           "BM": bm, "BN": bn, "warps": warps}  # fmt: skip
                    try:
                        call()
                    except Exception as exc:  # noqa: BLE001 - a config the compiler rejects
                        emit({**rec, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                        continue
                    want = refs[name]
                    err = float((t["y"].double().cpu() - want).norm() / want.norm())
                    rec["rel_err"] = float(f"{err:.2e}")
                    if dev == "cuda" and err < 1e-2:
                        ms = time_cuda(call, reps=20)
                        rec.update(ms=round(ms, 5), vs_bf16=round(bf16_ms / ms, 3))
                    emit(rec)
                    if err >= 1e-2:
                        raise SystemExit(f"{name} ({grid_name}) is wrong: relative error {err:.2e}")


if __name__ == "__main__":
    main()
