"""One attention step's inputs as the kernel tests build them: a dict of tensors (a fused
q/k/v buffer, positions, slots, caches, the sequences' tables), copied to a device, split into
q/k/v views and wrapped in a `ForwardContext`."""

from __future__ import annotations

import torch

from ember.layers.forward_context import ForwardContext
from ember.layers.reference_ops import build_cos_sin_cache


def copy_step(step: dict, device="cpu") -> dict:
    """The step's tensors copied to ``device`` (the rest as they are)."""
    return {k: v.clone().to(device) if torch.is_tensor(v) else v for k, v in step.items()}


def split_qkv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """q, k and v as [tokens, heads, head_dim] views of the fused buffer."""
    n = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    return q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)


def step_context(s: dict) -> ForwardContext:
    """The step's metadata from its (copied) tensors."""
    return ForwardContext(
        positions=s["positions"],
        slot_mapping=s["slots"],
        query_start_loc=s["query_start_loc"],
        seq_lens=s["seq_lens"],
        block_tables=s["block_tables"],
        max_query_len=s["max_query_len"],
        max_seq_len=s["max_seq_len"],
    )


def random_step(gen, q_lens, seq_lens, heads, kv_heads, head_dim, page, make_cache=None) -> dict:
    """One step over a shuffled paged cache: ``q_lens[i]`` new tokens of a sequence of
    ``seq_lens[i]``, q/k/v as one fused random buffer, the last token padding (slot -1).
    ``make_cache(shape)``: a cache holding earlier steps' entries (random normal by default)."""
    tokens, batch = sum(q_lens), len(seq_lens)
    blocks = [-(-n // page) for n in seq_lens]
    ids = (torch.randperm(sum(blocks), generator=gen) + 1).tolist()
    table = torch.zeros(batch, max(blocks), dtype=torch.int32)
    for seq, n in enumerate(blocks):
        table[seq, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    positions = torch.cat([torch.arange(n - q, n) for q, n in zip(q_lens, seq_lens)])
    seq_of_token = torch.repeat_interleave(torch.arange(batch), torch.tensor(q_lens))
    slots = table[seq_of_token, positions // page].long() * page + positions % page
    slots[-1] = -1  # the last token is padding
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    cache_shape = (sum(blocks) + 1, page, kv_heads, head_dim)
    make_cache = make_cache or (lambda shape: torch.randn(shape, generator=gen))
    return {
        "qkv": qkv,
        "positions": positions,
        "cos_sin": build_cos_sin_cache(head_dim, 1024, 500000.0, None),
        "slots": slots,
        "k_cache": make_cache(cache_shape),
        "v_cache": make_cache(cache_shape),
        "query_start_loc": torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_tables": table,
        "max_query_len": max(q_lens),
        "max_seq_len": max(seq_lens),
    }
