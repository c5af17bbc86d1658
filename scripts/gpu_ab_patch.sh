#!/usr/bin/env bash
# In-call A/B of a code change on the GPU: decode steps of the tree as it is, then with PATCH
# applied (`git apply`), then as it is again (machines of one kind differ by ~2%, more than most
# single changes, so both variants run on one machine, the baseline bracketing the variant).
#
#   scripts/gpu_ab_patch.sh OUTDIR PATCH [PATCH ...]     each patch is tried on its own
#
# EMBER_AB_STEP_ARGS: `ember bench step` arguments (default: decode steps at batch 1, 8, 64,
# context 512). EMBER_AB_PROFILE=1 also profiles batch 1 and 64 for the baseline and each patch.
# Results into $OUTDIR/ab.tar.gz (one step_bench.json per run, named baseline_1, PATCHNAME,
# baseline_2, ...), the log beside it. The tree is restored whatever happens.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_ab_patch.sh OUTDIR PATCH [PATCH ...]}
shift
[ $# -ge 1 ] || { echo "usage: scripts/gpu_ab_patch.sh OUTDIR PATCH [PATCH ...]"; exit 2; }
cd "$(dirname "$0")/.."
for patch in "$@"; do
  git apply --check "$patch" || { echo "does not apply: $patch"; exit 2; }
done
mkdir -p "$OUT/ab"
exec > >(tee -a "$OUT/log.txt") 2>&1
APPLIED=""
finish() {
  [ -n "$APPLIED" ] && git apply -R "$APPLIED"
  tar -czf "$OUT/ab.tar.gz" -C "$OUT" ab && rm -rf "$OUT/ab"
}
trap finish EXIT
source scripts/gpu_oneoff_setup.sh  # wheels, environment, $M being made ($MAKER)
wait $MAKER
read -r -a STEP_ARGS <<< "${EMBER_AB_STEP_ARGS:---sections decode --decode-batches 1 8 64 --decode-contexts 512}"
measure() {  # NAME
  echo "=== $1 $(date +%T)"
  python3 -m ember.cli bench step --model "$M" --out "$OUT/ab/$1" "${STEP_ARGS[@]}" 2>&1 \
    | grep '"batch"\|Error' | cut -c1-160
  if [ -n "${EMBER_AB_PROFILE:-}" ]; then
    python3 -m ember.cli bench profile --model "$M" --out "$OUT/ab/$1/profile" --batches 1 64 \
      2>&1 | grep '^{' | cut -c1-200
    rm -f "$OUT/ab/$1"/profile/profile_*.json
  fi
}
runs=1
measure "baseline_$runs"
for patch in "$@"; do
  name=$(basename "$patch" .patch)
  git apply "$patch" && APPLIED=$patch
  measure "$name"
  git apply -R "$patch" && APPLIED=""
  runs=$((runs + 1))
  measure "baseline_$runs"
done
echo "=== done $(date +%T)"
