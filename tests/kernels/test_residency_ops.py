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
    stage_from = (experts // 8) * ((1 << 20) // max(1, experts // 4))  # the last slots
    want_counts, want_gpu, want_st = counts.clone(), torch.tensor(7), torch.tensor(3)
    count_pairs_ref(ids, want_counts, table, offsets, 1 << 20, want_gpu, stage_from, want_st)
    got_counts, got_gpu = counts.to(DEVICE), torch.tensor(7, device=DEVICE)
    got_st = torch.tensor(3, device=DEVICE)
    count_pairs(ids.to(DEVICE), got_counts, table.to(DEVICE), offsets.to(DEVICE), 1 << 20,
                got_gpu, stage_from, got_st)  # fmt: skip
    assert torch.equal(got_counts.cpu(), want_counts)
    assert int(got_gpu) == int(want_gpu) and int(got_st) == int(want_st)
    # the twin itself, from first principles
    off = [int(offsets[int(table[e])]) for e in range(experts)]
    on_gpu = {e for e in range(experts) if 0 <= off[e] < 1 << 20}
    staged = {e for e in on_gpu if off[e] >= stage_from}
    assert int(want_gpu) - 7 == sum(int(e) in on_gpu for e in ids.flatten())
    assert int(want_st) - 3 == sum(int(e) in staged for e in ids.flatten())


def _counted(fn, device, ids, table, offsets, experts: int):
    """(counts [E], gpu pairs, staged pairs) of `fn` (count_pairs or its twin) from zero, a pool
    of 1 MiB whose every slot counts as staged."""
    counts = torch.zeros(experts, dtype=torch.int64, device=device)
    gpu, staged = torch.tensor(0, device=device), torch.tensor(0, device=device)
    fn(ids.to(device), counts, table.to(device), offsets.to(device), 1 << 20, gpu, 0, staged)
    return counts, gpu, staged


def test_count_pairs_skips_padding_rows():
    """Negative ids (a fixed-shape step's padding rows) count nowhere, in the kernel and twin."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(32, generator=gen)[:4] for _ in range(6)])
    ids[4:] = -1
    table, offsets = _entries(32, 8, 1 << 20, gen)
    for fn, device in ((count_pairs_ref, "cpu"), (count_pairs, DEVICE)):
        counts, gpu, staged = _counted(fn, device, ids, table, offsets, 32)
        want = torch.bincount(ids[:4].flatten(), minlength=32)
        assert torch.equal(counts.cpu(), want)
        on_gpu = sum(0 <= int(offsets[int(table[int(e)])]) < 1 << 20 for e in ids[:4].flatten())
        assert int(gpu) == on_gpu == int(staged)


def test_count_pairs_no_entry_is_not_a_gpu_pair():
    """An entry of -1 (hybrid misses: an expert the host's cores compute, which the experts
    kernel skips) counts its pairs per expert, never as read from a GPU slot, even where the
    offsets' last entry lies in the pool."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(5)])
    table = torch.arange(16, dtype=torch.int32)
    table[::3] = -1
    offsets = torch.zeros(16, dtype=torch.int64)  # every entry in the pool, the last one too
    for fn, device in ((count_pairs_ref, "cpu"), (count_pairs, DEVICE)):
        counts, gpu, staged = _counted(fn, device, ids, table, offsets, 16)
        assert torch.equal(counts.cpu(), torch.bincount(ids.flatten(), minlength=16))
        assert int(gpu) == int((table[ids] >= 0).sum()) == int(staged)


def _staging_case(seed: int):
    """8 experts; entries: 3 cached slots, 2 staging slots, then 8 host rows, all in one
    buffer (offsets are byte offsets into it); expert 1 cached, expert 6 with no host row."""
    gen = torch.Generator().manual_seed(seed)
    row = 512
    pool = torch.randint(0, 255, (13 * row,), generator=gen, dtype=torch.uint8)
    offsets = torch.arange(13, dtype=torch.int64) * row
    host_entry = torch.arange(5, 13, dtype=torch.int32)
    host_entry[6] = -1
    table = host_entry.clone()
    table[1], table[6] = 0, 2  # cached slots (entries below stage_first = 3)
    staging = torch.tensor([3, 4], dtype=torch.int32)
    staged = torch.full((2,), -1, dtype=torch.int32)
    return pool, offsets, host_entry, table, staging, staged


def test_stage_guesses_kernel_matches_ref():
    """The staging kernel (interpreter on CPU, compiled on the H200) against its twin over two
    calls: the best two guesses off the cached slots are copied into the staging slots and the
    table points at them; on the second call a slot's old guest goes back to its host row
    unless guessed again; 250-byte blobs (not whole words: the last word is copied whole)."""
    from moetier.kernels.residency_ops import stage_guesses_ref, stage_guesses_triton

    pool, offsets, host_entry, table, staging, staged = _staging_case(0)
    want = [t.clone() for t in (pool, table, staged)]
    got = [t.clone().to(DEVICE) for t in (pool, table, staged)]
    want_n, got_n = torch.tensor(0), torch.tensor(0, device=DEVICE)
    # experts 1 and 6 are never candidates; the second call guesses 3 again and 5 anew
    firsts = [
        torch.tensor([0.0, 9.0, 1.0, 5.0, 3.0, 2.0, 8.0, 4.0]),
        torch.tensor([0.0, 9.0, 1.0, 5.0, 3.0, 7.0, 8.0, 2.0]),
    ]
    for logits in firsts:
        stage_guesses_ref(logits, want[1], host_entry, offsets, want[0], 3, staging, want[2],
                          want_n, 250)  # fmt: skip
        stage_guesses_triton(logits.to(DEVICE), got[1], host_entry.to(DEVICE),
                             offsets.to(DEVICE), got[0], 3, staging.to(DEVICE), got[2], got_n,
                             250, parts=3, block=8)  # fmt: skip
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.cpu(), w)
        assert int(got_n) == int(want_n)
    # the twin from first principles: the first call staged [3, 7]; the second guesses
    # [5, 3]: slot 0 takes 5 (its guest 3 is guessed again, into slot 1), slot 1's guest 7
    # goes back to its host row
    pool0 = _staging_case(0)[0]
    assert want[2].tolist() == [5, 3]
    assert want[1][5] == 3 and want[1][3] == 4 and want[1][7] == host_entry[7]
    assert torch.equal(want[0][3 * 512 : 3 * 512 + 256], pool0[10 * 512 : 10 * 512 + 256])
    assert torch.equal(want[0][4 * 512 : 4 * 512 + 256], pool0[8 * 512 : 8 * 512 + 256])
    assert int(want_n) == 4


def test_opcheck_residency_ops():
    """The zero-copy step's custom ops pass torch.library.opcheck (schema, fake tensors,
    dispatch) on CPU. stage_guesses writes the staging slots of `pool` without declaring it
    (a compiled graph reads them only through `table`; declaring the multi-GB pool would invite
    a copy), so its schema test is skipped: the others still run it."""
    from moetier.kernels.residency_ops import stage_guesses, stage_join, stage_scores

    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(3)])
    table, offsets = _entries(16, 4, 1 << 20, gen)
    torch.library.opcheck(
        count_pairs,
        (ids, torch.zeros(16, dtype=torch.int64), table, offsets, 1 << 20,
         torch.zeros((), dtype=torch.int64), 0, torch.zeros((), dtype=torch.int64)),
    )  # fmt: skip
    hidden, router = torch.randn(1, 32, generator=gen), torch.randn(8, 32, generator=gen)
    torch.library.opcheck(stage_scores, (hidden, router, torch.empty(8), 0, True))
    pool, offsets, host_entry, table, staging, staged = _staging_case(1)
    scores = torch.randn(8, generator=gen)
    torch.library.opcheck(
        stage_guesses,
        (scores, table, host_entry, offsets, pool, 3, staging, staged,
         torch.zeros((), dtype=torch.int64), 250, 0, torch.zeros(1)),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )  # fmt: skip
    torch.library.opcheck(stage_join, (table, 0))


@pytest.mark.parametrize(("experts", "hidden"), [(128, 2048), (60, 300), (3, 17)])
def test_scores_kernel_matches_mv(experts, hidden):
    """`_scores_kernel` (stage_scores' CUDA path; the interpreter on CPU) against torch.mv in
    float32: ragged expert and hidden counts included."""
    from moetier.kernels.residency_ops import _scores

    gen = torch.Generator().manual_seed(experts + hidden)
    x = torch.randn(hidden, generator=gen).to(torch.bfloat16)
    router = torch.randn(experts, hidden, generator=gen).to(torch.bfloat16)
    got = torch.empty(experts, dtype=torch.float32, device=DEVICE)
    _scores(x.to(DEVICE), router.to(DEVICE), got)
    want = torch.mv(router.float(), x.float())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-4)
