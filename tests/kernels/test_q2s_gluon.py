"""The Gluon q2s GEMV study kernel (`moetier/kernels/q2s_gluon.py`) compiles for sm_90 here
(`bench/studies/gluon_sass.py`: Triton's bundled ptxas, no GPU; outside the interpreter the
CPU tests run in). Its GPU test against the twin is
`test_moe_triton.test_gpu_gluon_matches_twin`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")
from moetier.kernels import moe_dispatch, q2s_gluon  # noqa: E402

STUDIES = Path(__file__).parents[2] / "bench" / "studies"


@pytest.mark.parametrize(
    "args",
    [
        ["--k", "7168", "--group", "32", "--block-n", "128", "--warps", "8"],  # DeepSeek-V3 gate_up
        [
            "--k",
            "7168",
            "--group",
            "32",
            "--block-n",
            "128",
            "--warps",
            "8",
            "--quant-in",
            "1",
            "--quant-out",
            "1",
            "--stages",
            "2",
        ],  # x and h rounded in the kernel, a cp.async ring
        ["--down", "--k", "2048", "--group", "16", "--block-n", "64", "--warps", "4"],  # its down
        # gate_up with the timer stamps of a study (bench/studies/timeline.py)
        "--k 7168 --block-n 128 --warps 8 --pdl 1 --quant-in 1 --quant-out 1 --trace 1".split(),
        # Qwen3-30B-A3B's 1-token gate_up (H200 `:p8`): down's weights asked of L2 in its loop
        "--k 2048 --block-n 32 --block-k 1024 --warps 4 --quant-in 1 --quant-out 1 "
        "--next-l2-at 2".split(),
        # DeepSeek-V3's 1-token gate_up (`:p8`): waits before it reads anything (wait_first)
        "--k 7168 --block-n 128 --warps 8 --pdl 1 --quant-in 1 --quant-out 1 "
        "--wait-first 1".split(),
    ],
    ids=[
        "gate_up",
        "gate_up_rounding_ring",
        "down",
        "gate_up_traced",
        "gate_up_next_l2",
        "gate_up_wait_first",
    ],
)
def test_compiles_for_sm90_with_vector_loads(args):
    """DeepSeek-V3's tiles: no spills, at most 128 registers (two 8-warp or four 4-warp
    programs an SM), words in 16-byte loads, activations from shared memory, four IDP4A a
    word (16 words a thread a K tile, and the fitted grid's pass)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CPU tests set it
    out = subprocess.run([sys.executable, str(STUDIES / "gluon_sass.py"), *args],
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads(out.stdout.splitlines()[-1])
    assert rec["stack_bytes"] == 0 and rec["registers"] <= 128, rec
    assert rec["ldg128"] > 0 and rec["lds128"] > 0 and rec["idp4a"] >= 2 * 64, rec


def test_tile_refuses_what_it_cannot_run():
    gu = moe_dispatch.KernelChoice(block_n=128, block_k=512, num_warps=8, gluon=True)
    assert q2s_gluon.tile(7168, 32, gu) == (64, 32, 2, 4)
    with pytest.raises(ValueError, match="groups of 64"):
        q2s_gluon.tile(4096, 64, gu)
    with pytest.raises(ValueError, match="divides"):
        q2s_gluon.tile(16 * 40, 16, gu)  # 40 words: no tile of 16-128 words divides it
    with pytest.raises(ValueError, match="block_n"):
        q2s_gluon.tile(2048, 16, replace(gu, block_n=48, num_warps=4))


@pytest.mark.parametrize(
    "args",
    [
        "--k 4096 --block-n 64 --warps 8 --pdl 1 --quant-in 1 --quant-out 1".split(),
        "--down --k 2048 --block-n 64 --warps 8 --pdl 1".split(),
        "--down --k 2048 --block-n 64 --warps 8 --pdl 1 --prime 1".split(),
    ],
    ids=["gate_up", "down", "down_primed"],
)
def test_register_cap_asks_for_the_next_tile_at_the_loops_top(args):
    """DeepSeek-V4-Flash's 1-2 token launches (H200 configs `:p6`, `:p12`): with the register
    cap of 80 their configs set, ptxas issues the next K tile's loads in the first quarter of
    the K loop (uncapped it issued them near its middle: a shorter look-ahead; H200, 1-2
    tokens: 0.95-1.00x the time a call, docs/benchmarks.md), and three programs of 8 warps
    still fit an SM, down's too with its second K tile asked for before its wait (`prime`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(STUDIES / "gluon_sass.py"), "--block-k", "512", "--maxnreg", "80"]
    out = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads(out.stdout.splitlines()[-1])
    loop = rec["k_loop"]
    assert rec["stack_bytes"] == 0 and rec["registers"] <= 80, rec
    assert len(loop["ldg_at"]) == 4 and max(loop["ldg_at"]) < loop["instructions"] // 4, rec


@pytest.mark.parametrize(
    ("args", "prefetches"),
    [
        # Qwen3-30B-A3B's 1-token gate_up (H200 `:p8`): its gate rows and up rows, words and
        # scales each (next_l2's one prefetch of down's share comes on top)
        ("--k 2048 --block-n 32 --block-k 1024 --warps 4 --quant-in 1 --quant-out 1 "
         "--wait-first 1 --next-l2-at 2 --prefetch-l2 1", 5),
        ("--k 2048 --block-n 32 --block-k 1024 --warps 4 --quant-in 1 --quant-out 1 "
         "--wait-first 1 --next-l2-at 2", 1),
        ("--down --k 768 --group 16 --block-n 64 --block-k 256 --warps 4 --prefetch-l2 1", 2),
    ],
    ids=["gate_up", "gate_up_without", "down"],
)  # fmt: skip
def test_prefetch_l2_asks_for_each_row_span_once(args, prefetches):
    """prefetch_l2 compiles to one bulk L2 prefetch a contiguous span of the program's rows
    (gate_up: gate and up rows, their words and scales; down: its rows' words and scales),
    with no spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(STUDIES / "gluon_sass.py"), *args.split()],
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads(out.stdout.splitlines()[-1])
    assert rec["l2_prefetch"] == prefetches and rec["stack_bytes"] == 0, rec
    assert rec["registers"] <= 128, rec
