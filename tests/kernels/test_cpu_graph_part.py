"""Hybrid misses inside the graph step (kernels/cpu/graph_part.py): the C entry point
`mt_host_pairs` over the device-side pack of a layer's flagged pairs, against the torch twin:
T 1..8 rows, pairs flagged and not, padding rows, a count of 0; its rows land in the [T, k, H]
output (zero for the other pairs) and its struct counts pairs and distinct blobs."""

from __future__ import annotations

import pytest
import torch

from moetier.config import ExpertActivation
from moetier.core.layout import q2s_expert_format
from moetier.kernels.cpu.build import load
from moetier.kernels.cpu.experts import cpu_experts_ref
from moetier.kernels.cpu.graph_part import CpuPart, _pack, cpu_part_join, cpu_part_start
from tests.kernels.test_cpu_experts import _pool

pytestmark = pytest.mark.skipif(load() is None, reason="no C compiler to build the CPU kernel")

EXPERTS = 6


def _part(fmt, k: int, hidden: int) -> CpuPart:
    return CpuPart({3: fmt}, ExpertActivation(), k, hidden, torch.device("cpu"))


@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8])
def test_packed_pairs_match_the_twin(tokens):
    hidden, inter, k = 96, 48, 3
    fmt = q2s_expert_format(hidden, inter, False, 32, 16)
    buf, addresses = _pool(fmt, EXPERTS, seed=tokens)
    part = _part(fmt, k, hidden)
    generator = torch.Generator().manual_seed(tokens)
    flags = torch.tensor([True, False, True, True, False, False])
    ids = torch.randint(0, EXPERTS, (tokens, k), generator=generator)
    ids[0, 0] = 0  # at least one flagged pair, one not
    ids[0, 1] = 1
    weights = torch.rand(tokens, k, generator=generator)
    x = torch.randn(tokens, hidden, generator=generator) * 2
    live = torch.ones(tokens, dtype=torch.bool)
    live[tokens // 2 + 1 :] = False  # padding rows from the middle on (none with one row)
    out = torch.full((tokens, k, hidden), 0.25)  # what the GPU kernel left (others' rows)
    before = part.counters()
    cpu_part_start(x, ids, weights, flags, addresses, live if tokens > 1 else None, part.ticket,
                   part.part_id, 3)  # fmt: skip
    cpu_part_join(out, part.ticket, part.part_id, 3)
    on_cpu = flags[ids] & (live[:, None] if tokens > 1 else True)
    token, kk = torch.where(on_cpu)
    want = torch.full((tokens, k, hidden), 0.25)
    rows = cpu_experts_ref(x, token, weights[token, kk], addresses[ids[token, kk]], fmt,
                           ExpertActivation(), act_int8=True)  # fmt: skip
    want[token, kk] += rows
    err = ((out - want).abs().max() / rows.abs().max()).item()
    assert err < 2e-5
    assert torch.equal(out[~on_cpu], torch.full_like(out[~on_cpu], 0.25))
    done = part.counters()
    assert done.pairs - before.pairs == int(on_cpu.sum())
    assert done.blobs - before.blobs == len(set(ids[on_cpu].tolist()))
    assert done.calls - before.calls == 1 and done.failed == 0


def test_count_zero_writes_zero_rows():
    hidden, inter, k = 64, 32, 2
    fmt = q2s_expert_format(hidden, inter, False, 32, 16)
    buf, addresses = _pool(fmt, EXPERTS, seed=1)
    part = _part(fmt, k, hidden)
    ids = torch.tensor([[1, 4], [5, 1]])
    flags = torch.zeros(EXPERTS, dtype=torch.bool)
    flags[0] = True  # flagged, but no pair routes to it
    x, weights = torch.randn(2, hidden), torch.rand(2, k)
    # a previous call's rows in the output buffer must not leak into this one
    cpu_part_start(x, torch.tensor([[0, 0], [0, 1]]), weights, flags, addresses, None,
                   part.ticket, part.part_id, 3)  # fmt: skip
    assert part.counters().pairs == 3
    cpu_part_start(x, ids, weights, flags, addresses, None, part.ticket, part.part_id, 3)
    out = torch.zeros(2, k, hidden)
    cpu_part_join(out, part.ticket, part.part_id, 3)
    assert torch.equal(out, torch.zeros_like(out))
    assert part.counters().pairs == 3 and part.counters().calls == 2


def test_pack_puts_flagged_pairs_first():
    ids = torch.tensor([[2, 0], [1, 2], [0, 3]])
    flags = torch.tensor([False, False, True, True])
    addresses = torch.tensor([100, 200, 300, 400])
    weights = torch.arange(6, dtype=torch.float32).view(3, 2) / 10
    live = torch.tensor([True, True, False])
    ints, floats = _pack(torch.ones(3, 4), ids, weights, flags, addresses, live)
    assert ints[0] == 2  # (2, 0) and (1, 2); row 2's (0, 3) is padding
    assert ints[1:3].tolist() == [0, 3] and ints[7:9].tolist() == [300, 300]
    assert floats[:2].tolist() == pytest.approx([0.0, 0.3])
    assert floats[6:].tolist() == [1.0] * 12
