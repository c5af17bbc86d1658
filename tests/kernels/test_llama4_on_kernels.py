"""Llama 4's text model on the Triton kernels (interpreted on a CPU) gives transformers' greedy
tokens: the fused MoE kernels with one expert per token fed its scaled input, chunked attention
(16 keys) over prefill chunks and decodes with the QK L2 norm applied where RoPE is, in the
cache-write kernel and in the fused decode, and a NoPE layer with temperature tuning; the q/k
rows reordered for the kernels' RoPE."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_reference import hf_greedy_tokens
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fuse_decode", [True, False], ids=["rope-in-decode", "separate-rope"])
def test_llama4_on_the_kernels_gives_transformers_tokens(tmp_path, device, fuse_decode):
    transformers = pytest.importorskip("transformers")
    path = make_tiny_model("Llama4ForCausalLM", tmp_path, seed=3, llama3_rope=True)
    hf = transformers.Llama4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (5, 29, 40)]
    llm = LLM(
        str(path),
        device=str(device),
        backend="triton",
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=64 << 20,
        decode_rope_in_attention=fuse_decode,
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, 12)
    llm.instance.scheduler.check_invariants()
