#!/usr/bin/env bash
# CPU time per streamed token of each server process (front end, engine) under the serve
# benchmark's load, read from /proc/PID/stat before and after the load (docs/GPU_RUNBOOK.md,
# "Server CPU"). A 1-layer tiny random model on the CPU, so the engine's forward pass is cheap
# and the HTTP front end's cost per token shows. The load generator runs on the same machine;
# "others" is the CPU time everything else on the machine used meanwhile (non-zero: a noisy run).
#
#   scripts/measure_frontend_cpu.sh [RUNS]
# env: PYTHON, MODEL_DIR, PROMPTS, CONCURRENCY; SRC (the ember sources to serve, default ./src:
# point it at another checkout's src for an A/B on the same machine); FRONTEND_CPU=N gives the
# front end CPU N to itself and the engine and load generator the rest (less noise: unpinned,
# the engine's spinning torch threads and the client compete with the front end for 2 cores).
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
waited() { awk '{print $16 + $17}' "/proc/$$/stat"; }  # of this shell's waited-for children
busy() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8}' /proc/stat; }  # the machine's, all CPUs
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

pin_server=() pin_rest=()
if [[ -n ${FRONTEND_CPU:-} ]]; then
    rest=$(seq 0 $(($(nproc) - 1)) | grep -vx "$FRONTEND_CPU" | paste -sd,)
    pin_server=(taskset -c "$FRONTEND_CPU") pin_rest=(taskset -c "$rest")
fi

for run in $(seq "$RUNS"); do
    port=$("$PYTHON" -c "from ember.bench.launch import free_port; print(free_port())")
    "${pin_server[@]}" "$PYTHON" -m ember.cli serve "$MODEL_DIR" --device cpu --host 127.0.0.1 --port "$port" \
        --max-num-seqs 64 --disable-uvicorn-access-log --disable-progress-bar \
        >"$work/server.log" 2>&1 &
    server=$!
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
        kill -0 "$server" 2>/dev/null || { cat "$work/server.log"; exit 1; }
        sleep 0.5
    done
    # The engine is the front end's child that runs the most (the other is a resource tracker).
    children=$(cat /proc/"$server"/task/*/children)
    if [[ -n ${FRONTEND_CPU:-} ]]; then
        for pid in $children; do taskset -a -p -c "$rest" "$pid" >/dev/null; done
    fi
    fe0=$(ticks "$server")
    busy0=$(busy)
    client0=$(waited)
    declare -A before=()
    for pid in $children; do before[$pid]=$(ticks "$pid"); done

    "${pin_rest[@]}" "$PYTHON" -m ember.cli bench serve --base-url "http://127.0.0.1:$port" --dataset random \
        --input-len 32 --output-len 128 --num-prompts "$PROMPTS" \
        --max-concurrency "$CONCURRENCY" --disable-tqdm --output-json "$work/bench.json" \
        >"$work/bench.log" 2>&1 || { cat "$work/bench.log"; exit 1; }

    client=$(($(waited) - client0))
    fe=$(($(ticks "$server") - fe0))
    engine=0
    children_total=0
    for pid in $children; do
        used=$(($(ticks "$pid") - before[$pid]))
        children_total=$((children_total + used))
        ((used > engine)) && engine=$used
    done
    others=$(($(busy) - busy0 - fe - children_total - client))
    unset before
    kill -TERM "$server"
    wait "$server" || true
    server=""
    "$PYTHON" - "$work/bench.json" "$hz" "$run" "$fe" "$engine" "$client" "$others" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
hz, run = int(sys.argv[2]), sys.argv[3]
fe, engine, client, others = (int(ticks) / hz for ticks in sys.argv[4:8])
tokens = report["total_output_tokens"]
print(
    f"run {run}: {tokens} tokens, {report['failed']} failed, "
    f"{report['output_throughput']:.0f} output tok/s; CPU: front end {fe:.2f} s "
    f"= {1e6 * fe / tokens:.1f} us/token, engine {engine:.2f} s "
    f"= {1e6 * engine / tokens:.1f} us/token; load generator {client:.2f} s, others {others:.2f} s"
)
EOF
done
