#!/usr/bin/env bash
# One-off A/B on the H200 (2026-11-30/12-01): the skinny GEMM's first weight tile loaded before
# the PDL wait (EMBER_SKINNY_PREFETCH=1) or not, with programmatic launch on and off; decode
# steps at batch 1, 8, 64 (context 512) and plain-launch profiles (clean kernel times).
set -uo pipefail
OUT=${1:?usage: scripts/gpu_ab_prefetch.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/ab"
exec > >(tee -a "$OUT/ab/log.txt") 2>&1
trap 'tar -czf "$OUT/ab.tar.gz" -C "$OUT" ab && rm -rf "$OUT/ab"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
M=/tmp/llama-3.1-8b-random
[ -f $M/config.json ] || python3 -m ember.cli bench make-model --preset llama-3.1-8b --out $M \
  --tokenizer-dir .gpu_assets/tokenizer
for prefetch in 1 0; do
  for launch in on off; do
    echo "=== prefetch $prefetch, programmatic launch $launch"
    EMBER_SKINNY_PREFETCH=$prefetch python3 -m ember.cli bench step --model $M \
      --out "$OUT/ab/step_p${prefetch}_$launch" --sections decode --decode-batches 1 8 64 \
      --decode-contexts 512 --programmatic-launch $launch 2>&1 | grep '"batch"'
  done
  echo "=== profile, prefetch $prefetch, plain launches"
  EMBER_SKINNY_PREFETCH=$prefetch python3 -m ember.cli bench profile --model $M \
    --out "$OUT/ab/profile_p$prefetch" --batches 1 64 --programmatic-launch off 2>&1 | grep '{'
  rm -f "$OUT"/ab/profile_p$prefetch/profile_*.json  # traces: too large to bring back
done
