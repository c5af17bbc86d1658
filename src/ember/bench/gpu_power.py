"""The GPU's energy, power and SM clock over a timed window, through NVML.

A bench's figure is judged against ceilings measured in a short burst, at full clocks. A long
compute-bound run draws the card to its power limit, and the driver then lowers the SM clock
until the draw fits. A `PowerWindow` around the timed part of a run says which case a figure
is: its energy (NVML's energy counter, exact over the window), mean power against the enforced
limit, the SM clock and how often the power cap was holding it down (sampled on a thread, every
``interval_s``).

``nvml`` is the ``pynvml`` module (package nvidia-ml-py) or a stand-in with its functions; none
at all (a CPU machine) gives no reading rather than an error.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Self

# nvmlClocksEventReasonSwPowerCap: the driver holds the clocks down to stay under the limit.
_POWER_CAP_REASON = 0x4


@dataclass(frozen=True)
class PowerReading:
    seconds: float
    energy_j: float
    mean_w: float
    power_limit_w: float
    sm_clock_mhz_median: float | None
    sm_clock_mhz_min: float | None
    power_capped_fraction: float | None  # of the clock samples
    # NVML's power reading sampled beside the clocks, a cross-check of mean_w (the energy
    # counter updates in steps: a window under a second can read far off).
    sampled_w_median: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def open_nvml() -> tuple[ModuleType, object] | None:
    """``(pynvml, handle of GPU 0)``, or None where NVML or a GPU is missing."""
    try:
        import pynvml  # optional: absent on CPU-only machines
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
    except pynvml.NVMLError:
        return None


class PowerWindow:
    """``with PowerWindow(nvml, handle) as window: ...``; then ``window.reading``."""

    def __init__(self, nvml, handle, interval_s: float = 0.05) -> None:
        self._nvml, self._handle = nvml, handle
        self._interval_s = interval_s
        self._clocks: list[float] = []
        self._capped: list[bool] = []
        self._watts: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="power-window", daemon=True)
        self._start_mj = self._start_s = 0.0
        self.reading: PowerReading | None = None

    def __enter__(self) -> Self:
        self._start_mj = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        self._start_s = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        end_mj = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        seconds = time.perf_counter() - self._start_s
        self._stop.set()
        self._thread.join()
        self.reading = summarize(
            seconds,
            (end_mj - self._start_mj) / 1e3,
            self._nvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1e3,
            self._clocks,
            self._capped,
            self._watts,
        )

    def _sample(self) -> None:
        nvml, handle = self._nvml, self._handle
        while True:
            self._clocks.append(float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)))
            reasons = _clock_event_reasons(nvml)(handle)
            self._capped.append(bool(reasons & _POWER_CAP_REASON))
            self._watts.append(nvml.nvmlDeviceGetPowerUsage(handle) / 1e3)
            if self._stop.wait(self._interval_s):
                return


def _clock_event_reasons(nvml):
    # Renamed from "throttle reasons" in newer NVML bindings; both return the same bit mask.
    renamed = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    return renamed or nvml.nvmlDeviceGetCurrentClocksThrottleReasons


def summarize(
    seconds: float,
    energy_j: float,
    limit_w: float,
    clocks: list[float],
    capped: list[bool],
    watts: list[float],
) -> PowerReading:
    """A window's reading from its length, energy, the enforced limit and the samples."""
    return PowerReading(
        seconds=seconds,
        energy_j=energy_j,
        mean_w=energy_j / seconds if seconds > 0 else 0.0,
        power_limit_w=limit_w,
        sm_clock_mhz_median=statistics.median(clocks) if clocks else None,
        sm_clock_mhz_min=min(clocks) if clocks else None,
        power_capped_fraction=sum(capped) / len(capped) if capped else None,
        sampled_w_median=statistics.median(watts) if watts else None,
    )


class _NoWindow:
    """`power_window` without NVML: reads nothing."""

    reading = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        pass


def power_window(nvml_handle) -> PowerWindow | _NoWindow:
    """A `PowerWindow` on ``nvml_handle`` (`open_nvml`'s), or one that reads nothing for None."""
    return _NoWindow() if nvml_handle is None else PowerWindow(*nvml_handle)


def measure_power(nvml_handle, fn) -> tuple[object, PowerReading | None]:
    """``fn()``'s result and the power reading over it (None without NVML)."""
    with power_window(nvml_handle) as window:
        result = fn()
    return result, window.reading
