"""The fused launch's host-row stall (docs/benchmarks.md, "q2s decode studies that did not
land"): with `q2s-gluon-fused-preload-study.patch` applied, on the GPU, from the repo root:
`PYTHONPATH=$PWD python3 docs/bench/fused-host-stall-study.py`. Times three fused calls of 33
tokens (top-4 of 16 experts, 512 x 256) per config, with 10 experts in pinned host rows or
none, and prints whether each matched the twin (run_case) and its seconds: a call whose down
programs gave up waiting (2 s) has NaN rows and fails."""

import sys
import time

import torch

sys.path.insert(0, "tests/kernels")
import test_moe_triton as T  # noqa: E402

from moetier.kernels import moe_dispatch  # noqa: E402

for bn, bk, w, pipe, qi, dbn, dbk, host in [
    (64, 512, 8, 2, False, 128, 512, 10), (64, 512, 8, 2, False, 128, 512, 0),
    (64, 512, 8, 0, False, 128, 512, 10), (64, 512, 8, 2, True, 128, 512, 10),
    (64, 512, 4, 2, False, 128, 512, 10),
]:  # fmt: skip
    c = moe_dispatch.KernelChoice(block_n=bn, block_k=bk, num_warps=w, int8_act=True, pdl=False,
                                  gluon=True, pipe=pipe, quant_in=qi, fused=True)  # fmt: skip
    d = moe_dispatch.KernelChoice(block_n=dbn, block_k=dbk, num_warps=w, int8_act=True,
                                  pdl=False, gluon=True)  # fmt: skip
    out = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            T.run_case("q2s", 33, 4, 16, 512, 256, host_slots=host, seed=33, force=(c, d))
            r = "ok"
        except AssertionError:
            r = "FAIL"
        out.append(f"{r} {time.perf_counter() - t:.3f}s")
    print((bn, bk, w, pipe, qi, dbn, dbk, host), out, flush=True)
