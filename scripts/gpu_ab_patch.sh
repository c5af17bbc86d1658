#!/usr/bin/env bash
# In-call A/B of a code change on the GPU: decode steps of the tree as it is, then with a variant,
# then as it is again (machines of one kind differ by ~2%, more than most single changes, so both
# run on one machine, the baseline bracketing the variant).
#
#   scripts/gpu_ab_patch.sh OUTDIR VARIANT [VARIANT ...]     each variant is tried on its own
#
# A VARIANT is a patch file (applied with `git apply`, reverted after), one quoted argument of
# `ember bench` flags starting with "--" (e.g. "--programmatic-launch"), or both in one quoted
# argument, the patch first ("docs/wip/x.patch --programmatic-launch").
#
# EMBER_AB_STEP_ARGS: `ember bench step` arguments (default: decode steps at batch 1, 8, 64,
# context 512). EMBER_AB_BRACKET=ends runs the baseline only first and last (not between
# variants), a run saved per variant (~45 s) when several are tried; EMBER_AB_BRACKET=first only
# first (for changes well above the ~1-2% drift within a call). EMBER_AB_PROFILE=1 also profiles
# the baseline and each variant at the batches of EMBER_AB_PROFILE_BATCHES ("1 64")
# and the context EMBER_AB_PROFILE_CONTEXT (512). EMBER_AB_FIRST: a command run once the
# environment is set and the checkpoint made, before the first run (kernel tests, a tune sweep),
# its output into $OUTDIR/first.log.
# Results into $OUTDIR/ab.tar.gz (one step_bench.json per run, named baseline_1, PATCHNAME,
# baseline_2, ...), the log beside it. The tree is restored whatever happens.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_ab_patch.sh OUTDIR VARIANT [VARIANT ...]}
shift
[ $# -ge 1 ] || { echo "usage: scripts/gpu_ab_patch.sh OUTDIR VARIANT [VARIANT ...]"; exit 2; }
cd "$(dirname "$0")/.."
for variant in "$@"; do
  [[ "$variant" == --* ]] && continue
  git apply --check "${variant%% *}" || { echo "does not apply: ${variant%% *}"; exit 2; }
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
if [ -n "${EMBER_AB_FIRST:-}" ]; then
  echo "=== first: $EMBER_AB_FIRST $(date +%T)"
  bash -c "$EMBER_AB_FIRST" > "$OUT/first.log" 2>&1
  echo "rc $? $(date +%T)"
  tail -n 5 "$OUT/first.log"
fi
read -r -a STEP_ARGS <<< "${EMBER_AB_STEP_ARGS:---sections decode --decode-batches 1 8 64 --decode-contexts 512}"
slug() {  # "--a b" -> "a_b": a run's name from its flags
  echo "$*" | tr -cs 'a-zA-Z0-9' '_' | sed 's/^_*//; s/_*$//'
}
measure() {  # NAME [BENCH FLAGS...]
  local name=$1
  shift
  echo "=== $name $* $(date +%T)"
  mkdir -p "$OUT/ab/$name"
  # The whole output goes into the results; a run that printed no step (a crash: a compiler abort
  # prints no "Error") shows its last lines here.
  python3 -m ember.cli bench step --model "$M" --out "$OUT/ab/$name" "${STEP_ARGS[@]}" "$@" \
    > "$OUT/ab/$name/output.txt" 2>&1
  grep '"batch"\|Error' "$OUT/ab/$name/output.txt" | cut -c1-160
  grep -q '"batch"' "$OUT/ab/$name/output.txt" || tail -n 15 "$OUT/ab/$name/output.txt"
  if [ -n "${EMBER_AB_PROFILE:-}" ]; then
    read -r -a batches <<< "${EMBER_AB_PROFILE_BATCHES:-1 64}"
    python3 -m ember.cli bench profile --model "$M" --out "$OUT/ab/$name/profile" \
      --batches "${batches[@]}" --context "${EMBER_AB_PROFILE_CONTEXT:-512}" "$@" 2>&1 | grep '^{' | cut -c1-200
    rm -f "$OUT/ab/$name"/profile/profile_*.json
  fi
}
runs=1
measure "baseline_$runs"
for variant in "$@"; do
  if [[ "$variant" == --* ]]; then
    read -r -a flags <<< "$variant"
    measure "$(slug "$variant")" "${flags[@]}"
  else
    read -r patch flags <<< "$variant"
    read -r -a flags <<< "${flags:-}"
    name=$(basename "$patch" .patch)
    [ ${#flags[@]} -gt 0 ] && name="${name}_$(slug "${flags[*]}")"
    git apply "$patch" && APPLIED=$patch
    measure "$name" "${flags[@]}"
    git apply -R "$patch" && APPLIED=""
  fi
  if [ "${EMBER_AB_BRACKET:-each}" = each ]; then
    runs=$((runs + 1))
    measure "baseline_$runs"
  fi
done
[ "${EMBER_AB_BRACKET:-each}" = ends ] && measure "baseline_$((runs + 1))"
echo "=== done $(date +%T)"
