"""Compile the kernels the dispatcher chooses for each GPU architecture users have, on a machine
without a GPU (moetier/kernels/cross_compile.py: Triton's compiler and bundled ptxas, CPU tensors
of the real shapes). One JSON line per compiled launch: architecture, family shape, expert format
and delta plane, tokens, the kernel, its registers, stack (spills) and shared memory; a last line
sums it up. Exits non-zero if a launch fails to compile.

    python bench/cross_compile.py                       # every target, shape, format, path
    python bench/cross_compile.py --caps 86,120 --shapes qwen3-30b-a3b --formats q2s --tokens 1

Run with TRITON_INTERPRET unset (the CPU tests set it for this process's Triton)."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

from moetier.config import ExpertActivation  # noqa: E402
from moetier.core.layout import (  # noqa: E402
    TENSOR_ALIGN,
    align_up,
    fp4_expert_format,
    nested_expert_formats,
    q2s_expert_format,
    raw_expert_format,
)
from moetier.kernels.cross_compile import TARGETS, compile_for  # noqa: E402
from moetier.quant.synthetic import random_blob  # noqa: E402

# (hidden, expert intermediate, top-k, expert bias, activation) of the supported families
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 8, False, "silu"),
    "deepseek-v3": (7168, 2048, 8, False, "silu"),
    "gpt-oss-120b": (2880, 2880, 4, True, "gpt_oss"),
}
FORMATS = ("q2s", "q2s+nvfp4", "q2s+q2s", "nvfp4", "mxfp4", "nested", "bfloat16")
EXPERTS = 4  # blobs in the pool: the kernels' code does not depend on how many


def formats(name: str, hidden: int, inter: int, bias: bool):  # type: ignore[no-untyped-def]
    q2s = q2s_expert_format(hidden, inter, bias, 32, 16)
    if name == "q2s":
        return q2s, None
    if name == "q2s+nvfp4":
        return q2s, fp4_expert_format("nvfp4", hidden, inter, False)
    if name == "q2s+q2s":
        return q2s, q2s_expert_format(hidden, inter, False, 32, 16)
    if name in ("nvfp4", "mxfp4"):
        return fp4_expert_format(name, hidden, inter, bias), None
    if name == "nested":
        return nested_expert_formats(hidden, inter, bias)
    return raw_expert_format(name, hidden, inter, bias), None


def experts_call(shape: str, fmt_name: str, tokens: int) -> None:
    """One experts op call (moe_slots_triton, the dispatcher choosing) at a family's shape."""
    from moetier.kernels.moe_triton import moe_slots_triton

    hidden, inter, top_k, bias, act = SHAPES[shape]
    fmt, delta_fmt = formats(fmt_name, hidden, inter, bias)
    slot = align_up(max(fmt.nbytes, delta_fmt.nbytes if delta_fmt else 0), TENSOR_ALIGN)
    blobs = EXPERTS * (2 if delta_fmt else 1)
    pool = torch.zeros(blobs, slot, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    for s in range(blobs):
        random_blob(delta_fmt if s >= EXPERTS and delta_fmt else fmt, gen, pool[s])
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[: min(top_k, EXPERTS)]
                       for _ in range(tokens)])  # fmt: skip
    k = ids.shape[1]
    weights = torch.rand(tokens, k, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    out = torch.zeros(tokens, k, hidden)
    table = torch.arange(EXPERTS, dtype=torch.int32)
    delta = dict(delta_mask=torch.ones(tokens, k, dtype=torch.bool),
                 delta_table=torch.arange(EXPERTS, 2 * EXPERTS, dtype=torch.int32),
                 delta_fmt=delta_fmt) if delta_fmt else {}  # fmt: skip
    moe_slots_triton(x, ids, weights, table, pool, fmt, ExpertActivation(kind=act), out, **delta)


# the other kernels of a decode step, at each family's shapes: (dense [N, K] projections,
# attention (heads, kv heads, head dim) or MLA (heads, kv_lora_rank, rope dim), experts)
OTHERS = {
    "qwen3-30b-a3b": ([(5120, 2048), (2048, 4096)], ("gqa", 32, 4, 128), 128),
    "deepseek-v3": ([(24576, 1536), (7168, 16384)], ("mla", 128, 512, 64), 256),
    "gpt-oss-120b": ([(5120, 2880), (2880, 4096)], ("gqa", 64, 8, 64), 128),
}


def other_kernels(shape: str, tokens: int) -> None:
    """The dense GEMV (fp8, int4, nvfp4), the decode attention (GQA or MLA) over a paged cache
    with the fused K/V page write, and the router's top-k, at a family's shapes (the decode
    kernels at min(tokens, 4) rows: they serve decode steps)."""
    from moetier.kernels.attention import decode_attention_triton
    from moetier.kernels.dense_gemv import dense_gemv_triton
    from moetier.kernels.mla_decode import mla_decode_triton
    from moetier.kernels.paged_kv import write_kv_pages_triton
    from moetier.kernels.router import router_topk_triton
    from moetier.quant.dense_formats import DenseFormat

    dense, attention, experts = OTHERS[shape]
    rows = min(tokens, 4)
    for n, k in dense:
        for name in ("fp8", "int4", "nvfp4"):
            fmt = DenseFormat.parse(name)
            try:
                parts = fmt.quantize(torch.randn(n, k) * 0.02)
            except ValueError:  # a shape the format does not take (the converter picks another)
                continue
            kind, bn, bk = fmt.kernel_args()
            x = torch.randn(rows, k).to(torch.bfloat16)
            dense_gemv_triton(x, parts[0], parts[1], parts[2] if len(parts) > 2 else None, kind,
                              bn, bk)  # fmt: skip
    pages, page_size = 8, 16
    table = torch.arange(rows * 2, dtype=torch.int32).view(rows, 2) % pages
    positions = torch.full((rows,), 20, dtype=torch.int64)
    if attention[0] == "gqa":
        _, heads, kv_heads, dim = attention
        q = torch.randn(rows, heads, 1, dim).to(torch.bfloat16)
        cache = torch.zeros(1, 2, pages, kv_heads, page_size, dim, dtype=torch.bfloat16)
        decode_attention_triton(q, cache[0, 0], cache[0, 1], table, positions, dim**-0.5)
        kv = torch.randn(rows, kv_heads, 1, dim).to(torch.bfloat16)
        write_kv_pages_triton(cache, 0, table[:, :1].long(), positions[:, None] % page_size,
                              kv, kv)  # fmt: skip
    else:
        _, heads, rank, rope = attention
        q = torch.randn(rows, heads, rank + rope).to(torch.bfloat16)
        latent = torch.zeros(pages, page_size, rank + rope, dtype=torch.bfloat16)
        mla_decode_triton(q, latent, table, positions, rank, (rank + rope) ** -0.5)
    router_topk_triton(torch.randn(rows, experts), 8, True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--caps", default=",".join(map(str, TARGETS)))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--tokens", default="1,4,64", help="tokens a call (decode, prefill)")
    parser.add_argument(
        "--no-others",
        action="store_true",
        help="the experts kernels only (not the dense GEMV, attention, router)",
    )
    args = parser.parse_args()
    import triton

    from moetier.core.provenance import git_commit

    run = {"commit": git_commit(), "triton": triton.__version__, "torch": torch.__version__}
    failures = compiled = 0
    tokens = [int(t) for t in args.tokens.split(",")]
    for cap in [int(c) for c in args.caps.split(",")]:
        for shape in args.shapes.split(","):
            jobs = [(f, t, lambda s=shape, f=f, t=t: experts_call(s, f, t))
                    for f in args.formats.split(",") for t in tokens]  # fmt: skip
            if not args.no_others:  # ("format" "-": the step's other kernels)
                jobs += [("-", r, lambda s=shape, r=r: other_kernels(s, r))
                         for r in sorted({min(t, 4) for t in tokens})]  # fmt: skip
            for fmt_name, count, job in jobs:
                case = {**run, "cap": cap, "shape": shape, "format": fmt_name, "tokens": count}
                try:
                    with compile_for(cap) as session:
                        job()
                except Exception as exc:  # a compile error: say which and go on
                    failures += 1
                    print(json.dumps({**case, "error": f"{type(exc).__name__}: {exc}"[:400]}),
                          flush=True)  # fmt: skip
                    traceback.print_exc(limit=3, file=sys.stderr)
                    continue
                for r in session.records:
                    compiled += 1
                    print(json.dumps({**case, "kernel": r.kernel, "registers": r.registers,
                                      "stack": r.stack, "local": r.local, "shared": r.shared,
                                      "num_warps": r.num_warps}), flush=True)  # fmt: skip
    print(json.dumps({**run, "summary": True, "compiled": compiled, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
