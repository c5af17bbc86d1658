"""The mixture-of-experts architectures match Hugging Face transformers on tiny random-weight
models: Qwen3-MoE with dense layers among the sparse ones (``mlp_only_layers``,
``decoder_sparse_step``) and ``norm_topk_prob`` both ways, and Mixtral with its experts stored
one tensor each or stacked. Greedy generation runs under a small token budget, so prompts are
fed in several chunks and decodes share steps with other prompts' chunks."""

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

VARIANTS = {
    "qwen3-moe-mlp-only-layer": (
        "Qwen3MoeForCausalLM",
        {"num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": False},
    ),
    "qwen3-moe-sparse-step-norm-topk": (
        "Qwen3MoeForCausalLM",
        {"num_hidden_layers": 4, "decoder_sparse_step": 2, "norm_topk_prob": True},
    ),
    "mixtral": ("MixtralForCausalLM", {}),
    "mixtral-stacked-experts": ("MixtralForCausalLM", {"stacked_experts": True}),
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def tiny(request, tmp_path_factory):
    arch, kwargs = VARIANTS[request.param]
    path = make_tiny_model(arch, tmp_path_factory.mktemp(request.param), seed=5, **kwargs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    return hf, llm


def test_layers_are_sparse_or_dense_as_transformers_builds_them(tiny):
    hf, llm = tiny
    ours = [type(layer.mlp).__name__ for layer in llm.instance.model.layers]
    theirs = [type(layer.mlp).__name__ for layer in hf.model.layers]
    assert [name == "SparseMoeBlock" for name in ours] == [
        name.endswith("SparseMoeBlock") for name in theirs
    ]
    assert "SparseMoeBlock" in ours


def test_prefill_logits_match_transformers(tiny):
    check_prefill_logits(*tiny)


def test_greedy_generation_in_chunks_matches_transformers(tiny):
    check_greedy_tokens(*tiny, max_tokens=10)
