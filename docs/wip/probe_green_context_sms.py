"""One-off GPU probe: how batch 256's decode attention and its GEMMs run on part of the SMs.

The lead left for batch 256 at the power limit is running attention under the GEMMs on SMs split
between them (docs/GPU_RUNBOOK.md, "Next session"). Before building that, two questions:
how many SMs does decode attention need to stream ~4 TB/s, and how much do the GEMMs lose at the
power limit on the SMs that are left? Each case holds one workload (32 layers, batch 256, context
512; `ember.bench.tune_sustained`'s) for 2 s in its own process, inside a CUDA green context of
``--sms`` SMs made current before anything else touches the GPU (so the Triton modules, the
cuBLAS handle and every launch belong to it). Launched eagerly, not from a CUDA graph: a capture
would run on a stream of the primary context. Green contexts may round the SM count up.

    python docs/wip/probe_green_context_sms.py OUT.json
"""

from __future__ import annotations

import json
import subprocess
import sys

CASES = (("attention", 132), ("attention", 96), ("attention", 64), ("attention", 32),
         ("gemms", 132), ("gemms", 100), ("gemms", 64))  # fmt: skip
ROWS, CONTEXT, SECONDS = 256, 512, 2.0


def run_case(workload: str, sms: int) -> dict:
    """One held workload in this process, on ``sms`` SMs (all of them: no green context)."""
    import torch

    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).multi_processor_count
    if sms < total:
        from torch.cuda.green_contexts import GreenContext

        context = GreenContext.create(num_sms=sms, device_id=0)
        context.set_context()
    from ember.bench.gpu_power import open_nvml
    from ember.bench.roofline import sustained_rate
    from ember.bench.tune_sustained import decode_attention, decode_gemms

    if workload == "attention":
        fn, work = decode_attention(ROWS, CONTEXT)
        unit = "bytes"
    else:
        fn, work = decode_gemms("llama-3.1-8b", ROWS)
        unit = "flops"
    rate = sustained_rate(fn, work, SECONDS, calls_per_graph=1, nvml_handle=open_nvml(),
                          graph=False)  # fmt: skip
    return {"workload": workload, "sms_asked": sms, "sms_total": total, "unit": unit,
            "step_ms": work / rate.sustained_per_s * 1e3, **rate.as_dict()}  # fmt: skip


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--case":
        print("RESULT " + json.dumps(run_case(sys.argv[2], int(sys.argv[3]))), flush=True)
        return 0
    out = sys.argv[1]
    import torch.cuda.green_contexts as green

    results = {"green_contexts_supported": green.SUPPORTED, "cases": []}
    for workload, sms in CASES:
        done = subprocess.run([sys.executable, __file__, "--case", workload, str(sms)],
                              check=False, capture_output=True, text=True, timeout=120)  # fmt: skip
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            row = json.loads(lines[-1][len("RESULT ") :])
        else:
            row = {"workload": workload, "sms_asked": sms, "error": done.stderr[-1500:]}
        results["cases"].append(row)
        power = row.get("power") or {}
        print(json.dumps({k: row.get(k) for k in ("workload", "sms_asked", "step_ms")}
                         | {k: power.get(k) for k in ("mean_w", "sampled_w_median",
                                                      "sm_clock_mhz_median",
                                                      "power_capped_fraction")}
                         | ({"error": row["error"][-300:]} if "error" in row else {})),
              flush=True)  # fmt: skip
        with open(out, "w") as f:  # after each case: a timeout keeps what was measured
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
