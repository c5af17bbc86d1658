"""Each supported architecture matches Hugging Face transformers on tiny random-weight models."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_reference import hf_greedy_tokens
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.layers.forward_context import ForwardContext

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
VARIANTS = [(arch, {}) for arch in ARCHS] + [
    ("LlamaForCausalLM", {"tie": True}),
    ("LlamaForCausalLM", {"llama3_rope": True}),
]
VARIANT_IDS = [a + ("-" + "-".join(k) if k else "") for a, k in VARIANTS]


@pytest.fixture(scope="module", params=VARIANTS, ids=VARIANT_IDS)
def tiny(request, tmp_path_factory):
    arch, kwargs = request.param
    path = make_tiny_model(arch, tmp_path_factory.mktemp(arch), **kwargs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=256)
    return hf, llm


def prompts_of_lengths(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def ember_prefill_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Run every prompt as one varlen batch through the model and return all positions' logits."""
    inst = llm.instance
    bs = inst.kv_manager.block_size
    tables, slots, positions, qsl = [], [], [], [0]
    next_block = 1
    for p in prompts:
        n_blocks = -(-len(p) // bs)
        blocks = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        tables.append(blocks)
        positions += list(range(len(p)))
        slots += [blocks[i // bs] * bs + i % bs for i in range(len(p))]
        qsl.append(qsl[-1] + len(p))
    width = max(len(t) for t in tables)
    ctx = ForwardContext(
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(len(p) for p in prompts),
        max_seq_len=max(len(p) for p in prompts),
    )
    ids = torch.tensor([t for p in prompts for t in p])
    with torch.inference_mode():
        hidden = inst.model(ids, ctx, inst.runner.cos_sin_cache, inst.kv_cache)
        logits = inst.model.compute_logits(hidden)
    return list(logits.split([len(p) for p in prompts]))


def test_prefill_logits_match_transformers(tiny):
    hf, llm = tiny
    prompts = prompts_of_lengths([1, 7, 33, 70], hf.config.vocab_size)
    ours = ember_prefill_logits(llm, prompts)
    for prompt, logits in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, ref, atol=2e-4, rtol=2e-4)


def test_greedy_generation_matches_transformers(tiny):
    hf, llm = tiny
    prompts = prompts_of_lengths([3, 11, 26, 50, 5], hf.config.vocab_size, seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, 12)
    llm.instance.scheduler.check_invariants()
