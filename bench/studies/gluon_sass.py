"""The Gluon q2s GEMV kernel (`moetier/kernels/q2s_gluon.py`) compiled here for sm_90 (no GPU:
Triton's bundled ptxas, through `sass_count.compile_sm90`): one JSON line with its registers,
stack, shared memory and the SASS counts of its words' loads (LDG, or LDGSTS: cp.async),
shared-memory loads and IDP4A, and where in its K loop the next tile's global loads are
issued (`k_loop`: the loop's instructions and the index of each LDG in it; ptxas may place
them well after the loop's top, which shortens how far ahead they are asked for). Run without
TRITON_INTERPRET."""

from __future__ import annotations

import argparse
import json
import re

import triton
from sass_count import compile_sm90
from triton.experimental.gluon._runtime import GluonASTSource

from moetier.kernels import moe_dispatch, q2s_gluon

POINTERS = {"x_ptr": "*bf16", "xq": "*i32", "xs": "*fp32", "xsum": "*i32", "topk_ids": "*i64",
            "topk_w": "*fp32", "pool": "*u8", "slot_table": "*i32", "slot_offsets": "*i64",
            "out": "*fp32", "oq": "*i32", "osc": "*fp32", "osum": "*i32",
            "trace": "*i64"}  # fmt: skip
NOT_DIVISIBLE = {"limit", "alpha", "stride_xk", "topk_ids", "topk_w", "slot_table",
                 "slot_offsets", "N", "INTER"}  # fmt: skip


def k_loop(sass: str) -> dict[str, object]:
    """The first loop (a backward branch) holding IDP4A: its instruction count and the index of
    each global load (LDG) in it."""
    lines = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)
             or re.match(r"\s*\.L_x_\d+:", line)]  # fmt: skip
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"\s*\.(L_x_\d+):", line))}  # fmt: skip
    for i, line in enumerate(lines):
        m = re.search(r"BRA.*\.(L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i:
            body = [x for x in lines[labels[m.group(1)] : i + 1] if "/*" in x]
            if any("IDP" in x for x in body):
                ldg = [j for j, x in enumerate(body) if "LDG" in x]
                return {"instructions": len(body), "ldg_at": ldg}
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--down", action="store_true", help="the down launch (IS_DOWN=1)")
    parser.add_argument("--k", type=int, default=7168, help="the matrix's K")
    parser.add_argument("--group", type=int, default=32, help="q2s group (columns per scale)")
    parser.add_argument("--block-n", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=512)
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--pdl", type=int, default=1)
    parser.add_argument("--stages", type=int, default=1, help="STAGES (KernelChoice.pipe)")
    parser.add_argument("--prime", type=int, default=0, help="PRIME (KernelChoice.prime)")
    parser.add_argument("--next-l2-at", type=int, default=-1,
                        help="NEXT_L2 with NEXT_AT (KernelChoice.next_l2_at); -1: off")  # fmt: skip
    parser.add_argument("--maxnreg", type=int, help="register cap per thread (ptxas maxnreg)")
    parser.add_argument("--quant-in", type=int, default=0, help="QUANT_IN (gate_up rounds x)")
    parser.add_argument("--trace", type=int, default=0, help="TRACE (timer stamps)")
    parser.add_argument("--quant-out", type=int, default=0, help="QUANT_OUT (gate_up rounds h)")
    parser.add_argument("--wait-first", type=int, default=0, help="WAIT_FIRST (with --pdl 1)")
    parser.add_argument("--prefetch-l2", type=int, default=0, help="PREFETCH_L2")
    args = parser.parse_args()
    choice = moe_dispatch.KernelChoice(block_n=args.block_n, block_k=args.block_k,
                                       num_warps=args.warps, int8_act=True, gluon=True)  # fmt: skip
    r, w, rpt, tr = q2s_gluon.tile(args.k, args.group, choice)
    nt = args.k // 16 // w
    wpg = args.group // 16
    fn = q2s_gluon._q2s_gemv_gluon_kernel
    const = dict(ACT=0, IS_DOWN=int(args.down), TOPK=8, R=r, W=w, NT=nt,
                 NTP=triton.next_power_of_2(nt), WPG=wpg,
                 RPT=rpt, TR=tr, NW=args.warps, PDL=args.pdl, STAGES=args.stages,
                 QUANT_IN=args.quant_in, QUANT_OUT=args.quant_out,
                 NEXT_L2=int(args.next_l2_at >= 0), NEXT_AT=max(0, args.next_l2_at),
                 PRIME=args.prime, TRACE=args.trace,
                 WAIT_FIRST=args.wait_first, PREFETCH_L2=args.prefetch_l2)  # fmt: skip
    kernel, sass, regs, stack = compile_sm90(
        fn,
        const,
        POINTERS,
        NOT_DIVISIBLE,
        {"num_warps": args.warps, "maxnreg": args.maxnreg},
        GluonASTSource,
    )
    print(json.dumps({
        "registers": regs, "stack_bytes": stack,
        "shared_bytes": kernel.metadata.shared,
        "ldg128": sass.count("LDG.E.128"), "lds128": sass.count("LDS.128"),
        "ldgsts": sass.count("LDGSTS"),
        "idp4a": sass.count("IDP.4A"), "l2_prefetch": sass.count("UBLKPF"),
        "tile": {"R": r, "W": w, "RPT": rpt, "TR": tr},
        "k_loop": k_loop(sass),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
