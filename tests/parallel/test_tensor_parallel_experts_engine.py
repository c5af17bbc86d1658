"""Mixtures of experts through `LLM(..., tensor_parallel_size=N)` on the CPU (rank 0 here, the
others worker processes over gloo): greedy tokens equal the single-process model's for each
family, FP8 experts quantized at load and gpt-oss's packed MXFP4 checkpoint; `ember bench step
-tp 2` gives a split mixture of experts (dummy weights, each rank drawing its own slices) the
floors of one GPU's share, the chosen experts' too."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.mxfp4_checkpoints import mxfp4_checkpoint
from helpers.prefill import prompts_of_lengths
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.bench.make_model import make_model

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


def test_the_step_bench_gives_one_gpus_floors(tmp_path):
    """A rank holds every expert's half of the rows and half the KV heads: the decode row's
    bytes (all experts', and the chosen experts' floor) are one rank's."""
    from ember.bench.roofline import Ceilings
    from ember.bench.step_bench import StepBench, expected_chosen_experts
    from ember.config import engine_config
    from ember.engine.model_instance import ModelInstance
    from ember.engine.model_plan import plan_model

    path = make_model("tiny-qwen3-moe", tmp_path / "m", config_only=True)
    config = engine_config(
        str(path),
        device="cpu",
        load_format="dummy",
        num_gpu_blocks_override=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        tensor_parallel_size=2,
    )
    bench = StepBench(ModelInstance(config), Ceilings(1e11, 1e12))
    try:
        row = bench.decode(batch=2, context=32, steps=3, warmup=1)
        cfg = bench.inst.model_config
        moe_layers = sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_layers))
        whole_experts = moe_layers * cfg.num_experts * 3 * cfg.hidden_size
        whole_experts *= cfg.moe_intermediate_size * 4  # float32 on the CPU
        assert bench.expert_bytes == whole_experts // 2
        whole_kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
        assert bench.kv_bytes_per_token == whole_kv // 2
        chosen = expected_chosen_experts(cfg.num_experts, cfg.num_experts_per_tok, 2)
        assert row["expected_chosen_experts"] == pytest.approx(chosen)
        assert 0 < row["chosen_experts_roofline_ms"] < row["sequential_roofline_ms"]
        whole = dataclasses.replace(bench.inst.plan.config, tensor_parallel_size=1)
        assert bench.inst.plan.weight_bytes < 0.6 * plan_model(whole).weight_bytes
    finally:
        bench.inst.close()
