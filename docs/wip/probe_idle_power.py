"""One-off GPU probe: the power an H200 draws for doing nothing, idle and with its clocks up.

At the power limit an overlap of two kernels saves only the power paid per second, not per byte
or per FLOP (bench/results/README.md, "The SM-split lead"). This reads that floor with NVML over
2 s each: the GPU idle after CUDA is set up, then one thread on one SM spinning (the GPU busy, its
clocks up, nothing else working).

    python docs/wip/probe_idle_power.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ember.bench.gpu_power import measure_power, open_nvml

SECONDS = 2.0


def main() -> int:
    nvml_handle = open_nvml()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    time.sleep(1.0)
    _, idle = measure_power(nvml_handle, lambda: time.sleep(SECONDS))

    def spin() -> None:
        torch.cuda._sleep(int(2.0e9 * SECONDS))  # cycles: ~2 s at the 1.98 GHz clock
        torch.cuda.synchronize()

    spin()  # first: the clocks come up
    _, spinning = measure_power(nvml_handle, spin)
    result = {"idle": idle.as_dict(), "one_sm_spinning": spinning.as_dict()}
    print(json.dumps(result))
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
