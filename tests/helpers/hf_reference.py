"""What transformers itself generates: the reference our greedy tokens must equal."""

from __future__ import annotations

import torch


def hf_greedy_tokens(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    """Exactly `num_tokens` greedy tokens after `prompt` (EOS masked until then, as our
    `min_tokens` does), on the model's own device."""
    device = next(hf_model.parameters()).device
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt], device=device),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def prompt_log_softmax(model_dir, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log_softmax of the logits at every position of ``prompt``
    ([len(prompt), vocab]): the reference for prompt logprobs."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)
