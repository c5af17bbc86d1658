"""The two ceilings of the GPU, measured in the same run as the figures they judge."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ceilings:
    hbm_bytes_per_s: float  # device-to-device copy, bytes read + bytes written
    bf16_flops_per_s: float  # a large bf16 matrix product on random data

    def floor_seconds(self, bytes_moved: float, flops: float) -> float:
        """The physical limit: no implementation runs much faster."""
        return max(bytes_moved / self.hbm_bytes_per_s, flops / self.bf16_flops_per_s)


def time_cuda(fn, warmup: int = 3, repeat: int = 10) -> float:
    """Median seconds of `fn` on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def measure_ceilings(copy_bytes: int = 4 << 30, gemm: int = 8192) -> Ceilings:
    copy_s = _copy_seconds(copy_bytes)
    a = torch.randn(gemm, gemm, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(gemm, gemm, dtype=torch.bfloat16, device="cuda")
    gemm_s = time_cuda(lambda: torch.matmul(a, b))
    return Ceilings(hbm_bytes_per_s=2 * copy_bytes / copy_s, bf16_flops_per_s=2 * gemm**3 / gemm_s)


def _copy_seconds(copy_bytes: int) -> float:
    src = torch.randn(copy_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return time_cuda(lambda: dst.copy_(src))
