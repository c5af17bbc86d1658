#!/usr/bin/env bash
# Clocks, power and slowdown reasons while `ember bench` runs: nvidia-smi sampled every 100 ms
# beside each run, to tell a kernel's shortfall from a GPU that is holding its clocks down (at
# its power limit, say). Run it on the GPU machine, as tools/gpu_run.sh is (docs/gpu.md).
#
#   tools/gpu_clocks.sh OUTDIR NAME "BENCH ARGS" [NAME "BENCH ARGS" ...]
#
# BENCH ARGS follow `python3 -m ember.cli bench` and may use $M (the 8B-shaped checkpoint, made
# here unless an earlier call on the warm machine left it), e.g.
#   tools/gpu_clocks.sh $OUT b256 'step --model $M --sections decode --decode-batches 256'
# Results into $OUTDIR/clocks.tar.gz: per run NAME/output.txt and NAME/smi.csv (the samples, with
# the run's start and end times in NAME/window.txt); the log beside it. Needs what gpu_run.sh
# needs carried (.whl, .gpu_assets). It reads the card's state only and changes no setting.
set -uo pipefail
OUT=${1:?usage: tools/gpu_clocks.sh OUTDIR NAME "BENCH ARGS" [...]}
shift
[ $# -ge 2 ] && [ $(($# % 2)) -eq 0 ] || { echo "usage: NAME \"BENCH ARGS\" pairs"; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT/clocks"
exec > >(tee -a "$OUT/log.txt") 2>&1
trap 'tar -czf "$OUT/clocks.tar.gz" -C "$OUT" clocks && rm -rf "$OUT/clocks"' EXIT
# The environment of tools/gpu_run.sh (EMBER_SRC: another copy of the sources).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${EMBER_SRC:-$ROOT/src}:$ROOT/tests PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export EMBER_TEST_TOKENIZER_DIR=$ROOT/.gpu_assets/tokenizer
M=/tmp/llama-3.1-8b-random
if [ ! -f "$M/config.json" ]; then
  python3 -m ember.cli bench make-model --preset llama-3.1-8b --out $M \
    --tokenizer-dir "$EMBER_TEST_TOKENIZER_DIR" > /dev/null || exit 1
fi
FIELDS=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,utilization.gpu
REASONS=clocks_event_reasons.sw_power_cap,clocks_event_reasons.hw_slowdown
REASONS=$REASONS,clocks_event_reasons.sw_thermal_slowdown
# Older drivers lack the slowdown reasons: fall back to the plain fields.
nvidia-smi --query-gpu=$FIELDS,$REASONS --format=csv,nounits > /dev/null 2>&1 &&
  FIELDS=$FIELDS,$REASONS
while [ $# -gt 0 ]; do
  name=$1 args=$2
  shift 2
  mkdir -p "$OUT/clocks/$name"
  echo "=== $name: $args $(date +%T)"
  nvidia-smi --query-gpu=$FIELDS --format=csv,nounits -lms 100 \
    > "$OUT/clocks/$name/smi.csv" &
  smi=$!
  date +%Y/%m/%d\ %H:%M:%S.%3N > "$OUT/clocks/$name/window.txt"
  eval "python3 -m ember.cli bench $args --out $OUT/clocks/$name" \
    > "$OUT/clocks/$name/output.txt" 2>&1
  date +%Y/%m/%d\ %H:%M:%S.%3N >> "$OUT/clocks/$name/window.txt"
  kill $smi
  grep '"batch"\|"chunk"\|Error' "$OUT/clocks/$name/output.txt" | cut -c1-160
  # Per run: the SM clock and power over the samples taken while the GPU was busy.
  python3 - "$OUT/clocks/$name/smi.csv" <<'PY'
import csv, statistics, sys
# Column names differ across drivers ("clocks.sm" comes back as "clocks.current.sm [MHz]"): match
# them by a part of the name.
rows = list(csv.reader(open(sys.argv[1]), skipinitialspace=True))
header, rows = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
col = {key: next((i for i, h in enumerate(header) if key in h), None)
       for key in ("sm", "power.draw", "utilization.gpu", "sw_power_cap")}
def number(r, key):
    return float(r[col[key]].split()[0])
busy = [r for r in rows if number(r, "utilization.gpu") >= 90]
for label, sel in (("all", rows), ("busy", busy)):
    if sel:
        sm = [number(r, "sm") for r in sel]
        watts = [number(r, "power.draw") for r in sel]
        capped = sum(col["sw_power_cap"] is not None and r[col["sw_power_cap"]] == "Active"
                     for r in sel)
        print(f"{label}: {len(sel)} samples, SM clock median {statistics.median(sm):.0f} MHz "
              f"(min {min(sm):.0f}), power median {statistics.median(watts):.0f} W "
              f"(max {max(watts):.0f}), power cap active in {capped}")
PY
done
echo "=== done $(date +%T)"
