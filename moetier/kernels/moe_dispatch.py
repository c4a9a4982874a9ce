"""The one place that picks a MoE kernel variant (STYLE.md §6).

GEMV (one program per (token, expert) pair, broadcast-multiply and sum over K, split-K to fill
the GPU) for decode; GEMM (pairs grouped per expert into BLOCK_M rows, `tl.dot`) for prefill.
Tuned tile sizes come from the user's table (`moetier tune`, in the cache folder) over the
shipped configs/<gpu name>.json (written by bench/kernels.py --tune), or a card of the same
architecture's (`tuned_configs`); where neither has an entry the defaults below apply.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from moetier.kernels import tuned_tables

CONFIG_DIR = Path(__file__).parent / "configs"  # the shipped tables, configs/<card>.json
# Pairs per call above which the grouped tl.dot kernel wins (tokens * top_k).
GEMM_MIN_PAIRS = 128
# The same for q2s, whose GEMV kernel (H200, Qwen3-30B-A3B and DeepSeek shapes) still beats the
# grouped kernel at 128 pairs by 3x; it reads each expert once per pair, so it stops at 512.
Q2S_GEMV_MAX_PAIRS = 512
# The q2s GEMV grouped by expert (`q2s_gemv_grouped.py`) serves calls of 2+ tokens and at most
# this many pairs (512 included: Qwen3-30B-A3B's 64 tokens of top-8) whose expected pairs per
# distinct expert (`expected_sharing`) reach Q2S_GROUPED_MIN_SHARING, or
# Q2S_GROUPED_MIN_SHARING_ZC for calls reading pinned host rows, where every extra read of an
# expert crosses PCIe. Set from bench/studies/q2s_grouped.py on the H100 (8 layers of the
# Qwen3-30B-A3B shape, ms a step, per-pair or q2s_mma -> grouped): resident T=4 0.21 -> 0.49,
# T=16 0.57 -> 1.03, T=64 3.05 (q2s_mma) -> 2.56; a 25% GPU budget, the rest zero-copy: T=4
# 6.35 -> 6.74, T=16 23.2 -> 17.4, T=64 78.1 -> 27.3 (sharing: T=4 1.10, T=16 1.55, T=64 4.07).
Q2S_GROUPED_MAX_PAIRS = 512
Q2S_GROUPED_MIN_SHARING = 3.0
Q2S_GROUPED_MIN_SHARING_ZC = 1.3


@dataclass(frozen=True)
class KernelChoice:
    grouped: bool = False  # False: GEMV, one pair per program
    use_dot: bool = False
    block_m: int = 1
    block_n: int = 32
    block_k: int = 128
    # K ranges per row tile: the generic GEMV splits gate_up only (down is never split); the
    # q2s GEMV either launch, in 1 or 2 (`_split_sum`; H200: 2 was 14-31% slower at 1-2
    # tokens, docs/benchmarks.md, so 1 in its table)
    split_k: int = 1
    # q2s GEMV: pairs of one expert a program serves (1 or 2: its rows read once for both);
    # int8 activations rounded by a launch, no delta plane, no split, else 1. H200: 2 lost
    # everywhere (twice the accumulators: 225 registers), so 1 in its table.
    pairs: int = 1
    num_warps: int = 4
    num_stages: int = 2
    int8_act: bool = False  # q2s GEMV only: activations quantized to int8 per 16 columns, IDP4A
    group_acc: bool = False  # q2s GEMV int8 only: sums kept per q2s group (fewer FMUL, registers)
    q2s_mma: bool = False  # q2s grouped GEMM on tensor cores (`q2s_mma.py`), prefill
    # q2s GEMV on sm_90: prefetch_l2: each program first asks for its rows in L2 (blobs in the
    # GPU pool; for host rows it measured no gain). H200, the op's way: on Qwen3-30B-A3B's
    # 1-token Gluon gate_up (with wait_first: asked for once its routing is known), 0.96-0.97x
    # the time a call; 1.02-1.19x at its 2 tokens and the DeepSeek shapes (docs/benchmarks.md).
    # pdl: launched with programmatic dependent launch (weights read while the kernel before
    # still runs). Both launches of a call must agree on pdl.
    prefetch_l2: bool = False
    pdl: bool = False
    # q2s GEMV int8 on sm_90, gate_up's choice: the launches rounding activations to int8 are
    # launched with programmatic dependent launch too (their launch overlaps the kernel
    # before them, which they wait for before reading anything). H200: 0-4% faster, on
    # where the tuner kept it.
    quant_pdl: bool = False
    # q2s GEMV int8, gate_up: x rounded to int8 words in the kernel (one launch fewer a call;
    # not with a delta plane, which reads the rounded x from memory). The Triton kernel rounds
    # each K tile in its loop (H200: slower at every large shape, off in its configs); the
    # Gluon one (`gluon`) rounds its token's row once while staging it (on with it).
    quant_in: bool = False
    # q2s GEMV: K tiles of weights loaded ahead of the one being decoded (1 or 2); tuned per
    # launch (H200: kept for DeepSeek-V3's down only).
    depth: int = 1
    # q2s GEMV: 0, or the loop's stages when Triton's pipeliner streams the K tiles through
    # shared memory (cp.async) instead of the hand-made prefetch. Slower at every shape on
    # the H200 (docs/benchmarks.md): 0.
    pipe: int = 0
    # q2s GEMV, pipe 0: the activations and group scales (not the words) streamed one K tile
    # ahead through shared memory by Triton's pipeliner; tuned per launch (H200: won while
    # the fitted path ran, kept by no launch on the b = 3a path).
    pipe_x: bool = False
    # q2s GEMV: consecutive row tiles of a pair one program computes, one after another (its
    # blob found once for them all; no split-K)
    row_tiles: int = 1
    # q2s GEMV: the launch's register cap per thread (ptxas maxnreg; 0: the compiler's
    # choice), e.g. 128 keeps four programs of 4 warps an SM where row_tiles added a few; a
    # cap just above what the kernel takes moves where ptxas issues the next K tile's loads
    # (H200: DeepSeek-V4-Flash's 1-2 token Gluon launches at 80, from the loop's middle to
    # its top; DeepSeek-V3's 1-token gate_up at 128, with its down in Gluon 0.97-0.99x a call;
    # docs/benchmarks.md)
    maxnreg: int = 0
    # q2s GEMV gate_up on sm_90: its programs, when done, ask L2 for their pair's down weights
    # (down's reads start while gate_up's last programs run; blobs in the GPU pool)
    next_l2: bool = False
    # the Gluon gate_up with next_l2: asked for when that many K tiles of its loop are left (0:
    # after the loop). H200: 1-2 at Qwen3-30B-A3B's 1-2 tokens (0.93x the time a call), next_l2
    # off at the DeepSeek shapes (1.08-1.13x there), docs/benchmarks.md
    next_l2_at: int = 0
    # q2s GEMV in Gluon, words in registers (pipe < 2; the Triton kernel and a cp.async ring
    # ignore it): the second K tile's words and scales asked for with the first, before
    # the wait for the launch before and the staging of x (H200: on DeepSeek-V4-Flash's 1-2
    # token downs, 0.96-0.99x the time a call, its 1-token gate_up, 0.98x, its 2-token gate_up
    # with wait_first (then asked for with tile 0's, after the wait), 0.99x, and both its
    # launches at 4-16 tokens, 0.96-0.98x; on Qwen3-30B-A3B's gate_up at 4-16 tokens,
    # 0.92-0.97x, where at 1 token it took 1.08x; no gain at DeepSeek-V3; docs/benchmarks.md)
    prime: bool = False
    # q2s GEMV: the K loop unrolled this many times (1: not)
    unroll: int = 1
    # q2s GEMV (Triton kernel) with an NVFP4 delta plane: the delta's codes, block scales and
    # activations of K tile i + 1 loaded before tile i's are multiplied (else each tile's where
    # it is used). H200: on every shape's delta down and DeepSeek-V4-Flash's delta gate_up
    # (0.88-0.98x a call with a delta), off on the other gate_ups (1.01-1.16x there)
    delta_ahead: bool = False
    # q2s GEMV int8 on sm_90, no delta plane or bias: the launch runs the Gluon kernel
    # (`q2s_gluon.py`: activations staged in shared memory once a program, gate_up rounding x
    # and h itself) instead; elsewhere the Triton kernel with the same fields. H200: on where
    # it measured faster (1-2 tokens at DeepSeek-V3, every size at DeepSeek-V4-Flash, gate_up
    # and from 4 tokens down at Qwen3-30B-A3B; docs/benchmarks.md)
    gluon: bool = False
    # q2s GEMV gate_up on sm_90, a call's first launch (no rounding launch, `moe_slots_triton`
    # without first_pdl): launched with PDL all the same, its programs waiting for the kernel
    # before before they read anything (the routing may be its output) and letting down start
    # after that wait. Its launch overlaps the kernel before's end where that kernel lets the
    # next start early (`gdc_launch_dependents`). H200, the op's way: on at 1-2 tokens, 0.96-0.99x
    # the time a call (DeepSeek-V3: 1 token; at 2, 0.98-1.00x); at Qwen3-30B-A3B's 4-8 tokens
    # 1.03-1.07x, off; docs/benchmarks.md
    wait_first: bool = False
    # q2s decode grouped by expert (`q2s_gemv_grouped.py`): 0, or BLOCK_T, the pairs of one
    # expert a program serves (a power of two), its weight tile read once for all of them
    # (`choose_q2s_grouped` sets it; gate_up's value is the call's)
    group_pairs: int = 0


GEMV = KernelChoice()
# q2s GEMV kernel (`_q2s_gemv_kernel`): block_n = rows per program (four sub-tiles), no split-K
# (pdl: on sm_90 each launch starts while the one before ends, 2-3 µs a call on the H200)
Q2S_GEMV = KernelChoice(block_n=64, block_k=512, num_warps=4, int8_act=True, pdl=True)
GEMM = KernelChoice(grouped=True, use_dot=True, block_m=32, block_n=64, block_k=64, num_warps=4)
# q2s prefill kernel (`q2s_mma.py`); block_m follows the mean pairs per expert (`mean_rows`)
Q2S_MMA = replace(GEMM, block_n=64, block_k=64, num_stages=3, q2s_mma=True)


def _device_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name().replace(" ", "_")


# the compute capability of each card a tuned table ships for: a card without its own table
# takes one of its architecture's (an H100 the H200's), else the generic defaults
TUNED_CAPABILITY = {"NVIDIA_H200": (9, 0)}
log = logging.getLogger(__name__)
# the table every lookup reads while set (`using_table`), whatever the card
_OVERRIDE: dict[str, dict[str, Any]] | None = None


def _capability() -> tuple[int, int] | None:
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def _read_table(path: Path) -> dict[str, dict[str, Any]]:
    """A tuned table whose entries hold KernelChoice fields only (else a ValueError saying
    what to do)."""
    from dataclasses import fields

    return tuned_tables.read_table(path, {f.name for f in fields(KernelChoice)})


def shipped_table(device_name: str) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """(the card whose shipped table this GPU takes, that table): its own, else a tuned card's
    of the same architecture (`TUNED_CAPABILITY`), else (None, {})."""
    path = CONFIG_DIR / f"{device_name}.json"
    if path.exists():
        return device_name, _read_table(path)
    cap = _capability() if device_name != "cpu" else None
    same = [card for card, c in sorted(TUNED_CAPABILITY.items()) if c == cap]
    if not same:
        return None, {}
    return same[0], _read_table(CONFIG_DIR / f"{same[0]}.json")


@functools.cache
def tuned_configs(device_name: str) -> dict[str, dict[str, Any]]:
    """{"gemv:<n>x<k>" | "q2s-gemv:<n>x<k>" | ...: KernelChoice fields} for this GPU, first found
    first: the user's table for this card, driver and Triton (`moetier tune`), over the card's
    shipped table, else over the shipped table of a card of the same architecture; else the
    generic defaults ({}). Which ones is logged once (info); CPU reads none.
    $MOETIER_KERNEL_CONFIGS names one table file to read alone ("defaults": none)."""
    if _OVERRIDE is not None:
        return _OVERRIDE
    forced = os.environ.get(tuned_tables.TABLE_ENV)
    if forced:
        table = {} if forced == "defaults" else _read_table(Path(forced))
        log.info("kernel configs: %s only ($%s)", forced, tuned_tables.TABLE_ENV)
        return table
    if device_name == "cpu":
        return {}
    user_path = tuned_tables.user_table_path(device_name)
    user = _read_table(user_path) if user_path.exists() else {}
    source, shipped = shipped_table(device_name)
    said = [f"tuned on this card ({user_path})"] if user else []
    if source == device_name:
        said.append(f"shipped for {source}")
    elif source:
        said.append(f"shipped for {source} (same architecture)")
    log.info("kernel configs for %s: %s", device_name,
             ", then ".join(said + ["generic defaults"]))  # fmt: skip
    return tuned_tables.layered(user, shipped)


def untuned_hint(store: str = "STORE") -> str | None:
    """How to tune, for a CUDA card with neither a user table (`moetier tune`) nor a shipped
    one of its own; None elsewhere (CPU, a tuned card, a table forced by the environment)."""
    name = _device_name()
    if name == "cpu" or os.environ.get(tuned_tables.TABLE_ENV):
        return None
    path = tuned_tables.user_table_path(name)
    if path.exists() or (CONFIG_DIR / f"{name}.json").exists():
        return None
    source, _ = shipped_table(name)
    running = f"{source}'s (same architecture)" if source else "the generic defaults"
    return (f"no kernel configs tuned for {name} with this driver and Triton: running "
            f"{running}. `moetier tune {store}` times them on this card (5 minutes at most) "
            f"and keeps the fastest in {path}")  # fmt: skip


@contextlib.contextmanager
def using_table(table: dict[str, dict[str, Any]] | None) -> Iterator[None]:
    """Every lookup reads `table` alone inside (None: the usual tables; {}: the generic
    defaults): the tuner's starting point, a benchmark's A/B of tables in one process."""
    global _OVERRIDE
    before = _OVERRIDE
    _OVERRIDE = table
    tuned_configs.cache_clear()
    try:
        yield
    finally:
        _OVERRIDE = before
        tuned_configs.cache_clear()


def mean_rows(pairs: int, num_experts: int) -> int:
    """Mean pairs per expert as a power of two, 16..128: what sets the best BLOCK_M."""
    return max(16, min(128, 1 << max(0, (pairs // max(1, num_experts) - 1).bit_length())))


def config_key(pairs: int, num_experts: int, n: int, k: int) -> str:
    """Key of a tuned config: mode, weight shape, and for GEMM the mean rows per expert."""
    if pairs < GEMM_MIN_PAIRS:
        return f"gemv:{n}x{k}"
    return f"gemm:{n}x{k}:m{mean_rows(pairs, num_experts)}"


def choose_pair(
    pairs: int, num_experts: int, gate_up: tuple[int, int], down: tuple[int, int]
) -> tuple[KernelChoice, KernelChoice]:
    """Configs for the two launches of one call ([n, k] of gate_up and of down). The pair
    grouping (mode and BLOCK_M) is gate_up's, forced onto down: both launches walk the same
    blocks of pairs, whatever the tuned tables say for each shape alone."""
    c_gu = choose(pairs, num_experts, *gate_up)
    c_dn = choose(pairs, num_experts, *down)
    if (c_dn.grouped, c_dn.use_dot, c_dn.block_m) != (c_gu.grouped, c_gu.use_dot, c_gu.block_m):
        base = replace(GEMM if c_gu.grouped else GEMV, block_n=c_dn.block_n, block_k=c_dn.block_k)
        c_dn = replace(base, grouped=c_gu.grouped, use_dot=c_gu.use_dot, block_m=c_gu.block_m)
    return c_gu, replace(c_dn, split_k=1)


def choose(pairs: int, num_experts: int, n: int, k: int) -> KernelChoice:
    """Kernel config for one projection ([n, k] weights) over `pairs` pairs; the same tiles serve
    every format today.

    Depends only on shapes, never on routing values, so it is fixed for a CUDA-graph bucket."""
    mode = "gemm" if pairs >= GEMM_MIN_PAIRS else "gemv"
    base = GEMM if mode == "gemm" else GEMV
    tuned = tuned_configs(_device_name()).get(config_key(pairs, num_experts, n, k))
    if tuned:
        base = replace(base, **tuned)  # type: ignore[arg-type]
    elif mode == "gemv":
        # split K until each pair has >= 8 programs per 128 rows: enough CTAs at batch 1
        base = replace(base, split_k=max(1, min(8, k // 512)))
    return base


def choose_q2s_gemv(
    n: int, k: int, zero_copy: bool = False, delta: bool = False, pairs: int | None = None
) -> KernelChoice:
    """Config of the q2s GEMV kernel for one [n, k] projection (few pairs per call).
    zero_copy: the call reads blobs from pinned host rows too (zero-copy decode), whose tuned
    configs (`q2s-gemv-zc:`, PCIe-bound: larger K tiles win) are taken where they exist.
    delta: the call has a delta plane, whose loads and registers move the best tile; its own
    tuned configs (`q2s-gemv-delta:`, `bench/kernels.py --tune-delta`) are taken where they
    exist, else the base plane's at depth 1 (two K tiles in registers lost with a delta: H200,
    DeepSeek-V3 down at 8 tokens 0.855 -> 0.950 ms a call).
    pairs: the call's (token, expert) pairs; an entry `<key>:p<P>` (`--tune-small`: tuned on
    calls of at most P pairs) serves calls of at most P pairs, the smallest such P first,
    before the entry without a size."""
    table = tuned_configs(_device_name())

    def entry(prefix: str) -> dict[str, int | bool] | None:
        key = f"{prefix}:{n}x{k}"
        sizes = [int(name[len(key) + 2 :]) for name in table if name.startswith(key + ":p")]
        fits = [p for p in sizes if pairs is not None and pairs <= p]
        return table[f"{key}:p{min(fits)}"] if fits else table.get(key)

    tuned = (
        (entry("q2s-gemv-zc") if zero_copy else None)
        or (entry("q2s-gemv-delta") if delta and not zero_copy else None)
        or entry("q2s-gemv")
    )
    c = replace(Q2S_GEMV, **tuned) if tuned else Q2S_GEMV  # type: ignore[arg-type]
    return replace(c, depth=1) if delta else c


def choose_q2s_mma(
    pairs: int, num_experts: int, gate_up: tuple[int, int], down: tuple[int, int]
) -> tuple[KernelChoice, KernelChoice]:
    """Configs of the q2s prefill kernel's two launches; down takes gate_up's BLOCK_M (both walk
    the same blocks of pairs)."""
    rows = mean_rows(pairs, num_experts)
    table = tuned_configs(_device_name())
    base = replace(Q2S_MMA, block_m=min(64, rows))
    tuned = table.get(f"q2s-mma:{gate_up[0]}x{gate_up[1]}:m{rows}")
    c_gu = replace(base, **tuned) if tuned else base  # type: ignore[arg-type]
    tuned = table.get(f"q2s-mma:{down[0]}x{down[1]}:m{rows}")
    c_dn = replace(base, **tuned) if tuned else base  # type: ignore[arg-type]
    return c_gu, replace(c_dn, block_m=c_gu.block_m, split_k=1)


# the grouped kernel's default tiles: BLOCK_T pairs x 4 sub-tiles of 16 rows x 256 columns
Q2S_GROUPED = replace(Q2S_GEMV, block_n=64, block_k=256, pdl=False, group_acc=True, group_pairs=4)


def expected_sharing(tokens: int, top_k: int, num_experts: int) -> float:
    """Expected pairs per distinct expert of a call whose tokens each route to top_k of
    num_experts experts uniformly: P / (E (1 - (1 - k/E)^T))."""
    if tokens < 1 or num_experts < 1:
        return 1.0
    k = min(top_k, num_experts)
    distinct = num_experts * (1 - (1 - k / num_experts) ** tokens)
    return tokens * top_k / max(distinct, 1e-9)


def choose_q2s_grouped(
    tokens: int, top_k: int, num_experts: int, n_k: tuple[tuple[int, int], tuple[int, int]],
    zero_copy: bool = False,
) -> tuple[KernelChoice, KernelChoice] | None:  # fmt: skip
    """Configs of the grouped q2s decode kernel's two launches ([n, k] of gate_up and down), or
    None where the call stays with the per-pair GEMV or q2s_mma: one token (no expert shared),
    more than `Q2S_GROUPED_MAX_PAIRS` pairs, or too little expected sharing. BLOCK_T
    (`group_pairs`) covers the expected pairs per expert (4, 8 from 2 pairs an expert).
    Tuned entries `q2s-grouped:<n>x<k>:t<T>` (T = BLOCK_T) replace the default tiles.
    Depends only on shapes (a CUDA-graph bucket's choice is fixed)."""
    pairs = tokens * top_k
    share = expected_sharing(tokens, top_k, num_experts)
    least = Q2S_GROUPED_MIN_SHARING_ZC if zero_copy else Q2S_GROUPED_MIN_SHARING
    if tokens < 2 or pairs > Q2S_GROUPED_MAX_PAIRS or share < least:
        return None
    block_t = 8 if share >= 2 else 4
    table = tuned_configs(_device_name())
    out = []
    for n, k in n_k:
        tuned = table.get(f"q2s-grouped:{n}x{k}:t{block_t}")
        c = replace(Q2S_GROUPED, group_pairs=block_t)
        out.append(replace(c, **tuned) if tuned else c)  # type: ignore[arg-type]
    return out[0], replace(out[1], group_pairs=block_t)
