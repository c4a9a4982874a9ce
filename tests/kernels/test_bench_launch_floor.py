"""bench/studies/launch_floor.py's pure-read kernels (on CPU under Triton's interpreter, set in
conftest): each reads exactly the bytes its design says, every one once (checked against the
same reductions in torch), so the floors it times are of the right bytes."""

from __future__ import annotations

import functools
import importlib.util
import operator
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[2] / "bench"


@pytest.fixture(scope="module")
def lf():
    sys.path.insert(0, str(BENCH))  # its `common` and `kernels` modules
    try:
        path = BENCH / "studies" / "launch_floor.py"
        spec = importlib.util.spec_from_file_location("bench_launch_floor", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def _xor(t: torch.Tensor) -> int:
    return functools.reduce(operator.xor, t.to(torch.int64).flatten().tolist(), 0)


def _one_launch_buffers(lf, pairs, hidden, inter, s):  # type: ignore[no-untyped-def]
    """Random gate_up codes and scales, down codes and scales, activations and a zero
    accumulator for a one-launch call."""
    sizes = lf.one_launch_bytes(hidden, inter, pairs, s)
    return (torch.randint(0, 2**10, (sizes[0] // 4,), dtype=torch.int32),
            torch.randint(0, 255, (sizes[1],), dtype=torch.uint8),
            torch.randint(0, 2**10, (sizes[2] // 4,), dtype=torch.int32),
            torch.randint(0, 255, (sizes[3],), dtype=torch.uint8),
            torch.randint(0, 2**10, (hidden // 2,), dtype=torch.int32),
            torch.zeros(pairs * hidden))  # fmt: skip


def test_rows_read_reads_each_programs_rows_and_scales(lf):
    rows, rw, cw, programs, act = 8, 32, 8, 3, 16
    codes = torch.randint(0, 2**20, (programs * rows * rw,), dtype=torch.int32)
    scales = torch.randint(0, 255, (programs * rows * rw // 2,), dtype=torch.uint8)
    act_buf = torch.randint(0, 2**20, (act,), dtype=torch.int32)
    out = torch.zeros(programs, dtype=torch.int32)
    lf._rows_read[(programs,)](codes, scales, act_buf, out, rows, rw, cw, act, False)
    for p in range(programs):
        want = _xor(codes.view(programs, -1)[p]) ^ _xor(scales.view(programs, -1)[p])
        assert int(out[p]) == want ^ _xor(act_buf)


def test_slice_read_adds_each_slices_down_block(lf):
    """Program (pair, j): its 2S gate_up rows, then down block j ([H, S / 16] words) and its
    group's scale bytes [H], added into acc[pair] row by row."""
    pairs, hidden, inter, s, cw, chunk = 2, 64, 128, 16, 2, 16
    gu, gs, dn, ds, act, acc = _one_launch_buffers(lf, pairs, hidden, inter, s)
    slices = inter // s
    lf._slice_read[(pairs * slices,)](gu, gs, dn, ds, act, acc, s, hidden, slices, cw, chunk,
                                      hidden // 2)  # fmt: skip
    want = torch.zeros(pairs, hidden, dtype=torch.float64)
    gu_p, gs_p = gu.view(pairs * slices, -1), gs.view(pairs * slices, -1)
    blocks = dn.view(pairs * slices, hidden, s // 16).to(torch.float64).sum(-1)
    scale_rows = ds.view(pairs * inter // 32, hidden).to(torch.float64)
    for p in range(pairs * slices):
        h = float(_xor(gu_p[p]) ^ _xor(act)) * 1e-9 + float(_xor(gs_p[p])) * 1e-9
        want[p // slices] += blocks[p] * h + scale_rows[p // (32 // s)]
    torch.testing.assert_close(acc.view(pairs, hidden).double(), want, rtol=1e-4, atol=1e-3)


def test_one_launch_refuses_other_slices(lf):
    with pytest.raises(ValueError, match="slices of 16 or 32"):
        lf.one_launch_bytes(4096, 2048, 6, 64)


def test_launch_geometry_takes_power_of_two_tiles_dividing_k(lf):
    c = lf.moe_dispatch.KernelChoice(block_n=32, block_k=1024, row_tiles=2)
    assert lf.launch_geometry(2048, 768, c) == (64, 16)  # 48 words: 16-word tiles
    assert lf.launch_geometry(4096, 2048, c) == (64, 64)
    assert lf.launch_geometry(16, 2048, c) == (16, 64)  # no more rows than the matrix has


def test_shared_read_adds_its_share_of_its_blocks_rows(lf):
    """Program (pair, j): its 2S gate_up rows, then of row-major down the 128-column block
    j // (128 / S) (8 words and 4 scale bytes a row) for rows share j % (128 / S)."""
    pairs, hidden, inter, s, cw, chunk = 2, 64, 256, 32, 2, 8
    gu, gs, dn, ds, act, acc = _one_launch_buffers(lf, pairs, hidden, inter, s)
    slices, q = inter // s, 128 // s
    lf._shared_read[(pairs * slices,)](gu, gs, dn, ds, act, acc, s, hidden, inter, cw, chunk,
                                       hidden // 2)  # fmt: skip
    want = torch.zeros(pairs, hidden, dtype=torch.float64)
    gu_p, gs_p = gu.view(pairs * slices, -1), gs.view(pairs * slices, -1)
    codes = dn.view(pairs, hidden, inter // 16).to(torch.float64)
    scales = ds.view(pairs, hidden, inter // 32).to(torch.float64)
    share = hidden // q
    for p in range(pairs * slices):
        pair, j = divmod(p, slices)
        h = float(_xor(gu_p[p]) ^ _xor(act)) * 1e-9 + float(_xor(gs_p[p])) * 1e-9
        rows = slice((j % q) * share, (j % q + 1) * share)
        g = j // q
        want[pair, rows] += (codes[pair, rows, 8 * g : 8 * g + 8].sum(-1) * h
                             + scales[pair, rows, 4 * g : 4 * g + 4].sum(-1))  # fmt: skip
    torch.testing.assert_close(acc.view(pairs, hidden).double(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("lookups", [3, 2, 1])
def test_rows_read_op_finds_each_pairs_rows_through_the_tables(lf, lookups):
    """Program p reads the rows of its pair p // PPP found through ids -> table -> offs (the
    pairs' regions shuffled; or offsets by expert, or by pair), its share p % PPP of them, and
    its scale bytes at half the codes' word offset."""
    torch.manual_seed(3)
    pairs, ppp, rows, rw, cw, act, experts = 3, 2, 4, 16, 4, 8, 10
    region = ppp * rows * rw
    codes = torch.randint(0, 2**20, (pairs * region,), dtype=torch.int32)
    scales = torch.randint(0, 255, (pairs * region // 2,), dtype=torch.uint8)
    act_buf = torch.randint(0, 2**20, (act,), dtype=torch.int32)
    ids, table, offs = lf.op_tables(pairs, region, experts, "cpu", lookups)
    assert len(set(ids.tolist())) == pairs and int((table >= 0).sum()) == pairs
    out = torch.zeros(pairs * ppp, dtype=torch.int32)
    lf._rows_read_op[(pairs * ppp,)](codes, scales, act_buf, out, ids, table, offs, rows, rw,
                                     cw, act, ppp, False, False, lookups)  # fmt: skip
    starts = []  # where each program's rows are, by what the tables mean
    for p in range(pairs * ppp):
        pair = p // ppp
        at = {3: int(table[int(ids[pair])]), 2: int(ids[pair]), 1: pair}[lookups]
        starts.append(int(offs[at]) + (p % ppp) * rows * rw)
    for p, start in enumerate(starts):
        want = _xor(codes[start : start + rows * rw])
        want ^= _xor(scales[start // 2 : (start + rows * rw) // 2])
        assert int(out[p]) == want ^ _xor(act_buf)
    assert sorted(starts) == [i * rows * rw for i in range(pairs * ppp)]  # every row once
    assert [s // region for s in starts[::ppp]] != list(range(pairs))  # the regions shuffled


def test_op_tables_send_each_pair_to_the_same_region(lf):
    """Offsets by slot, by expert or by pair: the same draw sends every pair to the same one
    of the pairs' regions."""
    regions = {}
    for lookups in (3, 2, 1):
        torch.manual_seed(4)
        ids, table, offs = lf.op_tables(3, 100, 10, "cpu", lookups)
        at = {3: table[ids.long()].long(), 2: ids.long(), 1: torch.arange(3)}[lookups]
        regions[lookups] = offs[at].tolist()
    assert regions[3] == regions[2] == regions[1]
    assert sorted(regions[3]) == [0, 100, 200]
