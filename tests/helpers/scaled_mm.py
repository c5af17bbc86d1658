"""Whether this torch multiplies FP8 matrices with ``torch._scaled_mm`` on the CPU (row scales,
bf16 out), so the FP8 GEMM path's operands can be checked without a GPU."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_has_scaled_mm() -> bool:
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True
