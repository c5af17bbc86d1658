#!/usr/bin/env bash
# One-off on the H200 (2026-12-01): the split greedy argmax. Its compiled tests and the engine's
# Triton-vs-reference token tests; then the argmax alone against torch.argmax (CUDA graph of 20
# calls, replayed; µs per call) at batch 1-256 over Llama 3's 128,256 logits; then decode steps
# at batch 1, 8, 64 (context 512). Results into $OUT/check.tar.gz.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check_argmax.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/check"
exec > >(tee -a "$OUT/check/log.txt") 2>&1
trap 'tar -czf "$OUT/check.tar.gz" -C "$OUT" check && rm -rf "$OUT/check"' EXIT
source scripts/gpu_oneoff_setup.sh  # wheels, environment, $M being made ($MAKER)
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_argmax.py \
  tests/gpu/test_gpu_engine.py -k "argmax or triton_path_matches" 2>&1 | tail -n 8
echo "=== argmax alone"
python3 - <<'PY'
import json, torch
from ember.kernels import greedy_argmax
for batch in (1, 8, 64, 256):
    logits = torch.randn(batch, 128256, device="cuda")
    row = {"batch": batch}
    for name, fn in (("torch", lambda: logits.argmax(dim=-1)), ("ember", lambda: greedy_argmax(logits))):
        assert torch.equal(fn(), logits.argmax(dim=-1))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        row[f"{name}_us"] = start.elapsed_time(end) * 1e3 / 200
    print(json.dumps(row), flush=True)
PY
wait $MAKER
echo "=== step"
python3 -m ember.cli bench step --model $M --out "$OUT/check/step" --sections decode \
  --decode-batches 1 8 64 --decode-contexts 512 2>&1 | grep '"batch"\|Error'
