"""The floor of a q2s decode call's design, measured without its decode (H200): pure reads with
the call's geometry, timed as the calls are (a CUDA graph of calls, each on its own buffers,
the buffers together over 4x L2), one JSON line per case next to the copy bandwidth measured
in the same run.

  python bench/studies/launch_floor.py --shapes deepseek-v4-flash,qwen3-30b-a3b --tokens 1,2

- `two-launch` (the kernels' design): a gate_up launch then a down launch, each with the
  dispatcher's programs (rows a program, K tile), reading each program's rows' codes and group
  scales one K tile ahead, chained with PDL as the kernels are (a program asks for its first
  tile, waits for the launch before, then reads its activations and the rest);
- `two-launch-op`: the same launches as the op runs them in a model: each program finds its
  rows through the routing and the residency tables (three dependent loads, as the kernels'
  programs do), and gate_up, whose routing the kernel before writes, waits for that kernel
  before it looks anything up (as a call's first launch does the op's way, what
  `bench/kernels.py --first-launch after` times: `wait_first` in the H200 configs at 1-2
  tokens); `two-launch-op-2` and `-1` (tables the
  kernels do not have): the offsets by expert (two loads) or by pair (one); `two-launch-op-pf`:
  each program also asks L2 for all its rows once they are found (`prefetch_l2`);
- `one-launch-block` (a design the kernels do not have): each program reads the gate_up rows
  of S outputs of a pair (2S rows), then the S matching columns of down for all its rows,
  stored column-block-major (a layout the q2s blob does not have: its rows are whole),
  adding its partial down rows into the pair's output with float atomics;
- `one-launch-shared`: the same gate_up rows, then, of down as the blob stores it, the
  128-column block its slice is in for 1 / (128 / S) of the rows (so the programs of a block
  would have to swap their h first: not modelled), with atomics the same way.
  (The zeroing an atomics output needs between calls is not modelled either.)

Neither decodes anything: each is what a kernel of that design could take at best on this
GPU, launches, ramps and waits included.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, kernels
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import emit, graph_ms  # noqa: E402
from kernels import L2_BYTES, SHAPES  # noqa: E402

from moetier.core.provenance import run_info  # noqa: E402
from moetier.kernels import moe_dispatch  # noqa: E402
from moetier.kernels.ptx import _prefetch_l2  # noqa: E402
from moetier.residency.links import copy_bandwidth  # noqa: E402

GROUP = 32  # q2s columns per group scale (one byte)
# the `two-launch-op` designs: (lookups, prefetch) of `two_launch_op_calls`
OP_DESIGNS = {"two-launch-op": (3, False), "two-launch-op-2": (2, False),
              "two-launch-op-1": (1, False), "two-launch-op-pf": (3, True)}  # fmt: skip


@triton.jit
def _walk(cb, sb, w, s, ROWS: tl.constexpr, CW: tl.constexpr, NT: tl.constexpr):
    """The K tiles of ROWS rows from pointers cb (codes, CW words a tile) and sb (scales, CW / 2
    bytes a tile), tile 0 (w, s) already loaded, the next one asked for before each is used;
    -> the XOR of all the codes' words and of all the scales' bytes."""
    SC: tl.constexpr = CW // 2
    acc = tl.zeros((ROWS, CW), tl.int32)
    sacc = tl.zeros((ROWS, SC), tl.int32)
    for t in range(NT):
        tn = tl.minimum(t + 1, NT - 1)
        nw = tl.load(cb + tn * CW)
        ns = tl.load(sb + tn * SC)
        acc ^= w
        sacc ^= s.to(tl.int32)
        w, s = nw, ns
    codes = tl.xor_sum(tl.reshape(acc, (ROWS * CW,)), axis=0)
    return codes, tl.xor_sum(tl.reshape(sacc, (ROWS * SC,)), axis=0)


@triton.jit
def _rows_at(codes, scales, act, out, p, off, ROWS: tl.constexpr, RW: tl.constexpr,
             CW: tl.constexpr, ACT: tl.constexpr, WAIT: tl.constexpr,
             PREFETCH: tl.constexpr):  # fmt: skip
    """Program p's ROWS rows of RW int32 words of codes from word `off` (and RW / 2 bytes of
    group scales a row, from byte off / 2) in K tiles of CW words, one tile ahead: tile 0
    asked for (PREFETCH, sm_90: all its rows asked of L2 first, one bulk prefetch for the
    codes and one for the scales, as `KernelChoice.prefetch_l2` does), then the wait for the
    launch before (WAIT), then ACT words of activations and the rest. Writes the XOR of all it
    read (so nothing is optimised away)."""
    SB: tl.constexpr = RW // 2
    SC: tl.constexpr = CW // 2
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, CW)[None, :]
    cs = tl.arange(0, SC)[None, :]
    cb = codes + off + r * RW + c
    sb = scales + off // 2 + r * SB + cs
    if PREFETCH:
        _prefetch_l2(codes + off, ROWS * RW * 4)
        _prefetch_l2(scales + off // 2, ROWS * SB)
    w = tl.load(cb)
    s = tl.load(sb)
    if WAIT:
        gdc_wait()
    a = tl.xor_sum(tl.load(act + tl.arange(0, ACT)), axis=0)
    xc, xs = _walk(cb, sb, w, s, ROWS, CW, RW // CW)
    tl.store(out + p, xc ^ xs ^ a)


@triton.jit
def _rows_read(codes, scales, act, out, ROWS: tl.constexpr, RW: tl.constexpr,
               CW: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """One program: its ROWS rows, program after program (`_rows_at`), tile 0 before the wait
    for the launch before."""
    p = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    _rows_at(codes, scales, act, out, p, p.to(tl.int64) * ROWS * RW, ROWS, RW, CW, ACT, PDL,
             False)  # fmt: skip


@triton.jit
def _rows_read_op(codes, scales, act, out, ids, table, offs, ROWS: tl.constexpr,
                  RW: tl.constexpr, CW: tl.constexpr, ACT: tl.constexpr, PPP: tl.constexpr,
                  PDL: tl.constexpr, WAIT_FIRST: tl.constexpr,
                  LOOKUPS: tl.constexpr = 3, PREFETCH: tl.constexpr = False):  # fmt: skip
    """`_rows_read` as the op runs its launches in a model (`two-launch-op`): program p's pair
    is p // PPP, and its rows are found as the kernels find theirs, through three dependent
    loads (ids[pair] -> table[expert] -> offs[slot], the word offset of the pair's PPP
    programs' rows; their scale bytes at half of it). WAIT_FIRST (a call's first launch the
    op's way, as `KernelChoice.wait_first`): the program waits for the launch before first,
    then looks up and reads everything (the routing is that launch's output); else the
    lookups and tile 0 come before the wait, as down's do. LOOKUPS 2 or 1 (designs the
    kernels do not have): offs is indexed by the expert (ids -> offs) or by the pair (offs
    alone), table unused. PREFETCH: see `_rows_at`."""
    p = tl.program_id(0)
    if PDL:
        if WAIT_FIRST:
            gdc_wait()
        gdc_launch_dependents()
    if LOOKUPS == 3:
        at = tl.load(table + tl.load(ids + p // PPP))
    elif LOOKUPS == 2:
        at = tl.load(ids + p // PPP)
    else:
        at = p // PPP
    off = tl.load(offs + at) + (p % PPP).to(tl.int64) * ROWS * RW
    _rows_at(codes, scales, act, out, p, off, ROWS, RW, CW, ACT, PDL and not WAIT_FIRST,
             PREFETCH)  # fmt: skip


@triton.jit
def _slab_read(gu_codes, gu_scales, act, p, S: tl.constexpr, H: tl.constexpr,
               CW: tl.constexpr, ACT: tl.constexpr):  # fmt: skip
    """A one-launch program's first part: its 2S gate_up rows (H columns: H / 16 words and
    H / 32 scale bytes a row) in K tiles of CW words, one ahead, and the activations; -> a
    float made of all it read (its "h")."""
    a = tl.xor_sum(tl.load(act + tl.arange(0, ACT)), axis=0)
    RW: tl.constexpr = H // 16
    SB: tl.constexpr = H // 32
    SC: tl.constexpr = CW // 2
    r = tl.arange(0, 2 * S)[:, None]
    c = tl.arange(0, CW)[None, :]
    cs = tl.arange(0, SC)[None, :]
    cb = gu_codes + p.to(tl.int64) * 2 * S * RW + r * RW + c
    sb = gu_scales + p.to(tl.int64) * 2 * S * SB + r * SB + cs
    xc, xs = _walk(cb, sb, tl.load(cb), tl.load(sb), 2 * S, CW, RW // CW)
    return (xc ^ a).to(tl.float32) * 1e-9 + xs.to(tl.float32) * 1e-9


@triton.jit
def _slice_read(gu_codes, gu_scales, dn_codes, dn_scales, act, acc_out,
                S: tl.constexpr, H: tl.constexpr, SLICES: tl.constexpr, CW: tl.constexpr,
                CHUNK: tl.constexpr, ACT: tl.constexpr):  # fmt: skip
    """One program of the one-launch `block` design: pair p // SLICES, outputs slice
    p % SLICES of S: its gate_up rows (`_slab_read`), then the slice's down block (H rows of
    S / 16 words, contiguous; scale bytes [pair, I / 32, H]) in chunks of CHUNK rows, one
    ahead, each chunk's row sums added into acc_out[pair] with relaxed float atomics."""
    p = tl.program_id(0)
    pair = p // SLICES
    h = _slab_read(gu_codes, gu_scales, act, p, S, H, CW, ACT)
    DW: tl.constexpr = S // 16  # words of a down row in the block
    rr = tl.arange(0, CHUNK)[:, None]
    cc = tl.arange(0, DW)[None, :]
    db = dn_codes + p.to(tl.int64) * H * DW + rr * DW + cc
    SPG: tl.constexpr = 32 // S  # (S 16: two slices share a group's scale bytes)
    ds = dn_scales + (p // SPG).to(tl.int64) * H + tl.arange(0, CHUNK)
    dw = tl.load(db)
    dsc = tl.load(ds)
    NC: tl.constexpr = H // CHUNK
    for t in range(NC):
        tn = tl.minimum(t + 1, NC - 1)
        nw = tl.load(db + tn * CHUNK * DW)
        ns = tl.load(ds + tn * CHUNK)
        y = tl.sum(dw, axis=1).to(tl.float32) * h + dsc.to(tl.float32)
        rows = t * CHUNK + tl.arange(0, CHUNK)
        tl.atomic_add(acc_out + pair * H + rows, y, sem="relaxed")
        dw, dsc = nw, ns


@triton.jit
def _shared_read(gu_codes, gu_scales, dn_codes, dn_scales, act, acc_out,
                 S: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, CW: tl.constexpr,
                 CHUNK: tl.constexpr, ACT: tl.constexpr):  # fmt: skip
    """One program of the one-launch `shared` design: pair p // (INTER / S), slice j of S outputs:
    its gate_up rows (`_slab_read`), then, of down as the blob stores it (row-major: INTER / 16
    words and INTER / 32 scale bytes a row), the 128 columns of the block its slice is in (8 words
    and 4 scale bytes a row) for its 1 / (128 / S) share of the rows, in chunks of CHUNK rows,
    one ahead, adding them into acc_out[pair] with relaxed float atomics. (A kernel of this
    design needs the 128 / S programs of a block to swap their h; not modelled.)"""
    p = tl.program_id(0)
    SLICES: tl.constexpr = INTER // S
    Q: tl.constexpr = 128 // S
    pair = p // SLICES
    j = p % SLICES
    h = _slab_read(gu_codes, gu_scales, act, p, S, H, CW, ACT)
    ROWS: tl.constexpr = H // Q
    row0 = (j % Q) * ROWS
    rr = row0 + tl.arange(0, CHUNK)[:, None]
    db = (dn_codes + pair.to(tl.int64) * H * (INTER // 16) + (j // Q) * 8 + rr * (INTER // 16)
          + tl.arange(0, 8)[None, :])  # fmt: skip
    ds = (dn_scales + pair.to(tl.int64) * H * (INTER // 32) + (j // Q) * 4 + rr * (INTER // 32)
          + tl.arange(0, 4)[None, :])  # fmt: skip
    dw = tl.load(db)
    dsc = tl.load(ds)
    NC: tl.constexpr = ROWS // CHUNK
    for t in range(NC):
        tn = tl.minimum(t + 1, NC - 1)
        nw = tl.load(db + tn * CHUNK * (INTER // 16))
        ns = tl.load(ds + tn * CHUNK * (INTER // 32))
        y = tl.sum(dw, axis=1).to(tl.float32) * h + tl.sum(dsc.to(tl.float32), axis=1)
        rows = row0 + t * CHUNK + tl.arange(0, CHUNK)
        tl.atomic_add(acc_out + pair * H + rows, y, sem="relaxed")
        dw, dsc = nw, ns


def _words(nbytes: int, device: str) -> torch.Tensor:
    return torch.randint(0, 2**20, (max(1, nbytes // 4),), dtype=torch.int32, device=device)


def _bytes(nbytes: int, device: str) -> torch.Tensor:
    return torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)


def launch_geometry(n: int, k: int, choice: moe_dispatch.KernelChoice) -> tuple[int, int]:
    """(rows a program reads, K tile words) of one q2s GEMV launch with this config: block_n
    rows (gate_up: block_n / 2 outputs, their gate and up rows) times row_tiles, and the
    largest power-of-two tile of at most block_k / 16 words (128 at most) dividing K's words."""
    rows = choice.block_n * max(1, choice.row_tiles)
    cw = 1 << (min(choice.block_k // 16, 128, k // 16).bit_length() - 1)
    while (k // 16) % cw:
        cw //= 2
    if cw < 2:
        raise ValueError(f"no K tile of 2-128 words divides {k // 16} words")
    return min(rows, n), cw


def two_launch_geometry(hidden: int, inter: int, pairs: int) -> list[tuple[int, ...]]:
    """The kernels' design's two launches with the dispatcher's configs for this call size:
    (rows a program, words a row, K tile words, programs, code bytes, scale bytes, activation
    words) each, gate_up first."""
    c_gu = moe_dispatch.choose_q2s_gemv(2 * inter, hidden, pairs=pairs)
    c_dn = moe_dispatch.choose_q2s_gemv(hidden, inter, pairs=pairs)
    launches = []
    for n, k, c in ((2 * inter, hidden, c_gu), (hidden, inter, c_dn)):
        rows, cw = launch_geometry(n, k, c)
        programs = pairs * (n // rows)
        launches.append((rows, k // 16, cw, programs, programs * rows * k // 4,
                         programs * rows * k // GROUP, triton.next_power_of_2(k // 2)))  # fmt: skip
    return launches


def two_launch_calls(launches: list[tuple[int, ...]], device: str, count: int,
                     pdl: bool = True) -> list:  # type: ignore[type-arg]  # fmt: skip
    """`count` calls of the kernels' design, each on its own buffers."""
    out = torch.empty(max(lc[3] for lc in launches), dtype=torch.int32, device=device)
    act_buf = _words(4 * max(lc[6] for lc in launches), device)
    calls = []
    for _ in range(count):
        bufs = [(_words(lc[4], device), _bytes(lc[5], device)) for lc in launches]

        def call(bufs=bufs) -> None:  # type: ignore[no-untyped-def]
            for lc, (codes, scales) in zip(launches, bufs, strict=True):
                rows, rw, cw, programs, _, _, act = lc
                _rows_read[(programs,)](codes, scales, act_buf, out, rows, rw, cw, act, pdl,
                                        num_warps=8 if rows * cw >= 2048 else 4,
                                        launch_pdl=pdl)  # fmt: skip

        calls.append(call)
    return calls


def op_tables(pairs: int, region_words: int, experts: int, device: str,
              lookups: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A routing and residency tables for `_rows_read_op`: ids [pairs] int32 (distinct
    experts), table [experts] int32 (expert -> slot, -1 for experts without one), and offs,
    the word offset of each pair's rows (region_words a pair, the pairs' regions in a shuffled
    order) by slot (lookups 3: [2 pairs]), by expert (2: [experts], 0 where no slot) or by pair
    (1: [pairs])."""
    if pairs > experts:
        raise ValueError(f"{pairs} distinct experts asked of {experts}")
    expert = torch.randperm(experts)[:pairs]
    slots = torch.randperm(2 * pairs)[:pairs]
    table = torch.full((experts,), -1, dtype=torch.int32)
    table[expert] = slots.to(torch.int32)
    offs = torch.zeros(2 * pairs, dtype=torch.int64)
    offs[slots] = torch.randperm(pairs) * region_words
    if lookups == 2:
        by_expert = torch.zeros(experts, dtype=torch.int64)
        by_expert[expert] = offs[slots]
        offs = by_expert
    elif lookups == 1:
        offs = offs[slots]
    return expert.to(torch.int32).to(device), table.to(device), offs.to(device)


def two_launch_op_calls(launches: list[tuple[int, ...]], pairs: int, experts: int, device: str,
                        count: int, lookups: int = 3,
                        prefetch: bool = False) -> list:  # type: ignore[type-arg]  # fmt: skip
    """`count` calls of the kernels' design as the op runs in a model (`_rows_read_op`): each
    launch's programs find their rows through `lookups` dependent loads, gate_up waiting
    first; prefetch: each program asks L2 for all its rows once they are found."""
    out = torch.empty(max(lc[3] for lc in launches), dtype=torch.int32, device=device)
    act_buf = _words(4 * max(lc[6] for lc in launches), device)
    calls = []
    for _ in range(count):
        bufs = []
        for lc in launches:
            rows, rw, _, programs = lc[:4]
            tables = op_tables(pairs, programs // pairs * rows * rw, experts, device, lookups)
            bufs.append((_words(lc[4], device), _bytes(lc[5], device), tables))

        def call(bufs=bufs) -> None:  # type: ignore[no-untyped-def]
            for i, (lc, (codes, scales, tables)) in enumerate(zip(launches, bufs, strict=True)):
                rows, rw, cw, programs, _, _, act = lc
                _rows_read_op[(programs,)](codes, scales, act_buf, out, *tables, rows, rw, cw,
                                           act, programs // pairs, True, i == 0, lookups,
                                           prefetch, num_warps=8 if rows * cw >= 2048 else 4,
                                           launch_pdl=True)  # fmt: skip

        calls.append(call)
    return calls


def one_launch_bytes(hidden: int, inter: int, pairs: int, s: int) -> tuple[int, int, int, int]:
    """(gate_up code, gate_up scale, down code, down scale) bytes of one call of a one-launch
    design with slices of s outputs (16 or 32)."""
    if s not in (16, 32) or inter % 128:
        raise ValueError(f"one-launch: slices of 16 or 32 outputs, I a multiple of 128: {s}, "
                         f"{inter}")  # fmt: skip
    gu_rows = pairs * 2 * inter
    return (gu_rows * hidden // 4, gu_rows * hidden // GROUP, pairs * hidden * inter // 4,
            pairs * hidden * inter // GROUP)  # fmt: skip


def one_launch_calls(design: str, hidden: int, inter: int, pairs: int, s: int, device: str,
                     count: int) -> tuple[list, torch.Tensor]:  # type: ignore[type-arg]  # fmt: skip
    """`count` calls of a one-launch design (`block` or `shared`) with slices of s outputs,
    each on its own buffers, and their shared output accumulator [pairs, hidden]."""
    sizes = one_launch_bytes(hidden, inter, pairs, s)
    programs = pairs * (inter // s)
    acc = torch.zeros(pairs * hidden, dtype=torch.float32, device=device)
    act_buf = _words(2 * hidden, device)
    cw = min(32, hidden // 16)
    act = triton.next_power_of_2(hidden // 2)
    warps = 8 if s >= 32 else 4
    calls = []
    for _ in range(count):
        b = (_words(sizes[0], device), _bytes(sizes[1], device), _words(sizes[2], device),
             _bytes(sizes[3], device))  # fmt: skip

        def call(b=b) -> None:  # type: ignore[no-untyped-def]
            if design == "block":
                _slice_read[(programs,)](*b, act_buf, acc, s, hidden, inter // s, cw,
                                         min(256, hidden), act, num_warps=warps)  # fmt: skip
            else:
                _shared_read[(programs,)](*b, act_buf, acc, s, hidden, inter, cw,
                                          min(128, hidden * s // 128), act,
                                          num_warps=warps)  # fmt: skip

        calls.append(call)
    return calls, acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="deepseek-v3,deepseek-v4-flash,qwen3-30b-a3b")
    parser.add_argument("--tokens", default="1,2")
    parser.add_argument("--slices", default="16,32", help="one-launch: outputs a program")
    args = parser.parse_args()
    info = run_info()
    copy = copy_bandwidth()
    emit({**info, "case": "copy", "GB/s": round(copy / 1e9, 1)})
    for shape in args.shapes.split(","):
        hidden, inter, experts, top_k = SHAPES[shape]
        for tokens in (int(t) for t in args.tokens.split(",")):
            pairs = tokens * top_k
            designs = [("two-launch", None), *((name, None) for name in OP_DESIGNS)] + [
                (design, int(s)) for design in ("block", "shared") for s in args.slices.split(",")
            ]
            for design, s in designs:
                if s is None:
                    launches = two_launch_geometry(hidden, inter, pairs)
                    nbytes = sum(lc[4] + lc[5] for lc in launches)
                else:
                    nbytes = sum(one_launch_bytes(hidden, inter, pairs, s))
                count = max(2, -(-4 * L2_BYTES // nbytes) + 1)
                if design in OP_DESIGNS:
                    calls = two_launch_op_calls(launches, pairs, experts, "cuda", count,
                                                *OP_DESIGNS[design])  # fmt: skip
                elif s is None:
                    calls = two_launch_calls(launches, "cuda", count)
                else:
                    calls = one_launch_calls(design, hidden, inter, pairs, s, "cuda", count)[0]
                ms = graph_ms(calls)
                gbs = nbytes / ms / 1e6
                emit({**info, "case": "launch-floor", "shape": shape, "tokens": tokens,
                      "design": design if s is None else f"one-launch-{design}", "slice": s,
                      "MB": round(nbytes / 1e6, 2),
                      "us": round(ms * 1e3, 2), "GB/s": round(gbs, 1),
                      "copy_GB/s": round(copy / 1e9, 1),
                      "of_copy": round(gbs * 1e9 / copy, 3)})  # fmt: skip
                del calls
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
