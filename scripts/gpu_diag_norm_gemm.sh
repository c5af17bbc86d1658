#!/usr/bin/env bash
# One-off on the H200 (2026-12-01): which part of `skinny_norm_gemm` costs time. The kernel
# alone (CUDA graph, L2 flushed, µs per call) on the 8B q/k/v and gate/up weights at batch 1
# and 64, with each prologue/epilogue switch on its own. Output: $OUT/diag.txt.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_diag_norm_gemm.sh OUTDIR}
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
timeout 280 python3 - <<'PY' 2>&1 | tee "$OUT/diag.txt"
import json, torch, triton
from ember.bench.kernel_bench import gpu_seconds
from ember.kernels.skinny_gemm import _skinny_gemm_kernel, block_m_for

def run(m, n, k, norm, res, gated, bn, bk, st, w):
    rows = 2 * n if gated else n
    weight = WEIGHTS[(rows, k)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    r = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    h = torch.empty_like(x)
    g = torch.ones(k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    def call():
        _skinny_gemm_kernel[(triton.cdiv(n, bn),)](
            x, r, h, g, weight, weight, out, m, n, k, x.stride(0), r.stride(0), h.stride(0),
            weight.stride(0), out.stride(0), 1e-5, HAS_BIAS=False, ADD_RESIDUAL=res, NORM=norm,
            GATED=gated, EVEN_K=True, BLOCK_M=block_m_for(m), BLOCK_N=bn, BLOCK_K=bk, STAGES=st,
            DOT_PRECISION="tf32", PDL=False, launch_pdl=False, num_warps=w)
    try:
        us = gpu_seconds(call) * 1e6
        kern = _skinny_gemm_kernel
    except Exception as exc:
        return f"{type(exc).__name__}"
    return round(us, 1)

WEIGHTS = {}
for rows, k in ((6144, 4096), (28672, 4096)):
    WEIGHTS[(rows, k)] = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda") * 0.01
for m in (1, 64):
    for name, n, gated_ok in (("qkv", 6144, False), ("gate_up", 14336, True)):
        for cfg in ((64, 256, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (128, 128, 4, 8)):
            row = {"m": m, "shape": name, "cfg": cfg}
            variants = [("plain", False, False, False), ("norm", True, False, False),
                        ("res", False, True, False), ("norm_res", True, True, False)]
            if gated_ok:
                variants += [("gated", False, False, True), ("all", True, True, True)]
            for label, norm, res, gated in variants:
                nn = n if (gated or name == "qkv") else 2 * n
                row[label] = run(m, nn, 4096, norm, res, gated, *cfg)
            print(json.dumps(row), flush=True)
PY
