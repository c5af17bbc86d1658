"""Serving figures from per-request results: throughputs and latency percentiles.

The names follow vLLM's serving benchmark so that the numbers read the same way: TTFT (time to
first token), TPOT (time per output token after the first, per request), ITL (every gap between
streamed chunks, over all requests) and E2EL (end-to-end latency of a request).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ember.bench.client import RequestResult

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (("median", 50), ("p90", 90), ("p99", 99))


def latency_samples_s(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Each latency metric's samples, in seconds, over the successful requests."""
    done = [r for r in results if r.success]
    return {
        "ttft": [r.ttft_s for r in done],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2el": [r.e2el_s for r in done],
    }


def latency_summary_ms(name: str, samples_s: Sequence[float]) -> dict[str, float | None]:
    """`mean_<name>_ms`, `median_…`, `p90_…`, `p99_…`; None when there are no samples."""
    if not samples_s:
        return {f"{stat}_{name}_ms": None for stat in ("mean", *dict(PERCENTILES))}
    ms = np.asarray(samples_s, dtype=np.float64) * 1000.0
    summary = {f"mean_{name}_ms": float(ms.mean())}
    for stat, q in PERCENTILES:
        summary[f"{stat}_{name}_ms"] = float(np.percentile(ms, q))
    return summary


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, float | int | None]:
    """Counts, throughputs over the run's wall time, and the latency summaries.

    Token totals count completed requests only, as vLLM does: a failed request's partial output
    is not served work.
    """
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    figures: dict[str, float | int | None] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
    }
    for name, samples in latency_samples_s(results).items():
        figures.update(latency_summary_ms(name, samples))
    return figures


def output_tokens_per_second(results: Sequence[RequestResult], start_s: float) -> list[float]:
    """Output tokens delivered in each whole second after `start_s`, for a throughput plot.

    A request's tokens are spread evenly over its text chunks (the usage count can exceed the
    number of chunks when a chunk carries several tokens).
    """
    done = [r for r in results if r.success and r.chunk_times_s]
    if not done:
        return []
    end_s = max(r.chunk_times_s[-1] for r in done)
    per_second = np.zeros(max(1, math.ceil(end_s - start_s)), dtype=np.float64)
    for r in done:
        seconds = np.floor(np.asarray(r.chunk_times_s) - start_s).astype(np.int64)
        np.add.at(per_second, seconds.clip(0, len(per_second) - 1), r.output_tokens / len(seconds))
    return [round(float(v), 3) for v in per_second]


def full_load_output_throughput(
    results: Sequence[RequestResult], max_concurrency: int | None, request_rate: float = math.inf
) -> dict[str, float | None]:
    """Output tok/s while the client kept ``max_concurrency`` requests in flight: from the
    ``max_concurrency``-th request's start to the last request's start (after it, requests only
    end). The whole-run figure also counts the ramp and the tail, where the batch is smaller;
    this one is the server's rate at the load asked for. None when the load is not held by a
    concurrency limit alone (no limit, or paced arrivals), when the window is empty (no more
    requests than the concurrency), or when requests failed (a failure frees its slot early).

    A request's tokens are spread evenly over its streamed chunks, as in
    `output_tokens_per_second`.
    """
    empty = {"full_load_output_throughput": None, "full_load_window_s": None}
    if (
        max_concurrency is None
        or math.isfinite(request_rate)
        or len(results) <= max_concurrency
        or not all(r.success for r in results)
    ):
        return empty
    starts = sorted(r.start_s for r in results)
    window_start, window_end = starts[max_concurrency - 1], starts[-1]
    if window_end <= window_start:
        return empty
    tokens = 0.0
    for r in results:
        if r.chunk_times_s:
            times = np.asarray(r.chunk_times_s)
            inside = np.count_nonzero((times >= window_start) & (times < window_end))
            tokens += r.output_tokens * inside / len(times)
    seconds = window_end - window_start
    return {"full_load_output_throughput": tokens / seconds, "full_load_window_s": seconds}
