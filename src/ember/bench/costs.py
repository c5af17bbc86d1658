"""What a run costs besides time: the server's CPU over its whole process tree, and the GPU's
utilisation and memory through NVML when there is one.

A background thread samples both every `interval_s`; the event loop driving the load never does
this work, so a busy client cannot delay or skew the samples.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Self

import psutil

MIB = 1024 * 1024


@dataclass(frozen=True)
class CostReport:
    """Costs over one measured window; fields are None where nothing was measured."""

    server_cpu_seconds: float | None
    server_cores_busy: float | None
    server_cpu_seconds_per_1k_output_tokens: float | None
    gpu_util_mean: float | None
    gpu_util_max: float | None
    gpu_mem_used_max_mib: float | None

    def as_dict(self) -> dict[str, float | None]:
        """The report as flat JSON fields."""
        return dict(self.__dict__)


class ProcessTreeCpu:
    """CPU seconds (user + system) used by a process and all its descendants since creation.

    Each process's last reading is kept, so a child that exits mid-run keeps what it used up to
    the last sample (at most one interval is lost). Children's times are read directly rather
    than through the parent's `children_*` counters, which would count reaped ones twice.
    """

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self._seen: dict[tuple[int, float], float] = {}  # (pid, create time) -> cpu seconds
        self._baseline = self._lifetime_total()

    def sample(self) -> float:
        """CPU seconds used by the tree since this object was made."""
        return self._lifetime_total() - self._baseline

    def _lifetime_total(self) -> float:
        try:
            processes = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            processes = []
        for proc in processes:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    key = (proc.pid, proc.create_time())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            self._seen[key] = times.user + times.system
        return sum(self._seen.values())


class NvmlGpu:
    """Utilisation and memory of one GPU through NVML (package nvidia-ml-py)."""

    def __init__(self, nvml, index: int):
        self._nvml = nvml
        nvml.nvmlInit()
        self._handle = nvml.nvmlDeviceGetHandleByIndex(index)

    @classmethod
    def open(cls, index: int) -> NvmlGpu | None:
        """The GPU at `index`, or None when NVML or the GPU is not there."""
        try:
            import pynvml  # imported here: optional, absent on CPU-only machines
        except ImportError:
            return None
        try:
            return cls(pynvml, index)
        except pynvml.NVMLError:  # no driver, no such GPU: nothing to sample
            return None

    def sample(self) -> tuple[float, float]:
        """(utilisation percent over the driver's last period, memory used in MiB)."""
        util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
        used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
        return float(util), used / MIB

    def close(self) -> None:
        """Release NVML."""
        self._nvml.nvmlShutdown()


class CostMonitor:
    """Samples CPU and GPU costs in a background thread between `start()` and `stop()`."""

    def __init__(self, pid: int | None, gpu_index: int | None = 0, interval_s: float = 0.5):
        self.interval_s = interval_s
        self._pid = pid
        self._gpu_index = gpu_index
        self._cpu: ProcessTreeCpu | None = None
        self._gpu: NvmlGpu | None = None
        self._gpu_samples: list[tuple[float, float]] = []
        self._cpu_seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cost-monitor", daemon=True)
        self._started_s = self._stopped_s = 0.0

    def start(self) -> Self:
        """Begin the measured window."""
        self._started_s = time.perf_counter()
        if self._pid is not None:
            self._cpu = ProcessTreeCpu(self._pid)  # its baseline is the window's start
        if self._gpu_index is not None:
            self._gpu = NvmlGpu.open(self._gpu_index)
        self._thread.start()
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        """End the measured window with one last sample."""
        self._stop.set()
        self._thread.join()
        self._take_sample()
        self._stopped_s = time.perf_counter()
        if self._gpu is not None:
            self._gpu.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take_sample()

    def _take_sample(self) -> None:
        if self._cpu is not None:
            self._cpu_seconds = self._cpu.sample()
        if self._gpu is not None:
            self._gpu_samples.append(self._gpu.sample())

    def report(self, output_tokens: int) -> CostReport:
        """The window's costs; CPU per 1,000 output tokens uses `output_tokens` of the run."""
        cpu = gpu_util_mean = gpu_util_max = gpu_mem_max = cores = per_1k = None
        if self._cpu is not None:
            cpu = self._cpu_seconds
            cores = cpu / max(self._stopped_s - self._started_s, 1e-9)
            per_1k = cpu * 1000.0 / output_tokens if output_tokens else None
        if self._gpu_samples:
            utils = [util for util, _ in self._gpu_samples]
            gpu_util_mean = sum(utils) / len(utils)
            gpu_util_max = max(utils)
            gpu_mem_max = max(mem for _, mem in self._gpu_samples)
        return CostReport(cpu, cores, per_1k, gpu_util_mean, gpu_util_max, gpu_mem_max)
