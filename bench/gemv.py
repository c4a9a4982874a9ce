"""Dense decode projections (H200): the Triton GEMV (`moetier.kernels.gemv`) against F.linear
(cuBLAS) on the Qwen3-30B-A3B shapes, GB/s of weight bytes next to copy bandwidth.

  python bench/gemv.py                       # default tiles, tokens 1, 4, 8
  python bench/gemv.py --sweep               # also every (BLOCK_N, BLOCK_K) candidate
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, emit, run_info, time_cuda  # noqa: E402

from moetier.kernels import gemv  # noqa: E402

SHAPES = {  # name: (N, K) of the Qwen3-30B-A3B shape's decode matmuls
    "qkv": (5120, 2048),
    "o_proj": (2048, 4096),
    "router": (128, 2048),
    "lm_head": (8192, 2048),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,4,8")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    info = run_info()
    copy_bw = copy_bandwidth()
    emit({**info, "case": "copy", "GB/s": round(copy_bw / 1e9, 1)})
    for name, (n, k) in SHAPES.items():
        # several weight copies so consecutive calls do not hit L2
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            nbytes = n * k * 2
            blocks: dict[str, tuple[int, int] | None] = {"cublas": None, "triton": None}
            if args.sweep:
                for bn, bk in ((16, 256), (32, 128), (32, 256), (64, 128), (64, 64), (16, 512)):
                    blocks[f"triton-{bn}x{bk}"] = (bn, bk)
            ref = torch.nn.functional.linear(x, ws[0]).float()
            err = (gemv.linear_triton(x, ws[0]).float() - ref).norm() / ref.norm()
            for label, block in blocks.items():

                def calls(
                    label: str = label,
                    block: tuple[int, int] | None = block,
                    x: torch.Tensor = x,
                    ws: list[torch.Tensor] = ws,
                ) -> None:
                    for w in ws:
                        if label == "cublas":
                            torch.nn.functional.linear(x, w)
                        else:
                            gemv.linear_triton(x, w, block=block)

                # replayed from a CUDA graph: a plain loop times the launches, not the kernels
                calls()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    calls()
                ms = time_cuda(graph.replay) / len(ws)
                emit({**info, "case": "gemv", "shape": name, "n": n, "k": k, "tokens": tokens,
                      "kernel": label, "us": round(ms * 1e3, 2),
                      "GB/s": round(nbytes / ms / 1e6, 1), "copy_GB/s": round(copy_bw / 1e9, 1),
                      "rel_err": float(f"{err:.2e}")})  # fmt: skip


if __name__ == "__main__":
    main()
