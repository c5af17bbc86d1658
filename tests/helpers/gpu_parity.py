"""What the GPU parity tests share: the dense architectures they cover, their prompts, and a
distance between two runs' prompt logprobs (where greedy tokens may part for a rounding)."""

from __future__ import annotations

import torch

DENSE_ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def random_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of 1-89 random token ids (below 40000: every tiny model's vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 90, (count,), generator=g).tolist()
    return [torch.randint(3, 40000, (n,), generator=g).tolist() for n in lengths]


def mean_prompt_logprob_gap(a, b) -> float:
    """Mean |difference| of the prompt tokens' logprobs (all but each prompt's first) between
    two runs' outputs of the same prompts."""
    gaps = [
        abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob)
        for out_a, out_b in zip(a, b, strict=True)
        for x, y in zip(out_a.prompt_logprobs[1:], out_b.prompt_logprobs[1:], strict=True)
    ]
    return sum(gaps) / len(gaps)
