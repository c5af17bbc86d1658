"""FP8 experts on the CPU (the reference path, which dequantizes each expert as it loops): an FP8
Qwen3-MoE or Mixtral checkpoint, as llm-compressor writes one (each expert's projections in FP8
beside their scales, the routers left in float), computes what its dequantized weights compute;
a float checkpoint quantized at load, its experts stored one by one or stacked, stays within a
stated bound of itself; the experts take one byte an element in the memory plan.

The bounds are on every position's logits of four prompts (1-70 tokens) of the tiny random
models, whose logits have a standard deviation of about 1.6 (largest about 9): mean difference
at most 0.45, and at nine positions of ten a largest difference of at most 5.0 (measured over
three seeds: 0.18-0.35 and 1.7-4.0). Not the largest over every position: FP8 moves the
routers' inputs too, and a token near a tie between two experts takes the other expert, whose
output moves its logits by their whole range (measured up to 10.6). The dense models' bounds
(tests/models/test_fp8_weights.py) say why these tiny models' are loose.
"""

from __future__ import annotations

import pytest
import torch
from helpers.fp8_checkpoints import WEIGHTS, dequantized_checkpoint, fp8_checkpoint
from helpers.prefill import ember_prefill_logits
from helpers.tiny_models import make_tiny_model
from safetensors.torch import load_file

from ember import LLM
from ember.config import engine_config
from ember.engine.model_plan import plan_model
from ember.layers.fp8 import FP8_DTYPE, quantize_rows
from ember.models.moe import SparseMoeBlock

pytestmark = pytest.mark.slow

MEAN_BOUND, P90_BOUND = 0.45, 5.0
MODELS = {
    "qwen3-moe": ("Qwen3MoeForCausalLM", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "mixtral": ("MixtralForCausalLM", {}),
}
# Each family's expert projections in its checkpoints, as (gate, up, down).
EXPERT_NAMES = {
    "qwen3-moe": (
        "mlp.experts.{e}.gate_proj",
        "mlp.experts.{e}.up_proj",
        "mlp.experts.{e}.down_proj",
    ),
    "mixtral": (
        "block_sparse_moe.experts.{e}.w1",
        "block_sparse_moe.experts.{e}.w3",
        "block_sparse_moe.experts.{e}.w2",
    ),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8-moe")


@pytest.fixture(scope="module", params=list(MODELS))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def tiny(root, family):
    arch, overrides = MODELS[family]
    return make_tiny_model(arch, root / family, seed=3, **overrides)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (1, 7, 33, 70)]


def load(path, **options) -> LLM:
    return LLM(str(path), device="cpu", max_model_len=128, kv_cache_memory_bytes=8 << 20, **options)


def logits(llm: LLM, prompts) -> torch.Tensor:
    return torch.cat(ember_prefill_logits(llm, prompts))


@pytest.fixture(scope="module")
def float_logits(tiny, prompts):
    return logits(load(tiny), prompts)


def assert_within_bounds(fp8: torch.Tensor, reference: torch.Tensor) -> None:
    difference = (fp8 - reference).abs()
    assert 0.02 < difference.mean() <= MEAN_BOUND  # above 0.02: the weights were rounded
    assert difference.amax(dim=1).quantile(0.9) <= P90_BOUND


def sparse_block(llm: LLM) -> SparseMoeBlock:
    return llm.instance.model.layers[0].mlp


@pytest.mark.parametrize("layout", ["compressed-tensors", "fp8"])
def test_an_fp8_checkpoint_computes_what_its_dequantized_weights_compute(
    root, tiny, family, prompts, float_logits, layout
):
    path = fp8_checkpoint(tiny, root / f"{family}-{layout}", layout)
    llm = load(path)
    block = sparse_block(llm)
    assert block.w13.dtype == block.w2.dtype == FP8_DTYPE
    assert block.w13_scale.dtype == block.w2_scale.dtype == torch.float32
    assert block.gate.weight.dtype == torch.float32  # the router keeps the model's dtype
    ours = logits(llm, prompts)
    dequantized = dequantized_checkpoint(path, root / f"{family}-{layout}-dequantized")
    torch.testing.assert_close(ours, logits(load(dequantized), prompts), atol=1e-5, rtol=1e-5)
    assert_within_bounds(ours, float_logits)


def test_per_tensor_scales_keep_each_experts_own(root, tiny, family):
    """quant_method fp8: each expert's gate, up and down have one scale each, spread over their
    own rows of the stacked scales."""
    path = fp8_checkpoint(tiny, root / f"{family}-per-tensor", "fp8")
    block = sparse_block(load(path))
    weights = load_file(str(path / WEIGHTS))
    inter = block.w2.shape[-1]
    gate, up, down = EXPERT_NAMES[family]
    for expert in (0, 5):
        stored = [
            weights[f"model.layers.0.{name.format(e=expert)}.weight_scale"]
            for name in (gate, up, down)
        ]
        assert torch.equal(block.w13_scale[expert, :inter], stored[0].expand(inter))
        assert torch.equal(block.w13_scale[expert, inter:], stored[1].expand(inter))
        assert torch.equal(block.w2_scale[expert], stored[2].expand(block.w2.shape[1]))
    assert len(set(block.w13_scale.detach()[:, 0].tolist())) > 1


def test_quantized_at_load_each_experts_rows_get_their_own_scales(
    tiny, family, prompts, float_logits
):
    llm = load(tiny, quantization="fp8")
    block = sparse_block(llm)
    assert block.gate.weight.dtype == torch.float32
    weights = load_file(str(tiny / WEIGHTS))
    inter = block.w2.shape[-1]
    up_name = EXPERT_NAMES[family][1].format(e=3)
    expected_weight, expected_scale = quantize_rows(weights[f"model.layers.0.{up_name}.weight"])
    up_rows = block.w13[3, inter:]
    assert torch.equal(up_rows.view(torch.uint8), expected_weight.view(torch.uint8))
    assert torch.equal(block.w13_scale[3, inter:], expected_scale[:, 0])
    assert_within_bounds(logits(llm, prompts), float_logits)


def test_stacked_experts_quantize_at_load_as_per_expert_ones(root, prompts):
    """transformers 5's stacked form quantizes to the same FP8 experts as the per-expert form."""
    arch, overrides = MODELS["mixtral"]
    per_expert = make_tiny_model(arch, root / "mixtral-per-expert", seed=4, **overrides)
    stacked = make_tiny_model(
        arch, root / "mixtral-stacked", seed=4, stacked_experts=True, **overrides
    )
    one, other = (load(path, quantization="fp8") for path in (per_expert, stacked))
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        ours, theirs = (getattr(sparse_block(llm), name) for llm in (one, other))
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), name
    torch.testing.assert_close(logits(one, prompts), logits(other, prompts))


def test_the_memory_plan_counts_fp8_experts_at_one_byte_an_element(tiny):
    """In bf16: each expert's weights at one byte an element, their row scales at four."""
    plans = {
        name: plan_model(
            engine_config(str(tiny), device="cpu", dtype="bfloat16", quantization=quantization)
        )
        for name, quantization in (("bf16", None), ("fp8", "fp8"))
    }
    cfg = plans["fp8"].model_config
    sparse = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    expert_elements = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts
    expert_rows = (2 * cfg.moe_intermediate_size + cfg.hidden_size) * cfg.num_experts
    saved = plans["bf16"].weight_bytes - plans["fp8"].weight_bytes
    # The experts' saving, and at most the attention's and the dense MLPs' besides.
    assert saved > sparse * (expert_elements - 4 * expert_rows)
    instance = load(tiny, dtype="bfloat16", quantization="fp8").instance
    assert plans["fp8"].weight_bytes <= instance.weight_bytes < plans["bf16"].weight_bytes
