"""How the benches time GPU work, and the two ceilings of the GPU (HBM bandwidth, bf16
tensor-core rate) they judge it against, measured in the same run: in a burst
(`measure_ceilings`), and held for seconds (`sustained_rate`), where a long run's power limit
has set the clocks."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ember.bench.gpu_power import PowerReading, measure_power


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


def _warm_up(fn) -> None:
    """Run ``fn`` once on a side stream (compiles kernels) before a capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)


def _median_replay_seconds(graph: torch.cuda.CUDAGraph, replays: int = 5) -> float:
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return sorted(times)[len(times) // 2]


def gpu_seconds(fn, *, iters: int = 20, flush_bytes: int = 256 << 20) -> float:
    """GPU time of ``fn`` replayed from a CUDA graph (no launch or Python overhead), with L2
    flushed before each call; the flush's own time is subtracted."""
    flush = torch.empty(flush_bytes, dtype=torch.int8, device="cuda")
    _warm_up(fn)

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                flush.zero_()
                if with_fn:
                    fn()
        return graph

    with_fn, flush_only = capture(True), capture(False)
    elapsed = _median_replay_seconds(with_fn) - _median_replay_seconds(flush_only)
    return max(0.0, elapsed) / iters


def sequence_seconds(layer_fn, num_layers: int) -> float:
    """GPU time per layer of ``layer_fn(0) ... layer_fn(num_layers - 1)`` replayed from one CUDA
    graph, as a decode step runs its layers: each kernel meets its real neighbours and reads its
    own weights, with no flush between (a flushed one-kernel timing ranks the skinny GEMM level
    with cuBLAS where a step finds it slower)."""

    def all_layers() -> None:
        for layer in range(num_layers):
            layer_fn(layer)

    _warm_up(all_layers)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        all_layers()
    graph.replay()
    return _median_replay_seconds(graph) / num_layers


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


@dataclass(frozen=True)
class SustainedRate:
    """Work per second of a bench held for seconds: its first batch of replays (the burst the
    ceilings see) and the median of its last half (where the power limit has set the clocks)."""

    burst_per_s: float
    sustained_per_s: float
    batches: int
    power: PowerReading | None

    def as_dict(self) -> dict:
        return {
            "burst_per_s": self.burst_per_s,
            "sustained_per_s": self.sustained_per_s,
            "sustained_over_burst": self.sustained_per_s / self.burst_per_s,
            "batches": self.batches,
            "power": self.power.as_dict() if self.power else None,
        }


def steady_rates(batch_seconds: list[float], work_per_batch: float) -> tuple[float, float]:
    """(burst, sustained) work per second from each batch's seconds: the first batch's rate,
    and the rate of the median batch of the last half."""
    if not batch_seconds:
        raise ValueError("no batches timed")
    tail = sorted(batch_seconds[len(batch_seconds) // 2 :])
    return work_per_batch / batch_seconds[0], work_per_batch / tail[len(tail) // 2]


def sustained_rate(
    fn,
    work_per_call: float,
    seconds: float = 3.0,
    calls_per_graph: int = 4,
    batch_seconds: float = 0.05,
    nvml_handle=None,
    graph: bool = True,
) -> SustainedRate:
    """``fn``'s work per second held for ``seconds``: ``calls_per_graph`` calls replayed from
    one CUDA graph, in batches of about ``batch_seconds`` timed on the GPU and synchronized
    (so the host never runs ahead); NVML's power over the last half when ``nvml_handle``.
    ``graph`` False: the calls launched as they are (a device-to-device copy captured in a
    graph becomes a memcpy node on the copy engines, far slower than the same copy launched)."""
    fn()  # compile and allocate before the capture
    replay = partial(_calls, fn, calls_per_graph)
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            replay()
        replay = captured.replay
    one_replay = time_cuda(replay, warmup=1, repeat=3)
    replays = max(1, round(batch_seconds / max(one_replay, 1e-6)))
    total = max(2, round(seconds / (replays * one_replay)))

    def timed_batches(count: int) -> list[float]:
        times = []
        for _ in range(count):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return times

    first = timed_batches(total // 2)
    last, power = measure_power(nvml_handle, lambda: timed_batches(total - total // 2))
    burst, sustained = steady_rates(first + last, work_per_call * calls_per_graph * replays)
    return SustainedRate(burst, sustained, total, power)


def _calls(fn, count: int) -> None:
    for _ in range(count):
        fn()


def measure_sustained(
    seconds: float = 3.0, copy_bytes: int = 4 << 30, gemm: int = 8192, nvml_handle=None
) -> dict[str, SustainedRate]:
    """The ceilings held for ``seconds`` each: the bf16 product and the HBM copy."""
    return {
        "bf16_flops": _sustained_gemm(gemm, seconds, nvml_handle),
        "hbm_copy_bytes": _sustained_copy(copy_bytes, seconds, nvml_handle),
    }


def _sustained_gemm(size: int, seconds: float, nvml_handle) -> SustainedRate:
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    c = torch.empty_like(a)
    return sustained_rate(
        lambda: torch.matmul(a, b, out=c), 2 * size**3, seconds, nvml_handle=nvml_handle
    )


def _sustained_copy(copy_bytes: int, seconds: float, nvml_handle) -> SustainedRate:
    src = torch.randn(copy_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return sustained_rate(
        lambda: dst.copy_(src), 2 * copy_bytes, seconds, nvml_handle=nvml_handle, graph=False
    )
