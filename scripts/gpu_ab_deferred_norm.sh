#!/usr/bin/env bash
# One-off A/B on the H200 (2026-12-01): the deferred RMSNorm (norm weights folded into q/k/v and
# gate/up, cuBLAS kept there; o/down add the residual and sum its squares in the skinny GEMM's
# epilogue; 1/rms applied in the attention and SiLU kernels) against separate norm kernels
# (--separate-norms). Compiled kernel tests and the engine's Triton-vs-reference tokens, decode
# steps for both variants in one call, profiles (by_predecessor rows included), bf16 parity of
# the deferred path, then `bench tune --in-sequence` with what time is left. Results into
# $OUT/ab.tar.gz, the log beside it. EMBER_AB_STAGES picks sections (default: tests step profile
# parity tune); EMBER_AB_PROFILE_BATCHES the profiled batches (default: 1 64).
set -uo pipefail
STAGES=" ${EMBER_AB_STAGES:-tests step profile parity tune} "
want() { [[ "$STAGES" == *" $1 "* ]]; }
OUT=${1:?usage: scripts/gpu_ab_deferred_norm.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/ab"
exec > >(tee -a "$OUT/log.txt") 2>&1
trap 'tar -czf "$OUT/ab.tar.gz" -C "$OUT" ab && rm -rf "$OUT/ab"' EXIT
DEADLINE=$(( $(date +%s) + ${EMBER_RUN_SECONDS:-570} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
capped() {  # SECONDS CMD...: run for at most SECONDS, and never past the deadline
  local cap=$1 l
  shift
  l=$(left)
  [ "$l" -lt "$cap" ] && cap=$l
  if [ "$cap" -le 5 ]; then echo "skipped (out of time): $*"; return 124; fi
  timeout --signal=INT --kill-after=5 "$cap" "$@"
}
source scripts/gpu_oneoff_setup.sh  # wheels, environment, $M being made ($MAKER)
if want tests; then
  echo "=== tests $(date +%T)"
  capped 130 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_deferred_norm.py \
    tests/kernels/test_attention_step.py tests/kernels/test_activation.py \
    tests/kernels/test_rmsnorm.py tests/kernels/test_skinny_gemm.py \
    tests/kernels/test_rope_cache_write.py tests/kernels/test_engine_on_kernels.py \
    > "$OUT/ab/tests.log" 2>&1
  tail -n 6 "$OUT/ab/tests.log"
fi
wait $MAKER
want step && for variant in deferred separate; do
  flag=$([ $variant = separate ] && echo --separate-norms)
  echo "=== step $variant $(date +%T)"
  capped 75 python3 -m ember.cli bench step --model $M --out "$OUT/ab/step_$variant" \
    --sections decode --decode-batches 1 8 64 256 --decode-contexts 512 $flag 2>&1 \
    | grep '"batch"\|Error'
done
want profile && for variant in deferred separate; do
  flag=$([ $variant = separate ] && echo --separate-norms)
  echo "=== profile $variant $(date +%T)"
  capped 70 python3 -m ember.cli bench profile --model $M --out "$OUT/ab/profile_$variant" \
    --batches ${EMBER_AB_PROFILE_BATCHES:-1 64} $flag 2>&1 | grep -v '^\s*$' | tail -n 4
  rm -f "$OUT"/ab/profile_$variant/profile_decode_b*.json "$OUT"/ab/profile_$variant/profile_mixed.json
done
if want parity; then
  echo "=== parity bf16 deferred $(date +%T)"
  capped 75 python3 -m ember.cli bench parity --model $M --dtype bfloat16 \
    --output-json "$OUT/ab/parity_bf16.json" 2>&1 | tail -n 3
fi
if want tune; then
  echo "=== tune in sequence $(date +%T)"
  capped 150 python3 -m ember.cli bench tune --out "$OUT/ab/tune" --skip-attention --skip-gemm \
    --in-sequence 2>&1 | tail -n 4
fi
echo "=== done $(date +%T)"
