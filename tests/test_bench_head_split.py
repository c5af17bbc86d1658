"""The head-split benchmark's two-group attention block computes what the plain chain does.

Its streams only change when the kernels run, so on the CPU (kernels interpreted) the grouped
schedule's result in order must equal the plain q/k/v -> attention -> o chain's."""

from __future__ import annotations

import torch

from ember.bench.head_split import group_qkv_rows, grouped_block, make_block_weights, plain_block
from ember.bench.kernel_bench import AttentionShape, decode_inputs

SHAPE = AttentionShape(num_q_heads=8, num_kv_heads=4, head_dim=16, block_size=4)


def test_grouped_rows_put_each_groups_q_k_v_together():
    shape = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=1, block_size=4)
    # Rows q0 q1 q2 q3 | k0 k1 | v0 v1, each row holding its own index.
    qkv = torch.arange(8.0)[:, None]
    grouped = group_qkv_rows(qkv, shape, groups=2).flatten().tolist()
    assert grouped == [0, 1, 4, 6, 2, 3, 5, 7]  # q0 q1 k0 v0 | q2 q3 k1 v1


def test_two_group_block_matches_the_plain_chain():
    torch.manual_seed(0)
    batch, context, hidden = 3, 11, 32
    inputs = decode_inputs(SHAPE, batch, context, torch.float32, device="cpu")
    meta = {k: inputs[k] for k in ("query_start_loc", "seq_lens", "block_tables")}
    meta["seq_lens"] = torch.tensor([11, 5, 8], dtype=torch.int32)  # ragged
    weights = make_block_weights(SHAPE, hidden, 2, "cpu", torch.float32)
    x = torch.randn(batch, hidden)
    args = (x, weights, inputs["k_cache"], inputs["v_cache"], meta, SHAPE, context)
    plain = plain_block(*args)
    grouped = grouped_block(*args)
    assert grouped.shape == (batch, hidden)
    torch.testing.assert_close(grouped, plain, atol=1e-4, rtol=1e-4)
    assert plain.abs().max() > 1e-2  # not all zeros on both sides
    # One KV head per group: four GEMMs and attentions, four shares of o.
    weights4 = make_block_weights(SHAPE, hidden, 4, "cpu", torch.float32)
    args4 = (x, weights4, inputs["k_cache"], inputs["v_cache"], meta, SHAPE, context)
    torch.testing.assert_close(grouped_block(*args4, groups=4), plain_block(*args4),
                               atol=1e-4, rtol=1e-4)  # fmt: skip
