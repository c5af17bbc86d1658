"""One-off probe on a Hopper GPU: how fast does the bulk L2 prefetch pull a weight, and what does
a batch-1 GEMM gain from it in a step-like setting? With L2 flushed (a 512 MiB write), the main
stream runs ~8 us of other work (a sleep kernel, as attention would) then the GEMM, while a side
stream prefetches the GEMM's weight from the same start; against the same without the prefetch.
Median of 50 (CUDA events), per prefetch launch shape. Prints JSON lines."""

from __future__ import annotations

import json
import statistics

import torch

from ember.kernels import linear
from ember.kernels.l2_prefetch import prefetch_to_l2

SHAPES = {"o_proj": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336)}
LAUNCHES = [(8, 16384), (32, 16384), (64, 16384), (132, 16384), (32, 4096), (132, 4096)]
GAP_CYCLES = 16_000  # ~8 us at the H200's clock


def timed(main_work, side_work, flush, side: torch.cuda.Stream, reps: int = 50) -> float:
    times = []
    main = torch.cuda.current_stream()
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush()  # queued first: the GPU is busy while the host launches the rest
        start.record()
        if side_work is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                side_work()
        main_work()
        end.record()
        main.wait_stream(side)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush_buf = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()

    def flush():
        flush_buf.fill_(1)

    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)

        def gap_then_gemm(w=w, x=x):
            torch.cuda._sleep(GAP_CYCLES)
            linear(x, w)

        row = {
            "weight": name,
            "mib": w.numel() * 2 / 2**20,
            "gemm_cold_us": timed(lambda w=w, x=x: linear(x, w), None, flush, side),
            "gap_then_gemm_us": timed(gap_then_gemm, None, flush, side),
            "gap_alone_us": timed(lambda: torch.cuda._sleep(GAP_CYCLES), None, flush, side),
        }
        for programs, chunk in LAUNCHES:

            def fetch(w=w, programs=programs, chunk=chunk):
                prefetch_to_l2(w, num_programs=programs, chunk_bytes=chunk)

            key = f"p{programs}_c{chunk // 1024}k"
            row[f"prefetch_alone_{key}_us"] = timed(fetch, None, flush, side)
            row[f"gap_then_gemm_with_prefetch_{key}_us"] = timed(gap_then_gemm, fetch, flush, side)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
