#!/usr/bin/env bash
# One-off on the H200 (2026-12-01): decode steps with RoPE inside the attention kernel, and
# weights prefetched into L2 between GEMMs. First the compiled tests of both; then the prefetch
# probe (a batch-1 GEMM cold vs after its weight was prefetched); then decode steps at batch
# 1-64 (context 512) for: RoPE fused/separate without prefetch, and fused with prefetch
# 'attention' and 'all' (up to batch 64, to see where it stops paying).
set -uo pipefail
OUT=${1:?usage: scripts/gpu_ab_l2_prefetch.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/ab"
exec > >(tee -a "$OUT/ab/log.txt") 2>&1
trap 'tar -czf "$OUT/ab.tar.gz" -C "$OUT" ab && rm -rf "$OUT/ab"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export EMBER_TEST_TOKENIZER_DIR=$PWD/.gpu_assets/tokenizer
M=/tmp/llama-3.1-8b-random
[ -f $M/config.json ] || python3 -m ember.cli bench make-model --preset llama-3.1-8b --out $M \
  --tokenizer-dir .gpu_assets/tokenizer > /dev/null &
MAKER=$!  # waited for by pid: a bare `wait` would also wait for the tee above, forever
[ "${EMBER_AB_TESTS:-1}" = 1 ] && timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_l2_prefetch.py \
  tests/kernels/test_attention_step.py tests/kernels/test_paged_attention.py tests/gpu/test_gpu_engine.py \
  -k "prefetch or attention_step or rope or triton_path_matches" 2>&1 | tail -n 15
echo "=== probe"
python3 scripts/l2_prefetch_probe.py 2>&1 | tail -n 4
wait $MAKER
run_step() {  # name, flags...
  local name=$1; shift
  echo "=== step $name: $*"
  python3 -m ember.cli bench step --model $M --out "$OUT/ab/step_$name" --sections decode \
    --decode-batches 1 8 32 64 --decode-contexts 512 "$@" 2>&1 | grep '"batch"\|Error'
}
run_step fused_off
run_step fused_all --l2-prefetch all --l2-prefetch-max-batch 64
run_step fused_attention --l2-prefetch attention --l2-prefetch-max-batch 64
run_step separate_off --separate-decode-rope
echo "=== profile, fused, prefetch all"
python3 -m ember.cli bench profile --model $M --out "$OUT/ab/profile_fused_all" --batches 1 8 \
  --l2-prefetch all --l2-prefetch-max-batch 64 2>&1 | grep '{'
rm -f "$OUT"/ab/profile_fused_all/profile_*.json  # traces: too large to bring back
