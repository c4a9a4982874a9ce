"""The q2s decode GEMV grouped by expert (`q2s_gemv_grouped`): its grouping of a call's pairs
against a Python reference, and its outputs against the twin `moe_slots_ref(..., act_int8=True)`
(through `moe_slots_triton`, as the per-pair kernel's tests check it: `run_case`), on CPU under
Triton's interpreter with small shapes, and on the device sweeping 2-64 tokens with slots in
pinned host memory."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from moetier.kernels import moe_dispatch, q2s_gemv_grouped  # noqa: E402
from tests.kernels.test_moe_triton import DEVICE, run_case  # noqa: E402

GROUPED = replace(moe_dispatch.Q2S_GROUPED, block_n=64, block_k=64, group_acc=False)


def _reference_groups(ids: list[int], present: list[bool], block_t: int) -> list[list[int]]:
    """Pairs grouped by expert (expert order, pair order within), block_t at most a group."""
    out = []
    for e in sorted(set(ids)):
        if not present[e]:
            continue
        members = [p for p, x in enumerate(ids) if x == e]
        out += [members[i : i + block_t] for i in range(0, len(members), block_t)]
    return out


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_t"),
    [(7, 2, 5, 2), (3, 4, 16, 4), (16, 8, 9, 8), (1, 8, 128, 4)],
)
def test_group_pairs_match_python(tokens, top_k, experts, block_t):
    """The device grouping (a sort and a segmented scan in one program) equals a plain Python
    grouping; experts without a slot are left out, unused groups are all -1, and the table
    has `max_groups` rows (the grid's bound is never exceeded)."""
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    present = torch.rand(experts, generator=gen) < 0.8
    present[ids[0, 0]] = True
    table = torch.where(present, torch.arange(experts, dtype=torch.int32), -1).to(torch.int32)
    groups = q2s_gemv_grouped.group_pairs(ids.to(DEVICE), table.to(DEVICE), block_t).cpu()
    want = _reference_groups(ids.reshape(-1).tolist(), present.tolist(), block_t)
    assert groups.shape == (q2s_gemv_grouped.max_groups(ids.numel(), experts, block_t), block_t)
    got = [[p for p in row if p >= 0] for row in groups.tolist()]
    assert got[: len(want)] == want
    assert all(not row for row in got[len(want) :])
    assert all(p == -1 for row in groups.tolist() for p in row[len(row) - row.count(-1) :])


def test_grouped_matches_twin_with_shared_experts():
    """7 tokens of top-2 over 5 experts (about 3 pairs an expert, groups of 2: experts with
    more pairs than BLOCK_T take several programs), slots scattered in the pool, some experts
    without a slot, fitted and b = 3a grids (even / odd experts)."""
    c = replace(GROUPED, group_pairs=2)
    run_case("q2s", 7, 2, 5, 64, 32, force=(c, c), seed=1, present_frac=0.7)


def test_grouped_one_expert_everywhere_bias_and_group_sums():
    """Every token routes to expert 0 (one group of 4 and one of 1), gpt-oss's clamped
    activation with biases, sums kept per q2s group (`group_acc`), groups of 2 words."""
    c = replace(GROUPED, group_pairs=4, group_acc=True)
    run_case("q2s", 5, 2, 4, 128, 64, one_expert=True, act="gpt_oss", bias=True, force=(c, c),
             seed=2)  # fmt: skip


def test_grouped_ragged_tiles_float_h():
    """Ragged K tiles (gate_up's 96 columns in tiles of 64: EVEN off) and 8-row sub-tiles: h
    is written as float and rounded by a launch (no QUANT_OUT); groups of 8."""
    c = replace(GROUPED, block_n=32, group_pairs=8)
    run_case("q2s", 6, 2, 3, 96, 64, force=(c, c), seed=3)


def test_dispatcher_groups_only_shared_multi_token_calls():
    """One token never groups; a delta plane never does (the per-pair kernel keeps it); the
    expected sharing sets it on (more readily when rows are read zero-copy) and BLOCK_T."""
    choose = moe_dispatch.choose_q2s_grouped
    shapes = ((1536, 2048), (2048, 768))
    assert choose(1, 8, 128, shapes) is None
    assert choose(2, 8, 128, shapes) is None  # 16 pairs over ~15.5 experts
    assert choose(4, 8, 128, shapes) is None
    assert choose(4, 8, 128, shapes, zero_copy=True) is None  # ~1.1 pairs an expert
    assert choose(16, 8, 128, shapes) is None  # resident: the per-pair GEMV is faster
    sixteen = choose(16, 8, 128, shapes, zero_copy=True)
    assert sixteen is not None and sixteen[0].group_pairs == sixteen[1].group_pairs == 4
    sixty_four = choose(64, 8, 128, shapes)
    assert sixty_four is not None and sixty_four[1].group_pairs == 8
    assert choose(65, 8, 128, shapes) is None  # 520 pairs: q2s_mma
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 4, 16, 64):  # against the mean of random top-8 routings
        distinct = [
            len(set(torch.cat([torch.randperm(128, generator=gen)[:8] for _ in range(tokens)])
                    .tolist()))
            for _ in range(200)
        ]  # fmt: skip
        sampled = tokens * 8 / (sum(distinct) / len(distinct))
        assert moe_dispatch.expected_sharing(tokens, 8, 128) == pytest.approx(sampled, rel=0.02)


def test_moe_slots_triton_takes_grouped_path(monkeypatch):
    """Without a forced choice, a call with shared experts runs the grouped kernel (its
    config is returned) and still equals the twin; with a delta plane it stays per pair."""
    calls = []
    real = q2s_gemv_grouped.q2s_gemv_grouped
    monkeypatch.setattr(q2s_gemv_grouped, "q2s_gemv_grouped",
                        lambda *a: calls.append(1) or real(*a))  # fmt: skip
    run_case("q2s", 6, 2, 3, 64, 32, seed=4)  # 12 pairs over 3 experts
    assert calls
    calls.clear()
    run_case("q2s+nvfp4", 6, 2, 3, 64, 32, mask="random", seed=5)
    assert not calls


# ---- on the device ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [2, 4, 16, 32, 64])
@pytest.mark.parametrize("block_t", [2, 4, 8])
def test_gpu_grouped_sweep(tokens, block_t):
    """Compiled for real (IDP4A by inline assembly), 2-64 tokens of top-8 over 32 experts
    (heavy sharing), slots in the GPU pool and 12 in pinned host memory (zero-copy), whole
    and ragged tiles, float32 and bfloat16 activations, with and without group sums."""
    for gacc in (False, True):
        c = replace(moe_dispatch.Q2S_GROUPED, group_pairs=block_t, group_acc=gacc)
        for dtype in (torch.float32, torch.bfloat16):
            run_case("q2s", tokens, 8, 32, 256, 128, dtype=dtype, host_slots=12, seed=tokens,
                     force=(c, c), present_frac=0.9)  # fmt: skip
        run_case("q2s", tokens, 8, 16, 96, 96, host_slots=5, seed=tokens + 1,
                 force=(replace(c, block_n=32), replace(c, block_n=32)))  # fmt: skip


@pytest.mark.gpu
def test_gpu_grouped_default_dispatch_and_graph():
    """The dispatcher's own choice at 16 and 64 tokens of top-8 over 128 experts (the
    Qwen3-30B-A3B routing shape; some slots host rows), and the op replayed from a CUDA graph
    with new routing equals a fresh call (no host sync, fixed buffers)."""
    for tokens in (16, 64):
        run_case("q2s", tokens, 8, 128, 256, 128, host_slots=40, seed=tokens)
    from moetier.config import ExpertActivation
    from moetier.kernels.moe_triton import moe_slots_triton
    from tests.kernels.test_moe_triton import Pool, formats

    gen = torch.Generator().manual_seed(0)
    fmt, _ = formats(256, 128)["q2s"]
    pool = Pool(fmt, None, 32, torch.ones(32, dtype=torch.bool), gen, host_slots=8)
    dev_pool, offsets, table, _ = pool.device_args()
    act = ExpertActivation(kind="silu")
    x = torch.randn(16, 256, device="cuda")
    ids = torch.randint(0, 32, (16, 8), device="cuda")
    w = torch.rand(16, 8, device="cuda")
    out = torch.zeros(16, 8, 256, device="cuda")
    c = replace(moe_dispatch.Q2S_GROUPED, group_pairs=4)

    def call():
        moe_slots_triton(x, ids, w, table, dev_pool, fmt, act, out, slot_offsets=offsets,
                         choice=(c, c))  # fmt: skip

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    ids.copy_(torch.randint(0, 32, (16, 8), device="cuda"))
    x.copy_(torch.randn(16, 256, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    call()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)


_COMPILE = """
import json, sys
sys.path.insert(0, "bench/studies")
from sass_count import compile_sm90
from moetier.kernels import q2s_gemv_grouped as g
ptrs = {n: t for n, t in (("groups", "*i32"), ("topk_ids", "*i64"), ("topk_w", "*fp32"),
        ("pool", "*u8"), ("slot_table", "*i32"), ("slot_offsets", "*i64"), ("out", "*fp32"),
        ("xq", "*i32"), ("xs", "*fp32"), ("xsum", "*i32"), ("oq", "*i32"), ("osc", "*fp32"),
        ("osum", "*i32"))}
loose = {"limit", "alpha", "topk_ids", "topk_w", "slot_table", "slot_offsets", "in_bias",
         "out_bias", "N", "INTER", "groups"}
for bt, down, gacc, even in ((4, 0, 1, 1), (8, 1, 1, 1), (8, 0, 0, 0)):
    const = dict(GROUP=32, BIAS=0, ACT=0, IS_DOWN=down, TOPK=8, SUB=16, BLOCK_K=256, BT=bt,
                 ASM=1, QUANT_OUT=1 - down, EVEN=even, GROUP_ACC=gacc)
    _, _, regs, stack = compile_sm90(g._q2s_grouped_kernel, const, ptrs, loose,
                                     {"num_warps": 4})
    print(json.dumps({"bt": bt, "down": down, "registers": regs, "stack_bytes": stack}))
for bt in (4, 8):  # the grouping kernel (globals it reads must be constexprs, unlike interpreted)
    compile_sm90(g._group_kernel, dict(P2=512, BT=bt, FILL=1024),
                 {"topk_ids": "*i64", "slot_table": "*i32", "groups": "*i32"},
                 {"topk_ids", "slot_table", "groups", "P", "n_entries"}, {"num_warps": 4})
"""


def test_grouped_kernel_compiles_for_sm90_without_spills():
    """The default tiles (16-row sub-tiles, K tiles of 256, 4 warps) compile for sm_90 with
    Triton's bundled ptxas (no GPU needed) with no stack (spills) at BLOCK_T 4 and 8: the
    interpreter checks none of what the compiler does."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True,
                         env=env, cwd=root)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    recs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(recs) == 3
    assert all(r["stack_bytes"] == 0 and r["registers"] <= 255 for r in recs), recs
