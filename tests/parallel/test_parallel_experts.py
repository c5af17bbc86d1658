"""Mixtures of experts split over gloo ranks (threads): every rank runs the whole router and its
rows of every expert, one all-reduce sums the block (a shared expert's rows with it), and rank 0
gets the logits of the model on one rank. For each family (a dense layer beside the experts,
stacked experts, biases and sinks, Llama 4's scaled input, shared expert, chunks and NoPE), and
each weight form: FP8 from a checkpoint and quantized at load (the down projections' row scales
are the whole rows' on every rank), gpt-oss's packed MXFP4 experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.fp8_checkpoints import fp8_checkpoint
from helpers.mxfp4_checkpoints import mxfp4_checkpoint
from helpers.prefill import prefill_inputs, prompts_of_lengths
from helpers.thread_ranks import RankShard, run_ranks
from helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow


def tiny(arch: str, **fields):
    return lambda root: make_tiny_model(arch, root / "m", **fields)


def fp8_experts(root: Path) -> Path:
    source = make_tiny_model("MixtralForCausalLM", root / "float")
    return fp8_checkpoint(source, root / "fp8", "compressed-tensors")


# name -> (checkpoint builder, engine options)
VARIANTS = {
    "qwen3-moe-dense-layer": (tiny("Qwen3MoeForCausalLM", mlp_only_layers=[0]), {}),
    "qwen3-moe-stacked": (tiny("Qwen3MoeForCausalLM", stacked_experts=True), {}),
    "mixtral": (tiny("MixtralForCausalLM"), {}),
    "gpt-oss": (tiny("GptOssForCausalLM"), {}),
    "llama4-multimodal": (tiny("Llama4ForConditionalGeneration"), {}),
    "mixtral-fp8-checkpoint": (fp8_experts, {}),
    "qwen3-moe-fp8-at-load": (tiny("Qwen3MoeForCausalLM"), {"quantization": "fp8"}),
    "llama-fp8-at-load": (tiny("LlamaForCausalLM"), {"quantization": "fp8"}),
    "gpt-oss-mxfp4": (
        lambda root: mxfp4_checkpoint(make_tiny_model("GptOssForCausalLM", root / "f"), root / "m"),
        {},
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def variant(request, tmp_path_factory):
    build, options = VARIANTS[request.param]
    return build(tmp_path_factory.mktemp(request.param)), options


def logits_at(path: Path, size: int, prompts, options) -> list:
    def run(group):
        ids, ctx = prefill_inputs(prompts, 16)
        return RankShard(path, group, **options).prefill_logits(ids, ctx)

    return run_ranks(size, run)


@pytest.mark.parametrize("size", [2, 4])
def test_rank_zero_gets_the_whole_models_logits(variant, size):
    path, options = variant
    prompts = prompts_of_lengths((1, 9, 40), 49152)
    (expected,) = logits_at(path, 1, prompts, options)
    got = logits_at(path, size, prompts, options)
    assert got[1:] == [None] * (size - 1)
    torch.testing.assert_close(got[0], expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[0].argmax(-1), expected.argmax(-1))
