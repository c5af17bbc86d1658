"""Mixtures of experts through `LLM(..., tensor_parallel_size=N)` on the CPU (rank 0 here, the
others worker processes over gloo): greedy tokens equal the single-process model's for each
family, FP8 experts quantized at load and gpt-oss's packed MXFP4 checkpoint."""

from __future__ import annotations

import pytest
from helpers.mxfp4_checkpoints import mxfp4_checkpoint
from helpers.prefill import prompts_of_lengths
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tiny(arch: str):
    return lambda root: make_tiny_model(arch, root / "m")


def gpt_oss_mxfp4(root):
    return mxfp4_checkpoint(make_tiny_model("GptOssForCausalLM", root / "float"), root / "m")


# name -> (checkpoint builder, engine options, the sizes compared with one process)
VARIANTS = {
    "qwen3-moe": (tiny("Qwen3MoeForCausalLM"), {}, (2, 4)),
    "mixtral": (tiny("MixtralForCausalLM"), {}, (2,)),
    "llama4": (tiny("Llama4ForCausalLM"), {}, (2,)),
    "qwen3-moe-fp8-at-load": (tiny("Qwen3MoeForCausalLM"), {"quantization": "fp8"}, (2,)),
    "gpt-oss-mxfp4": (gpt_oss_mxfp4, {}, (2,)),
}


def load(path, size: int, **options) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_model_len=128,
        tensor_parallel_size=size,
        **options,
    )


def tokens(llm: LLM, prompts) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_equal_one_process(variant, tmp_path):
    build, options, sizes = VARIANTS[variant]
    path = build(tmp_path)
    prompts = prompts_of_lengths((3, 17, 40), 49152, seed=5)
    with load(path, 1, **options) as single:
        expected = tokens(single, prompts)
    for size in sizes:
        with load(path, size, **options) as split:
            assert tokens(split, prompts) == expected, size
            assert split.instance.bytes_read_by_rank.keys() == set(range(size))
