"""One-off probe on a Hopper GPU: does the bulk L2 prefetch land, and how much does a decode GEMM
gain from it? Times (median of 50, CUDA events) a batch-1 product with o_proj's shape (4096 x
4096 bf16, 32 MiB) cold (L2 flushed by a 512 MiB write) and right after prefetching its weight,
and the prefetch alone. Prints one JSON object."""

from __future__ import annotations

import json
import statistics

import torch

from ember.kernels import linear
from ember.kernels.l2_prefetch import prefetch_to_l2


def timed(fn, before, reps: int = 50) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Queued behind the flush, so the GPU is busy while the host launches: the events
        # time the GPU work, not the launch.
        before()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def probe(w: torch.Tensor, x: torch.Tensor, flush_buf: torch.Tensor) -> dict:
    nbytes = w.numel() * 2

    def flush():
        flush_buf.fill_(1)
        torch.cuda._sleep(50_000)  # ~25 us, as after a prefetch

    def flush_then_prefetch(cap=None):
        flush_buf.fill_(1)
        prefetch_to_l2(w, cap)
        torch.cuda._sleep(50_000)  # let the prefetched lines land

    cold = timed(lambda: linear(x, w), flush)
    warm = timed(lambda: linear(x, w), flush_then_prefetch)
    part = timed(lambda: linear(x, w), lambda: flush_then_prefetch(8 << 20))
    # The kernel returns once its prefetches are issued; to see the bytes land, read the weight
    # right after (a sum) and compare with the sum alone.
    cold_sum = timed(lambda: w.sum(), flush)
    fetched_sum = timed(lambda: (prefetch_to_l2(w), w.sum()), flush)
    prefetch = timed(lambda: prefetch_to_l2(w), flush)
    return {
        "weight_mib": nbytes / 2**20,
        "gemm_cold_us": cold,
        "gemm_after_prefetch_us": warm,
        "gemm_after_8mib_prefetch_us": part,
        "prefetch_kernel_us": prefetch,
        "sum_cold_us": cold_sum,
        "prefetch_then_sum_us": fetched_sum,
        "gemm_cold_tb_per_s": nbytes / cold / 1e6,
    }


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush_buf = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    result = {"gpu": torch.cuda.get_device_name()}
    for name, n, k in (("o_proj", 4096, 4096), ("qkv", 6144, 4096), ("down", 4096, 14336)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        result[name] = probe(w, x, flush_buf)
        print(json.dumps({name: result[name]}), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
