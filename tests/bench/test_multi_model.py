"""`ember bench multi-model`: its flags and server config, the weighted split of requests, the
transitions read from polls of /v1/models, the stalls, and the figures. No server, no GPU."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tomllib
from collections import Counter

import pytest

from ember.bench import multi_model as mm
from ember.bench.client import RequestResult
from ember.bench.datasets import SampledRequest


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    mm.add_arguments(parser)
    return parser.parse_args(argv)


FOUR_MODELS = (
    *("--model", "a=/ckpt/8b-0", "--model", "b=/ckpt/8b-1"),
    *("--model", "c=/ckpt/8b-2", "--model", "d=/ckpt/1b"),
    *("--weight", "60", "--weight", "25", "--weight", "10", "--weight", "5"),
)


# ----------------------------------------------------------------------------- flags, config


def test_flags_make_a_config_that_reads_back_as_toml():
    args = parse(
        *FOUR_MODELS,
        *("--kv-cache-bytes", "8e9", "--kv-cache-bytes", "8GB"),
        *("--kv-cache-bytes", "8_000_000_000", "--kv-cache-bytes", "4GiB"),
        *("--budget-bytes", "60e9", "--sleep-host-memory-bytes", "40G", "--pin", "a"),
        *("--model-load-timeout", "300", "--idle-timeout", "600"),
    )
    specs = mm.model_specs(args)
    assert [s.name for s in specs] == ["a", "b", "c", "d"]
    assert [s.weight for s in specs] == [60, 25, 10, 5]
    assert [s.pinned for s in specs] == [True, False, False, False]
    config = mm.server_config(args, specs)
    assert tomllib.loads(mm.config_toml(config)) == config
    assert config["memory_budget_bytes"] == 60_000_000_000
    assert config["sleep_host_memory_bytes"] == 40_000_000_000
    assert config["model_load_timeout"] == 300.0
    assert "gpu_memory_utilization" not in config  # left out: the server's default
    assert config["models"][3] == {
        "name": "d",
        "source": "/ckpt/1b",
        "kv_cache_memory_bytes": 4 << 30,
        "max_model_len": 4096,
        "pinned": False,
        "preload": True,
        "idle_timeout": 600.0,
    }
    assert {m["kv_cache_memory_bytes"] for m in config["models"][:3]} == {8_000_000_000}


def test_one_kv_cache_value_is_every_models_and_none_leaves_it_out():
    args = parse(*FOUR_MODELS, "--kv-cache-bytes", "2GiB", "--gpu-memory-utilization", "0.9")
    assert {s.kv_cache_bytes for s in mm.model_specs(args)} == {2 << 30}
    config = mm.server_config(
        parse(*FOUR_MODELS, "--no-preload"), mm.model_specs(parse(*FOUR_MODELS))
    )
    assert all("kv_cache_memory_bytes" not in m and not m["preload"] for m in config["models"])


def test_toml_strings_survive_quotes_backslashes_and_control_characters():
    odd = 'C:\\ckpt\\"quoted"\tdir\x7f\x01/ünï €😀'
    config = {"gpu_memory_utilization": 0.9, "models": [{"name": "x", "source": odd}]}
    assert tomllib.loads(mm.config_toml(config)) == config
    assert mm.toml_value(True) == "true" and mm.toml_value(1e16) == "1e+16"
    with pytest.raises(ValueError):
        mm.toml_value(float("nan"))


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("8000000000", 8_000_000_000),
        ("8_000_000_000", 8_000_000_000),
        ("8e9", 8_000_000_000),
        ("8G", 8_000_000_000),
        ("8gb", 8_000_000_000),
        ("7.5GiB", 15 << 29),
        ("512Mi", 512 << 20),
        ("100", 100),
    ],
)
def test_byte_counts_read_as_written(text, count):
    assert mm.byte_count(text) == count


@pytest.mark.parametrize("text", ["", "eight", "8X", "-1", "0.5"])
def test_byte_count_refuses_what_is_no_whole_count(text):
    with pytest.raises(argparse.ArgumentTypeError):
        mm.byte_count(text)


@pytest.mark.parametrize(
    "argv",
    [
        ("--model", "a"),  # no path to launch
        ("--model", "a=/x", "--model", "a=/y"),  # a name twice
        ("--model", "a=/x", "--model", "b=/y", "--weight", "1"),  # a weight short
        ("--model", "a=/x", "--model", "b=/y", "--kv-cache-bytes", "1", "--kv-cache-bytes", "2")
        + ("--kv-cache-bytes", "3"),
        ("--model", "a=/x", "--pin", "b"),
        ("--model", "a=/x", "--weight", "0"),
        (),  # nothing to launch
    ],
)
def test_model_flags_that_cannot_run_are_refused(argv):
    with pytest.raises(mm.BenchmarkError):
        mm.model_specs(parse(*argv))


def test_with_a_url_models_are_names_alone_or_none():
    specs = mm.model_specs(parse("--url", "http://h:1", "--model", "a", "--model", "b"))
    assert [(s.name, s.source) for s in specs] == [("a", None), ("b", None)]
    assert mm.model_specs(parse("--url", "http://h:1")) == []


def test_the_launch_passes_the_config_and_key_and_the_report_hides_the_key(tmp_path):
    args = parse(*FOUR_MODELS, "--api-key", "s3cret", "--server-args=--enforce-eager")
    spec = mm.launch_spec(args, tmp_path / "server.toml")
    assert spec.server_args == (
        "--config",
        str(tmp_path / "server.toml"),
        "--api-key",
        "s3cret",
        "--enforce-eager",
    )
    assert spec.model is None  # the models are in the config
    shown = mm.redacted(["ember", "serve", *spec.server_args], "s3cret")
    assert "s3cret" not in shown and "--api-key '***'" in shown
    assert mm.redacted(["/k/ember", "--api-key", "k"], "k") == "/k/ember --api-key '***'"
    assert mm.auth_headers("s3cret") == {"Authorization": "Bearer s3cret"}
    assert mm.auth_headers(None) == {}
    assert args.mode == "traffic" and args.concurrency == 200


# ----------------------------------------------------------------------------- weighted split


def test_apportion_gives_exact_shares_that_add_up():
    assert mm.apportion(1000, [60, 25, 10, 5]) == [600, 250, 100, 50]
    assert mm.apportion(7, [60, 25, 10, 5]) == [4, 2, 1, 0]
    assert mm.apportion(3, [1, 1, 1, 1]) == [1, 1, 1, 0]  # ties: the earlier model first
    for total in range(50):
        counts = mm.apportion(total, [0.6, 0.25, 0.1, 0.05])
        assert sum(counts) == total
        assert all(abs(c - total * w) < 1 for c, w in zip(counts, [0.6, 0.25, 0.1, 0.05]))
    with pytest.raises(ValueError):
        mm.apportion(10, [0, 0])


def test_split_is_by_weight_deterministic_and_spread():
    requests = [SampledRequest(f"p{i}", 10, 20) for i in range(1000)]
    weights = {"a": 60, "b": 25, "c": 10, "d": 5}
    plan = mm.split_requests(requests, weights, seed=3)
    assert [p.request for p in plan] == requests  # the sampled order is kept
    assert Counter(p.model for p in plan) == {"a": 600, "b": 250, "c": 100, "d": 50}
    assert plan == mm.split_requests(requests, weights, seed=3)
    assert plan != mm.split_requests(requests, weights, seed=4)
    halves = Counter(p.model for p in plan[:500]), Counter(p.model for p in plan[500:])
    assert all(half["d"] > 10 for half in halves)  # not all at one end


# ----------------------------------------------------------------------------- transitions


def snap(state="loaded", **counters) -> mm.ModelSnapshot:
    return mm.ModelSnapshot(state=state, **counters)


def test_parse_models_reads_the_ember_fields():
    body = {
        "object": "list",
        "data": [
            {
                "id": "a",
                "object": "model",
                "ember": {
                    "state": "sleeping",
                    "pinned": False,
                    "device_bytes": 0,
                    "host_bytes": 16,
                    "weight_bytes": 16_060_000_000,
                    "kv_cache_bytes": 0,
                    "loads": 1,
                    "sleeps": 2,
                    "wakes": 1,
                    "last_transition": {"action": "sleep", "seconds": 0.8},
                    "error": None,
                },
            },
            {"id": "other", "object": "model"},
            {"id": "a-alias", "object": "model", "parent": "a", "ember": {"state": "sleeping"}},
        ],
    }
    assert mm.parse_models(body) == {
        "a": snap(
            "sleeping",
            loads=1,
            sleeps=2,
            wakes=1,
            weight_bytes=16_060_000_000,
            last_action="sleep",
            last_seconds=0.8,
        ),
        "other": snap(),  # no ember fields: a plain OpenAI server's model
    }


def polls_of(*states: dict[str, mm.ModelSnapshot], period: float = 1.0) -> list[mm.Poll]:
    """Polls sent at 0, 1, 2, ... s, each answered 0.1 s later."""
    return [mm.Poll(i * period, i * period + 0.1, models) for i, models in enumerate(states)]


def test_transitions_come_from_in_progress_states_and_risen_counters():
    polls = polls_of(
        {"a": snap(), "b": snap("sleeping"), "c": snap()},
        {"a": snap(), "b": snap("waking"), "c": snap()},
        {"a": snap(), "b": snap("waking"), "c": snap()},
        {"a": snap(), "b": snap(wakes=1, last_action="wake", last_seconds=2.5), "c": snap()},
        {
            "a": snap(),
            "b": snap(wakes=1),
            "c": snap(sleeps=1, last_action="sleep", last_seconds=0.5),
        },
        {"a": snap("unloaded"), "b": snap(wakes=1), "c": snap(sleeps=1)},
    )
    assert mm.transitions_from_polls(polls) == [
        # seen waking at 1 and 2: from the poll before (sent at 0) to the one after (answered
        # at 3.1); the counter that rose by the poll at 3 reaches back 2.5 s before 2: merged
        mm.Transition("b", "wake", -0.5, 3.1),
        # done between the polls at 3 and 4, and took 0.5 s
        mm.Transition("c", "sleep", 2.5, 4.1),
        mm.Transition("a", "unload", 4.0, 5.1),
    ]


def test_counter_deltas_count_the_run_only():
    before = {"a": snap(loads=1), "b": snap(loads=1, sleeps=3, wakes=2)}
    after = {"a": snap(loads=1, sleeps=1), "b": snap(loads=2, sleeps=5, wakes=4)}
    assert mm.counter_deltas(before, after) == {
        "a": {"loads": 0, "sleeps": 1, "wakes": 0},
        "b": {"loads": 1, "sleeps": 2, "wakes": 2},
    }


# ----------------------------------------------------------------------------- stalls


def test_a_gap_over_another_models_wake_counts_and_one_over_its_own_does_not():
    transitions = [
        mm.Transition("a", "wake", 10.0, 12.0),  # a's own
        mm.Transition("b", "wake", 20.0, 20.5),
        mm.Transition("c", "sleep", 30.0, 31.0),
    ]
    streams = [
        ("a", [9.0, 9.1, 12.5, 12.6]),  # 3.4 s gap over its own wake only
        ("a", [19.8, 20.1, 20.3, 20.4]),  # 0.3 s gap over b's wake
        ("b", [29.0, 29.5, 30.2]),  # 0.7 s gap over c's sleep
        ("c", [29.0]),  # one chunk: no gap
    ]
    overall, during = mm.longest_stalls(streams, transitions)
    assert overall == mm.Stall("a", 9.1, 12.5, (("a", "wake"),))
    assert during == mm.Stall("b", 29.5, 30.2, (("c", "sleep"),))
    assert during.seconds == pytest.approx(0.7)
    assert mm.longest_stalls(streams[:1], transitions) == (overall, None)
    assert mm.longest_stalls([], transitions) == (None, None)


def test_a_gap_that_only_touches_a_transition_does_not_overlap_it():
    transitions = [mm.Transition("b", "load", 1.0, 2.0)]
    _, during = mm.longest_stalls([("a", [0.0, 1.0, 2.0, 3.0])], transitions)
    assert during == mm.Stall("a", 1.0, 2.0, (("b", "load"),))
    _, during = mm.longest_stalls([("a", [0.0, 0.9, 1.0]), ("a", [2.0, 2.5])], transitions)
    assert during is None


# ----------------------------------------------------------------------------- figures


def result(start: float, chunks: list[float], tokens: int | None = None) -> RequestResult:
    r = RequestResult(True, 10, start, chunk_times_s=chunks)
    r.output_tokens = len(chunks) if tokens is None else tokens
    r.ttft_s = chunks[0] - start
    r.e2el_s = chunks[-1] - start
    r.itl_s = [b - a for a, b in itertools.pairwise(chunks)]
    return r


def test_traffic_report_figures_per_model_and_in_total():
    records = [
        ("a", result(0.0, [1.0, 2.0, 3.0, 4.0])),  # 4 tokens in the window
        ("a", result(0.0, [5.0, 9.0, 11.0, 13.0], tokens=8)),  # half its chunks in it: 4
        ("b", result(1.0, [1.5, 2.0])),
        ("b", RequestResult(False, 10, 2.0, error="HTTP 503: busy")),
    ]
    polls = polls_of({"a": snap(), "b": snap("sleeping")}, {"a": snap(), "b": snap("waking")})
    before = {"a": snap(), "b": snap(sleeps=1)}
    after = {"a": snap(), "b": snap(sleeps=1, wakes=1)}
    report = mm.traffic_report(records, {"a": 3, "b": 1}, (0.0, 10.0), polls, before, after)
    a, b = report["models"]["a"], report["models"]["b"]
    assert (a["weight"], b["weight"]) == (0.75, 0.25)
    assert (a["requests"], a["completed"], a["failed"]) == (2, 2, 0)
    assert (b["requests"], b["completed"], b["failed"]) == (2, 1, 1)
    assert a["output_throughput"] == pytest.approx(0.8)
    assert b["output_throughput"] == pytest.approx(0.2)
    assert report["total_output_throughput"] == pytest.approx(1.0)
    assert a["median_ttft_ms"] == pytest.approx(3000.0)
    assert a["p99_itl_ms"] == pytest.approx(3900.0)  # np.percentile of [1, 1, 1, 2, 2, 4] s
    assert (b["loads"], b["sleeps"], b["wakes"]) == (0, 0, 1)
    assert report["transitions"] == [{"model": "b", "action": "wake", "start_s": 0.0, "end_s": 1.1}]
    assert report["longest_stall"]["seconds"] == pytest.approx(4.0)
    assert report["longest_stall_during_other_transition"]["overlapping"] == [
        {"model": "b", "action": "wake"}
    ]
    assert report["error_examples"] == ["HTTP 503: busy"]
    assert (report["completed"], report["failed"]) == (3, 1)


def test_wake_figures_against_the_copy_floor():
    timings = [
        mm.ActionTiming("wake", 0.4, 0.41, "loaded"),
        mm.ActionTiming("wake", 0.5, 0.52, "loaded"),
        mm.ActionTiming("wake", 0.8, 0.9, "loaded"),
    ]
    summary = mm.action_summary(timings, 16_000_000_000, h2d_gbps=50.0)
    assert summary["median_server_s"] == 0.5 and summary["median_client_s"] == 0.52
    assert summary["median_fraction_of_h2d"] == pytest.approx(0.64)  # 32 GB/s of 50
    assert summary["runs"][0]["fraction_of_h2d"] == pytest.approx(0.8)
    assert summary["median_client_fraction_of_h2d"] == pytest.approx(16 / 26)
    assert summary["server_s_over_round_trip"] == 0
    wrong = [mm.ActionTiming("wake", 16725.9, 0.05, "loaded")]  # a timestamp, not a duration
    assert mm.action_summary(wrong, 1, None)["server_s_over_round_trip"] == 1
    assert mm.action_summary(timings, 16_000_000_000, None)["median_fraction_of_h2d"] is None
    assert mm.h2d_fraction(1, 0.0, 50.0) is None


def test_pair_report_is_the_ratio_of_the_totals():
    single = {"total_output_throughput": 10_000.0}
    split = {"total_output_throughput": 7_500.0}
    report = mm.pair_report("a", "b", single, split)
    assert report["split_over_single"] == 0.75
    assert mm.ratio(None, 1.0) is None and mm.ratio(1.0, 0.0) is None


def test_summaries_print_for_every_mode():
    records = [("a", result(0.0, [1.0, 2.0])), ("b", result(0.0, [1.5, 3.0]))]
    polls = polls_of({"a": snap(), "b": snap("waking")})
    models = {"a": snap(), "b": snap()}
    traffic = mm.traffic_report(records, {"a": 1, "b": 1}, (0.0, 3.0), polls, models, models)
    text = mm.format_summary({"mode": "traffic", "concurrency": 200, **traffic})
    assert "longest stall during another model's transition" in text and "50%" in text
    pair = mm.pair_report("a", "b", traffic, traffic)
    assert "ratio 1.000" in mm.format_summary({"mode": "pair", **pair})
    timing = [mm.ActionTiming("x", 1.0, 1.1, "loaded")]
    summary = mm.action_summary(timing, 2_000_000_000, 50.0)
    wake = {"model": "a", "weight_bytes": 2_000_000_000, "h2d_gbps": 50.0, "h2d_source": "measured"}
    wake |= {action: summary for action in ("sleep", "wake", "unload", "load")}
    assert "4%" in mm.format_summary({"mode": "wake", **wake})
    assert mm.report_ok({"mode": "pair", "single": traffic, "split": traffic})


# ----------------------------------------------------------------------------- load generator


class FakeClient:
    """Stands in for OpenAIStreamClient: each request takes `seconds`; counts what is in
    flight."""

    def __init__(self, seconds: float, flight: dict):
        self.seconds = seconds
        self.flight = flight

    async def send(self, request: SampledRequest) -> RequestResult:
        self.flight["now"] += 1
        self.flight["max"] = max(self.flight["max"], self.flight["now"])
        start = asyncio.get_running_loop().time()
        await asyncio.sleep(self.seconds)
        self.flight["now"] -= 1
        return result(start, [start + self.seconds])


def test_the_load_keeps_the_concurrency_and_sends_each_request_once():
    flight = {"now": 0, "max": 0}
    clients = {"a": FakeClient(0.002, flight), "b": FakeClient(0.004, flight)}
    requests = [SampledRequest(f"p{i}", 5, 5) for i in range(40)]
    plan = mm.split_requests(requests, {"a": 3, "b": 1}, seed=0)
    run = asyncio.run(mm.drive_traffic(clients, plan, concurrency=4, duration_s=None))
    assert Counter(name for name, _ in run.records) == {"a": 30, "b": 10}
    assert flight["max"] == 4 and flight["now"] == 0
    assert run.end_s > run.start_s


def test_a_timed_load_cycles_the_plan_until_the_duration():
    flight = {"now": 0, "max": 0}
    clients = {"a": FakeClient(0.001, flight)}
    plan = mm.split_requests([SampledRequest("p", 5, 5)] * 3, {"a": 1}, seed=0)
    run = asyncio.run(mm.drive_traffic(clients, plan, concurrency=2, duration_s=0.05))
    assert len(run.records) > len(plan)  # went round more than once
    assert run.end_s - run.start_s == pytest.approx(0.05)
    assert flight["max"] <= 2 and flight["now"] == 0


def test_the_copy_floor_is_the_flag_when_given_and_none_without_cuda():
    import torch

    assert mm.h2d_floor_gbps(12.5) == (12.5, "--h2d-gbps")
    if not torch.cuda.is_available():
        assert mm.measure_h2d_gbps(1024) is None
