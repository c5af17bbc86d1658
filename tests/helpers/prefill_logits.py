"""Every position's logits of a batch of prompts, straight through a loaded model."""

from __future__ import annotations

import torch

from ember import LLM
from ember.layers.forward_context import ForwardContext


def ember_prefill_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Run every prompt as one varlen batch through the model and return all positions' logits."""
    inst = llm.instance
    bs = inst.kv_manager.block_size
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
    ids = torch.tensor([t for p in prompts for t in p])
    with torch.inference_mode():
        hidden = inst.model(ids, ctx, inst.runner.cos_sin_cache, inst.kv_cache)
        logits = inst.model.compute_logits(hidden)
    return list(logits.split([len(p) for p in prompts]))
