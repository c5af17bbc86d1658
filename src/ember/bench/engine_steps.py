"""The engine's step mix over a benchmark run, from the server's /metrics.

An ember server counts its steps by kind (decode only, or with prompt tokens) and the tokens it
fed of each kind (`ember:engine_steps_total`, `ember:scheduled_tokens_total`). Read before and
after the timed load, the difference says which steps the run was made of: how many carried a
prompt chunk, how many decodes a step held, how long the chunks were. The engine process's
garbage-collector passes (`engine_python_gc_collections_total` and
`engine_python_gc_pause_seconds_total`) ride along: a generation-2 pass stops the engine, so
the run's count and pause time say whether the collector cost it steps. Other servers lack the
series and get no figures.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

# (metric family, its `kind` label) -> report key, for the four cumulative counts.
_SERIES = {
    ("ember:engine_steps", "decode_only"): "steps_decode_only",
    ("ember:engine_steps", "with_prefill"): "steps_with_prefill",
    ("ember:scheduled_tokens", "decode"): "scheduled_decode_tokens",
    ("ember:scheduled_tokens", "prefill"): "scheduled_prefill_tokens",
}
_GC_PASSES, _GC_PAUSES = "engine_python_gc_collections", "engine_python_gc_pause_seconds"
STEP_MIX_FIELDS = (
    *_SERIES.values(),
    "steps_with_prefill_fraction",
    "mean_decodes_per_step",
    "mean_prefill_tokens_per_prefill_step",
    "engine_gc_gen2_passes",
    "engine_gc_pause_s",
)


def parse_step_counts(metrics_text: str, model: str) -> dict[str, float] | None:
    """The four cumulative counts of ``model`` in a Prometheus exposition, or None if the
    server does not export them; with the engine's collector passes where it exports those
    (``engine_gc_gen2_passes``, and ``engine_gc_pause_s`` over every generation)."""
    counts, gc = {}, {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if family.name == _GC_PASSES and sample.labels.get("generation") == "2":
                gc["engine_gc_gen2_passes"] = sample.value
            elif family.name == _GC_PAUSES:
                gc["engine_gc_pause_s"] = gc.get("engine_gc_pause_s", 0.0) + sample.value
            elif sample.labels.get("model_name") == model:
                key = _SERIES.get((family.name, sample.labels.get("kind")))
                if key is not None:
                    counts[key] = sample.value
    return {**counts, **gc} if len(counts) == len(_SERIES) else None


def scrape_counts(
    base_url: str, model: str, parse: Callable[[str, str], dict | None], timeout_s: float = 5.0
) -> dict | None:
    """``parse`` (e.g. `parse_step_counts`) of `base_url`/metrics now; None when it finds no
    counts or the server does not answer."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as reply:
            text = reply.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return parse(text, model)


def settled_counts(
    base_url: str,
    model: str,
    parse: Callable[[str, str], dict | None],
    interval_s: float = 0.3,
    limit_s: float = 3.0,
) -> dict | None:
    """`scrape_counts` once two scrapes ``interval_s`` apart agree: the engine sends its stats
    at most every ~0.5 s, and once more when it goes idle after the run."""
    deadline = time.monotonic() + limit_s
    last = scrape_counts(base_url, model, parse)
    while last is not None and time.monotonic() < deadline:
        time.sleep(interval_s)
        current = scrape_counts(base_url, model, parse)
        if current == last:
            break
        last = current
    return last


def settled_step_counts(base_url: str, model: str) -> dict | None:
    """The step counts of ``model``, settled (`settled_counts`)."""
    return settled_counts(base_url, model, parse_step_counts)


def step_mix(before: dict | None, after: dict | None) -> dict:
    """The run's share of each count (``after - before``) and what follows from them; every
    field None when either scrape had no counts."""
    if before is None or after is None:
        return dict.fromkeys(STEP_MIX_FIELDS)
    mix = {key: int(after[key] - before[key]) for key in _SERIES.values()}
    steps = mix["steps_decode_only"] + mix["steps_with_prefill"]
    prefill_steps = mix["steps_with_prefill"]
    mix["steps_with_prefill_fraction"] = prefill_steps / steps if steps else None
    mix["mean_decodes_per_step"] = mix["scheduled_decode_tokens"] / steps if steps else None
    mix["mean_prefill_tokens_per_prefill_step"] = (
        mix["scheduled_prefill_tokens"] / prefill_steps if prefill_steps else None
    )
    gc_passes = _delta(before, after, "engine_gc_gen2_passes")
    mix["engine_gc_gen2_passes"] = int(gc_passes) if gc_passes is not None else None
    mix["engine_gc_pause_s"] = _delta(before, after, "engine_gc_pause_s")
    return mix


def _delta(before: dict, after: dict, key: str) -> float | None:
    return after[key] - before[key] if key in before and key in after else None
