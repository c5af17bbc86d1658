"""Each supported architecture matches Hugging Face transformers on tiny random-weight models."""

from __future__ import annotations

import pytest
import torch
from helpers.prefill import (
    check_greedy_tokens,
    check_prefill_logits,
)
from helpers.tiny_models import make_tiny_model

from ember import LLM

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


def test_prefill_logits_match_transformers(tiny):
    check_prefill_logits(*tiny)


def test_greedy_generation_matches_transformers(tiny):
    check_greedy_tokens(*tiny, max_tokens=12)
