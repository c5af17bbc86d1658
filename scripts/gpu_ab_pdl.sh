#!/usr/bin/env bash
# One-off on the H200 (2026-12-01): where programmatic dependent launch wins and loses. Decode
# steps at batch 1-64 (context 512) with PDL on and off, and profiles of both whose
# `critical_path_us_per_step` says what each kernel category adds to the step (a PDL kernel's
# own span includes its wait). First the compiled kernel tests of the attention and PDL paths.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_ab_pdl.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/ab"
exec > >(tee -a "$OUT/ab/log.txt") 2>&1
trap 'tar -czf "$OUT/ab.tar.gz" -C "$OUT" ab && rm -rf "$OUT/ab"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py \
  tests/kernels/test_pdl.py 2>&1 | tail -n 15
M=/tmp/llama-3.1-8b-random
[ -f $M/config.json ] || python3 -m ember.cli bench make-model --preset llama-3.1-8b --out $M \
  --tokenizer-dir .gpu_assets/tokenizer
# (At 73bd977 the flag was --programmatic-launch on|off; it is a switch since.)
for launch in on off; do
  flag=$([ $launch = on ] && echo --programmatic-launch)
  echo "=== step, programmatic launch $launch"
  python3 -m ember.cli bench step --model $M --out "$OUT/ab/step_$launch" --sections decode \
    --decode-batches 1 8 32 64 --decode-contexts 512 $flag 2>&1 | grep '"batch"'
  echo "=== profile, programmatic launch $launch"
  python3 -m ember.cli bench profile --model $M --out "$OUT/ab/profile_$launch" \
    --batches 1 8 32 64 $flag 2>&1 | grep '{'
  rm -f "$OUT"/ab/profile_$launch/profile_*.json  # traces: too large to bring back
done
