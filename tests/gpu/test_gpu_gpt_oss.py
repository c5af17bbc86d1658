"""gpt-oss on the GPU fast path (Triton attention with sinks and windows, the fused MoE with the
clamped SwiGLU and expert biases, CUDA graphs) against the reference path and transformers, on
`ember bench make-model`'s tiny-gpt-oss preset with its experts in bf16 and in MXFP4 (kept
packed: the Triton path multiplies them in the fused MoE's MXFP4 variant, the reference
dequantizes each expert it runs).

Skipped without a CUDA GPU; `tools/gpu_run.sh` runs these on the H200.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.gpu_parity import random_prompts
from helpers.hf_reference import hf_greedy_tokens

from ember import LLM, SamplingParams
from ember.bench.make_model import make_model
from ember.bench.parity import compare_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LLM_ARGS = {"device": "cuda", "max_model_len": 256, "kv_cache_memory_bytes": 1 << 30}


@pytest.fixture(scope="module", params=[None, "mxfp4"], ids=["bf16-experts", "mxfp4-experts"])
def tiny_dir(request, tmp_path_factory):
    # Saved tokenizer files where the GPU machine has no GGUF (EMBER_TEST_TOKENIZER_DIR).
    saved = os.environ.get("EMBER_TEST_TOKENIZER_DIR")
    return make_model(
        "tiny-gpt-oss",
        tmp_path_factory.mktemp(f"tiny-gpt-oss-{request.param or 'bf16'}-"),
        device="cpu",
        tokenizer_dir=saved and Path(saved),
        quantization=request.param,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_path_matches_reference_path(tiny_dir, dtype):
    """fp32: the same greedy tokens. bf16: where the paths part, a near-tie (each token in the
    other's top 5). Prompts of up to 89 tokens outgrow the 16-key window."""
    prompts = random_prompts(16)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)

    def run(backend: str) -> list[tuple[list[int], list]]:
        llm = LLM(str(tiny_dir), backend=backend, dtype=dtype, **LLM_ARGS)
        assert llm.instance.model_config.mxfp4_experts == ("mxfp4" in tiny_dir.name)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.instance.scheduler.check_invariants()
        if backend == "triton":
            assert llm.instance.runner.graphs.captured, "steps should have used CUDA graphs"
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    reference, fast = run("reference"), run("triton")
    if dtype == "float32":
        assert [a for a, _ in fast] == [b for b, _ in reference]
    else:
        rows = [compare_greedy(a, b) for a, b in zip(fast, reference)]
        assert all(row["near_tie"] for row in rows), rows


def test_triton_path_matches_transformers(tiny_dir):
    transformers = pytest.importorskip("transformers")
    # On a GPU, transformers dequantizes MXFP4 experts to bf16 whatever dtype is asked: cast
    # the model back (e2m1 values times powers of two are exact in both).
    hf = (
        transformers.AutoModelForCausalLM.from_pretrained(
            tiny_dir, dtype=torch.float32, experts_implementation="eager"
        )
        .float()
        .cuda()
    )
    prompts = random_prompts(4, seed=3)
    llm = LLM(str(tiny_dir), dtype="float32", **LLM_ARGS)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    )
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, 24)
