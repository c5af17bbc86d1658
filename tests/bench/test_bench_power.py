"""The power window and the sustained ceilings' bookkeeping, on a CPU with a stand-in NVML."""

from __future__ import annotations

import time

import pytest

from ember.bench.gpu_power import PowerWindow, power_window, summarize
from ember.bench.roofline import Ceilings, steady_rates


class FakeNvml:
    """The NVML calls a PowerWindow makes: an energy counter that rises by ``watts`` a second,
    an SM clock that falls with each read, and the power-cap reason on every other read."""

    NVML_CLOCK_SM = 1

    def __init__(self, watts: float = 600.0, rename: bool = True) -> None:
        self.watts = watts
        self._clock_reads = 0
        self._reason_reads = 0
        self._t0 = time.perf_counter()
        if rename:
            self.nvmlDeviceGetCurrentClocksEventReasons = self._reasons
        else:
            self.nvmlDeviceGetCurrentClocksThrottleReasons = self._reasons

    def nvmlDeviceGetTotalEnergyConsumption(self, handle) -> int:  # mJ
        return int((time.perf_counter() - self._t0) * self.watts * 1e3) + 10**9

    def nvmlDeviceGetEnforcedPowerLimit(self, handle) -> int:  # mW
        return 700_000

    def nvmlDeviceGetPowerUsage(self, handle) -> int:  # mW
        return int(self.watts * 1e3)

    def nvmlDeviceGetClockInfo(self, handle, clock) -> int:
        assert clock == self.NVML_CLOCK_SM
        self._clock_reads += 1
        return max(1400, 1980 - 10 * self._clock_reads)

    def _reasons(self, handle) -> int:
        self._reason_reads += 1
        return 0x4 | 0x1 if self._reason_reads % 2 else 0x1  # 0x1: idle, not the power cap


@pytest.mark.parametrize("rename", [True, False])
def test_power_window_reads_energy_clocks_and_the_power_cap(rename):
    nvml = FakeNvml(watts=600.0, rename=rename)
    with PowerWindow(nvml, handle=0, interval_s=0.01) as window:
        time.sleep(0.2)
    reading = window.reading
    assert reading.seconds == pytest.approx(0.2, abs=0.05)
    assert reading.mean_w == pytest.approx(600.0, rel=0.05)
    assert reading.energy_j == pytest.approx(reading.mean_w * reading.seconds)
    assert reading.power_limit_w == 700.0
    assert 1400 <= reading.sm_clock_mhz_min < reading.sm_clock_mhz_median < 1980
    assert 0.3 < reading.power_capped_fraction < 0.7  # every other sample, power cap bit only
    assert reading.sampled_w_median == 600.0


def test_power_window_without_nvml_reads_nothing():
    with power_window(None) as window:
        pass
    assert window.reading is None


def test_summarize_without_clock_samples():
    reading = summarize(2.0, 1300.0, 700.0, [], [], [])
    assert reading.mean_w == 650.0
    assert reading.sm_clock_mhz_median is None and reading.power_capped_fraction is None
    assert reading.sampled_w_median is None


def test_steady_rates_take_the_first_batch_and_the_median_of_the_last_half():
    burst, sustained = steady_rates([1.0, 1.1, 1.2, 1.25, 1.3, 1.2], work_per_batch=10.0)
    assert burst == 10.0
    assert sustained == pytest.approx(10.0 / 1.25)  # last half 1.25, 1.3, 1.2: median 1.25
    with pytest.raises(ValueError):
        steady_rates([], 1.0)


def test_decode_rows_carry_the_capped_roofline(tiny_bench_factory):
    """With sustained ceilings at half the burst ones, the capped sequential bound is twice the
    plain one. A CPU has no decode graph to hold for a power reading, NVML or not."""
    burst = Ceilings(hbm_bytes_per_s=1e11, bf16_flops_per_s=1e12)
    half = Ceilings(hbm_bytes_per_s=5e10, bf16_flops_per_s=5e11)
    bench = tiny_bench_factory(burst, half, (FakeNvml(watts=500.0), 0))
    row = bench.decode(batch=2, context=32, steps=3, warmup=1)
    assert row["capped_sequential_roofline_ms"] == pytest.approx(2 * row["sequential_roofline_ms"])
    assert row["fraction_of_capped_sequential_roofline"] == pytest.approx(
        2 * row["fraction_of_sequential_roofline"]
    )
    assert row["power"] is None
    plain = tiny_bench_factory(burst, None, None).decode(batch=2, context=32, steps=3, warmup=1)
    assert plain["power"] is None and "capped_sequential_roofline_ms" not in plain
