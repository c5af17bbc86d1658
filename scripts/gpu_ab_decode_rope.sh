#!/usr/bin/env bash
# A/B for the next device call (branch wip/decode-rope-in-attention): decode steps with RoPE and
# the KV write inside the attention kernel (default) or in their own kernel
# (--separate-decode-rope), batch 1-256 at context 512 and 4096, with critical-path profiles;
# first the compiled kernel and engine tests of the fused path. ~5 min on an H200.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_ab_decode_rope.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/ab"
exec > >(tee -a "$OUT/ab/log.txt") 2>&1
trap 'tar -czf "$OUT/ab.tar.gz" -C "$OUT" ab && rm -rf "$OUT/ab"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export EMBER_TEST_TOKENIZER_DIR=$PWD/.gpu_assets/tokenizer
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention_step.py \
  tests/kernels/test_paged_attention.py tests/kernels/test_engine_on_kernels.py tests/gpu \
  2>&1 | tail -n 15
M=/tmp/llama-3.1-8b-random
[ -f $M/config.json ] || python3 -m ember.cli bench make-model --preset llama-3.1-8b --out $M \
  --tokenizer-dir .gpu_assets/tokenizer
for variant in fused separate; do
  flag=$([ $variant = separate ] && echo --separate-decode-rope)
  echo "=== step, decode RoPE $variant"
  python3 -m ember.cli bench step --model $M --out "$OUT/ab/step_$variant" --sections decode \
    $flag 2>&1 | grep '"batch"'
done
