"""Study (docs/benchmarks.md, code of bbc4ca8): the q2s GEMV launches' read geometry without
their decode, codes only (pure reads, one or two K tiles of words ahead a program, rows
row-major or each tile contiguous, 0 or 10 integer operations a word), each launch alone,
timed like a call (a CUDA graph of launches on separate buffers); one JSON line per case.
Run from the repo root on the GPU: python3 docs/bench/read-geometry-study.py. Superseded for
whole calls by bench/launch_floor.py (the dispatcher's configs, scales too, PDL). Its
"v4-gate_up-wide" case reads 16 rows a program, a quarter of the others' bytes."""
import json, os, sys, itertools
import torch, triton, triton.language as tl
sys.path.insert(0, "bench")
from common import graph_ms, copy_bandwidth

@triton.jit
def geom(src, out, ROWS: tl.constexpr, ROW_WORDS: tl.constexpr, CW: tl.constexpr,
         NT: tl.constexpr, DEPTH: tl.constexpr, TILE_MAJOR: tl.constexpr, EXTRA: tl.constexpr):
    base = src + tl.program_id(0).to(tl.int64) * ROWS * ROW_WORDS
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, CW)[None, :]
    acc = tl.zeros((ROWS, CW), tl.int32)
    if TILE_MAJOR:
        a0 = tl.load(base + r * CW + c)
        a1 = tl.load(base + tl.minimum(1, NT - 1) * ROWS * CW + r * CW + c)
    else:
        a0 = tl.load(base + r * ROW_WORDS + c)
        a1 = tl.load(base + r * ROW_WORDS + tl.minimum(1, NT - 1) * CW + c)
    for t in range(NT):
        cur = a0
        if DEPTH == 2:
            a0 = a1
            tn = tl.minimum(t + 2, NT - 1)
        else:
            tn = tl.minimum(t + 1, NT - 1)
        if TILE_MAJOR:
            nx = tl.load(base + tn * ROWS * CW + r * CW + c)
        else:
            nx = tl.load(base + r * ROW_WORDS + tn * CW + c)
        if DEPTH == 2:
            a1 = nx
        else:
            a0 = nx
        for _ in tl.static_range(EXTRA):
            cur = cur * 1664525 + 1013904223
        acc ^= cur
    tl.store(out + tl.program_id(0), tl.xor_sum(tl.reshape(acc, (ROWS * CW,)), axis=0))

def main():
    copy = copy_bandwidth()
    print(json.dumps({"case": "copy", "GB/s": round(copy / 1e9, 1)}), flush=True)
    out = torch.empty(4096, dtype=torch.int32, device="cuda")
    # (name, programs, rows a program, row bytes, tile bytes a row)
    geoms = [("v4-gate_up", 384, 64, 1024, 128), ("v4-down", 384, 64, 512, 128),
             ("qwen3-gate_up", 384, 32, 512, 256), ("qwen3-down", 512, 32, 192, 64),
             ("v4-gate_up-wide", 384, 16, 1024, 512)]
    for (name, progs, rows, row_b, tile_b), warps, depth, tm, extra in itertools.product(
            geoms, (4, 8), (1, 2), (0, 1), (0, 10)):
        if name.startswith("qwen3-down") and tm:
            continue
        row_words, cw = row_b // 4, tile_b // 4
        nt = row_words // cw
        if cw & (cw - 1):
            continue
        nbytes = progs * rows * row_b
        count = max(2, -(-4 * 50 * 2**20 // nbytes) + 1)
        bufs = [torch.randint(0, 100, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(count)]
        fns = [lambda b=b: geom[(progs,)](b, out, rows, row_words, cw, nt, depth, tm, extra, num_warps=warps) for b in bufs]
        ms = graph_ms(fns)
        gbs = nbytes / ms / 1e6
        print(json.dumps({"case": "geom", "geom": name, "programs": progs, "rows": rows, "row_B": row_b,
                          "tile_B": tile_b, "warps": warps, "depth": depth, "tile_major": tm, "extra": extra,
                          "MB": round(nbytes / 1e6, 2), "us": round(ms * 1e3, 2), "GB/s": round(gbs, 1),
                          "of_copy": round(gbs * 1e9 / copy, 3)}), flush=True)
        del bufs

main()
