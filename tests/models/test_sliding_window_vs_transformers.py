"""Sliding-window models match transformers: a tiny Mistral whose window (12 keys) is shorter
than its prompts, and a Qwen2 whose upper layer alone is windowed (max_window_layers), on the
reference path; a window as long as max_model_len is dropped."""

from __future__ import annotations

import pytest
import torch
from helpers.prefill import check_greedy_tokens, check_prefill_logits
from helpers.tiny_models import make_tiny_model

from ember import LLM

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

WINDOW = 12
VARIANTS = {
    "mistral": ("MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2-upper-layer": (
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def windowed(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    path = make_tiny_model(arch, tmp_path_factory.mktemp(request.param), **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=256)
    return hf, llm


def test_layers_take_the_window(windowed):
    hf, llm = windowed
    windows = [layer.self_attn.window for layer in llm.instance.model.layers]
    # Mistral has no layer_types: every layer slides.
    kinds = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * len(windows)
    assert windows == [WINDOW if kind == "sliding_attention" else None for kind in kinds]
    assert WINDOW in windows


def test_prefill_logits_match_transformers(windowed):
    check_prefill_logits(*windowed, lengths=(5, 13, 40), seed=2)


def test_greedy_generation_matches_transformers(windowed):
    """Decodes past the window, from prompts shorter and longer than it."""
    check_greedy_tokens(*windowed, max_tokens=16, lengths=(4, 30), seed=3)


def test_a_window_no_sequence_outgrows_costs_nothing(tmp_path):
    path = make_tiny_model("MistralForCausalLM", tmp_path, sliding_window=64)
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64)
    attention = llm.instance.model.layers[0].self_attn
    assert attention.window is None and attention.attention_options() == {}
