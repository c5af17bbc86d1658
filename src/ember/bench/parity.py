"""`ember bench parity`: the Triton path and the reference path on one checkpoint, greedy.

Records, per prompt, how many leading tokens the two paths share. In bf16 the two paths round
differently, so a near-tie in the logits can flip one token and everything after it; the report
says where the first difference falls rather than hiding it, and whether it is such a near-tie:
each path's token among the other's top-5 at that position (vLLM's check for kernels that round
differently), with the two tokens' logprob gap under the reference.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from ember.api import LLM
from ember.sampling_params import SamplingParams

TOP_K = 5


def greedy_tokens(
    model: str, backend: str, prompts: list[list[int]], max_tokens: int, dtype: str, kv_bytes: int
) -> list[tuple[list[int], list]]:
    """Each prompt's greedy tokens and their per-position logprobs (top ``TOP_K``)."""
    llm = LLM(
        model,
        backend=backend,
        dtype=dtype,
        max_model_len=2048,
        kv_cache_memory_bytes=kv_bytes,
        max_num_seqs=len(prompts),
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_K)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    result = [(o.outputs[0].token_ids, o.outputs[0].logprobs or []) for o in outs]
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def compare_greedy(fast: tuple[list[int], list], ref: tuple[list[int], list]) -> dict:
    """Where two greedy runs of one prompt part, and whether that is a near-tie."""
    (a, a_lps), (b, b_lps) = fast, ref
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    row: dict = {"identical": first is None, "first_difference_at": first}
    if first is None or first >= min(len(a_lps), len(b_lps), len(a), len(b)):
        row["near_tie"] = first is None
        return row
    fast_top, ref_top = dict(a_lps[first].top), dict(b_lps[first].top)
    row["near_tie"] = a[first] in ref_top and b[first] in fast_top
    if a[first] in ref_top:
        row["ref_logprob_gap"] = ref_top[b[first]] - ref_top[a[first]]
    return row


def run_parity(
    model: str,
    num_prompts: int = 8,
    max_tokens: int = 32,
    dtype: str = "bfloat16",
    max_prompt_len: int = 512,
    kv_bytes: int = 4 << 30,
) -> dict:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, max_prompt_len, (num_prompts,), generator=g).tolist()
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in lengths]
    fast = greedy_tokens(model, "triton", prompts, max_tokens, dtype, kv_bytes)
    ref = greedy_tokens(model, "reference", prompts, max_tokens, dtype, kv_bytes)
    rows = [compare_greedy(a, b) for a, b in zip(fast, ref)]
    return {
        "model": model,
        "dtype": dtype,
        "prompts": num_prompts,
        "max_tokens": max_tokens,
        "identical_sequences": sum(r["identical"] for r in rows),
        "identical_or_near_tie": sum(r["near_tie"] for r in rows),
        "rows": rows,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output-json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    result = run_parity(args.model, args.num_prompts, args.max_tokens, args.dtype)
    print(json.dumps(result, indent=2))
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=2))
    return 0
