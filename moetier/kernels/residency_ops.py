"""Device-side work of the zero-copy decode path, as torch custom ops (no host sync, so a decode
step that calls them still captures into a CUDA graph):

- `moetier::count_pairs`: one MoE layer's (token, expert) pairs counted per expert (what the
  rebalance promotes by), the GPU hits among them and the hits on staging slots, in one launch
  (the torch version was about ten launches, 160 µs of a 2 ms token on the H200).
- `moetier::stage_scores` / `moetier::stage_guesses` / `moetier::stage_join`: a later MoE
  layer's scores of its experts, its best guesses copied from their pinned host rows into
  reserved GPU staging slots on a side stream (the copies overlap the layers in between), the
  expert -> entry table pointed at them, and the join the compute stream waits on before that
  layer.

Each kernel has a plain-torch twin (`*_ref`): the CPU path and the tests' reference.
"""

from __future__ import annotations

import ctypes
import os

import torch

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _count_pairs_kernel(ids, n, counts, offsets, table, pool_bytes, gpu_pairs, stage_from,
                            staged_pairs, BLOCK: tl.constexpr):  # fmt: skip
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        e = tl.load(ids + i, mask=i < n, other=-1)
        m = e >= 0  # (a negative id: a padding row's pair, not counted)
        tl.atomic_add(counts + e, tl.full((BLOCK,), 1, tl.int64), mask=m)
        entry = tl.load(table + e, mask=m, other=-1)  # -1: no blob (hybrid misses: the CPU's)
        off = tl.load(offsets + entry, mask=m & (entry >= 0), other=-1)
        on_gpu = m & (entry >= 0) & (off >= 0) & (off < pool_bytes)
        tl.atomic_add(gpu_pairs, tl.sum(on_gpu.to(tl.int64), axis=0))
        tl.atomic_add(staged_pairs, tl.sum((on_gpu & (off >= stage_from)).to(tl.int64), axis=0))

    @triton.jit
    def _stage_kernel(logits, table, host_entry, offsets, pool, stage_first, staging, staged,
                      staged_blobs, E, blob_words, M: tl.constexpr, BLOCK_E: tl.constexpr,
                      PARTS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """Program (j, part): guess j of the M best-scored experts that are neither in a cached
        GPU slot nor without a host row; copies part `part` of its host row into staging slot j;
        part 0 points the expert's table entry at the staging slot and the slot's previous guest
        (unless guessed again) back at its host row."""
        j = tl.program_id(0) // PARTS
        part = tl.program_id(0) % PARTS
        e = tl.arange(0, BLOCK_E)
        em = e < E
        entry = tl.load(table + e, mask=em, other=0)
        hrow = tl.load(host_entry + e, mask=em, other=-1)
        s = tl.load(logits + e, mask=em, other=0.0).to(tl.float32)
        s = tl.where(em & (entry >= stage_first) & (hrow >= 0), s, float("-inf"))
        guessed = e < 0  # all False: the experts guessed this time
        pick = -1
        count = tl.zeros((), tl.int32)
        for k in tl.static_range(M):
            top = tl.max(s, axis=0)
            best = tl.argmax(s, axis=0)
            valid = top > float("-inf")
            pick = tl.where(j == k, tl.where(valid, best, -1), pick)
            count += valid.to(tl.int32)
            guessed = guessed | (tl.where(valid, best, -1) == e)
            s = tl.where(e == best, float("-inf"), s)
        slot_entry = tl.load(staging + j)
        if pick >= 0:
            src_entry = tl.sum(tl.where(e == pick, hrow, 0), axis=0)
            src = (pool + tl.load(offsets + src_entry)).to(tl.pointer_type(tl.int64))
            dst = (pool + tl.load(offsets + slot_entry)).to(tl.pointer_type(tl.int64))
            chunk = (blob_words + PARTS - 1) // PARTS
            lo = part * chunk
            hi = tl.minimum(lo + chunk, blob_words)
            for w in range(lo, hi, BLOCK):
                i = w + tl.arange(0, BLOCK)
                tl.store(dst + i, tl.load(src + i, mask=i < hi), mask=i < hi)
        if part == 0:
            old = tl.load(staged + j)
            if old >= 0:
                if tl.sum(tl.where(e == old, guessed.to(tl.int32), 0), axis=0) == 0:
                    tl.store(table + old, tl.sum(tl.where(e == old, hrow, 0), axis=0))
            if pick >= 0:
                tl.store(table + pick, slot_entry)
            tl.store(staged + j, pick)
            if j == 0:
                tl.atomic_add(staged_blobs, count.to(tl.int64))

    @triton.jit
    def _scores_kernel(x, w, out, E, H, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
        """out[e] = w[e, :] . x for BLOCK_E experts per program, float32 sums."""
        e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        em = e < E
        acc = tl.zeros((BLOCK_E, BLOCK_H), tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            hm = h < H
            xv = tl.load(x + h, mask=hm, other=0.0).to(tl.float32)
            wv = tl.load(w + e[:, None] * H + h[None, :], mask=em[:, None] & hm[None, :],
                         other=0.0).to(tl.float32)  # fmt: skip
            acc += wv * xv[None, :]
        tl.store(out + e, tl.sum(acc, axis=1).to(out.dtype.element_ty), mask=em)

except ImportError:  # pragma: no cover - triton is a dependency on Linux x86_64
    triton = None


def _runs_triton(t: torch.Tensor) -> bool:
    """The Triton kernels run on CUDA, and on CPU under TRITON_INTERPRET=1 (the tests)."""
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def count_pairs_ref(
    topk_ids: torch.Tensor,
    counts: torch.Tensor,
    table: torch.Tensor,
    offsets: torch.Tensor,
    pool_bytes: int,
    gpu_pairs: torch.Tensor,
    stage_from: int,
    staged_pairs: torch.Tensor,
) -> None:
    """Twin of `count_pairs` in plain torch."""
    flat = topk_ids.flatten().long()
    flat = flat[flat >= 0]
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=counts.dtype))
    entry = table[flat].long()
    off = torch.where(entry >= 0, offsets[entry.clamp(min=0)], -1)
    on_gpu = (entry >= 0) & (off >= 0) & (off < pool_bytes)
    gpu_pairs.add_(on_gpu.sum().to(gpu_pairs.dtype))
    staged_pairs.add_((on_gpu & (off >= stage_from)).sum().to(staged_pairs.dtype))


@torch.library.custom_op(
    "moetier::count_pairs", mutates_args=("counts", "gpu_pairs", "staged_pairs")
)
def count_pairs(
    topk_ids: torch.Tensor,
    counts: torch.Tensor,
    table: torch.Tensor,
    offsets: torch.Tensor,
    pool_bytes: int,
    gpu_pairs: torch.Tensor,
    stage_from: int,
    staged_pairs: torch.Tensor,
) -> None:
    """counts [E] int64 += pairs per expert of topk_ids [T, k] (negative ids skipped: padding
    rows); gpu_pairs [] int64 += the pairs
    whose expert's entry (table [E] -> offsets; -1: none, hybrid misses' CPU experts) lies in
    the GPU pool's [0, pool_bytes); staged_pairs [] int64 += those of them at or past byte
    `stage_from` (staging slots)."""
    n = topk_ids.numel()
    if not _runs_triton(topk_ids):
        count_pairs_ref(topk_ids, counts, table, offsets, pool_bytes, gpu_pairs, stage_from,
                        staged_pairs)  # fmt: skip
        return
    block = min(1024, triton.next_power_of_2(max(n, 16)))
    _count_pairs_kernel[(triton.cdiv(n, block),)](
        topk_ids.contiguous(), n, counts, offsets, table, pool_bytes, gpu_pairs, stage_from,
        staged_pairs, BLOCK=block,
    )  # fmt: skip


@count_pairs.register_fake
def _(
    topk_ids: torch.Tensor,
    counts: torch.Tensor,
    table: torch.Tensor,
    offsets: torch.Tensor,
    pool_bytes: int,
    gpu_pairs: torch.Tensor,
    stage_from: int,
    staged_pairs: torch.Tensor,
) -> None:
    return None


def _bytes_at(pool: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """n bytes at `offset` from pool's first byte: a slice of pool, or (CPU: a host row of
    another arena) a tensor over that memory."""
    if 0 <= offset and offset + n <= pool.numel():
        return pool.view(-1)[offset : offset + n]
    if pool.is_cuda:
        raise ValueError("the reference path addresses CUDA memory only inside the pool")
    return torch.frombuffer(
        (ctypes.c_uint8 * n).from_address(pool.data_ptr() + offset), dtype=torch.uint8
    )


def stage_guesses_ref(
    logits: torch.Tensor,
    table: torch.Tensor,
    host_entry: torch.Tensor,
    offsets: torch.Tensor,
    pool: torch.Tensor,
    stage_first: int,
    staging: torch.Tensor,
    staged: torch.Tensor,
    staged_blobs: torch.Tensor,
    blob_bytes: int,
) -> None:
    """Twin of `_stage_kernel` in plain torch (the CPU path): offsets are byte offsets from
    `pool`'s first byte, inside it or (host rows on CPU) anywhere in host memory."""
    m = staging.numel()
    candidates = (table >= stage_first) & (host_entry >= 0)
    scores = logits.float().masked_fill(~candidates, float("-inf"))
    top = torch.topk(scores, min(m, scores.numel()))
    picks = [
        int(i) if float(v) > float("-inf") else -1
        for v, i in zip(top.values, top.indices, strict=True)
    ]
    picks += [-1] * (m - len(picks))
    for j, pick in enumerate(picks):
        old = int(staged[j])
        if old >= 0 and old not in picks:
            table[old] = host_entry[old]
        if pick >= 0:
            n = (blob_bytes + 7) // 8 * 8  # whole 8-byte words, as the kernel copies
            src = _bytes_at(pool, int(offsets[int(host_entry[pick])]), n)
            _bytes_at(pool, int(offsets[int(staging[j])]), n).copy_(src)
            table[pick] = staging[j]
        staged[j] = pick
    staged_blobs.add_(sum(p >= 0 for p in picks))


def stage_guesses_triton(
    logits: torch.Tensor,
    table: torch.Tensor,
    host_entry: torch.Tensor,
    offsets: torch.Tensor,
    pool: torch.Tensor,
    stage_first: int,
    staging: torch.Tensor,
    staged: torch.Tensor,
    staged_blobs: torch.Tensor,
    blob_bytes: int,
    parts: int = 2,
    block: int = 4096,
    num_warps: int = 8,
) -> None:
    """`_stage_kernel` on the current stream: `parts` programs per staging slot, each copying
    a `block`-word-aligned share of the blob (8-byte words: blobs and rows are 256-aligned).
    Few programs: on the H200, 2 per slot copy 2 x 1.39 MB alone at 45 GB/s as 32 per slot
    do, and one 16 KB load per program (170 programs) at 46 GB/s, but in the decode step
    those programs held the SMs the overlapped layer's GEMVs needed (qkv: 8 -> 30 µs)."""
    m = staging.numel()
    words = (blob_bytes + 7) // 8
    _stage_kernel[(m * parts,)](
        logits, table, host_entry, offsets, pool, stage_first, staging, staged, staged_blobs,
        logits.shape[0], words, M=m,
        BLOCK_E=triton.next_power_of_2(logits.shape[0]), PARTS=parts, BLOCK=block,
        num_warps=num_warps,
    )  # fmt: skip


_SIDE: dict[int, torch.cuda.Stream] = {}
_EVENTS: dict[int, torch.cuda.Event] = {}
_INPUTS: dict[tuple[int, int, torch.dtype, int], torch.Tensor] = {}


def _side_stream(t: torch.Tensor) -> torch.cuda.Stream:
    """The staging side stream of t's device (created once)."""
    device = t.device.index or 0
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(t.device)
    return _SIDE[device]


@torch.library.custom_op("moetier::stage_scores", mutates_args=("scores",))
def stage_scores(
    hidden: torch.Tensor, router: torch.Tensor, scores: torch.Tensor, stage_id: int, side: bool
) -> None:
    """scores [E] = router [E, H] · hidden [1, H]: a later MoE layer's scores of its experts
    (`stage_guesses` takes its best). `router` is the next layer's router with its columns
    scaled (`ExpertsRuntime.enable_prefetch`). On CUDA one launch of `_scores_kernel` (32
    programs for 128 experts; cuBLAS took 2 programs and 5.6 µs for Qwen3-30B-A3B's router on
    the H200), on the side stream when `side` (guesses from the MoE input: the product overlaps
    this layer's experts kernel), else on the current stream (guesses from the layer's output:
    the copies that follow wait for it either way, and no copy of `hidden` is needed)."""
    if not hidden.is_cuda or triton is None:
        scores.copy_(torch.mv(router.float(), hidden[0].float()))
        return
    if not side:
        _scores(hidden[0], router, scores)
        return
    side_stream = _side_stream(hidden)
    key = (stage_id, hidden.device.index or 0, router.dtype, hidden.shape[1])
    if key not in _INPUTS:  # the side stream's input: outlives the call (and a CUDA graph)
        _INPUTS[key] = torch.empty(hidden.shape[1], dtype=router.dtype, device=hidden.device)
    inp = _INPUTS[key]
    inp.copy_(hidden[0])  # on the compute stream: hidden's memory may be reused after
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        _scores(inp, router, scores)


def _scores(x: torch.Tensor, router: torch.Tensor, scores: torch.Tensor) -> None:
    """`_scores_kernel` on the current stream: scores [E] = router [E, H] · x [H]."""
    experts, hidden = router.shape
    block_e = 4
    _scores_kernel[(triton.cdiv(experts, block_e),)](
        x.contiguous(), router.contiguous(), scores, experts, hidden, BLOCK_E=block_e,
        BLOCK_H=min(1024, triton.next_power_of_2(hidden)), num_warps=4,
    )  # fmt: skip


@stage_scores.register_fake
def _(
    hidden: torch.Tensor, router: torch.Tensor, scores: torch.Tensor, stage_id: int, side: bool
) -> None:
    return None


@torch.library.custom_op("moetier::stage_guesses", mutates_args=("table", "staged", "staged_blobs"))
def stage_guesses(
    scores: torch.Tensor,
    table: torch.Tensor,
    host_entry: torch.Tensor,
    offsets: torch.Tensor,
    pool: torch.Tensor,
    stage_first: int,
    staging: torch.Tensor,
    staged: torch.Tensor,
    staged_blobs: torch.Tensor,
    blob_bytes: int,
    stage_id: int,
    after: torch.Tensor,
) -> None:
    """Stage a later MoE layer's guessed experts in GPU slots, off the compute stream.

    scores [E]: that layer's scores of its experts (`stage_scores`); the `staging.numel()`
    best among those whose entry in `table` [E] is >= `stage_first` (host rows and staging
    slots; entries below are cached GPU slots) are copied from their host rows (`host_entry`
    [E], -1: none) into the staging slots (`staging` [m] entries) and `table` points at them;
    `staged` [m] holds each slot's expert (-1: none), whose entry goes back to its host row
    when the slot gets another guest. staged_blobs [] int64 += blobs copied.

    On CUDA the work runs on the side stream (after `stage_scores` there) once what the
    current stream has queued (this layer's experts kernel) is done, so the copies overlap what
    follows (the next layer's attention); `stage_join(table, stage_id)` makes the current
    stream wait for it before the next layer reads `table`: the table's readers (that layer's
    counting and kernel) come after the join, so none sees an entry pointing at a slot still
    being written. No host sync: capturable in a CUDA graph (fork and join inside it).
    `pool`'s staging slots are written but not declared mutated: nothing in a compiled graph
    reads them except through `table` (declaring the multi-GB pool would invite a copy).
    `after` (this layer's experts output) is not read: as an input it orders the op after the
    kernel that writes it under torch.compile."""
    if not scores.is_cuda or triton is None:
        stage_guesses_ref(scores, table, host_entry, offsets, pool, stage_first, staging, staged,
                          staged_blobs, blob_bytes)  # fmt: skip
        return
    side = _side_stream(scores)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stage_guesses_triton(scores, table, host_entry, offsets, pool, stage_first, staging,
                             staged, staged_blobs, blob_bytes)  # fmt: skip
        if stage_id not in _EVENTS:
            _EVENTS[stage_id] = torch.cuda.Event()
        _EVENTS[stage_id].record(side)


@stage_guesses.register_fake
def _(
    scores: torch.Tensor,
    table: torch.Tensor,
    host_entry: torch.Tensor,
    offsets: torch.Tensor,
    pool: torch.Tensor,
    stage_first: int,
    staging: torch.Tensor,
    staged: torch.Tensor,
    staged_blobs: torch.Tensor,
    blob_bytes: int,
    stage_id: int,
    after: torch.Tensor,
) -> None:
    return None


@torch.library.custom_op("moetier::stage_join", mutates_args=("table",))
def stage_join(table: torch.Tensor, stage_id: int) -> None:
    """The current stream waits for `stage_guesses(..., stage_id)` (a no-op on CPU, where it
    ran in place). `table` is what the staging wrote: naming it orders this op before the
    table's next reader under torch.compile."""
    if table.is_cuda and stage_id in _EVENTS:
        torch.cuda.current_stream().wait_event(_EVENTS[stage_id])


@stage_join.register_fake
def _(table: torch.Tensor, stage_id: int) -> None:
    return None
