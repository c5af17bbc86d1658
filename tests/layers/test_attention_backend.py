"""Attention has one owner per model instance: the backend plans for its own model's shape on
its own device's table, stages what a step needs for it, and the runner only asks it.

Two instances of different shapes in one process on the Triton path (its kernels under the CPU
interpreter; nothing is generated here) each get their own table and plan.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.eager_graphs import planned_attention
from helpers.tiny_models import make_tiny_model

from ember import LLM
from ember.config import StepLimits
from ember.kernels.attention_plan import AttentionTuning
from ember.layers.attention import ReferenceAttention, StagedAttention, TritonAttention


@pytest.fixture(scope="module")
def two_shapes(tmp_path_factory):
    """A GQA-4 model and a model without GQA, both on the Triton path."""
    root = tmp_path_factory.mktemp("shapes")
    gqa = make_tiny_model(
        "LlamaForCausalLM", root / "gqa", num_attention_heads=8, num_key_value_heads=2
    )
    mha = make_tiny_model(
        "LlamaForCausalLM", root / "mha", num_attention_heads=4, num_key_value_heads=4
    )
    options = {"device": "cpu", "backend": "triton", "max_model_len": 128}
    return (
        LLM(str(gqa), max_num_seqs=8, **options).instance,
        LLM(str(mha), max_num_seqs=3, **options).instance,
    )


def test_each_instance_plans_for_its_own_shape_and_limits(two_shapes):
    gqa, mha = two_shapes
    assert isinstance(gqa.attention, TritonAttention) and isinstance(mha.attention, TritonAttention)
    assert gqa.attention is not mha.attention and gqa.tuning is not mha.tuning
    assert (gqa.attention.planner.group, mha.attention.planner.group) == (4, 1)
    # A prefill tile's query tokens follow the group: 128 rows of (token, head) pairs.
    assert gqa.attention.planner.chunk_query_tile == 32
    assert mha.attention.planner.chunk_query_tile == 128
    # Split counters sized by each instance's own limits and KV heads.
    assert gqa.attention.split_counters.numel() == 8 * 2
    assert mha.attention.split_counters.numel() == 3 * 4
    # Each runner's buffers hold its own backend's arrays.
    bound = gqa.attention.planner.chunk_tile_bound(gqa.limits.max_step_tokens, 8)
    assert gqa.runner.buffers.general["chunk_tiles"].numel() == bound


def test_the_reference_backend_stages_nothing():
    backend = ReferenceAttention()
    assert backend.step_arrays() == {} and backend.graph_grid(64) is None
    assert backend.stage(None, 3, 9) == StagedAttention()
    assert backend.decode_variant(1, 512) == backend.decode_variant(256, 8192)


def test_a_mixed_step_stages_its_chunk_tiles_and_pads_them_for_a_graph():
    limits = StepLimits(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512)
    backend = planned_attention(8, 2, 64, limits)  # 32 query tokens a chunk tile

    class Staging(dict):
        def numpy(self, name):
            return self[name]

    staging = Staging(
        query_start_loc=np.array([0, 1, 41, 42, 50], dtype=np.int32),
        chunk_tiles=np.full(backend.step_arrays()["chunk_tiles"][0], 99, dtype=np.int32),
    )
    staged = backend.stage(staging, 4, max_query_len=40)
    # Sequence 1 (40 tokens) has two tiles, sequence 3 (8 tokens) one; decodes none.
    assert staged.grid == 3 and staged.uploads == {"chunk_tiles": 3}
    assert [int(e) >> 16 for e in staging["chunk_tiles"][:3]] == [1, 1, 3]
    grid = backend.graph_grid(64)
    padded = backend.pad_for_graph(staging, staged, grid)
    assert padded.grid == grid and (staging["chunk_tiles"][3:grid] == -1).all()
    assert backend.stage(staging, 4, max_query_len=1) == StagedAttention()  # decodes: nothing


def test_decode_graphs_differ_where_the_split_differs():
    limits = StepLimits(max_num_seqs=256, max_model_len=8192)
    wide = planned_attention(32, 8, 128, limits)
    narrow = planned_attention(32, 8, 128, limits, AttentionTuning(num_sms=8, max_splits=2))
    assert wide.decode_variant(1, 512) != wide.decode_variant(1, 4096)
    assert wide.decode_variant(256, 512) == wide.decode_variant(256, 8192)
    assert narrow.decode_variant(1, 4096) == 2  # another GPU's table: its own split count
    meta = wide.metadata({}, StagedAttention(), 1, 1, 4096)
    assert meta.launches[0].splits == wide.decode_variant(1, 4096)


def test_forward_without_staged_metadata_plans_itself():
    """A forward pass built outside the runner (no `ForwardContext.attention`) still runs: the
    backend plans from the context's bounds."""
    from ember.layers.forward_context import ForwardContext

    limits = StepLimits(max_num_seqs=4)
    backend = planned_attention(4, 2, 16, limits)
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, 16, 2, 16, generator=g)
    v_cache = torch.randn(4, 16, 2, 16, generator=g)
    q, k, v = (torch.randn(2, h, 16, generator=g) for h in (4, 2, 2))
    ctx = ForwardContext(
        positions=torch.tensor([4, 9]),
        slot_mapping=torch.tensor([16 + 4, 32 + 9]),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([5, 10], dtype=torch.int32),
        block_tables=torch.tensor([[1], [2]], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=10,
    )
    cos_sin = torch.zeros(16, 16)
    out = backend.forward(q, k, v, ctx, cos_sin, k_cache, v_cache, 0.25, torch.empty_like(q))
    assert torch.isfinite(out).all()
