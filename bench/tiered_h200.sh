#!/usr/bin/env bash
# Issue #6's acceptance points that still lack H200 figures, in one command (expected 5-7 min;
# each step has a time limit, 10 min in all at worst: give the call timeout_s=600). JSON lines
# of every step go to "$OUT/tiered.jsonl", stderr and the step times to "$OUT/tiered.log", and a
# summary against the targets to "$OUT/tiered-summary.jsonl" (also printed).
#
#   1. decode      bench/decode.py --tiered, 8-layer Qwen3-30B-A3B slice, batch 1, GPU budgets
#                  25% (first: the target), 100% (resident), 50%, each with eval-moe-70m's routing
#                  trace replayed (bench/trace_routing.py) and with the model's own (near-uniform)
#                  routing; zero-copy below 100% (the cost model's pick in the last H200 run, now
#                  forced so that 25% can run first), hot set rebalanced every 64 tokens as the
#                  Generator does; 256 timed tokens per case; zero-copy with 3 staging slots per
#                  layer guessed from each layer's output (the serving default) and without,
#                  model routing (trace routing: the trace replaces the routers the guesses come
#                  from, so without only); then 25% with 2 slots guessed from each layer's input
#                  (--guess-from input)
#   2. prefill     one 2,048-token prefill streamed from pinned host RAM at a 25% budget, against
#                  its PCIe-bound floor, beside the same prefill with every expert resident
#   3. disk        bench/disk.py: DiskReader expert reads against raw O_DIRECT, same run
#   4. accelerate  HF transformers + accelerate offload, bf16, GPU capped at the 25% budget
#   (BF16=1 adds the bf16 / LRU / no-prefetch baseline, about 1-2 min more; else the summary
#   compares with last session's 33.9 tok/s)
#
# Before (on the dev machine, from the repo root; .carry/ is gitignored):
#   mkdir -p .carry && cp ../shared/models/eval-moe-70m/router_trace.npz .carry/      # 0.7 MB
#   pip download accelerate==1.13.0 --no-deps -d .carry/wheels   # only used if the image lacks it
# On the device machine (carry: .carry/router_trace.npz and .carry/wheels), from the repo root:
#   MOETIER_COMMIT=<short hash> PYTHONPATH=$PWD bash bench/tiered_h200.sh
# CPU smoke test of the whole chain (tiny shape, seconds): SMOKE=1 OUT=/tmp/t bash bench/tiered_h200.sh
set -uo pipefail
: "${OUT:?set OUT to a folder for the results}"
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-$PWD}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TRACE=${TRACE:-.carry/router_trace.npz}
TMP=${BENCH_TMP:-/tmp}  # synthetic store and the accelerate checkpoint (10 GB)
mkdir -p "$OUT"
lines="$OUT/tiered.jsonl"
log="$OUT/tiered.log"
: >"$lines"
: >"$log"

if [[ "${SMOKE:-0}" == 1 ]]; then
    shape=(--device cpu --shape tiny --layers 2)
    steps=3
    prefill=300
    disk=(--file-gib 0.05 --budget-s 2 --repeat 1)
    limit=1
else
    shape=(--layers 8)
    steps=256
    prefill=2048
    disk=()
    limit=0
fi

step() {  # step NAME SECONDS COMMAND...: run with a time limit, lines to $lines, stderr to $log
    local name=$1 seconds=$2
    shift 2
    [[ $limit == 1 ]] && seconds=300
    echo "# $(date +%T) $name (limit ${seconds}s): $*" | tee -a "$log" >&2
    local start=$SECONDS
    timeout -k 10 "$seconds" "$@" 2>>"$log" | tee -a "$lines"
    local rc=${PIPESTATUS[0]}
    echo "# $(date +%T) $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log" >&2
}

{
    echo "# environment"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
    "$PY" -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
    df -h . "$TMP" 2>&1 | cat
    stat -f -c "%T  (repo root)" . 2>&1
    stat -f -c "%T  ($TMP)" "$TMP" 2>&1
} >>"$log" 2>&1

if ! "$PY" -c "import accelerate" 2>/dev/null; then
    if compgen -G ".carry/wheels/accelerate-*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/moetier-site \
            .carry/wheels/accelerate-*.whl >>"$log" 2>&1 &&
            export PYTHONPATH="$PYTHONPATH:/tmp/moetier-site"
    else
        echo "# accelerate is missing and .carry/wheels has no wheel: its step will fail" |
            tee -a "$log" >&2
    fi
fi
routing=model
if [[ -f "$TRACE" ]]; then
    routing="trace:$TRACE,model"
else
    echo "# no $TRACE: model routing only (copy it into .carry/ first, see the top)" | tee -a "$log" >&2
fi

decode=("$PY" bench/decode.py --tiered "${shape[@]}" --tmp "$TMP")
step decode 300 "${decode[@]}" --gpu-fraction 0.25,1.0,0.5 --strategy zero_copy \
    --zero-copy-stage 3,0 --guess-from output --rebalance-every 64 --steps "$steps" \
    --routing "$routing"
# staging's other guess source (each layer's MoE input; docs/residency.md), model routing
step decode-guess-input 120 "${decode[@]}" --gpu-fraction 0.25 --strategy zero_copy \
    --zero-copy-stage 2 --guess-from input --rebalance-every 64 --steps "$steps" --routing model
step prefill 100 "${decode[@]}" --gpu-fraction 0.25 --prefill-tokens "$prefill" --skip-decode
step disk 90 "$PY" bench/disk.py "${disk[@]}"
step accelerate 110 "${decode[@]}" --gpu-fraction 0.25 --accelerate-tokens 4 --skip-decode
if [[ "${BF16:-0}" == 1 ]]; then  # optional: the bf16 / LRU / no-prefetch baseline, same run
    step bf16-baseline 120 "${decode[@]}" --experts bfloat16 --gpu-fraction 0.25 \
        --strategy blocking --compile off --steps 32 --routing model
fi

"$PY" - "$lines" <<'EOF' | tee "$OUT/tiered-summary.jsonl"
"""One line per acceptance point of issue #6 from the lines above (same-run figures)."""
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
for r in rows:
    if "error" in r:
        print(json.dumps({"point": f"FAILED {r.get('case')}", **{k: r[k] for k in r if k in (
            "routing", "gpu_fraction", "strategy", "error")}}))
rows = [r for r in rows if "error" not in r]
decode = [r for r in rows if r.get("case") == "decode-tiered" and r.get("disk_fraction") == 0]
bf16 = [r for r in decode if r["experts"] == "bfloat16"]
decode = [r for r in decode if r["experts"] != "bfloat16"]
accelerate = [r for r in rows if r.get("case") == "decode-accelerate" and r["gpu_fraction"] == 0.25]
acc_tok_s = accelerate[0]["tok_s"] if accelerate else None
# the bf16 / LRU / no-prefetch baseline of this run (BF16=1), else last session's line
# (docs/benchmarks.md, 33.9 tok/s)
bf16_lru, bf16_source = (bf16[0]["tok_s"], "this run") if bf16 else (33.9, "last session")


def out(point, **figures):
    print(json.dumps({"point": point, **figures}))


for r in decode:
    stage = r.get("staging_slots_per_layer") or 0
    guess = f" from {r['guess_from']}" if stage and r.get("guess_from") else ""
    out(f"decode {r['routing']} {r['gpu_fraction']:.0%}" + (f" staging {stage}{guess}" if stage else ""),
        strategy=r["strategy"],
        tok_s=r["tok_s"], target_tok_s=580 if r["gpu_fraction"] == 0.25 else None,
        ratio_to_floor=r["ratio_to_floor"], target_ratio=1.25 if r["gpu_fraction"] == 0.25 else None,
        floor_kind=r["floor_kind"], hit_rate=r["hit_rate"],
        vs_accelerate=round(r["tok_s"] / acc_tok_s, 1) if acc_tok_s else None,
        vs_bf16_lru=round(r["tok_s"] / bf16_lru, 1), bf16_lru_from=bf16_source)
for r in bf16:
    out("bf16 / LRU / no-prefetch 25%", tok_s=r["tok_s"], strategy=r["strategy"])
for r in accelerate:
    out("accelerate 25%", tok_s=r["tok_s"], gpu_expert_fraction=r["gpu_expert_fraction"])
for r in rows:
    if r.get("case") == "prefill-tiered":
        out(f"prefill {r['tokens']} {r['routing']} {r['gpu_fraction']:.0%}", ms=r["ms"],
            floor_ms=r["floor_ms"], of_floor=r["of_floor"], target_of_floor=0.7,
            resident_ms=r["resident_ms"], pinned_ms=r["pinned_ms"], of_bound=r["of_bound"],
            h2d_GBs=r["h2d_GB/s"], identical_logits=r["identical_logits"])
disk = [r for r in rows if r.get("bench") == "disk"]
raw = [r for r in disk if r["what"].startswith("raw")]
if raw:
    best = max(raw, key=lambda r: r["gbps"])
    for r in disk:
        if "of_raw" in r:
            out(f"disk reader blob {r['blob_bytes']} x{r['batch']} qd{r['queue_depth']}",
                gbps=r["gbps"], raw_best_gbps=best["gbps"], of_raw=r["of_raw"],
                target_of_raw=0.9, direct=r["direct"], filesystem=r["filesystem"])
EOF
echo "# results in $OUT: tiered.jsonl, tiered.log, tiered-summary.jsonl" >&2
