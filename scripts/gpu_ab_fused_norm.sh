#!/usr/bin/env bash
# One-off on the H200 (2026-12-01): RMSNorm (and the SiLU gate) folded into the skinny GEMM of
# the skinny GEMMs' epilogues (`skinny_gemm_add`, `skinny_norm_gemm`) against the separate kernels
# (--separate-norm-kernels). Compiled tests of the kernels and the engine's Triton-vs-reference tokens; decode steps at batch
# 1-64 (context 512) for both, interleaved; profiles at batch 1 and 64 for both; the fused
# kernel's tile sweep; bf16 parity on the 8B shape. Results into $OUT/ab.tar.gz.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_ab_fused_norm.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/ab"
exec > >(tee -a "$OUT/ab/log.txt") 2>&1
trap 'tar -czf "$OUT/ab.tar.gz" -C "$OUT" ab && rm -rf "$OUT/ab"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export EMBER_TEST_TOKENIZER_DIR=$PWD/.gpu_assets/tokenizer
M=/tmp/llama-3.1-8b-random
python3 -m ember.cli bench make-model --preset llama-3.1-8b --out $M \
  --tokenizer-dir .gpu_assets/tokenizer > /dev/null &
MAKER=$!  # waited for by pid: a bare `wait` would also wait for the tee above
echo "=== tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_gemm.py \
  tests/kernels/test_pdl.py tests/gpu/test_gpu_engine.py -k "not transformers" 2>&1 | tail -n 8
wait $MAKER
for variant in fused separate; do
  flag=$([ $variant = separate ] && echo --separate-norm-kernels)
  echo "=== step $variant $(date +%T)"
  timeout 80 python3 -m ember.cli bench step --model $M --out "$OUT/ab/step_$variant" \
    --sections decode --decode-batches 1 8 32 64 --decode-contexts 512 $flag 2>&1 \
    | grep '"batch"\|Error'
done
for variant in fused separate; do
  flag=$([ $variant = separate ] && echo --separate-norm-kernels)
  echo "=== profile $variant $(date +%T)"
  timeout 75 python3 -m ember.cli bench profile --model $M --out "$OUT/ab/profile_$variant" \
    --batches 1 64 $flag 2>&1 | grep -v '^\s*$' | tail -n 6
  rm -f "$OUT"/ab/profile_$variant/profile_decode_b*.json "$OUT"/ab/profile_$variant/profile_mixed.json
done
echo "=== tune $(date +%T)"
timeout 100 python3 -m ember.cli bench tune --out "$OUT/ab/tune" --skip-attention --skip-gemm \
  --batches 1 64 2>&1 | tail -n 6
echo "=== parity bf16 $(date +%T)"
timeout 70 python3 -m ember.cli bench parity --model $M --dtype bfloat16 \
  --output-json "$OUT/ab/parity_bf16.json" 2>&1 | tail -n 3
echo "=== done $(date +%T)"
