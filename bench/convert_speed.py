"""Speed of the converter's expert quantisation (quant/calibration/q2s_batched.py).

One MoE layer's worth of experts of a named shape, random weights and Hessians (from random
activations), quantised the way the calibrated converter does: a chunk of experts at a time,
gate_up (group 32) then down (group 16), on the GPU when there is one, else on the CPU's cores.
Rounding modes: nearest (round to nearest, MSE scale search), diag (importance per input
channel), gptq (Hessians). One JSON line per case: M expert weights a second, excluding the
statistics (measured apart) and the reads from the checkpoint.

    python bench/convert_speed.py                                  # qwen3-30b-a3b layer widths
    python bench/convert_speed.py --shape deepseek-v3 --experts 16 --chunk 8
    python bench/convert_speed.py --shape small --device cpu       # a quick CPU check
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moetier.core.provenance import run_info
from moetier.quant.calibration.q2s_batched import quantize_q2s_batched

SHAPES = {  # hidden, expert intermediate
    "qwen3-30b-a3b": (2048, 768),
    "deepseek-v3": (7168, 2048),
    "small": (512, 256),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--experts", type=int, default=32, help="experts quantised per case")
    parser.add_argument("--chunk", type=int, default=16, help="experts per batched call")
    parser.add_argument("--modes", default="nearest,diag,gptq")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=2048, help="activations per Hessian")
    args = parser.parse_args()
    dev = torch.device(args.device)
    hidden, inter = SHAPES[args.shape]
    g = torch.Generator(device=dev).manual_seed(0)
    matrices = {"gate_up": (2 * inter, hidden, 32), "down": (hidden, inter, 16)}
    for mode in args.modes.split(","):
        seconds = stats_seconds = 0.0
        weights = 0
        for e0 in range(0, args.experts, args.chunk):
            c = min(args.chunk, args.experts - e0)
            for n, k, group in matrices.values():
                w = torch.randn(c, n, k, device=dev, generator=g) * 0.02
                _sync(dev)
                t0 = time.perf_counter()
                stats: dict[str, torch.Tensor] = {}
                if mode != "nearest":
                    x = torch.randn(c, args.tokens, k, device=dev, generator=g)
                    if mode == "gptq":
                        stats["hessian"] = torch.bmm(x.transpose(1, 2), x)
                    else:
                        stats["importance"] = (x * x).mean(1)
                    del x
                _sync(dev)
                t1 = time.perf_counter()
                q = quantize_q2s_batched(w, group=group, **stats)
                _ = [q.parts(i) for i in range(c)]  # packed and copied back, as stored
                _sync(dev)
                t2 = time.perf_counter()
                stats_seconds += t1 - t0
                seconds += t2 - t1
                weights += w.numel()
                del w, q, stats
        line = {
            "bench": "convert_speed",
            "shape": args.shape,
            "mode": mode,
            "experts": args.experts,
            "chunk": args.chunk,
            "expert_weights": weights,
            "seconds": round(seconds, 3),
            "m_weights_per_s": round(weights / seconds / 1e6, 2),
            "statistics_seconds": round(stats_seconds, 3),
            "device_kind": dev.type,
            "threads": torch.get_num_threads(),
            **run_info(),
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
