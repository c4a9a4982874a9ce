"""Triton MoE kernels against their plain-torch twin `moe_slots_ref`.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set in conftest) on small
shapes; the `gpu` tests sweep the awkward shapes of STYLE.md §13 on the real device, with slots
scattered in GPU memory and in pinned host memory.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moetier.config import ExpertActivation
from moetier.core.layout import (
    TENSOR_ALIGN,
    BlobFormat,
    align_up,
    fp4_expert_format,
    nested_expert_formats,
    q2s_expert_format,
    raw_expert_format,
)
from moetier.kernels.moe_ref import moe_slots_ref
from moetier.quant.synthetic import random_blob

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents  # noqa: E402

from moetier.kernels import (  # noqa: E402
    blob_decode,
    int8_words,
    moe_dispatch,
    moe_triton,
    pair_tables,
    ptx,
    q2s_gemv,
)
from moetier.kernels.moe_triton import moe_slots_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def formats(
    hidden: int, inter: int, bias: bool = False
) -> dict[str, tuple[BlobFormat, BlobFormat | None]]:
    nested_base, nested_delta = nested_expert_formats(hidden, inter, bias)
    nvfp4 = fp4_expert_format("nvfp4", hidden, inter, False)
    group = 32 if hidden % 32 == 0 else 16
    down_group = 16
    return {
        "q2s": (q2s_expert_format(hidden, inter, bias, group, down_group), None),
        "q2s+nvfp4": (q2s_expert_format(hidden, inter, bias, group, down_group), nvfp4),
        "q2s+q2s": (
            q2s_expert_format(hidden, inter, bias, group, down_group),
            q2s_expert_format(hidden, inter, False, group, down_group),
        ),
        "nvfp4": (fp4_expert_format("nvfp4", hidden, inter, bias), None),
        "mxfp4": (fp4_expert_format("mxfp4", hidden, inter, bias), None),
        "nested": (nested_base, nested_delta),
        "bfloat16": (raw_expert_format("bfloat16", hidden, inter, bias), None),
        "float32": (raw_expert_format("float32", hidden, inter, bias), None),
    }


class Pool:
    """Experts' base (and delta) blobs in scattered slots of one pool; optionally some slots in
    a separate pinned host buffer, addressed through slot offsets relative to the pool."""

    def __init__(self, fmt, delta_fmt, experts, present, gen, host_slots=0):
        # even experts get a fitted q2s grid, odd ones the evenly spaced b = 3a grid
        nbytes = max(fmt.nbytes, delta_fmt.nbytes if delta_fmt else 0)
        self.slot_bytes = align_up(nbytes, TENSOR_ALIGN)
        n_blobs = experts * (2 if delta_fmt else 1)
        slots = torch.randperm(n_blobs + 3, generator=gen)[:n_blobs]  # scattered, some unused
        self.pool = torch.zeros(n_blobs + 3, self.slot_bytes, dtype=torch.uint8)
        self.slot_table = torch.full((experts,), -1, dtype=torch.int32)
        self.delta_table = torch.full((experts,), -1, dtype=torch.int32)
        for e in range(experts):
            if not present[e]:
                continue
            self.slot_table[e] = slots[e]
            random_blob(fmt, gen, self.pool[slots[e]], fitted_grid=e % 2 == 0)
            if delta_fmt is not None and e % 3 != 2:  # some experts have no delta blob
                self.delta_table[e] = slots[experts + e]
                random_blob(delta_fmt, gen, self.pool[slots[experts + e]])
        self.host_slots = host_slots

    def device_args(self):
        """(pool, slot_offsets, slot_table, delta_table) on DEVICE; the first `host_slots`
        used slots are moved to pinned host memory and read zero-copy."""
        pool = self.pool.to(DEVICE)
        offsets = torch.arange(pool.shape[0], dtype=torch.int64) * self.slot_bytes
        self._host = None
        if self.host_slots:
            used = torch.cat([self.slot_table, self.delta_table])
            used = used[used >= 0][: self.host_slots]
            self._host = self.pool[used.long()].clone().pin_memory()
            pool[used.long()] = 0  # the GPU copies must not be what the kernel reads
            for i, s in enumerate(used.tolist()):
                offsets[s] = self._host[i].data_ptr() - pool.data_ptr()
        return (
            pool,
            offsets.to(DEVICE),
            self.slot_table.to(DEVICE),
            self.delta_table.to(DEVICE),
        )


def run_case(
    fmt_name, tokens, top_k, experts, hidden, inter, *, dtype=torch.float32, mask="random",
    act="silu", bias=False, present_frac=1.0, one_expert=False, host_slots=0, seed=0,
    non_contiguous=False, force=None,
):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    if fmt_name in ("bfloat16", "float32"):
        fmt, delta_fmt = raw_expert_format(fmt_name, hidden, inter, bias), None
    else:
        fmt, delta_fmt = formats(hidden, inter, bias)[fmt_name]
    present = torch.rand(experts, generator=gen) < present_frac
    present[0] = True
    pool = Pool(fmt, delta_fmt, experts, present, gen, host_slots)
    if one_expert:
        ids = torch.zeros(tokens, top_k, dtype=torch.int64)
        ids[:, 1:] = torch.randint(1, experts, (tokens, top_k - 1), generator=gen)
    else:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    x = torch.randn(tokens, hidden * (2 if non_contiguous else 1), generator=gen).to(dtype)
    if non_contiguous:
        x = x[:, ::2]
    dmask = None
    if delta_fmt is not None:
        dmask = {
            "off": torch.zeros(tokens, top_k, dtype=torch.bool),
            "on": torch.ones(tokens, top_k, dtype=torch.bool),
            "random": torch.rand(tokens, top_k, generator=gen) < 0.5,
        }[mask]
    activation = ExpertActivation(kind=act)
    dev_pool, offsets, table, dtable = pool.device_args()
    x_dev = x.to(DEVICE)
    if not non_contiguous:
        x_dev = x_dev.contiguous()
    got = torch.full((tokens, top_k, hidden), float("nan"), device=DEVICE)
    used = moe_slots_triton(
        x_dev, ids.to(DEVICE), weights.to(DEVICE), table, dev_pool, fmt, activation, got,
        delta_mask=dmask.to(DEVICE) if dmask is not None else None,
        delta_table=dtable if delta_fmt else None, delta_fmt=delta_fmt, slot_offsets=offsets,
        choice=force,
    )  # fmt: skip
    got = got.cpu()
    # the twin: int8 activations where the kernel quantized them (q2s GEMV with int8_act)
    int8 = used[0].int8_act
    ref = torch.full((tokens, top_k, hidden), float("nan"))
    moe_slots_ref(
        x.float(), ids, weights, pool.slot_table, pool.pool, fmt, activation, ref,
        delta_mask=dmask, delta_table=pool.delta_table if delta_fmt else None, delta_fmt=delta_fmt,
        act_int8=int8,
    )  # fmt: skip
    slotted = present[ids]  # [T, k] pairs the call computes; the others stay untouched
    assert torch.isnan(got[~slotted]).all(), "a pair without a slot was written"
    assert not torch.isnan(got[slotted]).any(), "a pair with a slot was not written"
    err = (got[slotted] - ref[slotted]).norm() / ref[slotted].norm().clamp_min(1e-30)
    # int8 words: a rounding tie broken differently flips one activation by one step
    limit = 1e-5 if dtype == torch.float32 else 2e-2
    if int8:
        limit = 1e-3 if dtype == torch.float32 else 2e-2
    assert err < limit, f"{fmt_name}: relative error {err:.2e}"


GEMV = moe_dispatch.KernelChoice(block_n=16, block_k=32, split_k=2)
Q2S_INT8 = moe_dispatch.KernelChoice(block_n=64, block_k=64, int8_act=True)
GEMM = moe_dispatch.KernelChoice(grouped=True, use_dot=True, block_m=16, block_n=16, block_k=32)


@pytest.mark.parametrize("fmt_name", list(formats(64, 32)))
@pytest.mark.parametrize("mode", ["gemv", "gemm"])
def test_formats_small(fmt_name, mode):
    force = (GEMV, GEMV) if mode == "gemv" else (GEMM, GEMM)
    run_case(fmt_name, 3, 2, 6, 64, 32, force=force, present_frac=0.7, seed=1)


@pytest.mark.parametrize("act", ["silu_clamped", "gpt_oss"])
def test_activations_and_bias(act):
    run_case("q2s", 2, 2, 4, 64, 32, act=act, bias=True, force=(GEMV, GEMV), seed=2)
    run_case("bfloat16", 2, 2, 4, 64, 32, act=act, bias=True, force=(GEMM, GEMM), seed=3)


@pytest.mark.parametrize("mask", ["off", "on", "random"])
def test_delta_masks(mask):
    run_case("q2s+nvfp4", 4, 2, 5, 64, 32, mask=mask, force=(GEMM, GEMM), seed=4)
    run_case("nested", 2, 2, 5, 64, 32, mask=mask, force=(GEMV, GEMV), seed=5)


def test_one_expert_non_contiguous_odd_tokens():
    run_case("q2s", 7, 3, 5, 64, 32, one_expert=True, non_contiguous=True, force=(GEMM, GEMM))


def test_q2s_gemv_default_config():
    """The q2s GEMV kernel with the dispatcher's own config (one K tile of up to 512, rows split
    in four sub-tiles), both grids (even experts fitted, odd b = 3a) and an additive delta."""
    gu = q2s_expert_format(64, 32, False, 32, 16)
    assert q2s_gemv.q2s_gemv_supports(
        blob_decode.matrix_spec(gu, "gate_up"), blob_decode.matrix_spec(gu, "down"), None, None
    )
    run_case("q2s", 3, 2, 6, 64, 32, present_frac=0.7, seed=13)
    run_case("q2s+q2s", 3, 2, 6, 64, 32, mask="random", seed=14)


@pytest.mark.parametrize("fmt_name", ["q2s", "q2s+q2s", "q2s+nvfp4"])
def test_q2s_gemv_int8(fmt_name):
    """The q2s GEMV kernel with int8 activations (IDP4A on the device, plain integer ops under
    the interpreter) against the twin that rounds activations the same way; fitted and b = 3a
    grids, a delta on random pairs, two K tiles."""
    run_case(fmt_name, 3, 2, 6, 128, 64, present_frac=0.7, force=(Q2S_INT8, Q2S_INT8), seed=15)


@pytest.mark.parametrize("fmt_name", ["q2s", "q2s+nvfp4"])
def test_q2s_gemv_int8_ragged_tiles(fmt_name):
    """K not a multiple of BLOCK_K and rows not a multiple of the program's (the masked path,
    EVEN=0): K = 96 is 1.5 tiles of 64 in both launches, and down's 96 rows 1.5 programs."""
    run_case(fmt_name, 2, 2, 5, 96, 96, force=(Q2S_INT8, Q2S_INT8), seed=16)


@pytest.mark.parametrize("fmt_name", ["q2s", "q2s+nvfp4"])
def test_q2s_gemv_group_acc(fmt_name):
    """Sums kept per q2s group (`KernelChoice.group_acc`): gate_up's groups of 2 words (K = 128
    in one tile), down's of 1 (the per-word path), whole and ragged tiles."""
    choice = moe_dispatch.KernelChoice(block_n=64, block_k=128, int8_act=True, group_acc=True)
    run_case(fmt_name, 3, 2, 6, 128, 64, present_frac=0.7, force=(choice, choice), seed=17)
    run_case(fmt_name, 2, 2, 5, 96, 96, force=(choice, choice), seed=18)


@pytest.mark.parametrize("fmt_name", ["q2s", "q2s+nvfp4"])
def test_q2s_gemv_quant_in(fmt_name):
    """gate_up rounding x to int8 words itself (`KernelChoice.quant_in`, no rounding launch):
    the twin's figures, whole and ragged tiles; with a delta plane the option is ignored (the
    delta reads the rounded x from memory) and results stay right."""
    choice = moe_dispatch.KernelChoice(block_n=64, block_k=64, int8_act=True, quant_in=True)
    run_case(fmt_name, 3, 2, 6, 128, 64, present_frac=0.7, force=(choice, choice), seed=19)
    run_case(fmt_name, 2, 2, 5, 96, 96, force=(choice, choice), seed=20)


def _q2s_outputs(choices, seed, tokens=2, experts=4):  # type: ignore[no-untyped-def]
    """The q2s GEMV's outputs [T, 2, 128] for each (gate_up, down) config of `choices`, on one
    random call: hidden 128, intermediate 64, top-2, bf16 activations, every expert in a slot."""
    gen = torch.Generator().manual_seed(seed)
    fmt = q2s_expert_format(128, 64, False, 32, 16)
    pool = Pool(fmt, None, experts, torch.ones(experts, dtype=torch.bool), gen)
    dev_pool, offsets, table, _ = pool.device_args()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
    w = torch.rand(tokens, 2, generator=gen).to(DEVICE)
    x = torch.randn(tokens, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    outs = []
    for choice in choices:
        out = torch.zeros(tokens, 2, 128, device=DEVICE)
        moe_slots_triton(x, ids.to(DEVICE), w, table, dev_pool, fmt, ExpertActivation(), out,
                         slot_offsets=offsets, choice=choice)  # fmt: skip
        outs.append(out.cpu())
    return outs


@pytest.mark.parametrize(("depth", "pipe"), [(2, 0), (1, 3)])
def test_q2s_gemv_look_ahead(depth, pipe):
    """Two K tiles of weights in flight (`KernelChoice.depth` 2), or the tiles loaded in a loop
    Triton's pipeliner streams (`pipe` 3; under the interpreter a plain loop), against the
    twin: four K tiles in gate_up (depth 2: the last two tiles' look-aheads past the end), two
    in down; ragged tiles (masked look-aheads). And bit for bit the sums of the hand-made
    one-tile prefetch (only when words are loaded changes), fitted and b = 3a grids."""
    four = moe_dispatch.KernelChoice(block_n=64, block_k=32, int8_act=True, depth=depth,
                                     pipe=pipe)  # fmt: skip
    run_case("q2s", 2, 2, 4, 128, 64, force=(four, four), seed=22)
    ragged = replace(four, block_k=64)
    run_case("q2s", 1, 2, 4, 96, 96, force=(ragged, ragged), seed=24)
    plain = replace(four, depth=1, pipe=0)
    outs = _q2s_outputs([(plain, plain), (four, four)], seed=25)
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0


@pytest.mark.parametrize("mask", ["on", "random"])
def test_q2s_gemv_delta_ahead(mask):
    """The NVFP4 delta's next K tile loaded before this one is used (`KernelChoice.delta_ahead`)
    against the twin: four K tiles in gate_up and two in down (the last tile's look-ahead
    reloading it), ragged tiles (masked look-aheads past the end), K split in two ranges (each
    range's own first tile), with group sums and pipe_x; pairs with the mask off skip it."""
    ahead = moe_dispatch.KernelChoice(block_n=64, block_k=32, int8_act=True, delta_ahead=True)
    run_case("q2s+nvfp4", 2, 2, 4, 128, 64, mask=mask, force=(ahead, ahead), seed=26)
    ragged = replace(ahead, block_k=64, group_acc=True)
    run_case("q2s+nvfp4", 2, 2, 5, 96, 96, mask=mask, force=(ragged, ragged), seed=27)
    split = replace(ahead, split_k=2, pipe_x=True)
    run_case("q2s+nvfp4", 1, 2, 4, 160, 64, mask=mask, force=(split, split), seed=28)


def test_q2s_gemv_split_k():
    """K split in two ranges of whole tiles (`KernelChoice.split_k` 2), the last program of each
    (pair, row tile) finishing the sums and the epilogue: the twin's figures with an even and an
    odd count of K tiles, ragged tiles, two tiles in flight, a delta on random pairs, bias and
    gpt-oss's activation (added once); the same outputs call after call, and the partial-sum
    and count buffers left zero for the next call."""
    two = moe_dispatch.KernelChoice(block_n=64, block_k=32, int8_act=True, split_k=2)
    run_case("q2s", 2, 2, 4, 128, 64, force=(two, two), seed=40)  # 4 tiles, 2 tiles
    run_case("q2s", 1, 2, 4, 160, 32, force=(two, two), seed=41)  # 5 tiles: 3 + 2
    ragged = replace(two, block_k=64)
    run_case("q2s+nvfp4", 2, 2, 5, 96, 96, mask="random", force=(ragged, ragged), seed=42)
    deep = replace(two, depth=2)
    run_case("q2s", 1, 2, 4, 128, 64, act="gpt_oss", bias=True, force=(deep, deep), seed=43)
    outs = _q2s_outputs([(two, two), (two, two)], seed=44, tokens=3, experts=6)
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0
    assert q2s_gemv._SPLIT_BUFFERS
    for partial, count in q2s_gemv._SPLIT_BUFFERS.values():
        assert not partial.any() and not count.any()
    with pytest.raises(ValueError, match="1 or 2"):
        _q2s_outputs([(replace(two, split_k=4), two)], seed=45)


def test_q2s_gemv_two_pairs_per_program():
    """Two pairs of one expert per program (`KernelChoice.pairs` 2): the twin's figures when
    every token shares an expert (seven pairs of it: three programs of two, one alone, three
    empty), on random routing over few experts, with ragged tiles, group sums, two tiles in
    flight and 8-row sub-tiles; calls it cannot serve so (a delta plane, gate_up rounding x
    itself) fall back to one pair and stay right; bit for bit the one-pair outputs."""
    two = moe_dispatch.KernelChoice(block_n=64, block_k=32, int8_act=True, pairs=2)
    run_case("q2s", 7, 3, 5, 64, 32, one_expert=True, force=(two, two), seed=50)
    run_case("q2s", 5, 2, 3, 64, 32, force=(two, two), seed=51)
    ragged = replace(two, block_k=64, group_acc=True)
    run_case("q2s", 3, 2, 2, 96, 96, force=(ragged, ragged), seed=52)
    deep = replace(two, depth=2, block_n=32)
    run_case("q2s", 3, 2, 2, 64, 32, act="gpt_oss", bias=True, force=(deep, deep), seed=53)
    run_case("q2s+nvfp4", 3, 2, 3, 64, 32, mask="random", force=(two, two), seed=54)
    qin = replace(two, quant_in=True)
    run_case("q2s", 3, 2, 2, 64, 32, force=(qin, qin), seed=55)
    one = replace(two, pairs=1)
    outs = _q2s_outputs([(one, one), (two, two)], seed=56, tokens=4, experts=3)
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0
    with pytest.raises(ValueError, match="1 or 2"):
        _q2s_outputs([(replace(two, pairs=3), two)], seed=57)


def test_q2s_gemv_row_tiles():
    """Consecutive row tiles of a pair in one program (`KernelChoice.row_tiles`): the twin's
    figures with a tile count that is no multiple of them (the last program redoes the last
    tile), ragged tiles, a delta on random pairs, two tiles in flight, two pairs of an expert a
    program; bit for bit the outputs of one tile a program; split-K refused with them."""
    rt = moe_dispatch.KernelChoice(block_n=32, block_k=64, int8_act=True, row_tiles=3,
                                   maxnreg=128)  # fmt: skip
    run_case("q2s", 2, 2, 4, 128, 64, force=(rt, rt), seed=70)  # 4 and 4 tiles
    deep = replace(rt, depth=2, row_tiles=2, block_n=64)
    run_case("q2s+nvfp4", 2, 2, 4, 96, 96, mask="random", force=(deep, deep), seed=71)
    two = replace(rt, row_tiles=2, pairs=2)  # two pairs of an expert a program, too
    run_case("q2s", 3, 2, 3, 64, 32, one_expert=True, force=(two, two), seed=74)
    one = replace(rt, row_tiles=1)
    outs = _q2s_outputs([(one, one), (rt, rt)], seed=72)
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0
    with pytest.raises(ValueError, match="row_tiles"):
        _q2s_outputs([(replace(rt, split_k=2), rt)], seed=73)


def test_q2s_gemv_eight_row_subtiles_round_h(monkeypatch):
    """gate_up with 8-row sub-tiles (block_n 32, the zero-copy configs' size) rounds h to int8
    words itself, its two sub-tiles making one word (so only x is rounded by a launch of its
    own): the twin's figures, and bit for bit the outputs of 16-row sub-tiles (whose words are
    one sub-tile's)."""
    eight = moe_dispatch.KernelChoice(block_n=32, block_k=64, int8_act=True)
    rounded = []
    real = int8_words.quant_words
    monkeypatch.setattr(q2s_gemv, "quant_words", lambda x, *a: rounded.append(x) or real(x, *a))
    run_case("q2s", 2, 2, 4, 128, 64, force=(eight, eight), seed=26)
    assert len(rounded) == 1 and rounded[0].shape[-1] == 128  # x only, not h
    outs = _q2s_outputs([(eight, eight), (replace(eight, block_n=64), eight)], seed=27)
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0


def test_q2s_gemv_quant_in_is_bit_identical():
    """The in-kernel rounding is `_quant_words_kernel`'s, bit for bit: the same outputs with
    and without the option (bf16 activations, fitted and b = 3a grids, two K tiles)."""
    c = moe_dispatch.KernelChoice(block_n=64, block_k=64, int8_act=True)
    qi = replace(c, quant_in=True)
    outs = _q2s_outputs([(c, c), (qi, qi)], seed=21, tokens=3, experts=6)
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0


@pytest.mark.parametrize("group", [64, 128, 48])
def test_q2s_gemv_groups(group):
    """Groups of 4 and 8 words take the q2s GEMV kernel (scales repeated by joins; a 128-column
    group widens a 64-column K tile); other multiples of 16 fall back to the generic kernel."""
    fmt = q2s_expert_format(384, 64, False, group, 16)
    gu, dn = moetier_specs(fmt)
    assert q2s_gemv.q2s_gemv_supports(gu, dn, None, None) == (group != 48)
    gen = torch.Generator().manual_seed(group)
    experts, tokens, top_k = 4, 2, 2
    pool = Pool(fmt, None, experts, torch.ones(experts, dtype=torch.bool), gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    x = torch.randn(tokens, 384, generator=gen)
    dev_pool, offsets, table, _ = pool.device_args()
    got = torch.empty(tokens, top_k, 384, device=DEVICE)
    choice = moe_dispatch.KernelChoice(block_n=64, block_k=64, int8_act=True)
    used = moe_slots_triton(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), table, dev_pool,
                            fmt, ExpertActivation(), got, slot_offsets=offsets,
                            choice=(choice, choice))  # fmt: skip
    ref = torch.empty(tokens, top_k, 384)
    moe_slots_ref(x, ids, weights, pool.slot_table, pool.pool, fmt, ExpertActivation(), ref,
                  act_int8=used[0].int8_act)  # fmt: skip
    err = (got.cpu() - ref).norm() / ref.norm()
    assert err < 1e-3, err


def moetier_specs(fmt):
    return blob_decode.matrix_spec(fmt, "gate_up"), blob_decode.matrix_spec(fmt, "down")


def test_quant_words_matches_ref():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * 3
    x[1, 16:32] = 0.0  # an all-zero word
    xq, xs, xsum, xqn = int8_words.quant_words(x.to(DEVICE))
    # xq [R, 4 (s), W]: byte j of (s, w) holds column 16w + s + 4j
    q = torch.stack([(xq.cpu() >> (8 * j)).to(torch.int8) for j in range(4)], dim=-1)
    q = q.permute(0, 2, 3, 1).reshape(5, 96).float()  # [R, w, j, s] -> column 16w + 4j + s
    from moetier.kernels.moe_ref import quant_words_ref

    deq = q * xs.cpu().repeat_interleave(16, dim=1)
    assert torch.equal(deq, quant_words_ref(x))
    assert torch.equal(xsum.cpu(), q.reshape(5, 6, 16).sum(dim=2).int())
    # xqn [R, 4 (j), W]: byte s of (j, w) holds column 16w + 4j + s
    natural = torch.stack([(xqn.cpu() >> (8 * s)).to(torch.int8) for s in range(4)], dim=-1)
    assert torch.equal(natural.permute(0, 2, 1, 3).reshape(5, 96).float(), q)


def test_default_slot_offsets_made_once_and_masks_viewed(monkeypatch):
    """A call without slot offsets takes the plain layout (slot s at s * stride) from a tensor
    made once per pool shape, not two launches a call; a bool delta mask is read through a
    uint8 view, not a cast launch. Both calls still match the twin."""
    torch.manual_seed(5)
    fmt, delta_fmt = formats(64, 32)["q2s+nvfp4"]
    experts, stride = 3, align_up(max(fmt.nbytes, delta_fmt.nbytes), 4096)
    pool = torch.zeros(2 * experts, stride, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(5)
    for e in range(experts):
        pool[e, : fmt.nbytes] = random_blob(fmt, gen)
        pool[experts + e, : delta_fmt.nbytes] = random_blob(delta_fmt, gen)
    pool = pool.to(DEVICE)
    table = torch.arange(experts, dtype=torch.int32, device=DEVICE)
    ids = torch.tensor([[0, 2], [1, 0]], device=DEVICE)
    w = torch.rand(2, 2, device=DEVICE)
    x = torch.randn(2, 64, device=DEVICE)
    mask = torch.tensor([[True, False], [False, True]], device=DEVICE)
    first = moe_triton._plain_slot_offsets(pool)
    assert moe_triton._plain_slot_offsets(pool) is first
    assert first.tolist() == [s * stride for s in range(2 * experts)]
    assert torch.equal(pair_tables._mask_bytes(mask), mask.to(torch.uint8))
    assert pair_tables._mask_bytes(mask).data_ptr() == mask.data_ptr()  # a view, no launch
    made = []
    real_arange = torch.arange
    monkeypatch.setattr(torch, "arange", lambda *a, **k: made.append(a) or real_arange(*a, **k))
    got = torch.empty(2, 2, 64, device=DEVICE)
    used = moe_slots_triton(x, ids, w, table, pool, fmt, ExpertActivation(), got, delta_mask=mask,
                            delta_table=table + experts, delta_fmt=delta_fmt)  # fmt: skip
    assert made == []
    want = torch.empty_like(got)
    moe_slots_ref(x.cpu(), ids.cpu(), w.cpu(), table.cpu(), pool.cpu(), fmt, ExpertActivation(),
                  want, delta_mask=mask.cpu(), delta_table=(table + experts).cpu(),
                  delta_fmt=delta_fmt, act_int8=used[0].int8_act)  # fmt: skip
    assert (got.cpu() - want).norm() / want.norm() < 1e-3


def test_dispatch_is_shape_only():
    small = moe_dispatch.choose(8, 128, 1536, 2048)
    large = moe_dispatch.choose(4096, 128, 1536, 2048)
    assert not small.grouped and small.split_k >= 1
    assert large.grouped and large.use_dot and large.block_m >= 16


def test_both_launches_share_one_grouping(monkeypatch):
    """A tuned table with an entry for gate_up's shape only (BLOCK_M 64) must not leave down at
    the default BLOCK_M: both launches walk the same blocks of pairs."""
    key = moe_dispatch.config_key(4096, 128, 4096, 2048)
    table = {key: {"grouped": True, "use_dot": True, "block_m": 64, "block_n": 128}}
    monkeypatch.setattr(moe_dispatch, "tuned_configs", lambda name: table)
    gu, dn = moe_dispatch.choose_pair(4096, 128, (4096, 2048), (2048, 2048))
    assert gu.block_m == 64 and (dn.grouped, dn.use_dot, dn.block_m) == (True, True, 64)
    assert dn.split_k == 1


def test_zero_copy_configs_apply_to_zero_copy_calls_only(monkeypatch):
    """`q2s-gemv-zc:` entries (tuned for calls reading pinned host rows) serve zero-copy calls;
    other calls, and zero-copy calls of a shape without such an entry, take `q2s-gemv:`."""
    table = {
        "q2s-gemv:1536x2048": {"block_n": 64, "block_k": 512},
        "q2s-gemv-zc:1536x2048": {"block_n": 32, "block_k": 2048},
        "q2s-gemv:2048x768": {"block_n": 64, "block_k": 256},
    }
    monkeypatch.setattr(moe_dispatch, "tuned_configs", lambda name: table)
    assert moe_dispatch.choose_q2s_gemv(1536, 2048).block_k == 512
    zc = moe_dispatch.choose_q2s_gemv(1536, 2048, zero_copy=True)
    assert (zc.block_n, zc.block_k) == (32, 2048) and zc.int8_act and zc.pdl
    assert moe_dispatch.choose_q2s_gemv(2048, 768, zero_copy=True).block_k == 256
    assert moe_dispatch.choose_q2s_gemv(512, 256, zero_copy=True) == moe_dispatch.Q2S_GEMV


def test_delta_calls_keep_one_tile_in_registers(monkeypatch):
    """A config tuned with two K tiles in registers (depth 2, on the base plane alone) serves
    calls with a delta plane at depth 1, its other fields as tuned."""
    table = {"q2s-gemv:7168x2048": {"block_n": 32, "block_k": 512, "depth": 2, "pipe_x": True}}
    monkeypatch.setattr(moe_dispatch, "tuned_configs", lambda name: table)
    base = moe_dispatch.choose_q2s_gemv(7168, 2048)
    delta = moe_dispatch.choose_q2s_gemv(7168, 2048, delta=True)
    assert base.depth == 2 and delta == replace(base, depth=1)
    seen = []
    choose = moe_dispatch.choose_q2s_gemv
    monkeypatch.setattr(moe_triton, "choose_q2s_gemv", lambda *a: seen.append(a) or choose(*a))
    run_case("q2s+nvfp4", 1, 2, 4, 128, 64, seed=33)
    run_case("q2s", 1, 2, 4, 128, 64, seed=34)
    assert [a[3] for a in seen] == [True, True, False, False]  # gate_up, down of each call


def test_delta_configs_serve_delta_calls(monkeypatch):
    """`q2s-gemv-delta:` entries (tuned on calls with a delta plane) serve those calls only."""
    table = {
        "q2s-gemv:7168x2048": {"block_n": 32, "block_k": 512, "depth": 2},
        "q2s-gemv-delta:7168x2048": {"block_n": 128, "block_k": 256, "num_warps": 8},
    }
    monkeypatch.setattr(moe_dispatch, "tuned_configs", lambda name: table)
    assert moe_dispatch.choose_q2s_gemv(7168, 2048).block_n == 32
    delta = moe_dispatch.choose_q2s_gemv(7168, 2048, delta=True)
    assert (delta.block_n, delta.block_k, delta.num_warps, delta.depth) == (128, 256, 8, 1)
    assert moe_dispatch.choose_q2s_gemv(7168, 2048, zero_copy=True).block_n == 32


def test_sized_configs_serve_calls_up_to_their_pairs(monkeypatch):
    """`<key>:p<P>` entries (`--tune-small`) serve calls of at most P pairs, the smallest P
    that fits first; larger calls, and calls whose pairs are not given, take the plain key."""
    table = {
        "q2s-gemv:2048x768": {"block_n": 128, "block_k": 256},
        "q2s-gemv:2048x768:p16": {"block_n": 32, "block_k": 512},
        "q2s-gemv:2048x768:p8": {"block_n": 16, "block_k": 1024},
        "q2s-gemv-delta:2048x768:p16": {"block_n": 64, "block_k": 256},
    }
    monkeypatch.setattr(moe_dispatch, "tuned_configs", lambda name: table)
    choose = moe_dispatch.choose_q2s_gemv
    assert [choose(2048, 768, pairs=p).block_n for p in (1, 8, 9, 16, 17, 512)] == [
        16, 16, 32, 32, 128, 128,
    ]  # fmt: skip
    assert choose(2048, 768).block_n == 128
    assert choose(2048, 768, delta=True, pairs=16).block_n == 64
    assert choose(2048, 768, delta=True, pairs=24).block_n == 128  # the base key, depth 1
    assert choose(1536, 2048, pairs=8) == moe_dispatch.Q2S_GEMV


# ---- the full sweep on the device --------------------------------------------------------

SWEEP_TOKENS = [1, 2, 7, 64, 65, 4096]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", SWEEP_TOKENS)
@pytest.mark.parametrize("fmt_name", ["q2s", "q2s+nvfp4", "nested", "nvfp4", "mxfp4", "bfloat16"])
def test_gpu_sweep(tokens, fmt_name):
    for dtype in (torch.float32, torch.bfloat16):
        run_case(fmt_name, tokens, 4, 16, 256, 96, dtype=dtype, present_frac=0.8, seed=tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["off", "on", "random"])
def test_gpu_pinned_host_slots(mask):
    for tokens in (1, 65):
        run_case("q2s+nvfp4", tokens, 4, 16, 256, 96, mask=mask, host_slots=10, seed=7)
        run_case("nested", tokens, 4, 16, 256, 96, mask=mask, host_slots=10, seed=8)


@pytest.mark.gpu
def test_gpu_awkward_shapes():
    run_case("q2s", 65, 8, 32, 32, 32, seed=9)  # K equal to the group size
    run_case("q2s", 64, 8, 16, 512, 96, one_expert=True, non_contiguous=True, seed=10)
    run_case("q2s", 2, 2, 64, 256, 96, present_frac=0.1, seed=11)  # most experts absent
    run_case("bfloat16", 7, 2, 8, 256, 97, dtype=torch.bfloat16, seed=12)  # odd N


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["off", "on", "random"])
def test_gpu_q2s_gemv_prefetch_and_pdl(mask):
    """The sm_90 launch options of the q2s GEMV kernel (L2 prefetch of each program's rows,
    programmatic dependent launch, each alone and together) leave the results those of the
    twin; with slots in GPU memory and in pinned host memory (which the prefetch skips), whole
    and ragged tiles, one call and a CUDA graph of several (launches overlapping their
    predecessors)."""
    for pf, pdl in ((True, False), (False, True), (True, True)):
        c = moe_dispatch.KernelChoice(block_n=64, block_k=64, int8_act=True, prefetch_l2=pf,
                                      pdl=pdl)  # fmt: skip
        for tokens in (1, 7):
            run_case("q2s+nvfp4", tokens, 4, 16, 256, 128, mask=mask, host_slots=6, seed=tokens,
                     force=(c, c), dtype=torch.bfloat16)  # fmt: skip
        run_case("q2s", 2, 2, 5, 96, 96, force=(c, c), seed=16)  # ragged, EVEN = 0


def _gpu_q2s_cases(c: moe_dispatch.KernelChoice) -> None:
    """The q2s GEMV with config c (both launches) against the twin: 1 and 7 tokens of top-4
    over 16 experts, slots in GPU and in pinned host memory, a delta on random pairs; and
    ragged tiles (EVEN = 0)."""
    for tokens in (1, 7):
        run_case("q2s+nvfp4", tokens, 4, 16, 256, 128, mask="random", host_slots=6,
                 seed=tokens, force=(c, c), dtype=torch.bfloat16)  # fmt: skip
        run_case("q2s", tokens, 4, 16, 256, 128, host_slots=10, seed=tokens + 2, force=(c, c))
    run_case("q2s", 2, 2, 5, 96, 96, force=(c, c), seed=16)  # ragged, EVEN = 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("depth", "pipe", "pipe_x", "block_n", "split", "pairs"),
    [(2, 0, False, 64, 1, 1), (1, 3, False, 64, 1, 1), (1, 4, False, 32, 1, 1),
     (1, 0, True, 32, 1, 1), (2, 0, True, 64, 1, 1), (1, 0, False, 64, 2, 1),
     (2, 0, False, 32, 2, 1), (1, 3, False, 64, 2, 1), (1, 0, False, 64, 1, 2),
     (2, 0, True, 32, 1, 2), (1, 3, False, 64, 1, 2)],
)  # fmt: skip
def test_gpu_q2s_gemv_look_ahead(depth, pipe, pipe_x, block_n, split, pairs):
    """The look-ahead options compiled for real (depth 2: two tiles in registers; pipe: the
    pipeliner's cp.async through shared memory, which must also read pinned host rows; pipe_x:
    only the activations and scales through it), with
    PDL, against the twin: slots in GPU memory and in pinned host memory, a delta on some
    pairs, whole and ragged tiles; block_n 32 takes the 8-row sub-tiles that round h
    themselves; split 2: K in two ranges (`_split_sum`); pairs 2: two pairs of an expert per
    program (the q2s calls: 7 tokens of top-4 over 16 experts share some)."""
    c = moe_dispatch.KernelChoice(block_n=block_n, block_k=64, int8_act=True, pdl=True,
                                  depth=depth, pipe=pipe, pipe_x=pipe_x, split_k=split,
                                  pairs=pairs)  # fmt: skip
    _gpu_q2s_cases(c)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("pipe_x", "split", "block_n", "group_acc"),
    [(False, 1, 64, True), (True, 1, 32, False), (False, 2, 64, True)],
)
def test_gpu_q2s_gemv_delta_ahead(pipe_x, split, block_n, group_acc):
    """The NVFP4 delta's next K tile loaded ahead (`delta_ahead`), compiled for real with PDL,
    against the twin: slots in GPU and pinned host memory, the delta on random pairs and on
    all, whole and ragged tiles, K in two ranges."""
    c = moe_dispatch.KernelChoice(block_n=block_n, block_k=64, int8_act=True, pdl=True,
                                  pipe_x=pipe_x, split_k=split, group_acc=group_acc,
                                  delta_ahead=True)  # fmt: skip
    _gpu_q2s_cases(c)
    run_case("q2s+nvfp4", 3, 4, 16, 256, 128, mask="on", host_slots=6, seed=9, force=(c, c))
    run_case("q2s+nvfp4", 2, 2, 5, 96, 96, mask="random", force=(c, c), seed=17)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("row_tiles", "maxnreg", "depth", "block_n"), [(2, 0, 1, 64), (3, 128, 2, 64), (4, 128, 1, 32)]
)
def test_gpu_q2s_gemv_row_tiles(row_tiles, maxnreg, depth, block_n):
    """Row tiles one after another in a program, compiled for real, with PDL and a register
    cap, against the twin: slots in GPU and pinned host memory, a delta on random pairs,
    whole and ragged tiles, tile counts no multiple of row_tiles."""
    c = moe_dispatch.KernelChoice(block_n=block_n, block_k=64, int8_act=True, pdl=True,
                                  depth=depth, row_tiles=row_tiles, maxnreg=maxnreg)  # fmt: skip
    _gpu_q2s_cases(c)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("next_l2", "unroll", "depth"), [(True, 1, 1), (False, 2, 1), (True, 2, 2)]
)
def test_gpu_q2s_gemv_next_l2_unroll(next_l2, unroll, depth):
    """gate_up asking L2 for down's weights when done (a hint: the results must not change,
    host slots included, which it skips) and the K loop unrolled, compiled for real with PDL,
    against the twin."""
    c = moe_dispatch.KernelChoice(block_n=64, block_k=64, int8_act=True, pdl=True,
                                  next_l2=next_l2, unroll=unroll, depth=depth)  # fmt: skip
    _gpu_q2s_cases(c)


@pytest.mark.gpu
@pytest.mark.parametrize(("quant_in", "wait_first", "prime"), [(False, False, False),
                                                              (True, True, True)])  # fmt: skip
def test_gpu_gluon_prefetch_l2_matches_twin(quant_in, wait_first, prime):
    """Gluon launches asking L2 for all their rows first (prefetch_l2) on both launches: slots
    in GPU memory (asked for) and in pinned host memory (not asked for) give the twin's
    results, gate_up waiting first (the op's way at 1-2 tokens) and priming or not."""
    g = moe_dispatch.KernelChoice(block_n=64, block_k=256, num_warps=4, int8_act=True, pdl=True,
                                  gluon=True, prefetch_l2=True, prime=prime)  # fmt: skip
    gu = replace(g, quant_in=quant_in, wait_first=wait_first)
    for tokens in (1, 7):
        run_case("q2s", tokens, 4, 16, 512, 256, host_slots=10, seed=tokens, force=(gu, g))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize(
    ("block_n", "block_k", "warps", "pipe", "quant_in"),
    [(64, 256, 4, 0, False), (128, 512, 8, 0, True), (64, 256, 4, 3, True),
     (128, 512, 8, 2, False), (32, 512, 2, 0, True), (128, 256, 8, 2, True)],
)  # fmt: skip
def test_gpu_gluon_matches_twin(pdl, block_n, block_k, warps, pipe, quant_in):
    """Both launches in Gluon, or one of them with the Triton kernel's other, against the twin
    (int8 activations): 1 and 7 tokens of top-4 over 16 experts, b = 3a and fitted grids (odd
    and even experts), slots in GPU and pinned host memory; words through registers (pipe 0)
    or a cp.async ring (pipe 2, 3); x rounded by a launch or in gate_up (quant_in), bf16 and
    strided x too; h rounded in gate_up (16-row words) for down."""
    g = moe_dispatch.KernelChoice(block_n=block_n, block_k=block_k, num_warps=warps,
                                  int8_act=True, pdl=pdl, gluon=True, pipe=pipe,
                                  quant_in=quant_in)  # fmt: skip
    t = moe_dispatch.KernelChoice(block_n=64, block_k=64, int8_act=True, pdl=pdl)
    for tokens in (1, 7):
        for force in ((g, g), (g, t), (t, g)):
            run_case("q2s", tokens, 4, 16, 512, 256, host_slots=10, seed=tokens, force=force)
    run_case("q2s", 3, 8, 16, 1024, 512, seed=5, force=(g, g), dtype=torch.bfloat16)
    run_case("q2s", 2, 4, 16, 512, 256, seed=6, force=(g, g), non_contiguous=True)


@pytest.mark.gpu
@pytest.mark.parametrize("quant_in", [False, True])
def test_gpu_gluon_prime_matches_twin(quant_in):
    """Both Gluon launches asking for their second K tile before their wait: one K tile (K 256,
    whose second is its first again), two (K 512, gate_up's next_l2 too) and eight (K 2048),
    host slots too, against the twin."""
    g = moe_dispatch.KernelChoice(block_n=64, block_k=256, num_warps=4, int8_act=True,
                                  pdl=True, gluon=True, quant_in=quant_in, prime=True)  # fmt: skip
    for tokens, hidden in ((1, 256), (3, 512), (7, 2048)):
        run_case("q2s", tokens, 4, 16, hidden, 256, host_slots=10, seed=tokens, force=(g, g))
    nl2 = replace(g, next_l2=True, next_l2_at=2)
    run_case("q2s", 2, 4, 16, 512, 512, host_slots=10, seed=9, force=(nl2, g))


@pytest.mark.gpu
@pytest.mark.parametrize("at", [0, 1, 2])
def test_gpu_gluon_next_l2_matches_twin(at):
    """The Gluon gate_up asking L2 for down's weights (next_l2) after its K loop or 1-2 tiles
    before its end: a hint, so the results stay the twin's, host slots (which it skips)
    included; one K tile (K 256) and eight (K 2048)."""
    g = moe_dispatch.KernelChoice(block_n=64, block_k=256, num_warps=4, int8_act=True,
                                  pdl=True, gluon=True, quant_in=True, next_l2=True,
                                  next_l2_at=at)  # fmt: skip
    for tokens, hidden in ((1, 256), (7, 2048)):
        run_case("q2s", tokens, 4, 16, hidden, 256, host_slots=10, seed=tokens, force=(g, g))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hidden", "inter", "top_k", "tokens"),
    [(2048, 768, 8, 1), (4096, 2048, 6, 1), (4096, 2048, 6, 2), (7168, 2048, 8, 1)],
)
def test_gpu_q2s_dispatcher_configs_at_model_shapes(hidden, inter, top_k, tokens):
    """The configs the dispatcher takes for 1-2 token calls at the bench's model shapes
    (Qwen3-30B-A3B, DeepSeek-V4-Flash, DeepSeek-V3; on the H200 its tuned `:p` entries, Gluon
    and Triton launches mixed) against the twin."""
    run_case("q2s", tokens, top_k, 16, hidden, inter, seed=tokens)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hidden", "inter", "top_k", "tokens"),
    [(2048, 768, 8, 1), (2048, 768, 8, 16), (4096, 2048, 6, 1), (4096, 2048, 6, 2)],
)
def test_gpu_q2s_delta_configs_at_model_shapes(hidden, inter, top_k, tokens):
    """The dispatcher's configs for calls with an NVFP4 delta plane (on the H200 its tuned
    `q2s-gemv-delta:` entries) at Qwen3-30B-A3B's and DeepSeek-V4-Flash's shapes, the delta
    on random pairs, against the twin."""
    run_case("q2s+nvfp4", tokens, top_k, 16, hidden, inter, mask="random", seed=tokens)


@pytest.mark.gpu
@pytest.mark.parametrize(("quant_pdl", "split"), [(False, 1), (True, 1), (True, 2)])
def test_gpu_q2s_gemv_pdl_in_a_cuda_graph(quant_pdl, split):
    """Calls chained in one CUDA graph with PDL (each GEMV launch may start before the kernel
    before it ends and waits for it before reading activations): replays give the eager
    results, call after call. quant_pdl: the rounding launch too, each call's x a view of the
    previous call's output, so that it directly follows the down launch it must wait for.
    split: K in two ranges (`_split_sum`'s atomics and counts between overlapping launches)."""
    gen = torch.Generator().manual_seed(0)
    fmt = q2s_expert_format(256, 128, False, 32, 16)
    experts, top_k = 16, 4
    pool = Pool(fmt, None, experts, torch.ones(experts, dtype=torch.bool), gen, 0)
    dev_pool, offsets, table, _ = pool.device_args()
    c = moe_dispatch.KernelChoice(block_n=64, block_k=64, int8_act=True, pdl=True,
                                  quant_pdl=quant_pdl, split_k=split)  # fmt: skip
    x = torch.randn(1, 256, generator=gen).cuda()
    outs, ids = [], []
    for _ in range(6):  # each call's input is the previous call's output: a real dependency
        ids.append(torch.randperm(experts, generator=gen)[:top_k][None].cuda())
        outs.append(torch.zeros(1, top_k, 256, device="cuda"))
    w = torch.rand(1, top_k, generator=gen).cuda()

    # chained directly, the clamped activation keeps the outputs finite
    act = ExpertActivation("silu_clamped" if quant_pdl else "silu")

    def chain() -> None:
        h = x
        for i in range(6):
            moe_slots_triton(h, ids[i], w, table, dev_pool, fmt, act, outs[i],
                             slot_offsets=offsets, choice=(c, c))  # fmt: skip
            if quant_pdl:  # no kernel between this call's down and the next one's rounding
                h = outs[i][:, 0]
            else:
                h = torch.nn.functional.normalize(outs[i].sum(1), dim=-1)  # stays finite

    chain()
    torch.cuda.synchronize()
    eager = [o.clone() for o in outs]
    assert all(bool(o.isfinite().all()) for o in eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for o in outs:
        o.zero_()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, eager, strict=True):
            assert torch.equal(got, want)


@triton.jit
def _late_routing_writer(src, dst, n, delay_ns, BLOCK: tl.constexpr):
    """A kernel that lets the launch after it start at once (as a PDL-aware router could),
    then spins delay_ns before it writes the routing: dst[:n] = src[:n]."""
    gdc_launch_dependents()
    start = ptx._globaltimer()
    while ptx._globaltimer() - start < delay_ns:
        pass
    at = tl.arange(0, BLOCK)
    tl.store(dst + at, tl.load(src + at, mask=at < n), mask=at < n)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    ["model-shape", "model-shape-no-wait-first", "triton-wait-first", "rounding-launch-first"],
)
def test_gpu_q2s_routing_written_by_the_kernel_before(case):
    """The q2s GEMV's launches read the routing and tables before their PDL wait (to find
    their weights early), but only the wait makes the kernel before's writes visible. A CUDA
    graph of a kernel (launched with PDL) that lets the next launch start at once and writes
    the routing 5 ms later, then the call: the op's way (first_pdl off: the call's first
    launch starts once that kernel has ended) computes the new routing's experts, as the
    twin does. With first_pdl (the bench's chained calls, whose routing is fixed) a GEMV
    first in the call starts early and computes with the stale routing (what first_pdl's
    default guards against), while a rounding launch first lets gate_up start only after its
    own wait. model-shape: the dispatcher's configs at Qwen3-30B-A3B's shape, 1 token (on
    the H200 a Gluon gate_up that rounds x itself, first, with wait_first: launched with PDL,
    its programs wait before they read anything); -no-wait-first: those configs with
    wait_first off (the first launch without PDL); triton-wait-first: the Triton kernel's
    gate_up rounding x itself, first, with wait_first; rounding-launch-first: the Triton
    kernel behind a rounding launch with PDL (quant_pdl). (H200: queued eagerly rather than
    in a graph, the call started only after that kernel had ended in either mode.)"""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90")
    gen = torch.Generator().manual_seed(5)
    model = case.startswith("model-shape")
    hidden, inter, experts, top_k = (2048, 768, 16, 8) if model else (256, 128, 16, 4)
    fmt = formats(hidden, inter)["q2s"][0]
    pool = Pool(fmt, None, experts, torch.ones(experts, dtype=torch.bool), gen, 0)
    dev_pool, offsets, table, _ = pool.device_args()
    force = None
    if case == "rounding-launch-first":
        c = moe_dispatch.KernelChoice(block_n=64, block_k=64, int8_act=True, pdl=True,
                                      quant_pdl=True)  # fmt: skip
        force = (c, c)
    elif case == "triton-wait-first":
        c = moe_dispatch.KernelChoice(block_n=64, block_k=64, int8_act=True, pdl=True)
        force = (replace(c, quant_in=True, wait_first=True), c)
    elif case == "model-shape-no-wait-first":
        pairs = top_k
        force = (
            replace(moe_dispatch.choose_q2s_gemv(2 * inter, hidden, pairs=pairs), wait_first=False),
            moe_dispatch.choose_q2s_gemv(hidden, inter, pairs=pairs),
        )
    perm = torch.randperm(experts, generator=gen)
    old, new = perm[:top_k][None], perm[top_k : 2 * top_k][None]  # no expert in both
    x = torch.randn(1, hidden, generator=gen).cuda()
    w = torch.rand(1, top_k, generator=gen).cuda()
    act = ExpertActivation()
    want = torch.zeros(1, top_k, hidden, device="cuda")
    used = moe_slots_triton(x, new.cuda(), w, table, dev_pool, fmt, act, want,
                            slot_offsets=offsets, choice=force)  # fmt: skip
    ref = torch.zeros(1, top_k, hidden)
    moe_slots_ref(x.cpu(), new, w.cpu(), pool.slot_table, pool.pool, fmt, act, ref,
                  act_int8=used[0].int8_act)  # fmt: skip
    err = (want.cpu() - ref).norm() / ref.norm()
    assert err < 1e-3, f"relative error {err:.2e} against the twin"
    results = {}
    src, ids = new.cuda(), old.cuda()
    for first_pdl in (False, True):
        got = torch.zeros(1, top_k, hidden, device="cuda")

        def step(got=got, first_pdl=first_pdl) -> None:
            _late_routing_writer[(1,)](src, ids, top_k, 5_000_000, BLOCK=16, launch_pdl=True)
            moe_slots_triton(x, ids, w, table, dev_pool, fmt, act, got, slot_offsets=offsets,
                             choice=force, first_pdl=first_pdl)  # fmt: skip

        step()  # (compiles)
        graph = torch.cuda.CUDAGraph()  # the launches queued together, as a decode step's are
        with torch.cuda.graph(graph):
            step()
        ids.copy_(old.cuda())
        got.zero_()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        results[first_pdl] = got
    assert torch.equal(results[False], want), "the op's call read a stale routing"
    if not (used[0].int8_act and not used[0].quant_in):  # no rounding launch: the GEMV first
        assert not torch.equal(results[True], want), "the test no longer sees a stale read"
    else:  # a rounding launch first, which lets gate_up start only once it has waited
        assert torch.equal(results[True], want)


Q2S_MMA = moe_dispatch.KernelChoice(
    grouped=True, use_dot=True, block_m=16, block_n=16, block_k=32, q2s_mma=True
)


@pytest.mark.parametrize("fmt_name", ["q2s", "q2s+nvfp4", "q2s+q2s"])
def test_q2s_mma(fmt_name):
    run_case(fmt_name, 9, 2, 6, 64, 32, force=(Q2S_MMA, Q2S_MMA), present_frac=0.7, seed=3)


@pytest.mark.parametrize("act", ["silu_clamped", "gpt_oss"])
def test_q2s_mma_activations_and_bias(act):
    run_case("q2s", 9, 2, 4, 64, 32, act=act, bias=True, force=(Q2S_MMA, Q2S_MMA), seed=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_q2s_mma(dtype):
    """The prefill kernel (PRMT lookup for 16-bit dots) at every size and awkward shape."""
    force = (Q2S_MMA, Q2S_MMA)
    for tokens in (1, 7, 65, 600):
        run_case("q2s", tokens, 4, 16, 256, 96, dtype=dtype, force=force, seed=tokens)
    run_case("q2s", 65, 8, 32, 32, 32, dtype=dtype, force=force, seed=9)  # K = the group
    run_case("q2s", 64, 8, 16, 512, 96, dtype=dtype, force=force, one_expert=True,
             non_contiguous=True, seed=10)  # fmt: skip
    wide = replace(Q2S_MMA, block_m=32, block_n=64, block_k=64)  # 288 and 96 rows: odd tiles
    run_case("q2s", 33, 2, 8, 288, 96, dtype=dtype, force=(wide, wide), seed=12)
    for mask in ("off", "on", "random"):
        run_case("q2s+nvfp4", 65, 4, 16, 256, 96, dtype=dtype, mask=mask, force=force,
                 host_slots=10, seed=13)  # fmt: skip
