"""The CUDA-graph step paths' inputs, checked on a CPU.

A graph replays a fixed shape, so decode steps are padded up to a batch bucket and mixed steps
(prefill chunks beside decodes) up to a token bucket with the sequence count at its maximum.
Here the graph is replaced by the same forward pass run eagerly on the padded buffers: padding
must change nothing (it writes no KV and its outputs are dropped), whatever the real shape.
"""

from __future__ import annotations

import pytest
import torch
from helpers.eager_graphs import EagerStepGraphs, llm_with_planned_attention, planned_attention
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.config import StepLimits
from ember.runner.cuda_graphs import (
    StepGraphs,
    decode_buckets,
    decode_length_classes,
    mixed_token_buckets,
)


def test_buckets_cover_every_batch_size():
    buckets = decode_buckets(100)
    assert buckets[:4] == [1, 2, 4, 8] and buckets[-1] == 100
    for batch in range(1, 101):
        assert any(b >= batch for b in buckets)


@pytest.mark.parametrize("max_tokens", [7, 100, 2048, 3000])
def test_token_buckets_cover_every_step_size(max_tokens):
    buckets = mixed_token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    for tokens in range(1, max_tokens + 1):
        assert any(t >= tokens for t in buckets)
    for tokens in range(257, max_tokens + 1):  # above 256, padding adds at most 1/8
        assert min(t for t in buckets if t >= tokens) <= tokens * 9 / 8


def test_token_buckets_step_by_an_eighth_of_their_doubling():
    assert mixed_token_buckets(1024) == [
        16,
        32,
        64,
        128,
        256,
        288,
        320,
        352,
        384,
        416,
        448,
        480,
        512,
        576,
        640,
        704,
        768,
        832,
        896,
        960,
        1024,
    ]
    assert mixed_token_buckets(40) == [16, 32, 40]


def test_length_classes_are_powers_of_two_up_to_the_model_length():
    assert decode_length_classes(8320) == [512, 1024, 2048, 4096, 8192, 8320]
    assert decode_length_classes(4096) == [512, 1024, 2048, 4096]
    assert decode_length_classes(128) == [128]


def _h200_like_graphs(max_seq_len: int) -> StepGraphs:
    """Graph keys only (nothing captured): an 8B attention shape planned for an H200's table."""
    limits = StepLimits(max_num_seqs=256, max_model_len=max_seq_len)
    attention = planned_attention(32, 8, 128, limits)
    return StepGraphs(None, None, attention, None, None, limits, mixed=False)


def test_a_decode_graph_splits_as_its_length_class_does():
    """A step takes the graph of the smallest length class holding its longest sequence, or one
    that splits the KV exactly as that class would; classes that split alike share a graph."""
    graphs = _h200_like_graphs(8320)

    def splits(batch, length):
        return graphs.attention.planner.num_splits(batch, length)

    keys = set(graphs.all_keys)
    for batch in (1, 2, 3, 8, 17, 32, 64, 256):
        for length in (1, 300, 512, 513, 560, 1024, 1500, 3000, 8320):
            key = graphs.bucket_for(batch, length)
            assert key in keys and key.num_seqs >= batch and key.max_seq_len >= length
            holding = next(c for c in graphs.length_classes if c >= length)
            assert splits(key.num_seqs, key.max_seq_len) == splits(key.num_seqs, holding)
    # Batch 1 at 560 tokens: 16 segments, not the 32 a graph cut for 8,320 runs; batch 32 at
    # 560: one segment where the full length splits in two; batch 64 never splits: one graph.
    assert splits(1, graphs.bucket_for(1, 560).max_seq_len) == 16
    assert splits(32, graphs.bucket_for(32, 560).max_seq_len) == 1
    assert graphs.bucket_for(32, 3000).max_seq_len == 8320
    assert {k.max_seq_len for k in keys if k.decode and k.num_seqs == 64} == {8320}
    assert graphs.bucket_for(1) == graphs.bucket_for(1, 8320)
    # No two graphs of one bucket split alike.
    decode = [k for k in keys if k.decode]
    assert len({(k.num_seqs, splits(k.num_seqs, k.max_seq_len)) for k in decode}) == len(decode)


@pytest.mark.slow
def test_steps_that_outgrow_a_length_class_move_to_the_next_graph(tmp_path, monkeypatch):
    """Sequences that grow past 512 tokens while decoding switch graphs; a graph's bound must
    hold every sequence it sees (the reference attention reads keys only up to it)."""
    path = make_tiny_model("LlamaForCausalLM", tmp_path, max_position_embeddings=2048)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (500, 506, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(use_graphs: bool):
        llm = llm_with_planned_attention(
            monkeypatch,
            str(path),
            device="cpu",
            max_model_len=1100,
            max_num_seqs=4,
            max_num_batched_tokens=512,
        )
        if use_graphs:
            EagerStepGraphs.install(llm, max_tokens=512)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0].token_ids for o in outs], llm

    plain, _ = run(use_graphs=False)
    classed, llm = run(use_graphs=True)
    assert classed == plain
    bounds = {k.max_seq_len for k, _ in llm.instance.runner.graphs.replayed if k.decode}
    assert {512, 1024} <= bounds or {512, 1100} <= bounds


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_padded_steps_give_the_same_tokens(tmp_path, overlap, monkeypatch):
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in range(3, 40, 3)]
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.8, seed=5, max_tokens=8, ignore_eos=True),
    ]
    params = [params[i % 2] for i in range(len(prompts))]

    def run(use_graphs: bool) -> tuple[list[list[int]], LLM]:
        # A 40-token budget splits prompts into chunks beside other requests' decodes.
        llm = llm_with_planned_attention(
            monkeypatch,
            str(path),
            device="cpu",
            max_model_len=128,
            max_num_seqs=16,
            max_num_batched_tokens=40,
            overlap=overlap,
        )
        if use_graphs:
            EagerStepGraphs.install(llm, max_tokens=40)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.instance.scheduler.check_invariants()
        return [o.outputs[0].token_ids for o in outs], llm

    plain, _ = run(use_graphs=False)
    padded, llm = run(use_graphs=True)
    assert padded == plain
    replayed = llm.instance.runner.graphs.replayed
    decodes = [(k.num_seqs, real) for k, real in replayed if k.decode]
    mixed = [(k, real) for k, real in replayed if not k.decode]
    assert decodes and all(b in decode_buckets(16) for b, _ in decodes)
    assert any(real < b for b, real in decodes)  # some decode batch was padded
    assert mixed and all(k.num_seqs == 16 and k.num_tokens in (16, 32, 40) for k, _ in mixed)
    assert any(real < k.num_tokens for k, real in mixed)  # and some mixed step


def test_only_the_triton_ops_are_marked_capturable():
    """The runner captures decode graphs only over ops that allow it: the reference ops index
    with boolean masks (a host sync), which a CUDA graph capture rejects."""
    import torch

    from ember.layers.ops import select_ops, triton_ops

    assert select_ops(torch.device("cpu"), "reference").capturable is False
    assert triton_ops().capturable is True


def test_start_up_capture_runs_every_bucket_over_a_padded_empty_step(tmp_path):
    """Start-up capture stages an empty step padded to each bucket, the same padding real
    steps get; every bucket's pass must run on it, and generation is unchanged afterwards."""
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    prompt = {"prompt_token_ids": list(range(3, 30))}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(
        str(path), device="cpu", max_model_len=128, max_num_seqs=16, max_num_batched_tokens=40
    )
    plain = llm.generate([prompt], params)[0].outputs[0].token_ids
    graphs = EagerStepGraphs.install(llm, max_tokens=40)
    assert llm.instance.runner.capture_graphs() == len(graphs.all_keys)
    assert {k for k in graphs.captured} == set(graphs.all_keys)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == plain
    assert llm.instance.kv_manager.num_free_blocks == llm.instance.kv_manager.pool.capacity


def test_a_step_with_more_chunk_tiles_than_a_graph_holds_takes_a_larger_one(tmp_path, monkeypatch):
    """A mixed graph's chunk launch has a fixed grid: its tokens' tiles plus a partial tile for
    each of a few chunks. A step of many short chunks needs more: it takes a larger graph whose
    grid holds them, or runs eagerly past the largest."""
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    llm = llm_with_planned_attention(
        monkeypatch,
        str(path),
        device="cpu",
        max_model_len=128,
        max_num_seqs=32,
        max_num_batched_tokens=512,
    )
    graphs = EagerStepGraphs.install(llm, max_tokens=512)
    tile = graphs.attention.planner.chunk_query_tile
    grid16, grid512 = (
        graphs.mixed_grid(graphs.mixed_bucket_for(16, 4)),
        graphs.attention.graph_grid(512),
    )
    assert grid512 == 512 // tile + graphs.attention.chunk_slack > grid16
    assert graphs.mixed_bucket_for(10, 4, grid16).num_tokens == 16
    larger = graphs.mixed_bucket_for(10, 4, grid16 + 1)
    assert larger.num_tokens > 16 and graphs.mixed_grid(larger) > grid16
    assert graphs.mixed_bucket_for(10, 4, grid512 + 1) is None
