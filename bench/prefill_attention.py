"""A packed step's GQA attention two ways, on one layer of the Qwen3-30B-A3B shape (32 query
heads, 4 kv heads, head_dim 128, bf16, pages of 16): the engine's gathered path (each sequence's
keys gathered from the pages, the kv heads repeated, SDPA over the [tokens, keys] mask, as
models/layers.py runs it with PAGED_PREFILL_KERNEL off) against `moetier::prefill_attention`
(kernels/prefill_attention.py: the pages read through the sequence's table). One JSON line per
(chunk, context): ms of each (CUDA events, median; each builds its batch from the page list, as
the engine does every step), the kernel's speed-up, the peak memory each allocates, and the
floor in the same run (the context's keys and values read once at the HBM copy speed, which
counts bytes read plus written, as the project's floors do). Decides whether
PAGED_PREFILL_KERNEL goes on by default (#42).

    python3 bench/prefill_attention.py                   # GPU
    python3 bench/prefill_attention.py --device cpu --cases 16:64   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit, time_cuda  # noqa: E402

from moetier.core.provenance import run_info  # noqa: E402
from moetier.kernels.prefill_attention import prefill_attention  # noqa: E402
from moetier.models.attention_batch import AttentionBatch  # noqa: E402
from moetier.models.layers import _repeat_kv, masked_attention  # noqa: E402
from moetier.residency.links import memory_bandwidth, time_host  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 32, 4, 128, 16


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def run_case(chunk: int, context: int, device: str, reps: int, copy: float) -> dict:
    """One (chunk, context): a sequence whose last `chunk` tokens of `context` are the step's,
    its pages shuffled in the cache -> the line's figures."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pages = -(-context // PAGE)
    ids = list(range(pages + 1))
    random.Random(0).shuffle(ids)
    k_cache = torch.randn(pages + 1, KV_HEADS, PAGE, DIM, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(1, HEADS, chunk, DIM, dtype=dtype, device=device)
    span = [(context - chunk, chunk, ids[:pages])]
    scale = DIM**-0.5

    def gathered() -> torch.Tensor:
        batch = AttentionBatch.packed(span, PAGE, device)
        keys = _repeat_kv(batch.keys(k_cache), HEADS // KV_HEADS)
        values = _repeat_kv(batch.keys(v_cache), HEADS // KV_HEADS)
        return masked_attention(q, keys, values, batch.mask, scale)

    def paged() -> torch.Tensor:  # (its batch built each call too, as the gathered one's)
        batch = AttentionBatch.packed(span, PAGE, device, paged=True)
        assert batch.seq_pages is not None and batch.blocks is not None
        return prefill_attention(q[0].transpose(0, 1), k_cache, v_cache, batch.seq_pages,
                                 batch.blocks, scale)  # fmt: skip

    want = gathered()[0].transpose(0, 1).float()
    err = (paged().float() - want).abs().max().item()
    figures: dict[str, tuple[float, float | None]] = {}
    for name, fn in (("gathered", gathered), ("paged", paged)):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = time_cuda(fn, reps)
            figures[name] = (ms, (torch.cuda.max_memory_allocated() - base) / 2**20)
        else:
            figures[name] = (1e3 * time_host(fn, reps), None)  # (no allocator figures)
    kv_bytes = 2 * context * KV_HEADS * DIM * k_cache.element_size()
    return {
        "case": "prefill-attention", "chunk": chunk, "context": context, "heads": HEADS,
        "kv_heads": KV_HEADS, "head_dim": DIM, "dtype": str(dtype),
        "gathered_ms": round(figures["gathered"][0], 4), "paged_ms": round(figures["paged"][0], 4),
        "speedup": round(figures["gathered"][0] / figures["paged"][0], 3),
        "gathered_peak_MiB": _mib(figures["gathered"][1]),
        "paged_peak_MiB": _mib(figures["paged"][1]),
        "floor_ms": round(1e3 * kv_bytes / copy, 4),  # the K/V read once at HBM copy speed
        "max_abs_err": round(err, 5),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="512:4096,2048:16384,2048:65536",
                        help="CHUNK:CONTEXT pairs (the chunk's tokens end at CONTEXT)")  # fmt: skip
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    info = run_info()
    copy = memory_bandwidth(args.device)
    for case in args.cases.split(","):
        chunk, context = (int(x) for x in case.split(":"))
        emit({**info, **run_case(chunk, context, args.device, args.reps, copy)})


if __name__ == "__main__":
    main()
