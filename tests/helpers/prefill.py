"""A model's logits at every position of a batch of prompts, straight through its forward pass
(one varlen prefill, no scheduler): what tests compare with transformers' logits."""

from __future__ import annotations

import torch

from ember import LLM
from ember.layers.forward_context import ForwardContext


def prompts_of_lengths(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def ember_prefill_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Run every prompt as one varlen batch through the model and return all positions' logits."""
    inst = llm.instance
    ids, ctx = prefill_inputs(prompts, inst.kv_manager.block_size)
    with torch.inference_mode():
        hidden = inst.model(ids, ctx, inst.runner.cos_sin_cache, inst.kv_cache)
        logits = inst.model.compute_logits(hidden)
    return list(logits.split([len(p) for p in prompts]))


def prefill_inputs(prompts: list[list[int]], bs: int) -> tuple[torch.Tensor, ForwardContext]:
    """The token ids and context of one varlen prefill of ``prompts`` (blocks from 1 on)."""
    tables, slots, positions, qsl = [], [], [], [0]
    next_block = 1
    for p in prompts:
        n_blocks = -(-len(p) // bs)
        blocks = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        tables.append(blocks)
        positions += list(range(len(p)))
        slots += [blocks[i // bs] * bs + i % bs for i in range(len(p))]
        qsl.append(qsl[-1] + len(p))
    width = max(len(t) for t in tables)
    ctx = ForwardContext(
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(len(p) for p in prompts),
        max_seq_len=max(len(p) for p in prompts),
    )
    return torch.tensor([t for p in prompts for t in p]), ctx


def check_prefill_logits(hf, llm: LLM, lengths=(1, 7, 33, 70), seed=0, tolerance=2e-4) -> None:
    """Every position's logits of prompts of ``lengths``: ember's against transformers' model
    ``hf`` (float32 both)."""
    prompts = prompts_of_lengths(lengths, hf.config.vocab_size, seed)
    for prompt, logits in zip(prompts, ember_prefill_logits(llm, prompts)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, ref, atol=tolerance, rtol=tolerance)


def check_greedy_tokens(hf, llm: LLM, max_tokens: int, lengths=(3, 11, 26, 50, 5), seed=1) -> None:
    """Greedy tokens of a batch of prompts through the engine (chunked, batched) against
    transformers' own greedy decoding of each; every KV block back afterwards."""
    from ember import SamplingParams
    from helpers.hf_reference import hf_greedy_tokens

    prompts = prompts_of_lengths(lengths, hf.config.vocab_size, seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, max_tokens)
    llm.instance.scheduler.check_invariants()
