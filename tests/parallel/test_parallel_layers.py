"""The sharded layers over gloo, the ranks as threads: a model split over 2 or 4 ranks gives
rank 0 the logits of the whole model (the others none), for each dense architecture, a
vocabulary that does not divide by the ranks, tied embeddings, and fewer KV heads than ranks."""

from __future__ import annotations

import pytest
import torch
from helpers.prefill import prefill_inputs, prompts_of_lengths
from helpers.thread_ranks import RankShard, run_ranks
from helpers.tiny_models import make_tiny_model

from ember.layers.ops import reference_ops
from ember.models.llama import Embedding

VARIANTS = {
    "llama-odd-vocab": ("LlamaForCausalLM", {"vocab_size": 49155}),
    "llama-tied": ("LlamaForCausalLM", {"tie": True}),
    "qwen2-biases": ("Qwen2ForCausalLM", {}),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", {}),
    "mistral-one-kv-head": ("MistralForCausalLM", {"num_key_value_heads": 1}),
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    arch, options = VARIANTS[request.param]
    return make_tiny_model(arch, tmp_path_factory.mktemp(request.param) / "m", **options)


def logits_at(path, size: int, prompts) -> list:
    def run(group):
        ids, ctx = prefill_inputs(prompts, 16)
        return RankShard(path, group).prefill_logits(ids, ctx)

    return run_ranks(size, run)


@pytest.mark.parametrize("size", [2, 4])
def test_rank_zero_gets_the_whole_models_logits(checkpoint, size):
    prompts = prompts_of_lengths((1, 9, 40), 49152)
    (expected,) = logits_at(checkpoint, 1, prompts)
    got = logits_at(checkpoint, size, prompts)
    assert got[1:] == [None] * (size - 1)
    assert got[0].shape == expected.shape
    torch.testing.assert_close(got[0], expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[0].argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize(
    "ops",
    [reference_ops(defer_norms=True), reference_ops(split_k_parts=2)],
    ids=["deferred-norms", "split-k-parts"],
)
def test_the_fast_paths_residual_forms_reduce_before_they_add(tmp_path, ops):
    """The deferred-norm stream (norms folded into the projections, statistics taken as the
    output joins) and split-K partial sums: at tp 2 the row-parallel products are summed over
    the ranks first, giving the logits of the plain form on one rank."""
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "m")
    prompts = prompts_of_lengths((1, 9, 40), 49152)
    (expected,) = logits_at(path, 1, prompts)

    def run(group):
        ids, ctx = prefill_inputs(prompts, 16)
        shard = RankShard(path, group, ops)
        assert shard.model.defers_norms == ops.defer_norms
        return shard.prefill_logits(ids, ctx)

    got = run_ranks(2, run)
    torch.testing.assert_close(got[0], expected, atol=1e-4, rtol=1e-4)


def test_a_vocabulary_slice_looks_up_only_its_ids():
    """10 ids over 3 ranks (4, 4, 2 real rows): every id's row, from whichever rank holds it."""
    table = torch.randn(10, 8)
    ids = torch.tensor([0, 3, 4, 7, 8, 9, 9, 2])

    def run(group):
        embedding = Embedding(10, 8, group)
        with torch.no_grad():
            embedding.weight.zero_()
            rows = table[embedding.first_id : embedding.first_id + embedding.num_ids]
            embedding.weight[: len(rows)] = rows
        return embedding.first_id, embedding.num_ids, embedding(ids)

    results = run_ranks(3, run)
    assert [(first, count) for first, count, _ in results] == [(0, 4), (4, 4), (8, 2)]
    for _, _, rows in results:
        torch.testing.assert_close(rows, table[ids])


def test_a_group_of_one_runs_no_collective():
    """tensor_parallel_size 1: the embedding is the plain lookup of the whole table."""
    embedding = Embedding(10, 8)
    assert embedding.weight.shape == (10, 8) and embedding.parallel.size == 1
    ids = torch.tensor([1, 9])
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(10, 8))
    assert torch.equal(embedding(ids), embedding.weight[ids])
