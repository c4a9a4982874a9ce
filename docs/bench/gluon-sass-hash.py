"""A check that a change to q2s_gluon.py leaves the Gluon kernel's code as it was: compiles
`_q2s_gemv_gluon_kernel` for sm_90 (Triton's bundled ptxas, no GPU, as bench/gluon_sass.py) at
five configs and prints each one's registers, shared memory and a hash of its SASS (addresses
and encodings dropped). Run before and after the change, from the repo root, Triton 3.6 first
on PYTHONPATH: `PYTHONPATH=<triton 3.6>:$PWD:bench python3 docs/bench/gluon-sass-hash.py`.
Configs: DeepSeek-V4-Flash's 1-token gate_up and down (H200 `:p6`), Qwen3-30B-A3B's 1-token
gate_up (`:p8`), a DeepSeek-V3 gate_up tile, a small one."""

import hashlib, json, sys, triton
sys.path.insert(0, "bench")
from sass_count import compile_sm90
from triton.experimental.gluon._runtime import GluonASTSource
from gluon_sass import POINTERS, NOT_DIVISIBLE
from moetier.kernels import moe_dispatch, q2s_gluon
cases = [  # k, group, block_n, block_k, warps, down, quant_in, quant_out, prime, maxnreg, next_at
 (4096, 32, 64, 512, 8, 0, 1, 1, 1, 80, -1),
 (2048, 16, 64, 512, 8, 1, 0, 0, 1, 80, -1),
 (2048, 32, 32, 1024, 4, 0, 1, 1, 0, None, 2),
 (7168, 32, 128, 512, 8, 0, 1, 1, 0, None, -1),
 (512, 32, 64, 256, 4, 0, 0, 1, 0, None, -1),
]
for k, group, bn, bk, w, down, qi, qo, prime, mx, nat in cases:
    c = moe_dispatch.KernelChoice(block_n=bn, block_k=bk, num_warps=w, int8_act=True, gluon=True)
    r, ww, rpt, tr = q2s_gluon.tile(k, group, c)
    nt = k // 16 // ww
    const = dict(ACT=0, IS_DOWN=down, TOPK=8, R=r, W=ww, NT=nt, NTP=triton.next_power_of_2(nt), WPG=group//16,
                 RPT=rpt, TR=tr, NW=w, PDL=1, STAGES=1, QUANT_IN=qi, QUANT_OUT=qo,
                 NEXT_L2=int(nat >= 0), NEXT_AT=max(0, nat), PRIME=prime, TRACE=0, WAIT_FIRST=0)
    kern, sass, regs, stack = compile_sm90(q2s_gluon._q2s_gemv_gluon_kernel, const, POINTERS, NOT_DIVISIBLE,
                                          {"num_warps": w, "maxnreg": mx}, GluonASTSource)
    body = "\n".join(l.split("*/", 1)[-1] for l in sass.splitlines() if "/*0" in l)
    print(k, bn, bk, down, regs, kern.metadata.shared, hashlib.sha1(body.encode()).hexdigest()[:12])
