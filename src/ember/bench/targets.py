"""`ember bench targets`: measured figures beside the project's targets, and by how much each
one is met or missed, read from the result files the other benchmarks wrote.

The targets are the issues' (GPU fast path; serving benchmark). Nothing is measured here: the
comparison is computed from the JSON files named, so it can be re-made from the committed results.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Target:
    name: str
    source: str  # which result file: step, serve, pinned or peer
    bound: float
    higher_is_better: bool
    read: Callable[[dict, dict], float | None]  # (this source's JSON, all sources) -> figure
    unit: str = ""


def _decode_fraction(batch: int, context: int) -> Callable[[dict, dict], float | None]:
    def read(step: dict, _: dict) -> float | None:
        for row in step.get("decode", []):
            if row.get("batch") == batch and row.get("context") == context:
                return row.get("fraction_of_roofline")
        return None

    return read


def _prefill_fraction(chunk: int) -> Callable[[dict, dict], float | None]:
    def read(step: dict, _: dict) -> float | None:
        rows = [r for r in step.get("prefill", []) if r.get("chunk") == chunk]
        return rows[0].get("fraction_of_bf16_peak") if rows else None

    return read


def _attention_fraction(batch: int, context: int) -> Callable[[dict, dict], float | None]:
    def read(step: dict, _: dict) -> float | None:
        attention = step.get("attention")
        for row in attention if isinstance(attention, list) else []:
            if row.get("batch") == batch and row.get("context") == context:
                return row.get("roofline_fraction")
        return None

    return read


def _max_idle(step: dict, _: dict) -> float | None:
    idle = [r["gpu_idle_fraction"] for r in step.get("decode", []) if r.get("gpu_idle_fraction")]
    return max(idle) if idle else None


def _pinned_ratio(pinned: dict, sources: dict) -> float | None:
    serve = sources.get("serve")
    if not serve or not serve.get("output_throughput"):
        return None
    return pinned["output_throughput"] / serve["output_throughput"]


TARGETS = (
    Target("decode batch 1, ctx 512: fraction of roofline", "step", 0.85, True,
           _decode_fraction(1, 512)),
    Target("decode batch 64, ctx 512: fraction of roofline", "step", 0.75, True,
           _decode_fraction(64, 512)),
    Target("decode batch 256, ctx 512: fraction of roofline", "step", 0.75, True,
           _decode_fraction(256, 512)),
    Target("prefill chunk 2048: fraction of bf16 peak", "step", 0.60, True, _prefill_fraction(2048)),
    Target("decode attention batch 256, ctx 4096: fraction of bytes roofline", "step", 0.70, True,
           _attention_fraction(256, 4096)),
    Target("GPU idle fraction between decode steps (worst bucket)", "step", 0.05, False, _max_idle),
    Target("output throughput, 1,000 ShareGPT prompts at concurrency 200", "serve", 15000, True,
           lambda r, _: r.get("output_throughput"), "tok/s"),
    Target("server cores busy (mean)", "serve", 1.0, False,
           lambda r, _: r.get("server_cores_busy"), "cores"),
    Target("TTFT median", "serve", 150, False, lambda r, _: r.get("median_ttft_ms"), "ms"),
    Target("server pinned to one core: throughput over unpinned", "pinned", 0.90, True,
           _pinned_ratio),
)  # fmt: skip


def compare(sources: dict[str, dict]) -> list[dict]:
    """One row per target whose source is given: figure, bound, met, and the shortfall."""
    rows = []
    for target in TARGETS:
        data = sources.get(target.source)
        if data is None:
            continue
        value = target.read(data, sources)
        row = {"target": target.name, "bound": target.bound, "unit": target.unit, "value": value}
        if value is not None:
            met = value >= target.bound if target.higher_is_better else value <= target.bound
            row["met"] = met
            # Relative distance to the bound: how far short (or how much margin) in percent.
            gap = (value - target.bound) / target.bound
            row["margin_percent"] = 100 * (gap if target.higher_is_better else -gap)
        rows.append(row)
    return rows


def peer_ratios(sources: dict[str, dict]) -> dict | None:
    serve, peer = sources.get("serve"), sources.get("peer")
    if not serve or not peer:
        return None
    per_1k = "server_cpu_seconds_per_1k_output_tokens"
    return {
        "output_throughput_ratio": serve["output_throughput"] / peer["output_throughput"],
        "cpu_seconds_per_1k_tokens_ratio": peer[per_1k] / serve[per_1k],
        "peer_output_throughput": peer["output_throughput"],
    }


def format_table(rows: list[dict]) -> str:
    lines = ["| target | bound | measured | met | margin |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        value = "n/a" if row["value"] is None else f"{row['value']:.4g} {row['unit']}".strip()
        met = "n/a" if "met" not in row else ("yes" if row["met"] else "**no**")
        margin = f"{row['margin_percent']:+.1f}%" if "margin_percent" in row else ""
        lines.append(
            f"| {row['target']} | {row['bound']:g} {row['unit']} | {value} | {met} | {margin} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--step", type=Path, nargs="+",
                        help="the step result JSON; several (e.g. `--sections` runs) are merged, "
                             "the first file's value winning a key they share")  # fmt: skip
    for name in ("serve", "pinned", "peer"):
        parser.add_argument(f"--{name}", type=Path, help=f"the {name} result JSON")
    parser.add_argument("--output-json", type=Path)


def _merged(paths: list[Path]) -> dict:
    merged: dict = {}
    for path in paths:
        for key, value in json.loads(path.read_text()).items():
            merged.setdefault(key, value)
    return merged


def run(args: argparse.Namespace) -> int:
    paths = {name: getattr(args, name) for name in ("step", "serve", "pinned", "peer")}
    sources = {
        name: _merged(path) if isinstance(path, list) else json.loads(path.read_text())
        for name, path in paths.items()
        if path is not None
    }
    rows = compare(sources)
    report = {
        "files": {
            name: [str(p) for p in path] if isinstance(path, list) else str(path)
            for name, path in paths.items()
            if path is not None
        },
        "targets": rows,
        "against_peer": peer_ratios(sources),
    }
    print(format_table(rows))
    if report["against_peer"]:
        print(json.dumps(report["against_peer"], indent=2))
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
