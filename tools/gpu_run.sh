#!/usr/bin/env bash
# One GPU run on a fresh machine with no network: install the carried wheels, run the GPU tests
# and the benchmarks, and write logs and results into OUTDIR (docs/gpu.md).
#
#   tools/gpu_run.sh OUTDIR [STAGE ...]       stages, run in the order given:
#                                             tests step profile tune parity serve peer
#                                             multi_wake multi_pair multi_traffic startup
#                                             resilience multi_turn structured fp8 (= fp8_step
#                                             fp8_serve) moe
#                                             (default: tests step parity serve peer)
#
# Needs, carried beside the tree (tools/prepare_gpu_assets.sh makes them here):
#   .whl/                        wheels the GPU image lacks (fastapi, msgspec, pyzmq, gguf, ...)
#   .gpu_assets/tokenizer/       SmolLM2's tokenizer files (the 98 MB GGUF does not travel)
#   .gpu_assets/sharegpt.json    the ShareGPT conversations, trimmed to what the benchmark samples
#   .gpu_assets/sharegpt_multi_turn.json  (stage multi_turn) whole conversations, turn by turn
#   .s3server/weed.xz            (stage startup) an S3-compatible server (tools/prepare_s3_server.sh)
#
# Environment overrides (for a dry run on a CPU: EMBER_GPU_RUN_SKIP_INSTALL=1 PYTHON=python
# EMBER_BENCH_PRESET=tiny EMBER_SERVE_PROMPTS=8 EMBER_PINNED_PROMPTS=8 EMBER_PEER_PROMPTS=4
# EMBER_PEER_DEVICE=cpu EMBER_SERVE_OUTPUT_LEN=8 EMBER_MT_CONVERSATIONS=8 EMBER_MT_OUTPUT_LEN=16):
#   EMBER_STEP_ARGS (e.g. "--sections attention"), EMBER_PROFILE_ARGS (e.g. "--batches 1 16"),
#   EMBER_TUNE_ARGS (e.g. "--sections split_k stream_k"),
#   EMBER_BENCH_PRESET (llama-3.1-8b), EMBER_BENCH_QUANTIZATION (unset; fp8: the benchmarks'
#   checkpoint with FP8 linear weights, llm-compressor's layout; mxfp4, gpt-oss presets: its
#   experts in MXFP4 as OpenAI publishes them, served packed), EMBER_BENCH_LOAD_FORMAT (unset;
#   dummy: the preset's config and tokenizer only, its weights made on the GPU by step, profile
#   and serve: for shapes whose checkpoint does not fit the disk), EMBER_GPU_TESTS
#   ("tests/gpu tests/kernels"),
#   EMBER_SERVE_PROMPTS ("1000 4000"), EMBER_PINNED_PROMPTS (1000), EMBER_PEER_PROMPTS (1000),
#   EMBER_PEER_DEVICE (cuda), EMBER_SERVE_OUTPUT_LEN (unset), EMBER_MT_CONVERSATIONS (200),
#   EMBER_MT_OUTPUT_LEN (256: the most tokens a multi-turn answer asks for),
#   EMBER_PEER_ARGS ("--cuda-graphs on --max-memory-percent 0.6"), EMBER_SRC (the ember sources
#   to run, default ./src: another copy of them, e.g. `git archive REV src` carried, gives a
#   before/after pair in one device call), EMBER_RUN_SECONDS (570: every command is stopped in
#   time for the results to be bundled inside the device's 600 s call), EMBER_SERVER_ARGS
#   (unset: further `ember serve` flags of every launched server, e.g. "-tp 2")
set -uo pipefail
OUT=${1:?usage: tools/gpu_run.sh OUTDIR [STAGE ...]}
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
# EMBER_SRC serves another copy of the sources (an A/B in one call: two runs, two OUTDIRs).
export PYTHONPATH=/tmp/site:${EMBER_SRC:-$ROOT/src}:$ROOT/tests
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export EMBER_TEST_TOKENIZER_DIR=$ROOT/.gpu_assets/tokenizer
PRESET=${EMBER_BENCH_PRESET:-llama-3.1-8b}
QUANTIZATION=${EMBER_BENCH_QUANTIZATION:-}
LOAD_FORMAT=${EMBER_BENCH_LOAD_FORMAT:-}
MODEL=/tmp/$PRESET-random${QUANTIZATION:+-$QUANTIZATION}${LOAD_FORMAT:+-$LOAD_FORMAT}
# A command the device kills loses the archive; each step here gets what is left of the budget.
DEADLINE=$(( $(date +%s) + ${EMBER_RUN_SECONDS:-570} ))
limited() {
  local left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -le 5 ]; then echo "skipped (out of time): $*"; return 124; fi
  timeout --signal=INT --kill-after=10 "$left" "$@"
}
stamp() { echo "=== $(date -u +%H:%M:%S) $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# Every server dependency imports, so a missing wheel shows here and not as a dead server.
$PY -c "import fastapi, uvicorn, msgspec, zmq, gguf, aiohttp, llguidance, ember.server.app" ||
  exit 1

make_model() {
  if [ ! -f "$MODEL/config.json" ]; then
    stamp "make-model $PRESET ${QUANTIZATION}"
    limited $PY -m ember.cli bench make-model --preset "$PRESET" --out "$MODEL" \
      --tokenizer-dir "$EMBER_TEST_TOKENIZER_DIR" ${QUANTIZATION:+--quantization "$QUANTIZATION"} \
      ${LOAD_FORMAT:+--config-only} || exit 1
  fi
}

DATASET=(--dataset sharegpt --dataset-path "$ROOT/.gpu_assets/sharegpt.json" --seed 0
  --tokenizer "$EMBER_TEST_TOKENIZER_DIR/tokenizer.json")
[ -n "${EMBER_SERVE_OUTPUT_LEN:-}" ] && DATASET+=(--sharegpt-output-len "$EMBER_SERVE_OUTPUT_LEN")
SERVE_COMMON=("${DATASET[@]}" --max-concurrency 200 --disable-tqdm)
SERVER_ARGS="--max-num-seqs 256 --max-num-batched-tokens 4096 --max-model-len 4096 ${EMBER_SERVER_ARGS:-}"

stage_tests() {
  stamp "GPU tests"
  limited $PY -m pytest -q -p no:cacheprovider ${EMBER_GPU_TESTS:-tests/gpu tests/kernels} \
    --junitxml="$RES/gpu_tests.xml" > "$RES/gpu_tests.log" 2>&1
  local rc=$?
  tail -n 40 "$RES/gpu_tests.log"
  if [ $rc != 0 ]; then
    # Later stages still measure, on the path the tests cover best: graphs for decode only.
    echo "GPU tests failed (rc $rc): serving with --cuda-graph-mode decode"
    SERVER_ARGS="$SERVER_ARGS --cuda-graph-mode decode"
  fi
}

stage_step() {
  make_model
  stamp "bench step"
  limited $PY -m ember.cli bench step --model "$MODEL" --out "$RES" ${EMBER_STEP_ARGS:-} \
    ${LOAD_FORMAT:+--load-format "$LOAD_FORMAT"}
}

stage_profile() {
  make_model
  stamp "bench profile"
  limited $PY -m ember.cli bench profile --model "$MODEL" --out "$RES/profile" \
    ${LOAD_FORMAT:+--load-format "$LOAD_FORMAT"} ${EMBER_PROFILE_ARGS:-}
}

stage_tune() {  # needs no checkpoint: the sweeps allocate the 8B shapes themselves
  stamp "bench tune"
  limited $PY -m ember.cli bench tune --out "$RES" ${EMBER_TUNE_ARGS:-}
}

stage_parity() {
  make_model
  for dtype in float32 bfloat16; do
    stamp "bench parity $dtype"
    limited $PY -m ember.cli bench parity --model "$MODEL" --dtype $dtype \
      --output-json "$RES/parity_${PRESET}_$dtype.json"
  done
}

serve_once() {  # NAME [extra bench-serve args...]
  local name=$1
  shift
  stamp "bench serve $name ($SERVER_ARGS)"
  limited $PY -m ember.cli bench serve --launch "$MODEL" --server-args="$SERVER_ARGS" \
    "${SERVE_COMMON[@]}" --server-log "$RES/server_${name}.log" \
    --output-json "$RES/serve_${name}.json" ${LOAD_FORMAT:+--load-format "$LOAD_FORMAT"} "$@"
}

stage_serve() {  # the first size, then the pinned run (its ratio to the first), then the rest
  make_model
  local sizes=(${EMBER_SERVE_PROMPTS:-1000 4000}) pinned=${EMBER_PINNED_PROMPTS:-1000} n
  serve_once "${sizes[0]}" --num-prompts "${sizes[0]}"
  [ "$pinned" != 0 ] && serve_once "${pinned}_pinned" --num-prompts "$pinned" --server-cpus 0
  for n in "${sizes[@]:1}"; do
    serve_once "$n" --num-prompts "$n"
  done
}

# FP8 (issue 42): the same 8B shape written as an FP8 checkpoint (compressed-tensors layout,
# per-channel weight scales), its decode/prefill steps against the FP8 roofline (stage fp8_step),
# and ShareGPT at concurrency 200 in bf16, then with FP8 weights, then FP8 weights + FP8 KV cache
# (stage fp8_serve); stage fp8 runs both.
FP8_MODEL=/tmp/$PRESET-random-fp8${LOAD_FORMAT:+-$LOAD_FORMAT}
make_fp8_model() {
  if [ ! -f "$FP8_MODEL/config.json" ]; then
    stamp "make-model $PRESET --quantization fp8"
    limited $PY -m ember.cli bench make-model --preset "$PRESET" --out "$FP8_MODEL" \
      --quantization fp8 --tokenizer-dir "$EMBER_TEST_TOKENIZER_DIR" \
      ${LOAD_FORMAT:+--config-only} || return 1
  fi
}
stage_fp8_step() {
  make_fp8_model || return 1
  stamp "bench step fp8 weights"
  limited $PY -m ember.cli bench step --model "$FP8_MODEL" --out "$RES/step_fp8" \
    --sections decode prefill --decode-batches 1 64 256 ${EMBER_STEP_ARGS:-} \
    ${LOAD_FORMAT:+--load-format "$LOAD_FORMAT"}
  stamp "bench step fp8 weights + fp8 kv"
  limited $PY -m ember.cli bench step --model "$FP8_MODEL" --out "$RES/step_fp8_kv" \
    --sections decode --decode-batches 1 64 256 --kv-cache-dtype fp8 ${EMBER_STEP_ARGS:-} \
    ${LOAD_FORMAT:+--load-format "$LOAD_FORMAT"}
}
stage_fp8_serve() {
  make_model
  make_fp8_model || return 1
  local n
  for n in ${EMBER_FP8_PROMPTS:-1000}; do
    serve_once "bf16_${n}" --num-prompts "$n"
    MODEL=$FP8_MODEL serve_once "fp8_${n}" --num-prompts "$n"
    SERVER_ARGS="$SERVER_ARGS --kv-cache-dtype fp8" MODEL=$FP8_MODEL \
      serve_once "fp8_kv_${n}" --num-prompts "$n"
  done
}
stage_fp8() {
  stage_fp8_step
  stage_fp8_serve
}

# Mixture of experts (issue 45): the fused MoE kernels' GPU tests, then their tiles and paths
# timed per expert shape against the chosen experts' bytes (`ember bench tune --sections moe`;
# EMBER_MOE_SHAPES picks the shapes, one a call fits the time; gpt-oss-20b-mxfp4 and
# gpt-oss-120b-mxfp4 time the kernels' MXFP4 variant on packed experts).
stage_moe() {
  stamp "GPU tests: fused MoE"
  limited $PY -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_fused_moe.py \
    tests/gpu/test_gpu_fused_moe_mxfp4.py \
    > "$RES/gpu_tests_moe.log" 2>&1
  tail -n 20 "$RES/gpu_tests_moe.log"
  stamp "bench tune moe"
  limited $PY -m ember.cli bench tune --sections moe --out "$RES" \
    ${EMBER_MOE_SHAPES:+--moe-shapes $EMBER_MOE_SHAPES}
}

stage_peer() {
  make_model
  local n=${EMBER_PEER_PROMPTS:-1000}
  # transformers' defaults (no CUDA graphs with paged|sdpa) ran ~250 tok/s on the 8B shape, ~14 min
  # for 1,000 prompts, over one call's 10 min; its own CUDA graphs need room left by the KV cache.
  local peer_args=${EMBER_PEER_ARGS---cuda-graphs on --max-memory-percent 0.6}
  stamp "peer: transformers continuous batching, $n prompts"
  limited $PY -m ember.bench.peer_transformers --model "$MODEL" --num-prompts "$n" "${DATASET[@]}" \
    --max-concurrency 200 --device "${EMBER_PEER_DEVICE:-cuda}" --disable-tqdm $peer_args \
    --output-json "$RES/peer_transformers_${n}.json"
}

# Several models in one server (`ember bench multi-model`): three 8B-shaped checkpoints of
# different random weights (the first is $MODEL) and one 1B-shaped. Sizes on the H200 (bf16):
# an 8B holds 16 GB of weights, 38 GB with its 20 GB KV cache and reserve; the 95 GB budget
# holds two 8B and the 1B, never all four.
MULTI_BUDGET=${EMBER_MULTI_BUDGET:-95e9}
MULTI_KV=${EMBER_MULTI_KV:-20e9}  # each 8B's KV cache (an H100's 80 GB: 95e9 -> 68e9, 20e9 -> 10e9)
MULTI_SECONDS=${EMBER_MULTI_SECONDS:-180}
make_multi_models() {
  make_model
  for seed in 1 2; do
    if [ ! -f "/tmp/$PRESET-$seed/config.json" ]; then
      stamp "make-model $PRESET seed $seed"
      limited $PY -m ember.cli bench make-model --preset "$PRESET" --out "/tmp/$PRESET-$seed" \
        --seed "$seed" --tokenizer-dir "$EMBER_TEST_TOKENIZER_DIR" || exit 1
    fi
  done
  if [ ! -f /tmp/llama-3.2-1b-random/config.json ]; then
    stamp "make-model llama-3.2-1b"
    limited $PY -m ember.cli bench make-model --preset llama-3.2-1b --out /tmp/llama-3.2-1b-random \
      --seed 3 --tokenizer-dir "$EMBER_TEST_TOKENIZER_DIR" || exit 1
  fi
}
MULTI_COMMON=(--dataset sharegpt --dataset-path "$ROOT/.gpu_assets/sharegpt.json" --seed 0
  --tokenizer "$EMBER_TEST_TOKENIZER_DIR/tokenizer.json" --max-model-len 4096
  --server-args="--max-num-seqs 256 --max-num-batched-tokens 4096"
  --sleep-host-memory-bytes 40e9 --budget-bytes "$MULTI_BUDGET")

stage_multi_wake() {  # sleep/wake and unload/load of one 8B model in a running server
  make_model
  stamp "bench multi-model wake"
  limited $PY -m ember.cli bench multi-model --mode wake --model "a=$MODEL" \
    --kv-cache-bytes "$MULTI_KV" --repeats 5 "${MULTI_COMMON[@]}" \
    --server-log "$RES/server_multi_wake.log" --out "$RES/multi_model_wake.json"
}

stage_multi_pair() {  # one 8B alone at concurrency 200, then two 8B sharing it 50/50
  make_multi_models
  stamp "bench multi-model pair"
  limited $PY -m ember.cli bench multi-model --mode pair --model "a=$MODEL" \
    --model "b=/tmp/$PRESET-1" --kv-cache-bytes "$MULTI_KV" --concurrency 200 \
    --duration "${EMBER_PAIR_SECONDS:-60}" --num-prompts 4000 "${MULTI_COMMON[@]}" \
    --server-log "$RES/server_multi_pair.log" --out "$RES/multi_model_pair.json"
}

stage_multi_traffic() {  # 3 x 8B + 1B, ShareGPT split 60/25/10/5 at concurrency 200
  make_multi_models
  stamp "bench multi-model traffic"
  limited $PY -m ember.cli bench multi-model --mode traffic --model "a=$MODEL" \
    --model "b=/tmp/$PRESET-1" --model "c=/tmp/$PRESET-2" --model d=/tmp/llama-3.2-1b-random \
    --weight 60 --weight 25 --weight 10 --weight 5 \
    --kv-cache-bytes "$MULTI_KV" --kv-cache-bytes "$MULTI_KV" --kv-cache-bytes "$MULTI_KV" \
    --kv-cache-bytes 8e9 \
    --concurrency 200 --duration "$MULTI_SECONDS" --num-prompts 20000 "${MULTI_COMMON[@]}" \
    --server-log "$RES/server_multi_traffic.log" --out "$RES/multi_model_traffic.json"
}

stage_startup() {  # ember serve -> first token: warm, kernels cold, disk cold, from a local S3
  make_model
  local bucket=http://127.0.0.1:8333/models weed_pid=""
  if [ -f .s3server/weed.xz ]; then
    stamp "S3 server (SeaweedFS) with the checkpoint"
    $PY -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.s3server/weed.xz'), open('/tmp/weed', 'wb'))"
    chmod +x /tmp/weed
    mkdir -p /tmp/weed-data
    /tmp/weed server -dir=/tmp/weed-data -s3 -s3.port=8333 -ip=127.0.0.1 -volume.max=0 \
      > "$RES/weed.log" 2>&1 &
    weed_pid=$!
    $PY - "$bucket" <<'PY'
import sys, time, urllib.error, urllib.request
for _ in range(120):  # the S3 port answers once the master, volume and filer are up
    try:
        urllib.request.urlopen(urllib.request.Request(sys.argv[1], method="PUT"), timeout=5)
        break
    except urllib.error.HTTPError:
        break  # it answers (the bucket may exist already)
    except OSError:
        time.sleep(0.5)
PY
    export AWS_ENDPOINT_URL=http://127.0.0.1:8333 AWS_ACCESS_KEY_ID=ember AWS_SECRET_ACCESS_KEY=ember
    S3_ARGS=(--s3-url s3://models/llama --upload)
  else
    echo "no .s3server/weed.xz: the store scenario is skipped"
    S3_ARGS=(--scenarios cold-kernels,warm,cold-disk)
  fi
  stamp "bench startup"
  limited $PY -m ember.cli bench startup "$MODEL" "${S3_ARGS[@]}" --drop-caches all \
    --server-args "$SERVER_ARGS" --label "$PRESET bf16" --output-json "$RES/startup.json"
  [ -n "${weed_pid:-}" ] && kill "$weed_pid"
}

stage_resilience() {  # hang-ups, KV leaks, throughput after, an engine killed under load
  make_model
  stamp "bench resilience"
  limited $PY -m ember.cli bench resilience --launch "$MODEL" --server-args "$SERVER_ARGS" \
    "${DATASET[@]}" --num-prompts 1000 --max-concurrency 200 --disconnect-streams 2000 \
    --kill-after 10 --server-log "$RES/server_resilience.log" --output-json "$RES/resilience.json"
}

stage_multi_turn() {  # ShareGPT conversations turn by turn: prefix caching on, then off
  make_model
  local conversations=$ROOT/.gpu_assets/sharegpt_multi_turn.json n=${EMBER_MT_CONVERSATIONS:-200}
  if [ ! -f "$conversations" ]; then
    echo "no $conversations: tools/prepare_gpu_assets.sh makes it"
    return 1
  fi
  stamp "bench multi-turn, $n conversations, prefix caching on and off ($SERVER_ARGS)"
  limited $PY -m ember.cli bench multi-turn --launch "$MODEL" --server-args="$SERVER_ARGS" \
    --compare-prefix-caching --dataset-path "$conversations" --seed 0 \
    --tokenizer "$EMBER_TEST_TOKENIZER_DIR/tokenizer.json" --num-conversations "$n" \
    --max-turns 6 --max-output-len "${EMBER_MT_OUTPUT_LEN:-256}" --max-context 4096 \
    --max-concurrency 64 --disable-tqdm --server-log "$RES/server_multi_turn.log" \
    --output-json "$RES/multi_turn.json"
}

stage_structured() {  # a JSON-schema constraint against none, per output token, batch 1 and 64
  make_model
  stamp "bench structured-output"
  limited $PY -m ember.cli bench structured-output --model "$MODEL" --batches 1,64 \
    --max-tokens 256 --out "$RES/structured_output_$PRESET.json"
}

# Stages run in the order given.
for stage in $STAGES; do
  case $stage in
    tests | step | profile | tune | parity | serve | peer | multi_wake | multi_pair | multi_traffic \
      | startup | resilience | multi_turn | structured | fp8 | fp8_step | fp8_serve | moe)
      "stage_$stage" ;;
    *) echo "unknown stage: $stage" ;;
  esac
done
stamp "done"
