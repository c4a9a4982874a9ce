"""`moetier tune` against the shipped configs and the generic defaults (#51 item 4), one run:
per decode shape and size, the q2s experts call's speed with each table as a share of the copy
bandwidth measured in the same run; the tune started from the generic defaults within a time
bound (its wall time said); then, optionally, resident decode of the 8-layer slice with each
table (`moetier bench`, the table chosen by $MOETIER_KERNEL_CONFIGS).

  python bench/tune.py                         # Qwen3-30B-A3B, 1,2,4,8 tokens, 120 s of tuning
  python bench/tune.py --shapes qwen3-30b-a3b,deepseek-v4-flash --tune-seconds 60 --no-decode
  python bench/tune.py --smoke                 # CPU, Triton's interpreter, a tiny shape, seconds

One JSON line per result (bench/common.py `emit`): "tune" (wall time, each call size's speedup
over its start), "tune-table" (shape, tokens, table: defaults / tuned / shipped, ms a call,
GB/s, copy_GB/s, of_copy: the floor's share, the configs, vs_shipped: the shipped table's time
over this one's), "decode" (moetier bench's line with the table), "done" (the script's wall
time). Bytes a call as bench/kernels.py counts them (`Case.bytes_per_call`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SMOKE_SHAPE = (128, 64, 8, 2)  # hidden, expert intermediate, experts, top-k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b", help="bench/kernels.py shapes")
    parser.add_argument("--tokens", default="1,2,4,8", help="decode call sizes")
    parser.add_argument("--tune-seconds", type=float, default=120.0, help="the tune's bound")
    parser.add_argument(
        "--no-decode", action="store_true", help="skip resident decode of the 8-layer slice"
    )
    parser.add_argument("--decode-timeout", type=float, default=80.0, help="s per decode run")
    parser.add_argument("--out", type=Path, help="folder for the tuned table (default: temp)")
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, Triton's interpreter, a tiny shape (seconds)"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined
        args.shapes, args.tokens = "smoke", "1"
        args.tune_seconds = min(args.tune_seconds, 3.0)
    sets = 1 if args.smoke else 8  # routings a timed call cycles through (interpreter: 1)
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import kernels as kb
    from common import emit

    from moetier.core.provenance import run_info
    from moetier.kernels import moe_dispatch, tuned_tables
    from moetier.kernels import tune as tuning
    from moetier.residency.links import memory_bandwidth

    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        kb.SHAPES["smoke"] = SMOKE_SHAPE
    info = run_info()
    info["triton"] = tuned_tables.triton_version()
    info["driver"] = tuned_tables.driver_version()
    copy_bw = memory_bandwidth(device, 2**26 if args.smoke else 2**30)
    emit({**info, "case": "copy", "GB/s": round(copy_bw / 1e9, 1)})
    card = moe_dispatch._device_name()
    source, shipped = moe_dispatch.shipped_table(card)
    out = args.out or Path(tempfile.mkdtemp(prefix="moetier-tune-"))
    out.mkdir(parents=True, exist_ok=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    tables: dict[str, Any] = {"defaults": {}}
    for shape in args.shapes.split(","):
        hidden, inter, experts, top_k = kb.SHAPES[shape]
        fmt = kb.q2s_format(shape)
        case = kb.Case(shape, fmt, None, device=device)
        tshape = tuning.TuneShape(shape, fmt, None, experts, top_k)

        def timer(job: tuning.Job, t: int, c_gu: Any, c_dn: Any, case: Any = case) -> float:
            return tuning.time_config(case, t, c_gu, c_dn, max_sets=sets)

        path = out / f"tuned-{shape}.json"
        report = tuning.run_tune([tshape], args.tune_seconds, timer, card=card,
                                 from_defaults=True, decode_tokens=tokens, prefill_tokens=[],
                                 path=path, progress=False)  # fmt: skip
        emit({**info, "case": "tune", "shape": shape, "budget_s": args.tune_seconds,
              "wall_s": round(report.wall_s, 1), "from": "generic defaults",
              "jobs": report.jobs, "results": [
                  {"job": r.job.label, "speedup": round(r.speedup, 3), "timed": r.timed,
                   "of": r.job.size, "complete": r.complete} for r in report.results]})  # fmt: skip
        tables["tuned"] = tuned_tables.read_table(path)
        if source:
            tables["shipped"] = shipped
        best: dict[tuple[int, str], tuple[float, Any]] = {}
        for _ in range(1 if args.smoke else 2):  # rounds, each table in turn: the best of them
            for t in tokens:
                for name, table in tables.items():
                    with moe_dispatch.using_table(table):
                        pairs = t * top_k
                        launches = ((2 * inter, hidden), (hidden, inter))
                        pair = [moe_dispatch.choose_q2s_gemv(n, k, pairs=pairs)
                                for n, k in launches]  # fmt: skip
                        # the op's own dispatch, over as many routings as bench/kernels.py's
                        ms, r = tuning.time_case(case, t, None, 1 if args.smoke else 32)
                    if (t, name) not in best or ms < best[(t, name)][0]:
                        best[(t, name)] = (ms, (pair, r))
        for t in tokens:
            shipped_ms = best[(t, "shipped")][0] if (t, "shipped") in best else None
            for name in tables:
                ms, ((c_gu, c_dn), r) = best[(t, name)]
                nbytes, _ = case.bytes_per_call(r, 0, c_gu.int8_act, c_gu.quant_in)
                gbs = nbytes / ms / 1e6
                rec = {**info, "case": "tune-table", "shape": shape, "tokens": t, "table": name,
                       "table_source": {"shipped": source, "tuned": str(path)}.get(name),
                       "ms": round(ms, 5), "MB": round(nbytes / 1e6, 3), "GB/s": round(gbs, 1),
                       "copy_GB/s": round(copy_bw / 1e9, 1), "floor": "copy bandwidth",
                       "of_copy": round(gbs * 1e9 / copy_bw, 4),
                       "gu": kb._short(c_gu), "dn": kb._short(c_dn)}  # fmt: skip
                if shipped_ms:
                    rec["vs_shipped"] = round(shipped_ms / ms, 3)
                if name == "tuned":
                    rec["tune_s"] = round(report.wall_s, 1)
                emit(rec)
        del case
        if device == "cuda":
            torch.cuda.empty_cache()
    if not args.no_decode:
        decode(args, tables, out, info, emit)
    emit({**info, "case": "done", "wall_s": round(time.perf_counter() - started, 1)})


def decode(args: argparse.Namespace, tables: dict[str, Any], out: Path, info: dict, emit) -> None:  # type: ignore[no-untyped-def, type-arg]
    """Resident decode of the 8-layer Qwen3-30B-A3B slice (tiny, 2 layers, with --smoke) with
    each table, one `moetier bench` process each (the table by $MOETIER_KERNEL_CONFIGS; the
    step not compiled, so each run takes seconds: the tables differ only in the experts'
    kernels)."""
    from moetier.kernels import tuned_tables

    shape, layers = ("tiny", "2") if args.smoke else ("qwen3-30b-a3b", "8")
    for name, table in tables.items():
        path = out / f"table-{name}.json"
        path.write_text(json.dumps(table))
        env = dict(os.environ, **{tuned_tables.TABLE_ENV: "defaults" if not table else str(path)})
        cmd = [sys.executable, "-m", "moetier", "bench", "--shape", shape, "--layers", layers,
               "--batch", "1", "--json", "--no-compile-decode", "--prompt-tokens", "16",
               "--new-tokens", "8" if args.smoke else "64"]  # fmt: skip
        if not args.smoke:
            cmd.append("--native")
        try:
            run = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                 timeout=args.decode_timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            emit({**info, "case": "decode", "table": name, "error": "timeout"})
            continue
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        if run.returncode or not lines:
            emit({**info, "case": "decode", "table": name, "error": run.stderr[-400:]})
            continue
        for line in lines:
            rec = json.loads(line)
            keep = ("batch", "decode_tok_s", "ms_per_step", "floor_ms_per_step", "ratio_to_floor")
            emit({**info, "case": "decode", "table": name, "shape": shape, "layers": int(layers),
                  "compile_decode": False, **{k: rec[k] for k in keep if k in rec}})  # fmt: skip


if __name__ == "__main__":
    main()
