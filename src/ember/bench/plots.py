"""One PNG per run: the four latency distributions and output throughput over time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

# The object-oriented Figure API needs no pyplot state and no display backend.
import numpy as np
from matplotlib.figure import Figure

HISTOGRAM_CLIP_PERCENTILE = 99.5

_LATENCY_PANELS = (
    ("ttft", "TTFT: time to first token"),
    ("tpot", "TPOT: time per output token"),
    ("itl", "ITL: gap between streamed chunks"),
    ("e2el", "E2E: request latency"),
)


def save_benchmark_plot(
    path: str | Path,
    latencies_ms: Mapping[str, Sequence[float]],
    output_tokens_per_s: Sequence[float],
    title: str,
) -> Path:
    """Write histograms of TTFT, TPOT, ITL and E2E latency (ms) with their median and p99, and
    the per-second output-token throughput, to `path`."""
    fig = Figure(figsize=(15, 8.5), layout="constrained")
    fig.suptitle(title)
    grid = fig.add_gridspec(2, 3)
    for slot, (name, label) in enumerate(_LATENCY_PANELS):
        ax = fig.add_subplot(grid[slot // 2, slot % 2])
        _latency_histogram(ax, latencies_ms.get(name) or [], label)
    _throughput_timeline(fig.add_subplot(grid[:, 2]), output_tokens_per_s)
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def _latency_histogram(ax, samples_ms: Sequence[float], label: str) -> None:
    ax.set_title(label)
    ax.set_xlabel("ms")
    ax.set_ylabel("count")
    if not samples_ms:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    samples = np.asarray(samples_ms, dtype=np.float64)
    # A few stalls would squeeze the body of the distribution into one bin: clip the far tail.
    upper = float(np.percentile(samples, HISTOGRAM_CLIP_PERCENTILE))
    ax.hist(samples, bins=50, range=(0.0, upper or 1.0), color="tab:blue", alpha=0.8)
    for q, style in ((50, "-"), (99, "--")):
        value = float(np.percentile(samples, q))
        ax.axvline(value, color="tab:red", linestyle=style, label=f"p{q} {value:.2f}")
    clipped = int((samples > upper).sum())
    if clipped:
        ax.plot([], [], " ", label=f"{clipped} above {upper:.1f} not shown")
    ax.legend(loc="upper right")


def _throughput_timeline(ax, output_tokens_per_s: Sequence[float]) -> None:
    ax.set_title("Output throughput over time")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens / s")
    if output_tokens_per_s:
        ax.stairs(output_tokens_per_s, range(len(output_tokens_per_s) + 1), fill=True, alpha=0.6)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
