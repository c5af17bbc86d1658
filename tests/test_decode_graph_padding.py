"""The CUDA-graph step paths' inputs, checked on a CPU.

A graph replays a fixed shape, so decode steps are padded up to a batch bucket and mixed steps
(prefill chunks beside decodes) up to a token bucket with the sequence count at its maximum.
Here the graph is replaced by the same forward pass run eagerly on the padded buffers: padding
must change nothing (it writes no KV and its outputs are dropped), whatever the real shape.
"""

from __future__ import annotations

import pytest
import torch
from helpers.eager_graphs import EagerStepGraphs
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.runner.cuda_graphs import decode_buckets, mixed_token_buckets


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


@pytest.mark.parametrize("overlap", [False, True])
def test_padded_steps_give_the_same_tokens(tmp_path, overlap):
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
        llm = LLM(
            str(path), device="cpu", max_model_len=128, max_num_seqs=16,
            max_num_batched_tokens=40, overlap=overlap,
        )  # fmt: skip
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
