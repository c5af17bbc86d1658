"""Llama 4's text model matches transformers on tiny random-weight models (tests/helpers/
tiny_models.py): experts on every other layer beside dense MLPs, one expert per token with a
shared expert, chunked attention (16 keys, shorter than the prompts) with the QK L2 norm on the
RoPE layers, and a NoPE layer whose queries are scaled by position; the q and k rows reordered
for ember's RoPE. As `Llama4ForCausalLM` and as the text model of a
`Llama4ForConditionalGeneration` checkpoint, whose vision tower is not read."""

from __future__ import annotations

import pytest
import torch
from helpers.prefill import (
    check_greedy_tokens,
    check_prefill_logits,
    ember_prefill_logits,
    prompts_of_lengths,
)
from helpers.tiny_models import make_tiny_model

from ember import LLM

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

ARCHS = ["Llama4ForCausalLM", "Llama4ForConditionalGeneration"]
CHUNK = 16


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {
        arch: make_tiny_model(arch, tmp_path_factory.mktemp(arch), seed=5, llama3_rope=True)
        for arch in ARCHS
    }


def text_model(path, arch: str, dtype: torch.dtype):
    """transformers' model of ``path``: its text model (transformers 5.24's multimodal forward
    fails without images)."""
    hf = getattr(transformers, arch).from_pretrained(path, dtype=dtype).eval()
    return getattr(hf, "language_model", hf)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, model_dirs):
    path = model_dirs[request.param]
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    return text_model(path, request.param, torch.float32), llm


def test_layers_are_built_as_transformers_builds_them(tiny):
    hf, llm = tiny
    ours = llm.instance.model.layers
    theirs = hf.model.layers
    assert (
        [type(layer.mlp).__name__ == "Llama4MoeBlock" for layer in ours]
        == [layer.is_moe_layer for layer in theirs]
        == [False, True, False, True]
    )
    assert [layer.self_attn.use_rope for layer in ours] == [
        bool(layer.self_attn.use_rope) for layer in theirs
    ]
    assert [layer.self_attn.chunk_size for layer in ours] == [CHUNK, CHUNK, CHUNK, None]
    assert [layer.self_attn.qk_l2_norm_eps is not None for layer in ours] == [
        hasattr(layer.self_attn, "qk_norm") for layer in theirs
    ]
    assert ours[3].self_attn.temperature is not None


def test_prefill_logits_match_transformers(tiny):
    """Prompts within one chunk and across up to five."""
    check_prefill_logits(*tiny, lengths=(1, 7, 33, 70))


def test_greedy_generation_in_chunks_matches_transformers(tiny):
    check_greedy_tokens(*tiny, max_tokens=10)


def test_bf16_is_as_close_to_float32_as_transformers_bf16_is(model_dirs):
    """In bf16 a one-token prompt's logits, run alone as transformers runs it, are
    transformers' bits (in a batch beside longer prompts, a CPU's bf16 GEMM may round its row
    differently with the batch's row count); over longer prompts the attention rounds
    differently (and a near tie may route a token to another expert), so ember's bf16 logits
    must be about as far from the float32 ones as transformers' are."""
    path = model_dirs["Llama4ForCausalLM"]
    hf_bf16 = text_model(path, "Llama4ForCausalLM", torch.bfloat16)
    hf_fp32 = text_model(path, "Llama4ForCausalLM", torch.float32)
    llm = LLM(str(path), dtype="bfloat16", device="cpu", max_model_len=256)
    prompts = prompts_of_lengths((1, 7, 33, 70), hf_fp32.config.vocab_size)
    for prompt, ours in zip(prompts, ember_prefill_logits(llm, prompts)):
        with torch.no_grad():
            theirs = hf_bf16(torch.tensor([prompt])).logits[0]
            exact = hf_fp32(torch.tensor([prompt])).logits[0]
        if len(prompt) == 1:
            assert torch.equal(ember_prefill_logits(llm, [prompt])[0], theirs)
        their_error = (theirs.float() - exact).abs().max()
        assert (ours.float() - exact).abs().max() <= 2 * their_error


def test_the_multimodal_checkpoint_reads_its_text_model_only(model_dirs):
    """The layout names the text model's tensors under ``language_model.``; the vision tower's
    are in the checkpoint but neither read nor missing."""
    from safetensors import safe_open

    path = model_dirs["Llama4ForConditionalGeneration"]
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64)
    layout = llm.instance.plan.layout
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    vision = {name for name in stored if not name.startswith("language_model.")}
    assert vision and all(layout.ignores(name) for name in vision)
    assert set(layout.names()) == stored - vision
