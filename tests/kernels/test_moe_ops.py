"""The public experts op: schema/fake checks (torch.library.opcheck) and CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from moetier.config import ExpertActivation
from moetier.core.layout import fp4_expert_format, q2s_expert_format
from moetier.kernels.moe_ops import format_id, moe_experts
from moetier.kernels.moe_ref import moe_slots_ref
from moetier.quant.synthetic import random_blob

HIDDEN, INTER, EXPERTS = 64, 32, 6


def op_args(device: str, tokens: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    fmt = q2s_expert_format(HIDDEN, INTER, False, 32, 16)
    delta = fp4_expert_format("nvfp4", HIDDEN, INTER, False)
    slot_bytes = 4096 * ((max(fmt.nbytes, delta.nbytes) + 4095) // 4096)
    pool = torch.zeros(2 * EXPERTS, slot_bytes, dtype=torch.uint8)
    for s in range(EXPERTS):
        random_blob(fmt, gen, pool[s])
        random_blob(delta, gen, pool[EXPERTS + s])
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:2] for _ in range(tokens)])
    return dict(
        hidden=torch.randn(tokens, HIDDEN, generator=gen).to(device),
        topk_ids=ids.to(device),
        topk_weights=torch.rand(tokens, 2, generator=gen).to(device),
        slot_table=torch.arange(EXPERTS, dtype=torch.int32).to(device),
        slot_offsets=(torch.arange(2 * EXPERTS, dtype=torch.int64) * slot_bytes).to(device),
        pool=pool.to(device),
        out=torch.zeros(tokens, 2, HIDDEN, device=device),
        delta_mask=(torch.rand(tokens, 2, generator=gen) < 0.5).to(device),
        delta_table=(torch.arange(EXPERTS, dtype=torch.int32) + EXPERTS).to(device),
        base_format=format_id(fmt),
        delta_format=format_id(delta),
        activation="silu",
        act_alpha=1.702,
        act_limit=7.0,
    ), (fmt, delta)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_opcheck_cpu(zero_copy):
    args, _ = op_args("cpu")
    torch.library.opcheck(moe_experts, (), {**args, "zero_copy": zero_copy})


def test_op_matches_ref_cpu():
    args, (fmt, delta) = op_args("cpu", seed=1)
    moe_experts(**args)
    ref = torch.zeros_like(args["out"])
    moe_slots_ref(
        args["hidden"], args["topk_ids"], args["topk_weights"], args["slot_table"], args["pool"],
        fmt, ExpertActivation(), ref, delta_mask=args["delta_mask"],
        delta_table=args["delta_table"], delta_fmt=delta,
    )  # fmt: skip
    assert torch.equal(args["out"], ref)


@pytest.mark.gpu
def test_opcheck_cuda():
    args, _ = op_args("cuda")
    torch.library.opcheck(moe_experts, (), args)


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    """A decode MoE step captured once replays correctly for new routing and hidden states."""
    args, _ = op_args("cuda", tokens=2, seed=2)
    static = {k: v for k, v in args.items()}
    moe_experts(**static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_experts(**static)
    for seed in (3, 4, 5):
        fresh, _ = op_args("cuda", tokens=2, seed=seed)
        for name in ("hidden", "topk_ids", "topk_weights", "delta_mask"):
            static[name].copy_(fresh[name])
        static["out"].zero_()
        graph.replay()
        eager = dict(fresh)
        eager["pool"] = static["pool"]  # the graph reads the pool it captured
        eager["out"] = torch.zeros_like(static["out"])
        moe_experts(**eager)
        torch.cuda.synchronize()
        assert torch.equal(static["out"], eager["out"])


def test_sum_pairs_is_the_sum_over_experts_and_compiles_with_dynamic_rows():
    from moetier.kernels.moe_ops import sum_pairs
    from moetier.models.experts import _sum_pairs

    out = torch.randn(5, 8, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sum_pairs(out, torch.bfloat16), out.sum(dim=1).to(torch.bfloat16))
    step = torch.compile(lambda o: _sum_pairs(o, torch.float32) * 2.0, dynamic=True)
    for rows in (1, 3, 7):
        x = torch.randn(rows, 8, 16)
        torch.testing.assert_close(step(x), x.sum(dim=1) * 2.0)
