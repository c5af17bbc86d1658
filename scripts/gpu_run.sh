#!/usr/bin/env bash
# One GPU run on a fresh machine with no network: install the carried wheels, run the GPU tests
# and the benchmarks, and write logs and results into OUTDIR.
#
#   scripts/gpu_run.sh OUTDIR [STAGE ...]     stages: tests step parity serve peer (default: all)
#
# Needs, carried beside the tree (see scripts/prepare_gpu_assets.sh, which makes them here):
#   .whl/                        wheels the GPU image lacks (fastapi, msgspec, pyzmq, gguf, ...)
#   .gpu_assets/tokenizer/       SmolLM2's tokenizer files (the 98 MB GGUF does not travel)
#   .gpu_assets/sharegpt.json    the ShareGPT conversations, trimmed to what the benchmark samples
#
# Environment overrides (for a dry run on a CPU: EMBER_GPU_RUN_SKIP_INSTALL=1 PYTHON=python
# EMBER_BENCH_PRESET=tiny EMBER_SERVE_PROMPTS=8 EMBER_PINNED_PROMPTS=8 EMBER_PEER_PROMPTS=4
# EMBER_PEER_DEVICE=cpu EMBER_SERVE_OUTPUT_LEN=8):
#   EMBER_BENCH_PRESET (llama-3.1-8b), EMBER_GPU_TESTS ("tests/gpu tests/kernels"), EMBER_SERVE_PROMPTS ("1000 4000"), EMBER_PINNED_PROMPTS
#   (1000), EMBER_PEER_PROMPTS (1000), EMBER_PEER_DEVICE (cuda), EMBER_SERVE_OUTPUT_LEN (unset),
#   EMBER_PEER_ARGS ("--cuda-graphs on --max-memory-percent 0.6"), EMBER_RUN_SECONDS (570: every
#   command is stopped in time for the results to be bundled inside the device's 600 s call)
set -uo pipefail
OUT=${1:?usage: scripts/gpu_run.sh OUTDIR [STAGE ...]}
shift
STAGES=${*:-tests step parity serve peer}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# At most 8 files come back from the device: results go to $OUT/results and are bundled into
# one archive when the script ends, however it ends; the log stays beside it.
RES="$OUT/results"
mkdir -p "$RES"
LOG="$OUT/gpu_run.log"
exec > >(tee -a "$LOG") 2>&1
bundle() { tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -rf "$RES"; }
trap bundle EXIT

PY=${PYTHON:-python3}
if [ -z "${EMBER_GPU_RUN_SKIP_INSTALL:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$ROOT/src:$ROOT/tests
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export EMBER_TEST_TOKENIZER_DIR=$ROOT/.gpu_assets/tokenizer
PRESET=${EMBER_BENCH_PRESET:-llama-3.1-8b}
MODEL=/tmp/$PRESET-random
# A command the device kills loses the archive; each step here gets what is left of the budget.
DEADLINE=$(( $(date +%s) + ${EMBER_RUN_SECONDS:-570} ))
limited() {
  local left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -le 5 ]; then echo "skipped (out of time): $*"; return 124; fi
  timeout --signal=INT --kill-after=10 "$left" "$@"
}
has_stage() { [[ " $STAGES " == *" $1 "* ]]; }
stamp() { echo "=== $(date -u +%H:%M:%S) $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# Every server dependency imports, so a missing wheel shows here and not as a dead server.
$PY -c "import fastapi, uvicorn, msgspec, zmq, gguf, aiohttp, ember.server.app" || exit 1

make_model() {
  if [ ! -f "$MODEL/config.json" ]; then
    stamp "make-model $PRESET"
    limited $PY -m ember.cli bench make-model --preset "$PRESET" --out "$MODEL" \
      --tokenizer-dir "$EMBER_TEST_TOKENIZER_DIR" || exit 1
  fi
}

if has_stage tests; then
  stamp "GPU tests"
  limited $PY -m pytest -q -p no:cacheprovider ${EMBER_GPU_TESTS:-tests/gpu tests/kernels} --junitxml="$RES/gpu_tests.xml" \
    2>&1 | tail -n 40
fi

if has_stage step; then
  make_model
  stamp "bench step"
  limited $PY -m ember.cli bench step --model "$MODEL" --out "$RES"
fi

if has_stage parity; then
  make_model
  stamp "bench parity"
  limited $PY -m ember.cli bench parity --model "$MODEL" --output-json "$RES/parity_$PRESET.json"
fi

DATASET=(--dataset sharegpt --dataset-path "$ROOT/.gpu_assets/sharegpt.json" --seed 0
  --tokenizer "$EMBER_TEST_TOKENIZER_DIR/tokenizer.json")
[ -n "${EMBER_SERVE_OUTPUT_LEN:-}" ] && DATASET+=(--sharegpt-output-len "$EMBER_SERVE_OUTPUT_LEN")
SERVE_COMMON=("${DATASET[@]}" --max-concurrency 200 --disable-tqdm)
SERVER_ARGS="--max-num-seqs 256 --max-num-batched-tokens 4096 --max-model-len 4096"

if has_stage serve; then
  make_model
  for n in ${EMBER_SERVE_PROMPTS:-1000 4000}; do
    stamp "bench serve $n prompts"
    limited $PY -m ember.cli bench serve --launch "$MODEL" --server-args="$SERVER_ARGS" \
      --num-prompts "$n" "${SERVE_COMMON[@]}" --server-log "$RES/server_${n}.log" \
      --output-json "$RES/serve_${n}.json"
  done
  n=${EMBER_PINNED_PROMPTS:-1000}
  if [ "$n" != 0 ]; then
    stamp "bench serve $n prompts, server pinned to one core"
    limited $PY -m ember.cli bench serve --launch "$MODEL" --server-args="$SERVER_ARGS" \
      --server-cpus 0 --num-prompts "$n" "${SERVE_COMMON[@]}" \
      --output-json "$RES/serve_${n}_pinned.json"
  fi
fi

if has_stage peer; then
  make_model
  n=${EMBER_PEER_PROMPTS:-1000}
  # transformers' defaults (no CUDA graphs with paged|sdpa) ran ~250 tok/s on the 8B shape, ~14 min
  # for 1,000 prompts, over one call's 10 min; its own CUDA graphs need room left by the KV cache.
  PEER_ARGS=${EMBER_PEER_ARGS---cuda-graphs on --max-memory-percent 0.6}
  stamp "peer: transformers continuous batching, $n prompts"
  limited $PY -m ember.bench.peer_transformers --model "$MODEL" --num-prompts "$n" "${DATASET[@]}" \
    --max-concurrency 200 --device "${EMBER_PEER_DEVICE:-cuda}" --disable-tqdm $PEER_ARGS \
    --output-json "$RES/peer_transformers_${n}.json"
fi
stamp "done"
