#!/usr/bin/env bash
# Make, on this machine, what tools/gpu_run.sh needs on a GPU machine that has no network
# (docs/gpu.md):
#   .whl/                      wheels for Python 3.12 that the GPU image lacks (llguidance too)
#   .gpu_assets/tokenizer/     SmolLM2's tokenizer files (the GGUF is too large to carry)
#   .gpu_assets/sharegpt.json  the 4,000 ShareGPT pairs `ember bench serve` samples with seed 0
#   .gpu_assets/sharegpt_multi_turn.json  600 ShareGPT conversations for `ember bench multi-turn`
# Both folders are git-ignored (.gitignore) and travel with the device call's `carry`.
# Needs ./.venv with the test extras (scripts/setup.sh test), and PyPI for the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
mkdir -p .whl .gpu_assets
# manylinux_2_31: llguidance's one wheel (abi3, so cp39 serves 3.12; the image's glibc is newer).
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
  annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 uvicorn==0.54.0 \
  httptools==0.9.0 msgspec==0.23.0 pyzmq==27.3.0 gguf==0.19.0 openai==3.57.0 jiter==0.19.0 \
  distro==1.9.0 sniffio==1.3.1 opentelemetry-api==1.45.2 typing-extensions==4.16.0 \
  obstore==0.12.1 filelock==4.3.2 platformdirs==4.14.9 llguidance==1.9.1
python - <<'PY'
import json, shutil, sys
from pathlib import Path
sys.path.insert(0, "tests")
from helpers.tiny_models import smollm2_tokenizer_dir
from ember.bench.datasets import LocalTokenizer, load_sharegpt_pairs, sample_sharegpt

out = Path(".gpu_assets")
shutil.copytree(smollm2_tokenizer_dir(), out / "tokenizer", dirs_exist_ok=True)
counter = LocalTokenizer(out / "tokenizer" / "tokenizer.json")
chosen = sample_sharegpt(load_sharegpt_pairs(), 4100, 0, counter)  # margin: repeated prompts
pairs = {r.prompt: r for r in chosen}
records = []
for prompt, answer in load_sharegpt_pairs():
    if prompt in pairs and len(records) < 4000:
        records.append({"conversations": [{"from": "human", "value": prompt},
                                          {"from": "gpt", "value": answer}]})
        del pairs[prompt]
(out / "sharegpt.json").write_text(json.dumps(records))
print(f"{len(records)} ShareGPT pairs, tokenizer in {out / 'tokenizer'}")
PY
python - <<'PY'
# The conversations `ember bench multi-turn` plans with seed 0 at its default limits, cut to the
# turns it sends: the multi_turn stage of tools/gpu_run.sh draws its sessions from these.
import json
from pathlib import Path
from ember.bench.chat_sessions import TurnLimits, plan_sessions
from ember.bench.datasets import LocalTokenizer, load_sharegpt_conversations

out = Path(".gpu_assets")
conversations = load_sharegpt_conversations(min_turns=2)
counter = LocalTokenizer(out / "tokenizer" / "tokenizer.json")
sessions = plan_sessions(conversations, 600, 0, counter, TurnLimits())
records = [
    {"conversations": [{"from": speaker, "value": text}
                       for turn in conversations[s.conversation][: len(s.turns)]
                       for speaker, text in (("human", turn.user), ("gpt", turn.reply))]}
    for s in sessions
]
(out / "sharegpt_multi_turn.json").write_text(json.dumps(records))
print(f"{len(records)} ShareGPT conversations for the multi_turn stage")
PY
du -sh .whl .gpu_assets
