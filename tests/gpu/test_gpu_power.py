"""The sustained ceilings and the power window on a real GPU: a product held in graph replays
gives a rate per batch, and NVML (where present) a reading whose energy matches its power.

Skipped without a CUDA GPU; `tools/gpu_run.sh` runs these on the H200.
"""

from __future__ import annotations

import pytest
import torch

from ember.bench.gpu_power import open_nvml
from ember.bench.roofline import sustained_rate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_sustained_rate_of_a_product_with_its_power():
    a = torch.randn(2048, 2048, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(2048, 2048, dtype=torch.bfloat16, device="cuda")
    c = torch.empty_like(a)
    nvml_handle = open_nvml()
    rate = sustained_rate(
        lambda: torch.matmul(a, b, out=c),
        2 * 2048**3,
        seconds=0.5,
        batch_seconds=0.02,
        nvml_handle=nvml_handle,
    )
    torch.testing.assert_close(c.float(), a.float() @ b.float(), atol=0.5, rtol=0.05)
    assert rate.batches >= 2
    # Far above a CPU's rate and under any GPU's bf16 peak.
    assert 1e12 < rate.sustained_per_s < 5e15 and 1e12 < rate.burst_per_s < 5e15
    if nvml_handle is None:
        assert rate.power is None
        return
    power = rate.power
    assert 0 < power.mean_w <= 2 * power.power_limit_w
    assert power.energy_j == pytest.approx(power.mean_w * power.seconds)
    assert power.sm_clock_mhz_median > 0 and 0 <= power.power_capped_fraction <= 1


def test_decode_row_holds_its_graph_for_a_power_reading(tiny_bench_factory):
    """On the GPU a decode row's graph is replayed for a power reading (where NVML is): its
    energy per step and the held step's GPU time."""
    from ember.bench.roofline import Ceilings

    nvml_handle = open_nvml()
    burst = Ceilings(hbm_bytes_per_s=4e12, bf16_flops_per_s=7e14)
    bench = tiny_bench_factory(burst, burst, nvml_handle, device="cuda")
    row = bench.decode(batch=4, context=32, steps=4, warmup=2)
    assert row["fraction_of_capped_sequential_roofline"] == pytest.approx(
        row["fraction_of_sequential_roofline"]
    )
    if nvml_handle is None:
        assert row["power"] is None
        return
    power = row["power"]
    assert power["seconds"] > 1.0 and power["energy_j_per_step"] > 0
    assert 0 < power["held_step_ms"] < 1e3 and power["sampled_w_median"] > 0
