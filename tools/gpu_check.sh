#!/usr/bin/env bash
# The GPU check of ringstream, in one run from the repo root on a CUDA host (within 8 minutes on an H200):
#   1. installs the wheels carried in WHEELS (default .whl) and ringstream itself into a private folder
#      (no index, no dependencies resolved: the host needs no network);
#   2. runs the CUDA tests (pytest -m cuda);
#   3. ringstream-bench compare on a random-weight llama-3.2-1b (batch 64, 512-token prompts);
#   4. ringstream-bench compare on a random-weight llama-3.1-8b at batches 64 and 256, max_model_len 32768,
#      with the KV capacity in 2,048-token sequences;
# each under a `timeout` (a compare appends one JSON line per part to OUT/NAME.parts.jsonl as each part ends, so a
# step cut at its limit keeps what it measured) (their limits add up to 470 s, and each is cut to what is left of that), writing its log and JSON to OUT (default ./gpu-check-out). A step that fails or
# times out is recorded in OUT/summary.txt and the next one runs; the exit status is that of the first failure.
#
# Usage: tools/gpu_check.sh [--dry-run] [--wheels DIR] [--out DIR] [--device cuda:0]
#   --dry-run  print the steps, run nothing.
#
# Building the wheels (on a host with the package index; the CUDA host has Python 3.12 with torch,
# transformers, tokenizers, safetensors, uvloop, psutil, prometheus_client, aiohttp, rich, jinja2 and pytest,
# but not msgspec, pyzmq, setproctitle or llguidance):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl \
#     msgspec pyzmq setproctitle llguidance pytest-rerunfailures pytest-timeout
#   python3 -m pip wheel --no-deps -w .whl .        # ringstream itself (pure Python)
# Keep one version of each, and copy the folder to the GPU host with the checkout.
set -uo pipefail

DRY_RUN=0
WHEELS=.whl
OUT_DIR=${OUT:-./gpu-check-out}
DEVICE=cuda:0
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --wheels) WHEELS=$2; shift ;;
        --out) OUT_DIR=$2; shift ;;
        --device) DEVICE=$2; shift ;;
        *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

SITE=${RINGSTREAM_GPU_SITE:-/tmp/ringstream-gpu-site}
MODELS=${RINGSTREAM_GPU_MODELS:-/tmp/ringstream-gpu-models}
PY=${PYTHON:-python3}
STATUS=0
START=$SECONDS
BUDGET_S=${RINGSTREAM_GPU_BUDGET_S:-470}  # every step's limit is cut to what is left of this

step() {  # step NAME SECONDS COMMAND...: run COMMAND under a timeout, log to OUT/NAME.log
    local name=$1 limit=$2 left
    shift 2
    left=$((BUDGET_S - (SECONDS - START)))
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
    if [ "$limit" -lt 10 ]; then
        echo "   $name: skipped, ${left}s of the budget left" | tee -a "$OUT_DIR/summary.txt"
        [ $STATUS -eq 0 ] && STATUS=124
        return 124
    fi
    if [ "$DRY_RUN" = 1 ]; then
        printf '[%s] timeout %ss: %s\n' "$name" "$limit" "$*"
        return 0
    fi
    echo "== $name (limit ${limit}s, at $((SECONDS - START))s)" | tee -a "$OUT_DIR/summary.txt"
    timeout --kill-after=10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    local rc=$?
    echo "   $name: exit $rc after $((SECONDS - START))s" | tee -a "$OUT_DIR/summary.txt"
    tail -n 40 "$OUT_DIR/$name.log"
    if [ $rc -ne 0 ] && [ $STATUS -eq 0 ]; then STATUS=$rc; fi
    return $rc
}

BENCH=("$PY" -m ringstream.tools.bench compare --quick --device "$DEVICE" --repeats 1 --seed-requests 8
       --time-limit 20)

if [ "$DRY_RUN" = 0 ]; then
    mkdir -p "$OUT_DIR" "$MODELS"
    : >"$OUT_DIR/summary.txt"
    export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1 RINGSTREAM_CUDA_REPORT="$OUT_DIR/cuda-tests.json"
fi

step install 45 bash -c "$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target '$SITE' $WHEELS/*.whl && { ls $WHEELS/ringstream-*.whl >/dev/null 2>&1 || \
    $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target '$SITE' . ; }" \
    || { echo "gpu_check.sh: cannot install the wheels" >&2; [ "$DRY_RUN" = 1 ] || exit 1; }
step env 15 bash -c "nvidia-smi; $PY -c 'import torch, transformers, ringstream; \
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), transformers.__version__)'"
# -W: pyproject's `timeout` option is unknown where pytest-timeout is missing, and its `filterwarnings = error`
# would turn that config warning into an INTERNALERROR before any test is collected
step cuda-tests 75 "$PY" -m pytest -m cuda -q -p no:cacheprovider -W ignore::pytest.PytestConfigWarning tests/cuda -rA
step compare-llama-3.2-1b 100 "${BENCH[@]}" --model-config llama-3.2-1b --concurrency 64 --prompt-len 512 \
    --max-tokens 64 --requests 128 --max-model-len 4096 --json "$OUT_DIR/compare-llama-3.2-1b.json" \
    --parts "$OUT_DIR/compare-llama-3.2-1b.parts.jsonl"
step write-llama-3.1-8b 45 "$PY" -m ringstream.tools.model_configs --name llama-3.1-8b \
    --out "$MODELS/llama-3.1-8b" --device "$DEVICE"
for batch in 64 256; do
    step "compare-llama-3.1-8b-b$batch" $((batch == 64 ? 90 : 100)) "${BENCH[@]}" --model "$MODELS/llama-3.1-8b" --concurrency "$batch" \
        --prompt-len 512 --max-tokens 64 --requests $((2 * batch)) --max-model-len 32768 --capacity-tokens 2048 \
        --json "$OUT_DIR/compare-llama-3.1-8b-b$batch.json" --parts "$OUT_DIR/compare-llama-3.1-8b-b$batch.parts.jsonl"
done
[ "$DRY_RUN" = 1 ] || rm -rf "$MODELS"
[ "$DRY_RUN" = 1 ] || echo "gpu_check.sh: done in $((SECONDS - START))s, status $STATUS" | tee -a "$OUT_DIR/summary.txt"
exit $STATUS
