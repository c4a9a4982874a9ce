#!/usr/bin/env bash
# The down-with-items study (`KernelChoice.items`, `q2s_gluon._q2s_down_items_kernel`; written
# in a session that had no GPU, so never run yet) in one device call, expected 4-6 min (each
# step has a time limit; give the call timeout_s=600, within which the second pass of step 2
# may be cut at worst):
#
#   1. its GPU twin tests and the dispatcher's configs at the model shapes
#   2. same-run A/Bs at DeepSeek-V4-Flash's and Qwen3-30B-A3B's 1 token, the op's way
#      (`--first-launch after`), q2s and q2s-hot: down with 2-4 items a program beside a
#      gate_up capped so that one down program fits beside its own three (V4: 3 x 8 warps x 64
#      registers + 8 warps x 64), against the cap alone, items with no room left (uncapped
#      gate_up), the Gluon down without items, and a no-op control
#   3. the timelines of the main variants (bench/timeline.py), then step 2 again
#
# JSON lines go to "$OUT/down-items-*.jsonl", the tests' tail to "$OUT/down-items-tests.txt", and
# a summary (time over the dispatcher's, each variant) is printed. On the device machine, from the
# repo root: MOETIER_COMMIT=<short hash> bash bench/down_items_h200.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/down-items}
mkdir -p "$OUT"

timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_moe_triton.py \
  -k "down_items or carveout or dispatcher_configs" 2>&1 | tail -30 >"$OUT/down-items-tests.txt"
tail -3 "$OUT/down-items-tests.txt"

CAP="gu:maxnreg=64+dn:maxnreg=64"
V4=(--variant dn:unroll=1 --variant gu:maxnreg=64 --variant dn:items=3,maxnreg=64
    --variant "$CAP,items=3" --variant "$CAP,items=2" --variant "$CAP,items=4"
    --variant "gu:maxnreg=64+dn:items=3,num_warps=4,maxnreg=96"
    --variant "gu:maxnreg=64,carveout=100+dn:maxnreg=64,items=3")
GD="gluon=1,block_n=64,block_k=256,num_warps=4"
QWEN=(--variant dn:unroll=1 --variant "dn:$GD" --variant "dn:$GD,items=2"
      --variant "dn:$GD,items=4" --variant "gu:next_l2=0+dn:$GD,items=2"
      --variant "gu:maxnreg=120+dn:$GD,items=2")
ab() {
  timeout 90 python3 bench/kernels.py --shapes deepseek-v4-flash --tokens 1 --no-baseline \
    --formats q2s,q2s-hot --variant-formats q2s,q2s-hot --first-launch after "${V4[@]}" \
    >>"$OUT/down-items-v4.jsonl" 2>>"$OUT/down-items.log"
  timeout 90 python3 bench/kernels.py --shapes qwen3-30b-a3b --tokens 1 --no-baseline \
    --formats q2s,q2s-hot --variant-formats q2s,q2s-hot --first-launch after "${QWEN[@]}" \
    >>"$OUT/down-items-qwen3.jsonl" 2>>"$OUT/down-items.log"
}
ab
# where the time goes (bench/timeline.py): do down's programs start beside gate_up's (dn_late
# 0, dn_per_sm_max 1), and how long does one take after its wait (dn_after_wait)?
timeout 60 python3 bench/timeline.py --shapes deepseek-v4-flash --tokens 1 \
  --variant gu:maxnreg=64 --variant "$CAP,items=3" \
  --variant "gu:maxnreg=64,carveout=100+dn:maxnreg=64,items=3" \
  >>"$OUT/down-items-timeline.jsonl" \
  2>>"$OUT/down-items.log"
timeout 60 python3 bench/timeline.py --shapes qwen3-30b-a3b --tokens 1 --variant "dn:$GD" \
  --variant "dn:$GD,items=2" >>"$OUT/down-items-timeline.jsonl" 2>>"$OUT/down-items.log"
ab  # again, a fresh process: the run-to-run spread

python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("down-items-*.jsonl")):
    for line in f.read_text().splitlines():
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        if d.get("case") == "timeline":
            print("timeline", d.get("shape"), d.get("variant"), d.get("error", ""),
                  {k: d.get(k) for k in ("call_us", "gu_span", "dn_release", "dn_span",
                                         "dn_after_wait", "dn_late", "dn_per_sm_max")})
        if d.get("case") != "moe":
            continue
        print(d.get("shape"), d.get("tokens"), d.get("format"), d.get("ms"), d.get("of_copy"),
              d.get("vs_dispatcher", ""), d.get("error", ""))
PY
