"""Batch-1 dense GEMV tiles: µs and GB/s of stored bytes per (format, shape, tile) of
`kernels/dense_gemv.dense_gemv_triton`, beside cuBLAS's bf16 GEMV of the same shape, each call
replayed from a CUDA graph (20 calls a graph, `bench/common.graph_ms`). The default tile is
the first of the sweep. One JSON line per case; H100 / H200.

  python bench/studies/dense_gemv_tiles.py
  python bench/studies/dense_gemv_tiles.py --formats fp8 --rows 16,32,64 --block-k 128 --warps 4,8
  (a tile is [block_rows, block_kk, num_warps, split_k]; split_k 0: the default rule)
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import emit, graph_ms  # noqa: E402

from moetier.kernels.dense_gemv import dense_gemv_triton  # noqa: E402
from moetier.quant.dense_formats import DenseFormat  # noqa: E402

# Qwen3-30B-A3B: qkv, o_proj, the router, lm_head
SHAPES = [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="fp8,int4-g128")
    parser.add_argument("--rows", default="32,16,64,128", help="BLOCK_N values")
    parser.add_argument("--block-k", default="128,256,512", help="K a loop step reads")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--split-k", default="0,1", help="K ranges per output (0: the default)")
    parser.add_argument("--fp8-decode", default="native", help="fp8: native (sm_89+), bits or both")
    args = parser.parse_args()
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    device = torch.cuda.get_device_name()
    for n, k in SHAPES:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        us = 1e3 * graph_ms([lambda w=w, x=x: torch.nn.functional.linear(x, w)] * 20)
        emit({"case": "bf16 cuBLAS", "device": device, "n": n, "k": k, "us": round(us, 2),
              "GB/s": round(w.numel() * 2 / us / 1e3, 1)})  # fmt: skip
        del w
        for name in args.formats.split(","):
            fmt = DenseFormat.parse(name)
            weight, scale, *rest = fmt.quantize(torch.randn(n, k, device="cuda"))
            scale_2 = rest[0] if rest else None
            kind, bn, bk = fmt.kernel_args()
            nbytes = weight.numel() + scale.numel() * scale.element_size()
            decodes = args.fp8_decode.replace("both", "native,bits").split(",")
            for rows, kk, warps, split, decode in itertools.product(
                ints(args.rows), ints(args.block_k), ints(args.warps), ints(args.split_k),
                decodes if kind == "fp8" else ["-"],
            ):  # fmt: skip
                if kind == "fp8" and kk > bk:
                    continue

                call = (x, weight, scale, scale_2, kind, bn, bk)
                tile = {"block_rows": rows, "block_kk": kk, "num_warps": warps,
                        "split_k": split or None}  # fmt: skip
                if kind == "fp8":
                    tile["fp8_native"] = decode == "native"

                def step(call=call, tile=tile):  # type: ignore[no-untyped-def]
                    return dense_gemv_triton(*call, **tile)

                try:
                    us = 1e3 * graph_ms([step] * 20)
                except Exception as error:  # a tile the compiler refuses: say so, go on
                    emit({"case": name, "n": n, "k": k, "tile": [rows, kk, warps, split],
                          "error": str(error)[:120]})  # fmt: skip
                    continue
                emit({"case": name, "device": device, "n": n, "k": k, "decode": decode,
                      "tile": [rows, kk, warps, split], "us": round(us, 2),
                      "GB/s": round(nbytes / us / 1e3, 1)})  # fmt: skip


if __name__ == "__main__":
    main()
