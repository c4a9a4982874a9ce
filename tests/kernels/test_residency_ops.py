"""The zero-copy path's device bookkeeping (`moetier::count_pairs`) against its plain-torch twin;
on CPU the Triton kernel runs under the interpreter (conftest), on the H200 compiled."""

from __future__ import annotations

import pytest
import torch

from moetier.kernels.residency_ops import count_pairs, count_pairs_ref

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _entries(experts: int, slots: int, pool_bytes: int, gen: torch.Generator):
    """A table [E] -> entries and offsets: entries < slots inside the pool, the rest outside
    (negative or past its end, as host rows are)."""
    table = torch.randperm(experts, generator=gen).to(torch.int32)
    offsets = torch.empty(experts, dtype=torch.int64)
    offsets[:slots] = torch.arange(slots) * (pool_bytes // max(1, slots))
    far = torch.randint(1, 1 << 30, (experts - slots,), generator=gen)
    offsets[slots:] = torch.where(far % 2 == 0, -far, pool_bytes + far)
    return table, offsets


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts"),
    [(1, 8, 128), (3, 6, 60), (16, 4, 32), (300, 8, 128)],  # the last: 3 programs of 1024
)
def test_count_pairs_matches_ref(tokens, top_k, experts):
    gen = torch.Generator().manual_seed(tokens * experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    table, offsets = _entries(experts, experts // 4, 1 << 20, gen)
    counts = torch.randint(0, 5, (experts,), generator=gen)
    want_counts, want_gpu = counts.clone(), torch.tensor(7)
    count_pairs_ref(ids, want_counts, table, offsets, 1 << 20, want_gpu)
    got_counts, got_gpu = counts.to(DEVICE), torch.tensor(7, device=DEVICE)
    count_pairs(ids.to(DEVICE), got_counts, table.to(DEVICE), offsets.to(DEVICE), 1 << 20, got_gpu)
    assert torch.equal(got_counts.cpu(), want_counts)
    assert int(got_gpu) == int(want_gpu)
    # the twin itself, from first principles
    on_gpu = {e for e in range(experts) if 0 <= int(offsets[int(table[e])]) < 1 << 20}
    assert int(want_gpu) - 7 == sum(int(e) in on_gpu for e in ids.flatten())
