#!/usr/bin/env bash
# What a device call of bench/device_checks.sh carries, built on the dev machine (repo root):
#   .whl/    wheels, for the device image's Python 3.12, of what that image (torch, triton,
#            transformers, no network) lacks, at the dev venv's versions
#   .carry/shared          eval-moe-70m's tokenizer files and the books (../shared on the device)
#   .carry/gpu-tests.txt   the GPU tests PART=1 runs when GPU_TESTS names them (one per line)
# Both folders are gitignored and travel with run(carry=[".whl", ".carry"]). Idempotent: a
# wheel already in .whl/ is not fetched again.
#   bash bench/device_prepare.sh [GPU test files...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PACKAGES="pytest pluggy iniconfig pytest-xdist execnet fastapi starlette uvicorn h11 click anyio
sniffio pydantic pydantic-core annotated-types typing-inspection typing_extensions llguidance
prometheus_client httpx httpcore certifi idna openai anthropic distro jiter docstring_parser
hypothesis sortedcontainers attrs jsonschema jsonschema-specifications referencing rpds-py
opentelemetry-api annotated-doc tqdm safetensors"
pins=()
for name in $PACKAGES; do
    version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
    pins+=("${name}${version:+==$version}")
done
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64 \
    --platform any -d .whl "${pins[@]}"
echo "$(ls .whl/*.whl | wc -l) wheels in .whl/"

# carry holds 64 MiB in all: eval-moe-70m without its weights, and 8 MiB of the books (the
# calibration text of bench/convert_calibrated.py, the held-out books)
model=.carry/shared/models/eval-moe-70m books=.carry/shared/data/gutenberg
mkdir -p "$model" "$books/train" "$books/eval"
find ../shared/models/eval-moe-70m -maxdepth 1 -type f ! -name '*.safetensors' \
    -exec cp -u {} "$model/" \;
cp -u ../shared/data/gutenberg/eval/* "$books/eval/"
total=0
for f in ../shared/data/gutenberg/train/*.txt; do
    size=$(stat -c %s "$f")
    [ $((total + size)) -gt $((5 * 1024 * 1024)) ] && break
    cp -u "$f" "$books/train/"
    total=$((total + size))
done
if [ "$#" -gt 0 ]; then
    printf '%s\n' "$@" > .carry/gpu-tests.txt
fi
du -sh .whl .carry
