# ruff: noqa: B023, F821 - the lambdas run at once, inside their loop
"""One-off GPU probe: how far cuBLAS's default kernel choice is from the fastest cuBLASLt algorithm
on the 8B decode GEMMs at 128-256 rows.

For each (layer GEMM, M): 32 distinct weights (one layer each, as in a step, so no weight stays in
L2), timed as a sequence on the GPU clock (a sleep kernel first lets the host enqueue the whole
sequence before the GPU reaches it). Candidates: `F.linear` (cuBLAS, torch's default), `F.linear`
with torch's cuBLASLt backend, and every algorithm cuBLASLt's heuristic offers through
nvmath-python (`Matmul.plan(preferences=limit)`, each executed on its own).

    python docs/wip/probe_cublaslt_algos.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

LAYERS = 32
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (128, 192, 256)
REPS = 5
PEAK_TFLOPS = 756.0  # r16's measured bf16 peak, for the fraction column only


def time_sequence(calls) -> float:
    """Median GPU microseconds per call over REPS runs of the sequence. Raises if the host took
    longer to enqueue the sequence than the sleep kernel gave it (the figure would be the
    host's)."""
    per_call = []
    for rep in range(REPS + 1):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # >= 10 ms at 1.98 GHz
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        for call in calls:
            call()
        end.record()
        host_ms = (time.perf_counter() - began) * 1000
        if rep and host_ms > 8:  # the first run pays one-time set-up
            raise RuntimeError(f"host-bound: {host_ms:.1f} ms to enqueue")
        end.synchronize()
        if rep:
            per_call.append(start.elapsed_time(end) * 1000 / len(calls))
    return statistics.median(per_call)


def kernel_names(call) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name[:90] for e in prof.events() if e.device_type.name == "CUDA"]


def describe(algo) -> dict:
    out = {"id": algo.algorithm_id}
    for name in ("tile", "stages", "split_k", "reduction_scheme", "cta_swizzling",
                 "custom_option", "cluster_shape"):
        try:
            value = getattr(algo, name)
            out[name] = value if isinstance(value, (int, str, bool)) else str(value)
        except Exception as error:  # noqa: BLE001 - some attributes are absent per algorithm
            out[name] = f"n/a ({type(error).__name__})"
    return out


def main() -> None:
    from nvmath.linalg.advanced import Matmul, MatmulPlanPreferences

    torch.manual_seed(0)
    stream = torch.cuda.current_stream()
    results = []
    for gemm, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(LAYERS)]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bound_us = 2 * m * n * k / (PEAK_TFLOPS * 1e6)
            row = {"gemm": gemm, "m": m, "n": n, "k": k, "flops_bound_us": round(bound_us, 2)}
            row["cublas_us"] = time_sequence([lambda w=w: F.linear(x, w) for w in weights])
            row["cublas_kernels"] = kernel_names(lambda: F.linear(x, weights[0]))
            torch.backends.cuda.preferred_blas_library("cublaslt")
            row["torch_cublaslt_us"] = time_sequence([lambda w=w: F.linear(x, w) for w in weights])
            row["torch_cublaslt_kernels"] = kernel_names(lambda: F.linear(x, weights[0]))
            torch.backends.cuda.preferred_blas_library("cublas")
            reference = F.linear(x, weights[0]).float()
            plans, algos = [], []
            for w in weights:
                mm = Matmul(x, w.t())
                algos.append(mm.plan(preferences=MatmulPlanPreferences(limit=64)))
                plans.append(mm)
            count = min(len(a) for a in algos)
            candidates = []
            for i in range(count):
                try:
                    us = time_sequence([lambda mm=mm, a=a: mm.execute(algorithm=a[i], stream=stream)
                                        for mm, a in zip(plans, algos)])
                    err = (plans[0].execute(algorithm=algos[0][i], stream=stream).float()
                           - reference).abs().max().item()
                except Exception as error:  # noqa: BLE001 - report, go on
                    candidates.append({"index": i, "error": repr(error)[:200]})
                    continue
                candidates.append({"index": i, "us": round(us, 2), "max_abs_err": err,
                                   **describe(algos[0][i])})
            timed = [c for c in candidates if "us" in c]
            best = min(timed, key=lambda c: c["us"]) if timed else None
            row["heuristic_count"] = count
            row["heuristic_first_us"] = timed[0]["us"] if timed else None
            row["best"] = best
            if best is not None:
                row["best_kernels"] = kernel_names(
                    lambda: plans[0].execute(algorithm=algos[0][best["index"]], stream=stream))
            row["candidates"] = candidates
            for key in ("cublas_us", "torch_cublaslt_us"):
                row[key] = round(row[key], 2)
            print(json.dumps({key: row[key] for key in row if key not in ("candidates",)}),
                  flush=True)
            results.append(row)
            for mm in plans:
                mm.free()
        del weights
        torch.cuda.empty_cache()
    summary = {}
    for m in ROWS:
        rows = [r for r in results if r["m"] == m]
        summary[m] = {
            "cublas_us_per_layer": round(sum(r["cublas_us"] for r in rows), 1),
            "torch_cublaslt_us_per_layer": round(sum(r["torch_cublaslt_us"] for r in rows), 1),
            "best_lt_us_per_layer": round(sum(r["best"]["us"] for r in rows if r["best"]), 1),
            "flops_bound_us_per_layer": round(sum(r["flops_bound_us"] for r in rows), 1),
        }
    print(json.dumps({"summary": summary}), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "summary": summary, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
