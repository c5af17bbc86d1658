"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A decode step at small batch is ~290 short kernels in a row; each one pays its launch, its
first memory latency and the previous kernel's tail, where only a few SMs still work. Launched
with PDL, a kernel's programs are launched and scheduled while the kernel before it finishes, then
wait for it at ``wait_for_producer``, which also lets the next kernel launch in turn.

Opt-in (``--programmatic-launch``): on an H200 it took ~50 us per step off the small kernels, but
a cuBLAS kernel in the chain breaks it, so q/k/v and gate/up move to the skinny GEMM, which is
slower than cuBLAS there (+180 to +650 us of GEMM per step at batch 1-32); net, plain launches
win below batch 64 (bench/results/README.md, third round).

The rule that keeps this race-free: every kernel launched with PDL calls ``wait_for_producer``
before it reads or writes anything another kernel touches. Completion is transitive (a kernel
ends only after its own wait returned), so a chain of such kernels sees every earlier write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def supports_programmatic_launch(device: torch.device) -> bool:
    """PDL needs a CUDA GPU of compute capability 9.0 (Hopper) or later."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def wait_for_producer(ENABLED: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible,
    then allow the next one to launch. Compiled out when the kernel is not launched with PDL
    (Triton's interpreter has no grid-dependency control)."""
    if ENABLED:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
