"""The q2s GEMV kernel compiles for sm_90 (here, without a GPU: `bench/studies/sass_count.py` runs
Triton's compiler and its bundled ptxas) in each of its constexpr paths, without spilling.
Triton's interpreter, which the CPU tests run the kernel in, does not check what the compiler
checks (a loop-carried variable keeping its type, for one: the float path once re-used a
name the look-ahead carries, which only the H200 caught)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
STUDIES = ROOT / "bench" / "studies"

VARIANTS = [
    ["--float"],
    ["--float", "--depth", "2"],
    ["--delta", "nvfp4", "--even", "0"],
    ["--depth", "2", "--prefetch-l2", "1", "--pdl", "1"],
    ["--pipe", "3", "--quant-in", "1"],
    ["--pipe-x", "1", "--group-acc", "1", "--sub", "32", "--warps", "8"],
    ["--split", "2", "--depth", "2", "--quant-in", "1"],
    ["--split", "2", "--delta", "nvfp4", "--even", "0"],
    ["--pairs", "2", "--group-acc", "1", "--pipe-x", "1"],
    ["--pairs", "2", "--depth", "2", "--even", "0", "--pdl", "1"],
    # the H200 tables' row-tile configs (DeepSeek-V3 gate_up, DeepSeek-V4-Flash both launches)
    ["--row-tiles", "2", "--group-acc", "1", "--sub", "32", "--warps", "8", "--maxnreg", "128"],
    ["--down", "--row-tiles", "2", "--group-acc", "1", "--sub", "32", "--warps", "8"],
    # gate_up asking L2 for down's weights when done; the K loop unrolled
    ["--next-l2", "1", "--unroll", "2", "--pdl", "1", "--group-acc", "1", "--sub", "32"],
    ["--unroll", "2", "--depth", "2", "--even", "0"],
    # the timer stamps of a study (bench/studies/timeline.py)
    ["--trace", "1", "--pdl", "1", "--quant-in", "1", "--sub", "8", "--block-k", "1024"],
    # a call's first launch waiting before it reads anything (wait_first)
    ["--wait-first", "1", "--pdl", "1", "--quant-in", "1", "--group-acc", "1"],
]


@pytest.mark.parametrize("args", VARIANTS, ids=lambda a: "".join(a).replace("--", "_"))
def test_q2s_gemv_compiles_for_sm90(args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CPU tests set it
    out = subprocess.run([sys.executable, str(STUDIES / "sass_count.py"), *args],
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads(out.stdout.splitlines()[-1])
    assert rec["stack_bytes"] == 0 and rec["registers"] <= 255
    assert rec["loop_instructions"] > 0
    # one fence at most: split-K's arrival count (acq_rel); its partial sums' atomics are
    # relaxed (an acq_rel atomic each cost a fence and an L1 flush: H200, DeepSeek-V3 down at
    # one token 17.7 -> 34.8 us)
    assert rec["fences"] <= ("--split" in args)


def test_quant_words_kernel_compiles_for_sm90_with_pdl_wait():
    """`_quant_words_kernel` with WAIT (launched with programmatic dependent launch) compiles
    for sm_90 and waits (griddepcontrol.wait) before it lets the next launch start
    (griddepcontrol.launch_dependents)."""
    script = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetier.kernels import int8_words
fn = int8_words._quant_words_kernel
const = {"BLOCK_W": 64, "PDL": 1, "WAIT": 1}
sig = {n: "constexpr" if n in const else ("*fp32" if n == "x_ptr" else "*i32" if n in
       ("xq", "xsum", "xqn") else "*fp32" if n == "xs" else "i32") for n in fn.arg_names}
k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32))
ptx = k.asm["ptx"]
print(ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents"))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "True"
