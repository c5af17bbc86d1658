"""Prometheus metrics, named like vLLM's with an `ember:` prefix and a `model_name` label; the
engine process's own series (its garbage-collector passes, which stop every model's steps) are
named like prometheus_client's `python_gc_*` process series, with an `engine_` prefix and no
model label.

Two sources: the front end observes requests (token counters, latency histograms) as they
finish; the engine's scheduler state (running, waiting, KV usage, preemptions, steps and tokens
by kind, prefix-cache lookups and hits) and its process's garbage-collector passes arrive with its outputs and are read at
scrape time by custom collectors. Each app owns its registry, so two apps in one process
(tests) never share a metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ember.engine.ipc import EngineGc, ModelStats, ModelStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600, 1200, 3600)


class EngineStatsCollector(Collector):
    """Exposes the latest engine stats snapshot of every model at scrape time."""

    def __init__(self, snapshot: Callable[[], Iterable[ModelStats]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name"]
        running = GaugeMetricFamily(
            "ember:num_requests_running", "Requests in the running batch.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "ember:num_requests_waiting", "Requests waiting to be scheduled.", labels=labels
        )
        usage = GaugeMetricFamily(
            "ember:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", labels=labels
        )
        blocks = GaugeMetricFamily(
            "ember:kv_cache_blocks_used", "KV cache blocks held by requests.", labels=labels
        )
        preemptions = CounterMetricFamily(
            "ember:num_preemptions", "Requests preempted to free KV blocks.", labels=labels
        )
        steps = CounterMetricFamily(
            "ember:engine_steps",
            "Engine steps: decode_only, or with_prefill (prompt chunks or recomputation).",
            labels=[*labels, "kind"],
        )
        tokens = CounterMetricFamily(
            "ember:scheduled_tokens",
            "Tokens fed to the model: decode (one per decoding sequence a step) or prefill.",
            labels=[*labels, "kind"],
        )
        cache_queries = CounterMetricFamily(
            "ember:prefix_cache_queries",
            "Tokens of admitted requests looked up in the prefix cache.",
            labels=labels,
        )
        cache_hits = CounterMetricFamily(
            "ember:prefix_cache_hits",
            "Tokens of admitted requests found in the prefix cache (not computed again).",
            labels=labels,
        )
        for stats in self._snapshot():
            label = [stats.model]
            cache_queries.add_metric(label, stats.prefix_cache_queries)
            cache_hits.add_metric(label, stats.prefix_cache_hits)
            running.add_metric(label, stats.num_running)
            waiting.add_metric(label, stats.num_waiting)
            usage.add_metric(label, stats.kv_blocks_used / max(1, stats.kv_blocks_total))
            blocks.add_metric(label, stats.kv_blocks_used)
            preemptions.add_metric(label, stats.num_preemptions)
            steps.add_metric([*label, "decode_only"], stats.decode_only_steps)
            steps.add_metric([*label, "with_prefill"], stats.prefill_steps)
            tokens.add_metric([*label, "decode"], stats.decode_tokens)
            tokens.add_metric([*label, "prefill"], stats.prefill_tokens)
        return [
            running,
            waiting,
            usage,
            blocks,
            preemptions,
            steps,
            tokens,
            cache_queries,
            cache_hits,
        ]


MODEL_STATES = ("unloaded", "loading", "loaded", "sleeping", "waking", "failed")


class ModelStatesCollector(Collector):
    """Each configured model's state (one series per state, 1 for the current one), memory and
    transitions (counts and seconds: load, sleep, wake), as the engine last reported them."""

    def __init__(self, snapshot: Callable[[], Iterable[ModelStatus]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name"]
        state = GaugeMetricFamily(
            "ember:model_state", "1 for the model's current state.", labels=[*labels, "state"]
        )
        memory = GaugeMetricFamily(
            "ember:model_memory_bytes",
            "Memory a model holds: device (charged to the budget) or host (its weights while "
            "it sleeps).",
            labels=[*labels, "kind"],
        )
        transitions = CounterMetricFamily(
            "ember:model_transitions",
            "Completed model transitions, by action (load, sleep, wake).",
            labels=[*labels, "action"],
        )
        seconds = CounterMetricFamily(
            "ember:model_transition_seconds",
            "Seconds spent in model transitions, by action (load, sleep, wake).",
            labels=[*labels, "action"],
        )
        for status in self._snapshot():
            label = [status.model]
            for name in MODEL_STATES:
                state.add_metric([*label, name], 1.0 if status.state == name else 0.0)
            memory.add_metric([*label, "device"], status.device_bytes)
            memory.add_metric([*label, "host"], status.host_bytes)
            for action, count, spent in (
                ("load", status.transitions.loads, status.transitions.load_seconds),
                ("sleep", status.transitions.sleeps, status.transitions.sleep_seconds),
                ("wake", status.transitions.wakes, status.transitions.wake_seconds),
            ):
                transitions.add_metric([*label, action], count)
                seconds.add_metric([*label, action], spent)
        return [state, memory, transitions, seconds]


class EngineGcCollector(Collector):
    """The engine process's collector passes and their pauses, by generation, as
    prometheus_client's `python_gc_collections_total` counts a process's (no model label: a
    pass stops every model's steps). Zero until the engine's first stats arrive."""

    def __init__(self, snapshot: Callable[[], EngineGc | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        labels = ["generation"]
        passes = CounterMetricFamily(
            "engine_python_gc_collections",
            "Garbage-collector passes in the engine process, by generation.",
            labels=labels,
        )
        pauses = CounterMetricFamily(
            "engine_python_gc_pause_seconds",
            "Time the engine process spent stopped in garbage-collector passes.",
            labels=labels,
        )
        gc = self._snapshot() or EngineGc([0, 0, 0], [0.0, 0.0, 0.0])
        for generation, (count, seconds) in enumerate(zip(gc.passes, gc.pause_seconds)):
            passes.add_metric([str(generation)], count)
            pauses.add_metric([str(generation)], seconds)
        return [passes, pauses]


class ServerMetrics:
    """The app's metrics and its private registry."""

    def __init__(
        self,
        model_names: Iterable[str],
        engine_stats: Callable[[], Iterable[ModelStats]],
        engine_gc: Callable[[], EngineGc | None] = lambda: None,
        model_states: Callable[[], Iterable[ModelStatus]] = lambda: (),
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.prompt_tokens = Counter(
            "ember:prompt_tokens", "Prompt tokens processed.", labels, registry=self.registry
        )
        self.generation_tokens = Counter(
            "ember:generation_tokens", "Tokens generated.", labels, registry=self.registry
        )
        self.request_success = Counter(
            "ember:request_success",
            "Requests finished, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "ember:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "ember:time_per_output_token_seconds",
            "Mean time between output tokens after the first, per sequence.",
            labels,
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "ember:e2e_request_latency_seconds",
            "Time from arrival to the last generated token.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineStatsCollector(engine_stats))
        self.registry.register(EngineGcCollector(engine_gc))
        self.registry.register(ModelStatesCollector(model_states))
        for name in model_names:  # every series exists (at zero) from the first scrape
            for metric in (
                self.prompt_tokens,
                self.generation_tokens,
                self.time_to_first_token,
                self.time_per_output_token,
                self.e2e_request_latency,
            ):
                metric.labels(name)

    def observe_sequence(
        self,
        model: str,
        arrival: float,
        first_token: float | None,
        last_token: float | None,
        num_prompt_tokens: int,
        num_tokens: int,
        finish_reason: str | None,
    ) -> None:
        """Record one finished sequence (times from `time.monotonic()`). Each sequence counts
        its prompt: the engine computes it once per sequence. Aborted sequences count their
        tokens but no latency."""
        self.prompt_tokens.labels(model).inc(num_prompt_tokens)
        self.generation_tokens.labels(model).inc(num_tokens)
        if finish_reason in (None, "abort") or first_token is None or last_token is None:
            return
        self.request_success.labels(model, finish_reason).inc()
        self.time_to_first_token.labels(model).observe(first_token - arrival)
        self.e2e_request_latency.labels(model).observe(last_token - arrival)
        if num_tokens > 1:
            self.time_per_output_token.labels(model).observe(
                (last_token - first_token) / (num_tokens - 1)
            )

    def render(self) -> bytes:
        return generate_latest(self.registry)
