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
set -uo pipefail
OUT=${1:?usage: scripts/gpu_run.sh OUTDIR [STAGE ...]}
shift
STAGES=${*:-tests step parity serve peer}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
LOG="$OUT/gpu_run.log"
exec > >(tee -a "$LOG") 2>&1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$ROOT/src:$ROOT/tests
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export EMBER_TEST_TOKENIZER_DIR=$ROOT/.gpu_assets/tokenizer
MODEL=/tmp/llama-3.1-8b-random
has_stage() { [[ " $STAGES " == *" $1 "* ]]; }
stamp() { echo "=== $(date -u +%H:%M:%S) $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

make_model() {
  if [ ! -f "$MODEL/config.json" ]; then
    stamp "make-model llama-3.1-8b"
    python3 -m ember.cli bench make-model --preset llama-3.1-8b --out "$MODEL" \
      --tokenizer-dir "$EMBER_TEST_TOKENIZER_DIR" || exit 1
  fi
}

if has_stage tests; then
  stamp "GPU tests"
  python3 -m pytest -q -p no:cacheprovider tests/gpu tests/kernels -x --junitxml="$OUT/gpu_tests.xml" \
    2>&1 | tail -n 40
fi

if has_stage step; then
  make_model
  stamp "bench step"
  python3 -m ember.cli bench step --model "$MODEL" --out "$OUT"
fi

if has_stage parity; then
  make_model
  stamp "bench parity"
  python3 -m ember.cli bench parity --model "$MODEL" --output-json "$OUT/parity_8b.json"
fi

SERVE_COMMON=(--dataset sharegpt --dataset-path "$ROOT/.gpu_assets/sharegpt.json"
  --tokenizer "$EMBER_TEST_TOKENIZER_DIR/tokenizer.json" --max-concurrency 200 --seed 0)
SERVER_ARGS="--max-num-seqs 256 --max-num-batched-tokens 4096 --max-model-len 4096"

if has_stage serve; then
  make_model
  for n in 1000 4000; do
    stamp "bench serve $n prompts"
    python3 -m ember.cli bench serve --launch "$MODEL" --server-args "$SERVER_ARGS" \
      --model "$MODEL" --num-prompts "$n" "${SERVE_COMMON[@]}" \
      --output-json "$OUT/serve_${n}.json"
  done
  stamp "bench serve 1000 prompts, server pinned to one core"
  python3 -m ember.cli bench serve --launch "$MODEL" --server-args "$SERVER_ARGS" \
    --server-cpus 0 --model "$MODEL" --num-prompts 1000 "${SERVE_COMMON[@]}" \
    --output-json "$OUT/serve_1000_pinned.json"
fi

if has_stage peer; then
  make_model
  stamp "peer: transformers continuous batching, 1000 prompts"
  python3 -m ember.bench.peer_transformers --model "$MODEL" --num-prompts 1000 --seed 0 \
    --dataset-path "$ROOT/.gpu_assets/sharegpt.json" --output-json "$OUT/peer_transformers_1000.json"
fi
stamp "done"
