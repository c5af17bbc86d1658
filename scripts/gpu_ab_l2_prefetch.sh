#!/usr/bin/env bash
# One-off on the H200 (2026-12-01), second round of the L2 weight prefetch (the first, at a960c7a,
# lost 140-700 us per step: 8 programs prefetched at ~1.5 TB/s and the main stream joined each
# prefetch). Now up to 32 programs and a single join per forward pass. The compiled prefetch
# tests; the probe (prefetch launch shapes, a batch-1 GEMM after an 8 us gap with and without a
# concurrent prefetch); decode steps at batch 1, 8, 32 (context 512): off, 'all', 'attention'.
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
timeout 120 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_l2_prefetch.py \
  tests/gpu/test_gpu_engine.py -k "prefetch" 2>&1 | tail -n 15
echo "=== probe"
python3 scripts/l2_prefetch_probe.py 2>&1 | tail -n 4
wait $MAKER
run_step() {  # name, flags...
  local name=$1; shift
  echo "=== step $name: $*"
  python3 -m ember.cli bench step --model $M --out "$OUT/ab/step_$name" --sections decode \
    --decode-batches 1 8 32 --decode-contexts 512 "$@" 2>&1 | grep '"batch"\|Error'
}
run_step off
run_step all --l2-prefetch all --l2-prefetch-max-batch 64
run_step attention --l2-prefetch attention --l2-prefetch-max-batch 64
