"""Each supported architecture matches Hugging Face transformers on tiny random-weight models."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_reference import hf_greedy_tokens
from helpers.prefill_logits import ember_prefill_logits
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams

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
