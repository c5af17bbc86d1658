"""What the GPU parity tests share: the dense architectures they cover and their prompts."""

from __future__ import annotations

import torch

DENSE_ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def random_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of 1-89 random token ids (below 40000: every tiny model's vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 90, (count,), generator=g).tolist()
    return [torch.randint(3, 40000, (n,), generator=g).tolist() for n in lengths]
