# Sourced (from the repository root) by the one-off GPU scripts: installs the carried wheels, sets
# the environment, and starts making the 8B-shaped checkpoint at $M in the background. Wait for
# it by pid (`wait $MAKER`): a bare `wait` would also wait for the scripts' `tee`.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export EMBER_TEST_TOKENIZER_DIR=$PWD/.gpu_assets/tokenizer
M=/tmp/llama-3.1-8b-random
python3 -m ember.cli bench make-model --preset llama-3.1-8b --out $M \
  --tokenizer-dir .gpu_assets/tokenizer > /dev/null &
MAKER=$!
