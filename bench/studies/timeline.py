"""Where a chained q2s decode call's time goes (H200 study): every program of the q2s GEMV's
launches (Triton or Gluon) writes the GPU's global timer at its start, before and after its
wait for the launch before it (programmatic dependent launch), and at its end
(`q2s_gemv.TRACE_BUFFERS`).
Calls are replayed as `bench/kernels.py` times them (one CUDA graph of chained calls); one JSON
line per (shape, tokens, variant) with the medians over the graph's middle calls, in µs:

- `call_us`: the graph's time per call with the stamps (`plain_call_us`: without them);
- `gu_release` / `dn_release`: from the end of the launch before (the previous call's down /
  this call's gate_up: its last program) to the first program past its wait;
- `gu_span` / `dn_span`: from that first release to the launch's last program's end;
- `gu_after_wait` / `dn_after_wait`: a program's time from its wait's end to its own end
  (median, and `_max`), and `*_before_wait`: from its start to its wait;
- `gu_late` / `dn_late`: programs that started only after the launch's first release (a
  second wave: no SM had room for them earlier);
- `gu_end_spread`: last end minus the median end (the tail).

  python3 bench/studies/timeline.py --shapes qwen3-30b-a3b,deepseek-v4-flash --tokens 1,2 \
      --variant gu:quant_in=0

The int8 rounding launch (configs without quant_in) writes no stamps; it sits inside
`gu_release`. The stamps cost time themselves (`call_us` against `plain_call_us`), so the
figures say where time goes, not how much each part takes untraced."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, kernels
from common import emit, graph_ms  # noqa: E402
from kernels import SHAPES, make_case, parse_variant, variant_choices  # noqa: E402

from moetier.core.provenance import run_info  # noqa: E402
from moetier.kernels import moe_dispatch, q2s_gemv  # noqa: E402


def _med(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def timeline(shape: str, tokens: int, choice, calls: int) -> dict:  # type: ignore[no-untyped-def, type-arg]
    case = make_case("q2s", shape)
    sets = case.routings(tokens, calls, seed=tokens)
    fns = [lambda r=r: case.call(r, choice) for r in sets]
    plain = graph_ms(fns)
    most = 1 << 16
    bufs = [(torch.zeros(most, 8, dtype=torch.int64, device="cuda"),
             torch.zeros(most, 8, dtype=torch.int64, device="cuda")) for _ in sets]  # fmt: skip

    def traced(i: int):  # type: ignore[no-untyped-def]
        def run() -> None:
            q2s_gemv.TRACE_BUFFERS = bufs[i]
            try:
                fns[i]()
            finally:
                q2s_gemv.TRACE_BUFFERS = None

        return run

    # the stamps of graph_ms's last replay (every program writes all of its row each replay;
    # rows past a launch's programs stay zero)
    ms = graph_ms([traced(i) for i in range(len(sets))])
    torch.cuda.synchronize()
    launches = [tuple(buf[buf[:, 0] != 0].cpu() for buf in pair) for pair in bufs]
    rec: dict[str, object] = {"call_us": round(ms * 1e3, 3), "plain_call_us": round(plain * 1e3, 3)}
    rec.update(summarize(launches))  # type: ignore[arg-type]
    return rec


def summarize(launches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, object]:
    """The line's figures from each call's (gate_up, down) stamps, int64 [programs, 5] (start,
    before the wait, after it, end in ns; SM): medians over calls 2 .. n - 3 (each with a call
    before and after it), in µs."""
    rec: dict[str, object] = {}
    rec["traced"] = [name for name, i in (("gate_up", 0), ("down", 1)) if len(launches[0][i])]
    stats: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        stats.setdefault(key, []).append(float(value))

    for i in range(2, len(launches) - 2):
        gu, dn = launches[i]
        prev_dn = launches[i - 1][1]
        nxt_gu = launches[i + 1][0]
        for name, rows, before_end in (("gu", gu, prev_dn), ("dn", dn, gu)):
            if not len(rows):
                continue
            start, pre, post, end = (rows[:, j].double() / 1e3 for j in range(4))
            release = float(post.min())
            if len(before_end):
                add(f"{name}_release", release - float(before_end[:, 3].max()) / 1e3)
            add(f"{name}_span", float(end.max()) - release)
            add(f"{name}_after_wait", float((end - post).median()))
            add(f"{name}_after_wait_max", float((end - post).max()))
            add(f"{name}_before_wait", float((pre - start).median()))
            add(f"{name}_late", float((start > release).sum()))
            add(f"{name}_end_spread", float(end.max() - end.median()))
            add(f"{name}_programs", float(len(rows)))
            steps = start.sort().values.diff()
            if (steps > 0).any():  # the smallest gap between two starts: the timer's step, or more
                add("timer_step_ns", float(steps[steps > 0].min()) * 1e3)
            per_sm = torch.bincount(rows[:, 4].long())
            add(f"{name}_per_sm_max", float(per_sm.max()))
            if name == "gu" and len(nxt_gu):
                add("period", float(nxt_gu[:, 2].min()) / 1e3 - release)
    rec.update({k: _med(v) for k, v in stats.items()})
    return rec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v4-flash,deepseek-v3")
    parser.add_argument("--tokens", default="1")
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--variant", action="append", default=[],
                        help="[gu:|dn:]FIELD=V,... as bench/kernels.py takes it")  # fmt: skip
    args = parser.parse_args()
    info = run_info()
    variants: list[tuple[str, dict, str]] = [("dispatcher", {}, "both")]  # type: ignore[type-arg]
    variants += [parse_variant(v) for v in args.variant]
    for shape in args.shapes.split(","):
        hidden, inter, _, top_k = SHAPES[shape]
        for tokens in (int(t) for t in args.tokens.split(",")):
            pairs = tokens * top_k
            for spec, fields, launch in variants:
                choice = variant_choices(hidden, inter, pairs, fields, launch)
                try:
                    rec = timeline(shape, tokens, choice, args.calls)
                except Exception as exc:  # noqa: BLE001 (a variant a shape cannot run)
                    rec = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                emit({**info, "case": "timeline", "shape": shape, "tokens": tokens,
                      "variant": spec, **rec})  # fmt: skip
    moe_dispatch.tuned_configs.cache_clear()


if __name__ == "__main__":
    main()
