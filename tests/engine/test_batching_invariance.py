"""A request's tokens do not depend on what else runs, how prompts are chunked, or preemption."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(2, 60, (32,), generator=g).tolist()
    return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lengths]


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.instance.scheduler.check_invariants()
    return [o.outputs[0].token_ids for o in outs]


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(model_dir, prompts):
    llm = LLM(str(model_dir), device="cpu", max_model_len=128)
    return [generate(llm, [p], GREEDY)[0] for p in prompts]


@pytest.mark.slow
def test_batch_of_32_equals_alone(model_dir, prompts, alone):
    llm = LLM(str(model_dir), device="cpu", max_model_len=128)
    assert generate(llm, prompts, GREEDY) == alone


@pytest.mark.slow
def test_small_token_budget_chunks_every_prompt(model_dir, prompts, alone):
    llm = LLM(str(model_dir), device="cpu", max_model_len=128, max_num_batched_tokens=7)
    assert generate(llm, prompts, GREEDY) == alone


def test_small_kv_pool_forces_preemption(model_dir, prompts, alone):
    # 20 blocks of 8 tokens: a few requests at a time, so running ones get preempted.
    llm = LLM(
        str(model_dir), device="cpu", max_model_len=128, block_size=8, num_gpu_blocks_override=20
    )
    assert generate(llm, prompts, GREEDY) == alone
    assert llm.instance.scheduler.num_preemptions > 0


def test_overlapped_steps_equal_plain_steps(model_dir, prompts, alone):
    llm = LLM(str(model_dir), device="cpu", max_model_len=128, overlap=True)
    assert generate(llm, prompts, GREEDY) == alone


def test_seeded_sampling_is_independent_of_the_batch(model_dir, prompts):
    llm = LLM(
        str(model_dir), device="cpu", max_model_len=128, block_size=8, num_gpu_blocks_override=40
    )
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=8)
    target = prompts[3]
    lone = generate(llm, [target], params)[0]
    unseeded_others = [SamplingParams(temperature=1.0, max_tokens=8) for _ in prompts]
    mixed = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:10]] + [{"prompt_token_ids": target}],
        unseeded_others[:10] + [params],
    )
    assert mixed[-1].outputs[0].token_ids == lone
    again = generate(llm, [target], params)[0]
    assert again == lone
    other_seed = generate(llm, [target], SamplingParams(**{**params.__dict__, "seed": 99}))[0]
    assert other_seed != lone  # 8 tokens at T=0.9 over a 49k vocab: a collision is negligible


def test_every_block_returns_after_abort(model_dir, prompts):
    llm = LLM(str(model_dir), device="cpu", max_model_len=128)
    inst = llm.instance
    for i, p in enumerate(prompts[:8]):
        inst.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        inst.step()
    for i in range(0, 8, 2):
        assert inst.abort(f"r{i}")
    while inst.has_work():
        inst.step()
    inst.scheduler.check_invariants()
    assert inst.kv_manager.num_free_blocks == inst.kv_manager.pool.capacity
