#!/usr/bin/env bash
# CPU time per streamed token of each server process (front end, engine) under the serve
# benchmark's load, read from /proc/PID/stat before and after the load (docs/GPU_RUNBOOK.md,
# "Server CPU"). A 1-layer tiny random model on the CPU, so the engine's forward pass is cheap
# and the HTTP front end's cost per token shows. The load generator runs on the same machine.
#
#   scripts/measure_frontend_cpu.sh [RUNS]
# env: PYTHON, MODEL_DIR, PROMPTS, CONCURRENCY; SRC (the ember sources to serve, default ./src:
# point it at another checkout's src for an A/B on the same machine).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
MODEL_DIR=${MODEL_DIR:-/tmp/ember-frontend-cpu-model}
PROMPTS=${PROMPTS:-600}
CONCURRENCY=${CONCURRENCY:-64}
RUNS=${1:-1}
SRC=${SRC:-$PWD/src}
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"

if [[ ! -f $MODEL_DIR/config.json ]]; then
    PYTHONPATH="$PWD/tests:$PYTHONPATH" "$PYTHON" -c "
from helpers.tiny_models import make_tiny_model
make_tiny_model('LlamaForCausalLM', '$MODEL_DIR', num_hidden_layers=1)"
fi

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }  # utime + stime, in clock ticks
hz=$(getconf CLK_TCK)
work=$(mktemp -d)
server=""
cleanup() {
    if [[ -n $server ]] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"
        wait "$server" || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

for run in $(seq "$RUNS"); do
    port=$("$PYTHON" -c "from ember.bench.launch import free_port; print(free_port())")
    "$PYTHON" -m ember.cli serve "$MODEL_DIR" --device cpu --host 127.0.0.1 --port "$port" \
        --max-num-seqs 64 --disable-uvicorn-access-log --disable-progress-bar \
        >"$work/server.log" 2>&1 &
    server=$!
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
        kill -0 "$server" 2>/dev/null || { cat "$work/server.log"; exit 1; }
        sleep 0.5
    done
    # The engine is the front end's child that runs the most (the other is a resource tracker).
    children=$(cat /proc/"$server"/task/*/children)
    fe0=$(ticks "$server")
    declare -A before=()
    for pid in $children; do before[$pid]=$(ticks "$pid"); done

    "$PYTHON" -m ember.cli bench serve --base-url "http://127.0.0.1:$port" --dataset random \
        --input-len 32 --output-len 128 --num-prompts "$PROMPTS" \
        --max-concurrency "$CONCURRENCY" --disable-tqdm --output-json "$work/bench.json" \
        >"$work/bench.log" 2>&1 || { cat "$work/bench.log"; exit 1; }

    fe=$(($(ticks "$server") - fe0))
    engine=0
    for pid in $children; do
        used=$(($(ticks "$pid") - before[$pid]))
        ((used > engine)) && engine=$used
    done
    unset before
    kill -TERM "$server"
    wait "$server" || true
    server=""
    "$PYTHON" - "$work/bench.json" "$fe" "$engine" "$hz" "$run" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
fe, engine, hz, run = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
tokens = report["total_output_tokens"]
print(
    f"run {run}: {tokens} tokens, {report['failed']} failed, "
    f"{report['output_throughput']:.0f} output tok/s; CPU: front end {fe / hz:.2f} s "
    f"= {1e6 * fe / hz / tokens:.1f} us/token, engine {engine / hz:.2f} s "
    f"= {1e6 * engine / hz / tokens:.1f} us/token"
)
EOF
done
