"""The CUDA-graph decode path's inputs, checked on a CPU.

A graph replays a fixed batch size, so decode steps are padded up to a bucket. Here the graph
is replaced by the same forward pass run eagerly on the padded buffers: padded rows must change
nothing (they write no KV and their logits are dropped), whatever the real batch size.
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.runner.cuda_graphs import DecodeGraphs, decode_buckets


class EagerDecodeGraphs(DecodeGraphs):
    """DecodeGraphs whose 'replay' runs the captured function eagerly (no CUDA needed)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replayed: list[int] = []

    def replay(self, bucket: int) -> torch.Tensor:
        self.replayed.append(bucket)
        return self._forward(bucket)


def test_buckets_cover_every_batch_size():
    buckets = decode_buckets(100)
    assert buckets[:4] == [1, 2, 4, 8] and buckets[-1] == 100
    for batch in range(1, 101):
        assert any(b >= batch for b in buckets)


@pytest.mark.parametrize("overlap", [False, True])
def test_padded_decode_steps_give_the_same_tokens(tmp_path, overlap):
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in range(3, 40, 3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(use_graphs: bool) -> tuple[list[list[int]], LLM]:
        llm = LLM(str(path), device="cpu", max_model_len=128, max_num_seqs=16, overlap=overlap)
        runner = llm.instance.runner
        if use_graphs:
            runner.graphs = EagerDecodeGraphs(
                llm.instance.model, runner.buffers, runner.kv_cache, runner.cos_sin_cache,
                max_batch=16, max_seq_len=128,
            )  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.instance.scheduler.check_invariants()
        return [o.outputs[0].token_ids for o in outs], llm

    plain, _ = run(use_graphs=False)
    padded, llm = run(use_graphs=True)
    assert padded == plain
    replayed = llm.instance.runner.graphs.replayed
    assert replayed and all(b in decode_buckets(16) for b in replayed)
    assert any(b > 8 for b in replayed)  # 13 requests decode together: padded to 16


def test_only_the_triton_ops_are_marked_capturable():
    """The runner captures decode graphs only over ops that allow it: the reference ops index
    with boolean masks (a host sync), which a CUDA graph capture rejects."""
    import torch

    from ember.layers.ops import select_ops, triton_ops

    assert select_ops(torch.device("cpu"), "reference").capturable is False
    assert triton_ops().capturable is True
