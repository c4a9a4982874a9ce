#!/usr/bin/env bash
# The GPU checks that open issues still wait for, in device calls of under 10 minutes each
# (PART=1 to 9), each step with a time limit so a slow one cannot eat the call. Lines go to
# $OUT/*.jsonl, the GPU suite's output to $OUT/gpu-tests.txt, stderr to $OUT/*.log.
#
#   PART=1  the GPU suite (every `gpu`-marked test, 12 workers, a line per test), the serving
#           engine's 1, 16 and 64 streams and the agent shape with a profiled warm turn on one
#           engine, a second start of it, and the compiled static step (#42)
#   PART=5  on one 8-layer Qwen3-30B-A3B store with an NVFP4 delta plane and an MTP layer:
#           decode without drafts, with 2 drafts replayed at eval-moe-70m's measured acceptance
#           drafting every step (its cost) and under serve's auto rule, and both at a quarter
#           of the experts on the GPU (#47; each a `moetier bench` that loads and compiles:
#           80-100 s on an H100)
#   PART=7  on that store: the confidence gate off, at 10% / all / 25% of pairs (#46 item 6)
#   PART=2  moetier tune's test and bench/tune.py (#51), the agent-shape TTFT (and a profile of
#           a warm turn; then again with the prefill steps eager), a packed step's attention
#           gathered against paged, and a 25% budget's steps against their floors (#42)
#   PART=9  dense bf16 / fp8 / int4 (#52), the converter's speed (#53), the CPU expert kernel
#           against DRAM (#54)
#   PART=4  hybrid misses (#54): the CPU split's GPU tests (host nodes in a captured step), then
#           the 8-layer slice at 10% and 25% GPU expert budgets, batch 1 and 4, --cpu-experts off
#           against auto (fetch-only against hybrid, same call)
#   PART=6  the paths users run (`moetier bench --batch 1`, `moetier generate`, a stream from a
#           real `moetier serve`) on all 48 layers of the Qwen3-30B-A3B shape, every expert
#           resident and a 25% GPU expert budget (#42: within 10% of the bench)
#   PART=3  the GLM-5 and DeepSeek-V4-Flash slices native against the transformers path and at
#           a 25% budget (#45)
#   PART=8  the planner's whole-model predictions for GLM-5 and DeepSeek-V4-Flash (#45), the
#           planner against the bench (#48), calibrated conversion of an 8-layer
#           Qwen3-30B-A3B slice (#53)
#
# On the dev machine first (repo root): `bash bench/device_prepare.sh [GPU test files]` fills
# the ignored .whl/ (wheels of what the device image lacks) and .carry/ (../shared's small
# files, the list GPU_TESTS may read); then
#   run(command="python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#       && ln -s $PWD/.carry/shared ../shared && PYTHONPATH=/tmp/site:$PWD \
#       MOETIER_COMMIT=<hash> PART=1 bash bench/device_checks.sh", carry=[".whl", ".carry"])
# CPU smoke test of the chain (tiny shape, no GPU tests): SMOKE=1 OUT=/tmp/d PART=1 bash ...
# TESTS=0 leaves PART=1's GPU suite out (a short call: the decode figures only); GPU_TESTS
# names the tests it runs instead of all of tests/ (node ids or files, space-separated); ONLY
# runs just the steps it names (space-separated, e.g. ONLY="agent budget-25").
set -uo pipefail
: "${OUT:?set OUT to a folder for the results}"
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-$PWD}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-560}  # seconds this call may take
case "${PART:-1}" in
    1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9) ;;
    *) echo "PART=${PART}: use 1-9 (the header says what each runs)" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
exec 3>&1  # the step lines, whatever a step's own output is redirected to

step() {  # step NAME SECONDS COMMAND...: skipped when the call's time is nearly spent
    local name=$1 cap=$2 left=$((BUDGET - SECONDS))
    shift 2
    if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then return; fi
    ((cap > left - 5)) && cap=$((left - 5))
    if ((cap < 15)); then echo "skipped $name (${left} s left)" >&3; return; fi
    echo "== $name (up to $cap s, at $SECONDS s)" >&3
    timeout "$cap" "$@"
    echo "== $name: status $? at $SECONDS s" >&3
}

if [[ "${SMOKE:-0}" == 1 ]]; then
    shape=tiny layers=2 args=(--device cpu --new-tokens 8 --prompt-tokens 16)
else
    shape=qwen3-30b-a3b layers=8 args=(--new-tokens 128)
fi

if [[ "${PART:-1}" == 1 ]]; then
    [[ "${SMOKE:-0}" == 1 || "${TESTS:-1}" == 0 ]] || step gpu-tests 300 "$PY" -m pytest -m gpu \
        -n 12 -v --tb=short --show-capture=no -p no:logging -p no:cacheprovider ${GPU_TESTS:-tests} >"$OUT/gpu-tests.txt" 2>&1
    tail -20 "$OUT/gpu-tests.txt" 2>/dev/null
    # #42: the engine's streams, then the agent shape on the same engine (one load), against
    # the compiled static step in the same call; then a second start of the same shapes (its
    # load, compile and capture seconds, the compile cache's hits)
    if [[ "${SMOKE:-0}" == 1 ]]; then
        eng=(--device cpu --shape tiny --layers 2 --concurrency 1,3 --prompt-tokens 16
            --new-tokens 8 --compile off --first-tokens 100 --turn-tokens 40 --answer-tokens 8)
        again=(--device cpu --shape tiny --layers 2 --compile off)
    else
        eng=(--layers 8 --concurrency 1,16,64 --prompt-tokens 512 --new-tokens 96
            --first-tokens 5000 --turn-tokens 200 --answer-tokens 200)
        again=(--layers 8)
    fi
    step engine 180 "$PY" bench/serve.py "${eng[@]}" --agent-turns 8 --profile-turn \
        >>"$OUT/engine-streams.jsonl" 2>>"$OUT/decode.log"
    step restart 100 "$PY" bench/serve.py "${again[@]}" --concurrency 1 --prompt-tokens 16 \
        --new-tokens 8 >>"$OUT/engine-streams.jsonl" 2>>"$OUT/decode.log"
    [[ "${SMOKE:-0}" == 1 ]] || step static 100 "$PY" bench/decode.py --resident --layers 8 \
        --batch 1,16 --steps 64 --hf-tokens 0 >>"$OUT/engine-streams.jsonl" 2>>"$OUT/decode.log"
elif [[ "${PART:-1}" == 5 || "${PART:-1}" == 7 ]]; then
    store=${BENCH_TMP:-/tmp}/device-checks-store
    [[ -d "$store" ]] || step store 60 "$PY" -c "import sys; from pathlib import Path
from moetier.cli.bench import DEFAULT_STORE
from moetier.quant.synthetic import shape, write_synthetic_store
write_synthetic_store(Path(sys.argv[1]), shape(sys.argv[2], int(sys.argv[3])), 'q2s', DEFAULT_STORE, delta='nvfp4', mtp=True)" \
        "$store" "$shape" "$layers"
    b=("$PY" -m moetier bench "$store" --native --batch 1,16 --json "${args[@]}")
    mtp=(--speculative-tokens 2 --mtp-replay 0.50,0.25)
    quarter=(--expert-cache-slots $((layers * 36)) --host-memory 1TiB)
    if [[ "${PART:-1}" == 5 ]]; then  # MTP: its cost (always), and serve's rule (auto)
        step mtp-off 120 "${b[@]}" --delta none >>"$OUT/decode.jsonl" 2>>"$OUT/decode.log"
        step mtp-k2 120 "${b[@]}" --delta none "${mtp[@]}" >>"$OUT/decode.jsonl" \
            2>>"$OUT/decode.log"
        step mtp-k2-auto 120 "${b[@]}" --delta none "${mtp[@]}" --speculative-policy auto \
            >>"$OUT/decode.jsonl" 2>>"$OUT/decode.log"
        step mtp-off-25 120 "${b[@]}" --delta none "${quarter[@]}" >>"$OUT/decode.jsonl" \
            2>>"$OUT/decode.log"
        step mtp-k2-auto-25 120 "${b[@]}" --delta none "${quarter[@]}" "${mtp[@]}" \
            --speculative-policy auto >>"$OUT/decode.jsonl" 2>>"$OUT/decode.log"
    else  # the confidence gate at 10% / all / 25% of pairs (#46)
        for d in none budget:0.1:weight all budget:0.25:weight; do
            step "gate-$d" 120 "${b[@]}" --delta "$d" >>"$OUT/gate.jsonl" 2>>"$OUT/decode.log"
        done
    fi
elif [[ "${PART:-1}" == 4 ]]; then
    [[ "${SMOKE:-0}" == 1 ]] || step hybrid-tests 120 "$PY" -m pytest -m gpu -v --tb=short \
        -p no:cacheprovider tests/engine/test_hybrid_graph.py tests/models/test_hybrid_split.py \
        tests/kernels/test_cpu_graph_part.py >"$OUT/hybrid-tests.txt" 2>&1
    tail -5 "$OUT/hybrid-tests.txt" 2>/dev/null
    for share in 13 32; do  # GPU expert slots a layer of 128: 10% and 25%
        for cpu in off auto; do
            step "hybrid-$share-$cpu" 100 "$PY" -m moetier bench --shape "$shape" --layers "$layers" \
                --native --expert-cache-slots $((layers * share)) --host-memory 1TiB \
                --cpu-experts "$cpu" --batch 1,4 --json "${args[@]}" >>"$OUT/hybrid.jsonl" \
                2>>"$OUT/hybrid.log"
        done
    done
elif [[ "${PART:-1}" == 6 ]]; then
    if [[ "${SMOKE:-0}" == 1 ]]; then
        paths=(--device cpu --layers 1 --new-tokens 8)  # (tiny: 512 ids, the tokenizer 4,096)
    else
        paths=(--layers 48 --new-tokens 256)
    fi
    step paths-48 270 "$PY" bench/user_paths.py "${paths[@]}" >"$OUT/user-paths.jsonl" \
        2>"$OUT/user-paths.log"
    step paths-48-25 270 "$PY" bench/user_paths.py "${paths[@]}" --gpu-fraction 0.25 \
        >>"$OUT/user-paths.jsonl" 2>>"$OUT/user-paths.log"
    tail -n 40 "$OUT/user-paths.log"  # (a failed path's error: the log has not always come back)
elif [[ "${PART:-1}" == 3 ]]; then
    if [[ "${SMOKE:-0}" == 1 ]]; then
        models=(glm-5-tiny:2 deepseek-v4-flash-tiny:2) dev=(--device cpu)
    else
        models=(glm-5:2 deepseek-v4-flash:4) dev=()
    fi
    for m in "${models[@]}"; do
        s=${m%%:*} n=${m##*:}
        one=("$PY" -m moetier bench --shape "$s" --layers "$n" --batch 1 --prompt-tokens 128
            --json "${dev[@]}")
        # (a bench loads and compiles first: 80-100 s on an H100 for the 8-layer Qwen3 slice)
        step "$s-native" 100 "${one[@]}" --native --new-tokens 64 >>"$OUT/models.jsonl" \
            2>>"$OUT/models.log"
        step "$s-hf" 60 "${one[@]}" --no-native --new-tokens 16 >>"$OUT/models.jsonl" \
            2>>"$OUT/models.log"
        step "$s-25" 100 "${one[@]}" --native --new-tokens 64 --host-memory 1TiB \
            --expert-cache-slots $((n * 64)) >>"$OUT/models.jsonl" 2>>"$OUT/models.log"
    done
    tail -n 20 "$OUT/models.log"
elif [[ "${PART:-1}" == 8 ]]; then
    if [[ "${SMOKE:-0}" == 1 ]]; then
        plan=(--layers 1 --new-tokens 4 --prompt-tokens 8 --batch 1 --bench-args
            "--device cpu --warmup 0")
        calib=(--layers 2 --tokens 2048 --experts 16 --modes diag)
    else
        plan=(--layers 8) calib=(--layers 8 --tokens 65536)
    fi
    step plan-glm5 30 "$PY" -m moetier plan --shape glm-5 --gpu-memory 96GB --host-memory 512GB \
        --predict --json >"$OUT/plan-models.jsonl" 2>>"$OUT/models.log"
    step plan-dsv4 30 "$PY" -m moetier plan --shape deepseek-v4-flash --gpu-memory 32GB \
        --host-memory 192GB --predict --json >>"$OUT/plan-models.jsonl" 2>>"$OUT/models.log"
    step plan-check 200 "$PY" bench/plan_check.py "${plan[@]}" >"$OUT/plan-check.jsonl" \
        2>"$OUT/plan-check.log"
    step calibrated 200 "$PY" bench/convert_calibrated.py "${calib[@]}" \
        >"$OUT/convert-calibrated.jsonl" 2>"$OUT/convert-calibrated.log"
elif [[ "${PART:-1}" == 2 ]]; then
    smoke=()
    [[ "${SMOKE:-0}" == 1 ]] && smoke=(--smoke)
    [[ "${SMOKE:-0}" == 1 ]] || step tune-test 70 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
        tests/kernels/test_tune.py >"$OUT/tune.log" 2>&1
    step tune 150 "$PY" bench/tune.py --tune-seconds 75 --no-decode "${smoke[@]}" \
        >"$OUT/tune.jsonl" 2>>"$OUT/tune.log"
    if [[ "${SMOKE:-0}" == 1 ]]; then
        serve=(--device cpu --shape tiny --layers 2 --first-tokens 100 --turn-tokens 40
            --answer-tokens 8)
    else  # the agent shape: a system prompt and tools, then 200 new tokens a turn, to ~8K
        serve=(--layers 8 --first-tokens 5000 --turn-tokens 200 --answer-tokens 200)
    fi
    step agent 110 "$PY" bench/serve.py --agent-turns 8 --profile-turn "${serve[@]}" \
        >"$OUT/engine.jsonl" 2>"$OUT/engine.log"
    # the same turns with the packed steps eager (the compiled prefill's gain, same call)
    step agent-eager 110 "$PY" bench/serve.py --agent-turns 8 --compile-prefill off \
        "${serve[@]}" >>"$OUT/engine.jsonl" 2>>"$OUT/engine.log"
    # a packed step's attention: gathered keys + SDPA against the paged kernel (#42)
    [[ "${SMOKE:-0}" == 1 ]] || step prefill-attn 45 "$PY" bench/prefill_attention.py \
        >>"$OUT/engine.jsonl" 2>>"$OUT/engine.log"
    step budget-25 120 "$PY" -m moetier bench --shape "$shape" --layers "$layers" --native \
        --expert-cache-slots $((layers * 32)) --host-memory 1TiB --batch 1,4,16,64 --json \
        "${args[@]}" >>"$OUT/engine.jsonl" 2>>"$OUT/engine.log"
fi
if [[ "${PART:-1}" == 9 ]]; then
    for f in bf16 fp8 int4; do
        step "dense-$f" 100 "$PY" -m moetier bench --shape "$shape" --layers "$layers" --native \
            --dense "$f" --batch 1 --json "${args[@]}" >>"$OUT/dense.jsonl" 2>>"$OUT/engine.log"
    done
    conv=()
    [[ "${SMOKE:-0}" == 1 ]] && conv=(--shape small --device cpu --experts 2 --chunk 2 --tokens 64)
    step convert 45 "$PY" bench/convert_speed.py "${conv[@]}" >"$OUT/convert.jsonl" \
        2>>"$OUT/engine.log"
    step cpu-kernel 60 "$PY" bench/hybrid.py --batch 1,4 >"$OUT/hybrid.jsonl" 2>>"$OUT/engine.log"
fi
echo "done at $SECONDS s"
