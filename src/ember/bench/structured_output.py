"""`ember bench structured-output`: what a JSON-schema constraint costs per output token.

At each batch size the same prompts decode for the same number of tokens unconstrained
(``ignore_eos``) and held to a JSON schema that cannot be complete within ``max_tokens`` (an
array of many objects), in turns, a few times each. The difference per output token is
structured output's whole cost in the engine: the masks computed on the host (beside the
forward pass on a GPU), the wait for the step in flight that a row with a grammar needs before
its mask, and the masked fill before the draw. Beside it: the host's own time to fill one step's masks, replayed over the tokens the
constrained run wrote, and the one-off costs (the grammar tokenizer, a schema's compile).

On a CPU with ``--preset tiny``; on a GPU with the 8B preset (``--preset llama-3.1-8b``). A
benchmark: it prints and writes figures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ember.bench.make_model import PRESETS, make_model
from ember.config import engine_config
from ember.engine.model_instance import ModelInstance
from ember.sampling_params import SamplingParams
from ember.structured_output.params import StructuredOutputsParams

# Items past any max_tokens: the grammar never completes, so every request runs to the limit.
ENDLESS_ARRAY_SCHEMA = {
    "type": "array",
    "minItems": 1_000_000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
        },
        "required": ["id", "name", "tags"],
        "additionalProperties": False,
    },
}
CONSTRAINT = StructuredOutputsParams(json=ENDLESS_ARRAY_SCHEMA)


def run_batch(
    instance: ModelInstance, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, int, list[list[int]]]:
    """Decode ``prompts`` to the end: the seconds and output tokens after every request's
    first token (the prefill is left out: the same for both modes), and each one's tokens."""
    requests = [
        instance.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
        for i, prompt in enumerate(prompts)
    ]
    while not all(request.output_token_ids for request in requests):
        instance.step()
    _sync(instance)
    started, first = time.perf_counter(), sum(len(r.output_token_ids) for r in requests)
    while instance.has_work():
        instance.step()
    _sync(instance)
    seconds = time.perf_counter() - started
    outputs = [request.output_token_ids for request in requests]
    return seconds, sum(map(len, outputs)) - first, outputs


def mask_fill_seconds(instance: ModelInstance, outputs: list[list[int]]) -> float:
    """The host's time to fill one step's masks for ``outputs``' requests, on average: their
    tokens replayed through fresh matchers, one step at a time."""
    from ember.structured_output.bitmask import GrammarMasks

    compiler = instance.plan.grammars
    masks = GrammarMasks(compiler.vocab_size, len(outputs), torch.device("cpu"))
    grammars = [compiler.matcher(CONSTRAINT) for _ in outputs]
    rows = list(range(len(outputs)))
    steps = min(len(tokens) for tokens in outputs)
    started = time.perf_counter()
    for step in range(steps):
        masks.fill(grammars, rows, len(rows))
        for grammar, tokens in zip(grammars, outputs):
            grammar.catch_up(tokens[: step + 1])
    return (time.perf_counter() - started) / max(steps, 1)


def measure(
    instance: ModelInstance, batch: int, max_tokens: int, prompt_len: int, repeats: int
) -> list[dict]:
    """One row per mode (none, json) at ``batch``: time per step and per output token, the
    median of ``repeats`` runs taken in turns (a host shared with other work slows whichever
    run it meets); the json row adds its overhead over none and the host's mask time per
    step."""
    rng = random.Random(batch)
    prompts = [[rng.randrange(100, 40_000) for _ in range(prompt_len)] for _ in range(batch)]
    modes = {"none": None, "json": CONSTRAINT}

    def params(constraint, tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=0, max_tokens=tokens, ignore_eos=True, structured_outputs=constraint
        )

    for constraint in modes.values():  # warm-up: this batch's shapes on both paths
        run_batch(instance, prompts, params(constraint, 4))
    runs: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode, constraint in modes.items():
            seconds, tokens, outputs = run_batch(instance, prompts, params(constraint, max_tokens))
            runs[mode].append(seconds)
    rows = []
    for mode, seconds_per_run in runs.items():
        seconds = statistics.median(seconds_per_run)
        rows.append(
            {
                "batch": batch,
                "mode": mode,
                "output_tokens": tokens,
                "runs_s": seconds_per_run,
                "ms_per_step": seconds / max(tokens / batch, 1) * 1e3,
                "us_per_output_token": seconds / max(tokens, 1) * 1e6,
                "tokens_per_s": tokens / seconds,
            }
        )
    none, constrained = rows
    ratio = constrained["us_per_output_token"] / none["us_per_output_token"]
    constrained["overhead_vs_none"] = ratio - 1
    constrained["mask_fill_ms_per_step"] = mask_fill_seconds(instance, outputs) * 1e3
    return rows


def _sync(instance: ModelInstance) -> None:
    if instance.device.type == "cuda":
        torch.cuda.synchronize(instance.device)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (else --preset)")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="tiny", help="random weights of this shape"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, in turns")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="ember-so-bench-") as scratch:
        model = args.model or str(make_model(args.preset, Path(scratch) / args.preset))
        config = engine_config(
            model,
            device=args.device,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(2048, max(batches) * args.prompt_len),
            max_model_len=args.prompt_len + args.max_tokens + 16,
        )
        instance = ModelInstance(config)
        result = {"model": args.model or args.preset, "device": str(instance.device)}
        result.update(_one_off_costs(instance))
        rows = []
        for batch in batches:
            rows += measure(instance, batch, args.max_tokens, args.prompt_len, args.repeats)
        instance.close()
    result["rows"] = rows
    _print_table(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


def _one_off_costs(instance: ModelInstance) -> dict:
    """The grammar tokenizer's build (a model's first structured request pays it) and the
    benchmark schema's compile (each new schema pays it; a repeated one is a copy)."""
    compiler = instance.plan.grammars
    started = time.perf_counter()
    _ = compiler.ll_tokenizer
    built = time.perf_counter()
    compiler.check(CONSTRAINT)
    compiled = time.perf_counter()
    return {"grammar_tokenizer_s": built - started, "schema_compile_ms": (compiled - built) * 1e3}


def _print_table(result: dict) -> None:
    print(
        f"{result['model']} on {result['device']}: grammar tokenizer "
        f"{result['grammar_tokenizer_s']:.2f} s, schema compile {result['schema_compile_ms']:.2f} ms"
    )
    print(
        f"{'batch':>5} {'mode':>5} {'ms/step':>9} {'us/token':>9} {'tok/s':>9} {'overhead':>9} "
        f"{'mask ms/step':>13}"
    )
    for row in result["rows"]:
        overhead, mask = row.get("overhead_vs_none"), row.get("mask_fill_ms_per_step")
        print(
            f"{row['batch']:>5} {row['mode']:>5} {row['ms_per_step']:>9.2f} "
            f"{row['us_per_output_token']:>9.1f} {row['tokens_per_s']:>9.0f} "
            f"{'' if overhead is None else f'{overhead:+.1%}':>9} "
            f"{'' if mask is None else f'{mask:.3f}':>13}"
        )
