"""Llama 4's text model on the GPU: the `tiny-llama4` preset (experts on every other layer, one
per token with a shared expert; 128-key chunks with the QK L2 norm; a NoPE layer with
temperature tuning from position 63) on the Triton path with CUDA graphs against the reference
path in bf16, with prompts and generations across several chunks, and so with FP8 weights (an
FP8 checkpoint, quantized at load, dummy); the memory a quantizing load holds; and a tiny random
model on the Triton path in float32 against transformers' greedy tokens.

Skipped without a CUDA GPU; `tools/gpu_run.sh` runs these on the H200.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.gpu_parity import random_prompts
from helpers.hf_reference import hf_greedy_tokens
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.bench.make_model import make_model
from ember.bench.parity import compare_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KWARGS = {"device": "cuda", "max_model_len": 1024, "kv_cache_memory_bytes": 1 << 30}


def test_tiny_llama4_through_cuda_graphs_matches_the_reference_at_bf16(tmp_path):
    """The same greedy tokens but for near-ties (each path's token in the other's top 5)."""
    saved = os.environ.get("EMBER_TEST_TOKENIZER_DIR")  # the GPU machine has no GGUF
    path = make_model("tiny-llama4", tmp_path / "tiny-llama4", tokenizer_dir=saved and Path(saved))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (5, 90, 200, 450)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=5)
    results = {}
    for backend in ("reference", "triton"):
        llm = LLM(str(path), backend=backend, dtype="bfloat16", lazy_cuda_graphs=True, **KWARGS)
        assert llm.instance.model.layers[0].self_attn.chunk_size == 128
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        results[backend] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        llm.instance.scheduler.check_invariants()
        if backend == "triton":
            assert llm.instance.runner.graphs.captured
    rows = [compare_greedy(a, b) for a, b in zip(results["triton"], results["reference"])]
    assert all(row["near_tie"] for row in rows), rows


@pytest.mark.parametrize("source", ["fp8-checkpoint", "quantized-at-load", "dummy"])
def test_tiny_llama4_in_fp8_through_cuda_graphs_matches_the_reference(tmp_path, source):
    """FP8 weights (make-model's llm-compressor checkpoint, --quantization fp8 on the bf16 one,
    or dummy weights from the FP8 config): the Triton path (skinny FP8 GEMMs, FP8 fused MoE)
    with CUDA graphs gives the reference's greedy tokens but for near-ties."""
    saved = os.environ.get("EMBER_TEST_TOKENIZER_DIR")
    tokenizer_dir = saved and Path(saved)
    fp8_config = source != "quantized-at-load"
    path = make_model(
        "tiny-llama4",
        tmp_path / "tiny-llama4",
        tokenizer_dir=tokenizer_dir,
        quantization="fp8" if fp8_config else None,
        config_only=source == "dummy",
    )
    options = {
        "quantization": "fp8" if source == "quantized-at-load" else None,
        "load_format": "dummy" if source == "dummy" else "auto",
    }
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (5, 90, 200)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    results = {}
    for backend in ("reference", "triton"):
        llm = LLM(
            str(path), backend=backend, dtype="bfloat16", lazy_cuda_graphs=True, **options, **KWARGS
        )
        assert llm.instance.model.layers[1].mlp.w13.dtype == torch.float8_e4m3fn
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        results[backend] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        if backend == "triton":
            assert llm.instance.runner.graphs.captured
        del llm
        torch.cuda.empty_cache()
    rows = [compare_greedy(a, b) for a, b in zip(results["triton"], results["reference"])]
    assert all(row["near_tie"] for row in rows), rows


def test_quantizing_llama4_at_load_holds_one_stacked_expert_tensor(tmp_path):
    """--quantization fp8 lands each stacked float expert tensor alone and quantizes it before
    the next lands: beyond what it keeps (weights, KV cache), the load's peak of allocated
    memory exceeds a bf16 load's by less than 1.2 stacked gate/up tensors (a layer's float
    weights would be 1.6: gate/up, down, attention and the shared expert)."""
    path = make_tiny_model(
        "Llama4ForCausalLM",
        tmp_path / "m",
        hidden_size=512,
        intermediate_size=4096,
        intermediate_size_mlp=1024,
        num_local_experts=16,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    )
    gate_up_bytes = 16 * 512 * 2 * 4096 * 4  # stored in float32
    transient = {}
    for quantization in (None, "fp8"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        llm = LLM(
            str(path),
            device="cuda",
            dtype="bfloat16",
            max_model_len=256,
            kv_cache_memory_bytes=64 << 20,
            enforce_eager=True,
            quantization=quantization,
        )
        # The peak over what stays: torch's statistics count the load's temporaries, but not
        # the weights and cache where they live in the CUDA virtual-memory arena.
        transient[quantization] = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        del llm
    assert transient["fp8"] - transient[None] < 1.2 * gate_up_bytes


def test_triton_path_matches_transformers_in_float32(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = make_tiny_model("Llama4ForCausalLM", tmp_path, seed=3, llama3_rope=True)
    hf = transformers.Llama4ForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    prompts = random_prompts(4, seed=3)
    llm = LLM(str(path), dtype="float32", **KWARGS)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    )
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, 24)
