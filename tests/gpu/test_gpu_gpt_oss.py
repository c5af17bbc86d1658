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
from helpers.gpu_parity import mean_prompt_logprob_gap, random_prompts
from helpers.hf_reference import hf_greedy_tokens

from ember import LLM, SamplingParams
from ember.bench.make_model import make_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LLM_ARGS = {"device": "cuda", "max_model_len": 256, "kv_cache_memory_bytes": 1 << 30}
BACKENDS = ("reference", "triton")


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


def _run(path: Path, backend: str, dtype: str, prompts, params: SamplingParams):
    llm = LLM(str(path), backend=backend, dtype=dtype, **LLM_ARGS)
    assert llm.instance.model_config.mxfp4_experts == ("mxfp4" in path.name)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.instance.scheduler.check_invariants()
    if backend == "triton":
        assert llm.instance.runner.graphs.captured, "steps should have used CUDA graphs"
    return outs


def test_triton_path_matches_reference_path_in_float32(tiny_dir):
    """The same greedy tokens. Prompts of up to 89 tokens outgrow the 16-key window."""
    prompts = random_prompts(16)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference, fast = (_run(tiny_dir, b, "float32", prompts, params) for b in BACKENDS)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in reference]


def test_triton_path_in_bf16_is_as_close_to_float32_as_the_reference(tiny_dir):
    """In bf16 the paths round differently (the fused MoE adds biases and computes the clamped
    SwiGLU in fp32 where the reference rounds each op; attention multiplies P by V in bf16 on
    the tensor cores), and gpt-oss's router turns a last-bit difference at a near-tie of its
    top-k logits into another expert: greedy tokens can part at non-near-ties (a layer-by-layer
    trace: bench/results/README.md, "gpt-oss in bf16"). What must hold is that the Triton path
    is no further from the float32 reference than the reference path in bf16 is."""
    prompts = random_prompts(16)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    exact = _run(tiny_dir, "reference", "float32", prompts, params)
    reference, fast = (_run(tiny_dir, b, "bfloat16", prompts, params) for b in BACKENDS)
    rounding = mean_prompt_logprob_gap(reference, exact)
    assert rounding > 0, "bf16 should have moved the reference's logprobs"
    gap = mean_prompt_logprob_gap(fast, exact)
    assert gap < 1.25 * rounding, (gap, rounding)


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
