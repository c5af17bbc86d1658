#!/usr/bin/env bash
# One-off A/B on the H200 (2026-12-01): under PDL, q/k/v and gate/up on the skinny GEMM (default)
# or on cuBLAS (EMBER_PDL_WIDE_ON_CUBLAS=1), and plain launches; decode at batch 1-64, context
# 512, with split-KV partials merged in the attention kernel. First the kernel tests of the new
# paths, compiled.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_ab_routing.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/ab"
exec > >(tee -a "$OUT/ab/log.txt") 2>&1
trap 'tar -czf "$OUT/ab.tar.gz" -C "$OUT" ab && rm -rf "$OUT/ab"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export EMBER_TEST_TOKENIZER_DIR=$PWD/.gpu_assets/tokenizer
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py \
  tests/kernels/test_pdl.py tests/gpu 2>&1 | tail -n 15
M=/tmp/llama-3.1-8b-random
[ -f $M/config.json ] || python3 -m ember.cli bench make-model --preset llama-3.1-8b --out $M \
  --tokenizer-dir .gpu_assets/tokenizer
run() {  # NAME ENV=VALUE LAUNCH
  echo "=== $1"
  env "$2" python3 -m ember.cli bench step --model $M --out "$OUT/ab/step_$1" --sections decode \
    --decode-batches 1 8 32 64 --decode-contexts 512 --programmatic-launch "$3" 2>&1 | grep '"batch"'
}
run pdl_all_skinny EMBER_PDL_WIDE_ON_CUBLAS=0 on
run pdl_wide_on_cublas EMBER_PDL_WIDE_ON_CUBLAS=1 on
run plain EMBER_PDL_WIDE_ON_CUBLAS=0 off
