"""A mixture-of-experts model in the engine, on the CPU: its planned weight bytes are its
checkpoint's, and prefix caching and sleep/wake give the tokens it gives without them."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tiny_models import make_tiny_model
from safetensors import safe_open

from ember import LLM, SamplingParams
from ember.api import Engine

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Qwen3-MoE with a dense layer between two sparse ones."""
    return make_tiny_model(
        "Qwen3MoeForCausalLM",
        tmp_path_factory.mktemp("qwen3-moe"),
        seed=7,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    )


@pytest.fixture(scope="module")
def prompts():
    """Prompts that share a 37-token system prefix."""
    g = torch.Generator().manual_seed(3)
    system = torch.randint(3, 4000, (37,), generator=g).tolist()
    return [system + torch.randint(3, 4000, (n,), generator=g).tolist() for n in (5, 9, 14, 3)]


def generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def uncached(model_dir, prompts):
    llm = LLM(str(model_dir), device="cpu", max_model_len=128, enable_prefix_caching=False)
    return [generate(llm, [{"prompt_token_ids": p}])[0] for p in prompts]


def test_the_plan_counts_every_experts_bytes(model_dir):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_model_len=128)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        shapes = [f.get_slice(name).get_shape() for name in list(f.keys())]
    stored = sum(math.prod(shape) * 4 for shape in shapes)  # float32
    assert llm.instance.plan.weight_bytes == stored
    assert stored <= llm.instance.weight_bytes  # the arena, its tensors aligned


def test_cached_prefixes_give_the_tokens_of_an_uncached_run(model_dir, prompts, uncached):
    llm = LLM(str(model_dir), device="cpu", max_model_len=128, block_size=8)
    tokens = [generate(llm, [{"prompt_token_ids": p}])[0] for p in prompts]
    assert tokens == uncached
    assert llm.instance.kv_manager.stats.hits >= 32 * (len(prompts) - 1)  # 4 blocks each


def test_a_woken_model_gives_the_tokens_it_gave_before_sleeping(model_dir, prompts, uncached):
    engine = Engine()
    engine.add_model("moe", str(model_dir), device="cpu", max_model_len=128)
    batch = [{"prompt_token_ids": p} for p in prompts]
    assert [o.outputs[0].token_ids for o in engine.generate(batch, GREEDY, model="moe")] == uncached
    weight_bytes = engine.instance("moe").weight_bytes
    engine.sleep("moe")
    status = engine.pool.statuses()[0]
    assert status.state == "sleeping" and status.host_bytes == weight_bytes
    engine.wake("moe")
    assert [o.outputs[0].token_ids for o in engine.generate(batch, GREEDY, model="moe")] == uncached
