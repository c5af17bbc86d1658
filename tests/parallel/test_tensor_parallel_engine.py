"""`LLM(..., tensor_parallel_size=N)` on the CPU: rank 0 in this process, the other ranks in
worker processes over gloo. Greedy tokens equal the single-process model's and transformers';
prompt logprobs, chunked prefill and overlap (tokens fed from rank 0's samples) agree; a worker
that dies fails the model with an error naming it, at once, and the next request starts a new
group; what tensor parallelism does not serve yet, or a shape it cannot split, is refused by
name."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch
from helpers.prefill import check_greedy_tokens, prompts_of_lengths
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.engine.model_plan import plan_model

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

VARIANTS = {
    "llama-odd-vocab": ("LlamaForCausalLM", {"vocab_size": 49155}),
    "qwen2-biases": ("Qwen2ForCausalLM", {}),
    "mistral-one-kv-head": ("MistralForCausalLM", {"num_key_value_heads": 1}),
}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def load(path, size: int, **options) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        tensor_parallel_size=size,
        **options,
    )


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama") / "m")


def tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_equal_one_process_and_transformers(variant, tmp_path):
    arch, options = VARIANTS[variant]
    path = make_tiny_model(arch, tmp_path / "m", **options)
    prompts = prompts_of_lengths((3, 11, 26, 50, 5), 49152, seed=1)
    with load(path, 1) as single:
        expected = tokens(single, prompts)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with load(path, 2) as split:
        assert tokens(split, prompts) == expected
        check_greedy_tokens(hf, split, max_tokens=10)


def test_four_ranks_two_sharing_each_kv_head(llama):
    prompts = prompts_of_lengths((7, 30), 49152, seed=2)
    with load(llama, 1) as single:
        expected = tokens(single, prompts)
    with load(llama, 4) as split:
        assert tokens(split, prompts) == expected
        assert split.instance.bytes_read_by_rank.keys() == {0, 1, 2, 3}


def test_chunks_overlap_and_prompt_logprobs_agree(llama):
    """Prompts fed in chunks of 16 tokens, steps launched before the last is collected (the
    other ranks get rank 0's sampled tokens by broadcast), and prompt logprobs (every rank
    computes the same chunks of logits)."""
    prompts = prompts_of_lengths((40, 9, 23), 49152, seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    options = {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 16}
    with load(llama, 1, **options) as single:
        expected = single.generate([{"prompt_token_ids": p} for p in prompts], params)
    with load(llama, 2, overlap=True, **options) as split:
        got = split.generate([{"prompt_token_ids": p} for p in prompts], params)
    for ours, theirs in zip(got, expected):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


def test_a_worker_killed_mid_run_fails_the_model_by_name_then_a_new_group_serves(llama):
    prompts = prompts_of_lengths((12, 20), 49152, seed=4)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with load(llama, 1) as single:
        expected = tokens(single, prompts)
    with load(llama, 2) as split:
        workers = split.instance.workers
        (pid,) = workers.pids.values()
        send, sent = workers.send, []

        def send_then_kill(step):
            send(step)
            sent.append(step)
            if len(sent) == 5:  # the worker has this step; rank 0 meets its absence inside it
                os.kill(pid, signal.SIGKILL)

        workers.send = send_then_kill
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(pid \d+\) exited"):
            tokens(split, prompts, long)
        assert time.monotonic() - started < 30
        assert split.engine.state(split.model_name) == "unloaded"
        assert tokens(split, prompts) == expected  # loaded again: a new group of workers
        assert split.instance.workers.pids[1] != pid


def test_what_is_not_built_yet_is_refused_by_name(llama, tmp_path):
    with load(llama, 2) as split, pytest.raises(RuntimeError, match="not supported yet"):
        split.engine.sleep(split.model_name)
    moe = make_tiny_model("Qwen3MoeForCausalLM", tmp_path / "moe", moe_intermediate_size=34)
    with pytest.raises(
        ValueError, match="does not divide the model's experts' intermediate size 34"
    ):
        load(moe, 4)


def test_the_step_bench_times_a_split_decode(tiny_bench_factory):
    """`ember bench step -tp 2`'s decode rows on the CPU: the steps go through rank 0's loop,
    the worker takes part, and the floor is one rank's bytes (each GPU reads its shard)."""
    from ember.bench.roofline import Ceilings

    bench = tiny_bench_factory(Ceilings(1e11, 1e12), tensor_parallel_size=2)
    row = bench.decode(batch=2, context=32, steps=3, warmup=1)
    assert row["step_ms"] > 0 and 0 < row["fraction_of_roofline"]
    plan = bench.inst.plan
    whole = plan_model(dataclasses.replace(plan.config, tensor_parallel_size=1)).weight_bytes
    assert max(bench.inst.weight_bytes, plan.weight_bytes) < 0.6 * whole
    bench.inst.close()
