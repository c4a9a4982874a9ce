"""SASS instruction counts of the q2s GEMV kernel's K loop, compiled here for sm_90 (no GPU
needed: Triton's bundled ptxas and nvdisasm).

  python bench/studies/sass_count.py                   # int8 activations, b = 3a path, no delta
  python bench/studies/sass_count.py --float           # float activations
  python bench/studies/sass_count.py --delta nvfp4     # with the NVFP4 delta decoded in the loop

Prints one JSON line: registers, spilled bytes, memory fences in the whole kernel (MEMBAR:
each waits for every memory access of its thread in flight), weights per thread per K step,
and the K loop's instructions per weight on each path through its runtime-conditional blocks:
`per_weight` skips them all (b = 3a grid, delta off), `per_weight_fitted` takes the fitted
grid's blocks (b != 3a), `per_weight_delta` the delta's (blocks holding PRMT: the NVFP4
delta), `per_weight_all` every block. `--dump FILE` writes the loop's SASS (and FILE.ttgir
the kernel's TTGIR, where layout conversions show).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moetier.kernels import blob_decode, q2s_gemv

POINTERS = {
    "x_ptr": "*fp32", "topk_ids": "*i64", "topk_w": "*fp32", "delta_mask": "*u8", "pool": "*u8",
    "slot_table": "*i32", "slot_offsets": "*i64", "delta_table": "*i32", "out": "*fp32",
    "xq": "*i32", "xs": "*fp32", "xsum": "*i32", "xqn": "*i32", "oq": "*i32", "osc": "*fp32",
    "osum": "*i32", "oqn": "*i32", "scratch": "*fp32", "counters": "*i32", "trace": "*i64",
}  # fmt: skip
NOT_DIVISIBLE = {"limit", "alpha", "stride_xk", "topk_ids", "topk_w", "delta_mask", "slot_table",
                 "slot_offsets", "delta_table", "in_bias", "out_bias", "N", "INTER"}  # fmt: skip


def compile_sm90(fn, const, pointers, not_divisible, options, source_cls=ASTSource):  # type: ignore[no-untyped-def]
    """(compiled kernel, SASS, registers, stack bytes) of jit function fn compiled for sm_90
    with these constexprs: arguments typed from `pointers` (else fp32 for limit / alpha, i32),
    those not in `not_divisible` marked divisible by 16; source_cls: Gluon's for its kernels."""
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        else:
            sig[name] = pointers.get(name, "fp32" if name in ("limit", "alpha") else "i32")
    divisible = [
        i for i, n in enumerate(fn.arg_names) if sig[n] != "constexpr" and n not in not_divisible
    ]
    source = source_cls(fn, sig, const, attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", str(cubin)], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    regs = int(re.search(r"REG:(\d+)", usage).group(1))  # type: ignore[union-attr]
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))  # type: ignore[union-attr]
    return kernel, sass, regs, stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--float", action="store_true", help="float activations (INT8=0)")
    parser.add_argument("--delta", choices=("none", "nvfp4"), default="none")
    parser.add_argument("--sub", type=int, default=16, help="rows per sub-tile (block_n / 4)")
    parser.add_argument("--block-k", type=int, default=512)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--group", type=int, default=32, help="q2s group (columns per scale)")
    parser.add_argument("--even", type=int, default=1, help="EVEN constexpr (whole tiles)")
    parser.add_argument("--group-acc", type=int, default=0, help="GROUP_ACC constexpr")
    parser.add_argument("--prefetch-l2", type=int, default=0, help="PREFETCH_L2 constexpr")
    parser.add_argument("--pdl", type=int, default=0, help="PDL constexpr")
    parser.add_argument("--quant-in", type=int, default=0, help="QUANT_IN constexpr (gate_up)")
    parser.add_argument("--depth", type=int, default=1, help="DEPTH constexpr (tiles ahead)")
    parser.add_argument("--pipe", type=int, default=0, help="PIPE constexpr (loop stages)")
    parser.add_argument("--pipe-x", type=int, default=0,
                        help="1: loop stages 2 with PIPE 0 (KernelChoice.pipe_x)")  # fmt: skip
    parser.add_argument("--down", action="store_true", help="the down launch (IS_DOWN=1)")
    parser.add_argument("--row-tiles", type=int, default=1, help="ROW_TILES constexpr")
    parser.add_argument("--next-l2", type=int, default=0, help="NEXT_L2 constexpr (gate_up)")
    parser.add_argument("--unroll", type=int, default=1, help="UNROLL (K loop unroll factor)")
    parser.add_argument("--split", type=int, default=1, help="SPLIT constexpr (K ranges)")
    parser.add_argument("--pairs", type=int, default=1, help="PAIRS constexpr (pairs a program)")
    parser.add_argument("--maxnreg", type=int, help="register cap per thread (ptxas maxnreg)")
    parser.add_argument("--trace", type=int, default=0, help="TRACE constexpr (timer stamps)")
    parser.add_argument("--delta-ahead", type=int, default=0, help="DELTA_AHEAD constexpr")
    parser.add_argument("--wait-first", type=int, default=0, help="WAIT_FIRST (with --pdl 1)")
    parser.add_argument("--dump", type=Path, help="write the K loop's SASS here")
    args = parser.parse_args()
    fn = q2s_gemv._q2s_gemv_kernel
    int8 = 0 if args.float else 1
    dkind = blob_decode.NVFP4 if args.delta == "nvfp4" else -1
    const = dict(GROUP=args.group, DKIND=dkind, DGROUP=16, BIAS=0, ACT=0,
                 IS_DOWN=int(args.down), TOPK=8, SUB=args.sub, BLOCK_K=args.block_k,
                 INT8=int8, ASM=1,
                 QUANT_OUT=int(int8 and (args.sub % 16 == 0 or args.sub == 8)), EVEN=args.even,
                 GROUP_ACC=args.group_acc, PREFETCH_L2=args.prefetch_l2,
                 PDL=args.pdl, QUANT_IN=args.quant_in, DEPTH=args.depth, PIPE=args.pipe,
                 LOOP_STAGES=args.pipe or (2 if args.pipe_x else None),
                 SPLIT=args.split, PAIRS=args.pairs, PAIRS_P2=64,
                 ROW_TILES=args.row_tiles, NEXT_L2=args.next_l2,
                 UNROLL=args.unroll if args.unroll > 1 else None,
                 DELTA_AHEAD=args.delta_ahead, TRACE=args.trace,
                 WAIT_FIRST=args.wait_first)  # fmt: skip
    kernel, sass, regs, stack = compile_sm90(
        fn, const, POINTERS, NOT_DIVISIBLE, {"num_warps": args.warps, "maxnreg": args.maxnreg}
    )
    lines = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", line).split(";")[0].strip()
             for line in sass.splitlines()]  # fmt: skip
    # (a fence may be predicated: the atomics it orders run on one thread)
    fences = sum(re.sub(r"^@!?P\d\s+", "", op).startswith("MEMBAR") for op in lines if op)
    # the K loop: from the label its backward branch targets to that branch
    branches = [(i, m.group(1)) for i, line in enumerate(lines)
                if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line))]  # fmt: skip
    labels = {line[:-1]: i for i, line in enumerate(lines) if line.startswith(".L_x_")}
    start, end = max(((labels[t], i) for i, t in branches if labels.get(t, i) < i),
                     key=lambda r: r[1] - r[0])  # fmt: skip
    # split the loop body into the straight path and the blocks a forward branch jumps over
    # (runtime conditions: the fitted grid, the delta)
    straight, blocks, block, skip = [], [], [], None
    for line in lines[start + 1 : end + 1]:
        m = re.search(r"@!?P\d BRA `\((\.L_x_\d+)\)", line)
        if skip is None and m and labels.get(m.group(1), 0) > labels.get(line, -1):
            skip, block = m.group(1) + ":", []
            straight.append(line)  # the branch itself is on every path
            continue
        if skip is not None and line == skip:
            blocks.append(block)
            skip = None
            continue
        if line and not line.startswith("."):
            (block if skip is not None else straight).append(line)
    delta_blocks = [b for b in blocks if any(op.split()[0] == "PRMT" for op in b)]
    fitted_blocks = [b for b in blocks if b not in delta_blocks]
    body = straight + [op for b in blocks for op in b]
    ops = collections.Counter(re.sub(r"^@!?P\d\s+", "", op).split()[0].split(".")[0]
                              for op in straight)  # fmt: skip
    weights = 4 * args.sub * args.block_k // (32 * args.warps)  # per thread per K step

    def per_weight(extra: list[list[str]]) -> float:
        return round((len(straight) + sum(len(b) for b in extra)) / weights, 3)

    if args.dump:
        args.dump.write_text("\n".join(lines[start : end + 1]) + "\n")
        args.dump.with_suffix(".ttgir").write_text(kernel.asm["ttgir"])  # layouts, conversions
    print(json.dumps({"case": "sass", "int8": bool(int8), "delta": args.delta, "sub": args.sub,
                      "block_k": args.block_k, "warps": args.warps, "group": args.group,
                      "even": args.even, "group_acc": args.group_acc, "depth": args.depth,
                      "pipe": args.pipe, "pipe_x": args.pipe_x,
                      "shared_bytes": kernel.metadata.shared,
                      "registers": regs, "stack_bytes": stack,
                      "fences": fences,
                      "loop_instructions": len(straight), "weights_per_thread": weights,
                      "per_weight": per_weight([]),
                      "per_weight_fitted": per_weight(fitted_blocks),
                      "per_weight_delta": per_weight(delta_blocks),
                      "per_weight_all": round(len(body) / weights, 3),
                      "top_ops": dict(ops.most_common(10))}))  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
