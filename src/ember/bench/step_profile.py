"""`ember bench profile`: where a step's GPU time goes, kernel by kernel, with torch.profiler.

Profiles a few steps of each shape through the engine loop (CUDA graphs and overlap as in
serving): pure decode at the given batch sizes, and a serving-like mixed step (a decode batch
beside one prefill chunk). Kernels are grouped into categories (GEMM, attention, norm, RoPE/KV
write, activation, sampling, copies, other) and reported per step, beside the step's wall time,
so "GPU busy" and "what it is busy with" come from one measurement.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from ember import cli
from ember.bench.step_bench import StepBench, bench_instance
from ember.sampling_params import SamplingParams

# Substrings of kernel names, checked in order; the first match names the category.
CATEGORIES = (
    ("attention", ("paged_attention",)),
    # The fused MoE's kernels (`ember.kernels.fused_moe`, `moe_align`, `moe_route`).
    (
        "moe",
        (
            "gate_up_kernel",
            "down_kernel",
            "down_by_token",
            "align_kernel",
            "sum_over_top_k",
            "route_kernel",
        ),
    ),
    ("norm", ("rms_norm", "rmsnorm")),
    ("rope_kv_write", ("rope",)),
    ("activation", ("silu",)),
    ("sampling", ("sample", "argmax", "topk", "softmax", "gumbel", "hash")),
    ("gemm", ("gemm", "gemv", "cutlass", "sm90", "sm80", "cublas", "nvjet", "matmul", "xmma")),
    ("copy", ("memcpy", "memset", "copy", "index", "gather", "scatter", "fill")),
)


def categorize(kernel_name: str) -> str:
    name = kernel_name.lower()
    for category, needles in CATEGORIES:
        if any(n in name for n in needles):
            return category
    return "other"


def summarize_kernels(events, num_steps: int) -> dict:
    """Per-step microseconds by category and the top kernels, from profiler kernel events."""
    by_category: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, micros in events:
        by_category[categorize(name)] += micros
        by_kernel[name][0] += micros
        by_kernel[name][1] += 1
    total = sum(by_category.values())
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:15]
    return {
        "gpu_us_per_step": total / num_steps,
        "categories_us_per_step": {
            k: v / num_steps for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])
        },
        "top_kernels": [
            {
                "name": name[:120],
                "us_per_step": t / num_steps,
                "launches_per_step": n / num_steps,
                "category": categorize(name),
            }
            for name, (t, n) in top
        ],
    }


def critical_path_us(spans: list[tuple[str, float, float]], num_steps: int) -> dict[str, float]:
    """Per-step microseconds each category adds to the stream's busy time, from (name, start,
    end) spans of one stream. Under programmatic dependent launch a kernel starts while the one
    before it finishes, so its span includes that wait and durations over-count; what a kernel
    adds is how far its end lies past the previous kernel's end (idle gaps excluded)."""
    added: dict[str, float] = defaultdict(float)
    previous_end = float("-inf")
    for name, start, end in sorted(spans, key=lambda span: span[2]):
        added[categorize(name)] += end - max(previous_end, start)
        previous_end = end
    return {k: v / num_steps for k, v in sorted(added.items(), key=lambda kv: -kv[1])}


def by_predecessor(spans: list[tuple[str, float, float]], num_steps: int, top: int = 20) -> list:
    """Kernels keyed by the kernel before them on the stream: one name serves several roles in
    a step (the skinny GEMM is o, down and the LM head; cuBLAS is q/k/v and gate/up), and what a
    kernel costs depends on what it follows. Per (predecessor, kernel): launches per step, mean
    span, and mean gap from the predecessor's end to its start (launch latency; negative when it
    started early, under programmatic launch)."""
    stats: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    previous = None
    for name, start, end in sorted(spans, key=lambda span: span[1]):
        if previous is not None:
            entry = stats[(previous[0][:60], name[:60])]
            entry[0] += 1
            entry[1] += end - start
            entry[2] += start - previous[2]
        previous = (name, start, end)
    rows = [
        {
            "after": after,
            "kernel": kernel,
            "launches_per_step": n / num_steps,
            "us_each": span / n,
            "gap_us_each": gap / n,
            "us_per_step": span / num_steps,
        }
        for (after, kernel), (n, span, gap) in stats.items()
    ]
    return sorted(rows, key=lambda row: -row["us_per_step"])[:top]


def critical_path_by_role(
    spans: list[tuple[str, float, float]], num_steps: int, top: int = 30
) -> list[dict]:
    """What each kernel adds to the stream's busy time (as `critical_path_us`), keyed by its role:
    the two kernels before it and the one after it. One name has several roles in a decode step
    that only its neighbours tell apart (after attention the skinny GEMM is o; after o it is
    gate/up, after gate/up it is down, and the one before attention is q/k/v), so this splits the
    GEMMs `by_predecessor` lumps together. Per role: launches per step, and the critical time
    each and per step."""
    ordered = sorted(spans, key=lambda span: span[1])
    names = [name[:60] for name, _, _ in ordered]
    stats: dict[tuple[str, str, str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    previous_end = float("-inf")
    for i, (_, start, end) in enumerate(ordered):
        added = max(0.0, end - max(previous_end, start))
        previous_end = max(previous_end, end)
        role = (
            names[i - 2] if i >= 2 else "",
            names[i - 1] if i >= 1 else "",
            names[i],
            names[i + 1] if i + 1 < len(names) else "",
        )
        stats[role][0] += 1
        stats[role][1] += added
    rows = [
        {
            "before": [before2, before1],
            "kernel": kernel,
            "next": after,
            "launches_per_step": n / num_steps,
            "critical_us_each": added / n,
            "critical_us_per_step": added / num_steps,
        }
        for (before2, before1, kernel, after), (n, added) in stats.items()
    ]
    return sorted(rows, key=lambda row: -row["critical_us_per_step"])[:top]


def _kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every CUDA kernel and copy the profiler saw."""
    events = []
    for event in prof.events():
        device_type = getattr(event, "device_type", None)
        if device_type is not None and device_type == torch.autograd.DeviceType.CUDA:
            events.append((event.name, event.time_range.start, event.time_range.end))
    return events


def profile_steps(bench: StepBench, steps: int, trace_path: Path | None) -> dict:
    """Profile `steps` engine steps of whatever is queued; returns wall and kernel figures."""
    inst = bench.inst
    activities = [torch.profiler.ProfilerActivity.CPU]
    if inst.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    bench.sync()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            bench.step()
        bench.sync()
        wall = time.perf_counter() - start
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    spans = _kernel_events(prof)
    summary = summarize_kernels([(name, end - start) for name, start, end in spans], steps)
    summary["critical_path_us_per_step"] = critical_path_us(spans, steps)
    summary["by_predecessor"] = by_predecessor(spans, steps)
    summary["critical_path_by_role"] = critical_path_by_role(spans, steps)
    summary["wall_us_per_step"] = wall / steps * 1e6
    summary["gpu_busy_fraction"] = summary["gpu_us_per_step"] / summary["wall_us_per_step"]
    inst.scheduler.check_invariants()
    return summary


def profile_decode(bench: StepBench, batch: int, context: int, steps: int, trace: Path | None):
    ids = [bench.add_warm_request(context, steps + 12) for _ in range(batch)]
    for _ in range(6):
        bench.step()
    row = {"kind": "decode", "batch": batch, "context": context}
    row.update(profile_steps(bench, steps, trace))
    bench.drain(ids)
    return row


def profile_mixed(bench: StepBench, batch: int, context: int, chunk: int, trace: Path | None):
    """A decode batch with one prompt of `chunk` tokens arriving: its first step is mixed."""
    max_seqs = bench.inst.limits.max_num_seqs
    if batch + 1 > max_seqs:
        # The prompt would wait for a free slot and the profiled step would be decode-only.
        raise ValueError(
            f"a mixed step needs a slot beside {batch} decodes; max_num_seqs is {max_seqs}"
        )
    ids = [bench.add_warm_request(context, 40) for _ in range(batch)]
    for _ in range(6):
        bench.step()
    prompt = torch.randint(3, bench.cfg.vocab_size, (chunk,)).tolist()
    bench.inst.add_request("profile-prefill", prompt, SamplingParams(temperature=0, max_tokens=2))
    row = {"kind": "mixed", "batch": batch, "context": context, "prefill_tokens": chunk}
    row.update(profile_steps(bench, 1, trace))
    bench.drain([*ids, "profile-prefill"])
    return row


def run_profile(
    model: str,
    out_dir: Path,
    batches: list[int],
    context: int,
    chunk: int,
    engine_options: dict | None = None,
) -> dict:
    inst, ceilings = bench_instance(
        model,
        max_model_len=4160,
        max_num_batched_tokens=4096,
        engine_options=engine_options,
    )
    bench = StepBench(inst, ceilings)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for batch in batches:
        trace = out_dir / f"profile_decode_b{batch}.json"
        rows.append(profile_decode(bench, batch, context, steps=10, trace=trace))
        # What each category adds to the step (spans over-count under programmatic launch).
        print(json.dumps(rows[-1]["critical_path_us_per_step"]), flush=True)
    # The largest decode batch that leaves the prompt a slot (at 256 of 256 it would wait).
    mixed_batch = max(b for b in [0, *batches] if b < inst.limits.max_num_seqs)
    rows.append(profile_mixed(bench, mixed_batch, context, chunk, out_dir / "profile_mixed.json"))
    result = {
        "model": model,
        "gpu": torch.cuda.get_device_name(),
        "programmatic_launch": inst.ops.programmatic_launch,
        "decode_rope_in_attention": inst.config.decode_rope_in_attention,
        "defer_norms": inst.model.defers_norms,
        "defer_norms_max_rows": inst.ops.defer_norms_max_rows,
        "rows": rows,
    }
    (out_dir / "step_profile.json").write_text(json.dumps(result, indent=2))
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (see make-model)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 200, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    cli.add_fast_path_arguments(parser)
    cli.add_load_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("ember bench profile needs a CUDA GPU")
        return 2
    run_profile(
        args.model,
        args.out,
        args.batches,
        args.context,
        args.prefill_chunk,
        cli.engine_options(args),
    )
    return 0
