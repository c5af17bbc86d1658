"""FP8 Llama 4 on the CPU (the reference path), as `Llama4ForCausalLM` and as the text model of
a `Llama4ForConditionalGeneration` checkpoint: a float checkpoint quantized at load (its experts
stacked as transformers saves them, quantized from their transpose, a stacked tensor at a time;
the q/k rows reordered for ember's RoPE with their row scales) stays within a stated bound of
itself; an FP8 checkpoint as llm-compressor writes Llama 4 (each expert's projections one by
one, the router, vision tower and projector left in float) computes what its dequantized
weights compute; FP8 experts stored stacked are refused.

The bounds are those of the other mixtures of experts (tests/models/test_fp8_moe_weights.py,
which says why they are loose), on every position's logits of four prompts (1-70 tokens, past
the tiny models' 16-key chunks and the NoPE layer's temperature tuning) of the tiny random
models, whose logits have a standard deviation of about 1.6: mean difference at most 0.45
(measured 0.15-0.21), and at nine positions of ten a largest difference of at most 5.0.
"""

from __future__ import annotations

import collections

import pytest
import torch
from helpers.fp8_checkpoints import WEIGHTS, dequantized_checkpoint, fp8_checkpoint
from helpers.prefill import ember_prefill_logits
from helpers.tiny_models import make_tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ember import LLM
from ember.layers.fp8 import FP8_DTYPE, quantize_rows
from ember.weights.gguf_names import undo_rope_permutation
from ember.weights.parallel_load import load_extents

pytestmark = pytest.mark.slow

MEAN_BOUND, P90_BOUND = 0.45, 5.0
ARCHS = ["Llama4ForCausalLM", "Llama4ForConditionalGeneration"]
# The tiny models' first MoE layer (experts on every other layer, dense MLPs between).
MOE_LAYER = 1
# Where each architecture's text model's tensors are in its checkpoints.
PREFIX = {"Llama4ForCausalLM": "", "Llama4ForConditionalGeneration": "language_model."}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8-llama4")


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def tiny(root, arch):
    return make_tiny_model(arch, root / arch, seed=3, llama3_rope=True)


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


@pytest.fixture(scope="module")
def quantized_at_load(tiny):
    return load(tiny, quantization="fp8")


def assert_within_bounds(fp8: torch.Tensor, reference: torch.Tensor) -> None:
    difference = (fp8 - reference).abs()
    assert 0.02 < difference.mean() <= MEAN_BOUND  # above 0.02: the weights were rounded
    assert difference.amax(dim=1).quantile(0.9) <= P90_BOUND


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))


def test_quantized_at_load_every_projection_and_expert_is_fp8_but_the_router(
    quantized_at_load, prompts, float_logits
):
    layers = quantized_at_load.instance.model.layers
    block = layers[MOE_LAYER].mlp
    assert block.w13.dtype == block.w2.dtype == FP8_DTYPE
    assert block.gate.weight.dtype == torch.float32  # the router keeps the model's dtype
    assert block.shared_expert.gate_up_proj.weight.dtype == FP8_DTYPE
    assert layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE  # a dense MLP
    assert layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    assert_within_bounds(logits(quantized_at_load, prompts), float_logits)


def test_quantized_at_load_each_expert_is_its_transposes_rows_quantized(
    tiny, arch, quantized_at_load
):
    """transformers' [E, in, out] stacks: expert e's rows of w13 and w2 (and their scales) are
    those of its [out, in] weights quantized by rows, as a per-expert checkpoint's would be."""
    block = quantized_at_load.instance.model.layers[MOE_LAYER].mlp
    weights = load_file(str(tiny / WEIGHTS))
    stem = f"{PREFIX[arch]}model.layers.{MOE_LAYER}.feed_forward.experts"
    gate_up, down = weights[f"{stem}.gate_up_proj"], weights[f"{stem}.down_proj"]
    for expert in (0, 5):
        for stored, weight, scale in (
            (gate_up[expert], block.w13[expert], block.w13_scale[expert]),
            (down[expert], block.w2[expert], block.w2_scale[expert]),
        ):
            expected_weight, expected_scale = quantize_rows(stored.T)
            assert same_bytes(weight, expected_weight)
            assert torch.equal(scale, expected_scale[:, 0])


def test_quantized_at_load_q_and_k_rows_are_reordered_with_their_scales(
    tiny, arch, quantized_at_load
):
    """Each head's q and k rows go from adjacent RoPE pairs to halves after they are quantized:
    a row keeps its own scale."""
    cfg = quantized_at_load.instance.model_config
    qkv = quantized_at_load.instance.model.layers[0].self_attn.qkv_proj
    weights = load_file(str(tiny / WEIGHTS))
    attention = f"{PREFIX[arch]}model.layers.0.self_attn"
    q_weight, q_scale = quantize_rows(weights[f"{attention}.q_proj.weight"])
    k_weight, k_scale = quantize_rows(weights[f"{attention}.k_proj.weight"])
    q_rows, k_rows = slice(0, cfg.q_size), slice(cfg.q_size, cfg.q_size + cfg.kv_size)
    assert same_bytes(qkv.weight[q_rows], undo_rope_permutation(q_weight, cfg.num_heads))
    assert same_bytes(qkv.weight[k_rows], undo_rope_permutation(k_weight, cfg.num_kv_heads))
    assert torch.equal(
        qkv.weight_scale[q_rows], undo_rope_permutation(q_scale[:, 0], cfg.num_heads)
    )
    assert torch.equal(
        qkv.weight_scale[k_rows], undo_rope_permutation(k_scale[:, 0], cfg.num_kv_heads)
    )


def test_quantizing_at_load_lands_one_stacked_expert_tensor_at_a_time(tiny):
    """The loader's groups (`WeightPlacer.load_group`): each stacked expert tensor lands alone,
    the text model's other tensors a layer at a time (under the multimodal prefix too), so an
    MoE layer's largest float scratch is one stacked gate/up tensor, not the layer's."""
    llm = load(tiny, quantization="fp8")
    model, plan = llm.instance.model, llm.instance.plan
    placer = model.weight_placer()
    arena = {param.untyped_storage().data_ptr() for param in model.parameters()}
    scratch_bytes = collections.Counter()  # by group

    def target_for(extent):
        target = placer.target(extent.name, extent.shape, extent.dtype)
        if target is not None and target.untyped_storage().data_ptr() not in arena:
            scratch_bytes[placer.load_group(extent.name)] += target.numel() * target.element_size()
        return target

    load_extents(
        plan.checkpoint.tensor_extents(),
        target_for,
        torch.device("cpu"),
        group_of=lambda extent: placer.load_group(extent.name),
        after_group=placer.transform_landed,
    )
    placer.finish()
    cfg = llm.instance.model_config
    gate_up_bytes = cfg.num_experts * cfg.hidden_size * 2 * cfg.moe_intermediate_size * 4
    assert scratch_bytes[(MOE_LAYER, "gate_up_proj")] == gate_up_bytes
    assert scratch_bytes[(MOE_LAYER, "down_proj")] == gate_up_bytes // 2
    assert 0 < scratch_bytes[MOE_LAYER] < gate_up_bytes  # attention and the shared expert
    moe_layers = [layer for layer in range(cfg.num_layers) if cfg.is_moe_layer(layer)]
    stacked = {(layer, name) for layer in moe_layers for name in ("gate_up_proj", "down_proj")}
    assert set(scratch_bytes) == {*range(cfg.num_layers), *stacked}


@pytest.mark.parametrize("layout", ["compressed-tensors", "fp8"])
def test_an_fp8_checkpoint_computes_what_its_dequantized_weights_compute(
    root, tiny, arch, prompts, float_logits, layout
):
    path = fp8_checkpoint(tiny, root / f"{arch}-{layout}", layout)
    with safe_open(str(path / WEIGHTS), framework="pt") as reader:
        expert = f"{PREFIX[arch]}model.layers.{MOE_LAYER}.feed_forward.experts.3.up_proj"
        assert reader.get_tensor(f"{expert}.weight").dtype == FP8_DTYPE  # one tensor an expert
    llm = load(path)
    block = llm.instance.model.layers[MOE_LAYER].mlp
    assert block.w13.dtype == FP8_DTYPE and block.w13_scale.dtype == torch.float32
    assert block.gate.weight.dtype == torch.float32
    ours = logits(llm, prompts)
    dequantized = dequantized_checkpoint(path, root / f"{arch}-{layout}-dequantized")
    torch.testing.assert_close(ours, logits(load(dequantized), prompts), atol=1e-5, rtol=1e-5)
    assert_within_bounds(ours, float_logits)


def test_fp8_experts_stored_stacked_are_refused(root, tiny, arch):
    path = fp8_checkpoint(tiny, root / f"{arch}-stacked", "compressed-tensors")
    weights = load_file(str(path / WEIGHTS))
    stem = f"{PREFIX[arch]}model.layers.{MOE_LAYER}.feed_forward.experts"
    weights[f"{stem}.gate_up_proj"] = torch.zeros(8, 64, 64).to(FP8_DTYPE)
    save_file(weights, str(path / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="FP8 experts stored stacked are not supported"):
        load(path)


@pytest.mark.parametrize("layout", ["compressed-tensors", "fp8"])
def test_an_fp8_checkpoint_may_leave_its_attention_in_float(
    root, tiny, arch, prompts, float_logits, layout
):
    """llm-compressor's Llama 4 recipes leave every attention projection unquantized
    ("re:.*self_attn", "Llama4TextAttention"): they keep the model's dtype, the experts, shared
    expert and dense MLPs are FP8, and the model computes what its dequantized weights do."""
    path = fp8_checkpoint(
        tiny, root / f"{arch}-{layout}-float-attention", layout, float_attention=True
    )
    llm = load(path)
    model = llm.instance.model
    assert model.cfg.fp8.float_attention
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert not model.layers[0].self_attn.o_proj.fp8
    assert model.layers[MOE_LAYER].mlp.w2.dtype == FP8_DTYPE
    assert model.layers[0].mlp.gate_up_proj.weight.dtype == FP8_DTYPE
    ours = logits(llm, prompts)
    dequantized = dequantized_checkpoint(path, root / f"{arch}-{layout}-float-attention-deq")
    torch.testing.assert_close(ours, logits(load(dequantized), prompts), atol=1e-5, rtol=1e-5)
    assert_within_bounds(ours, float_logits)


def test_fp8_values_where_the_checkpoint_says_float_are_refused(root, tiny, arch):
    """An attention weight stored in FP8 though the config leaves attention unquantized."""
    path = fp8_checkpoint(
        tiny, root / f"{arch}-fp8-in-float", "compressed-tensors", float_attention=True
    )
    weights = load_file(str(path / WEIGHTS))
    name = f"{PREFIX[arch]}model.layers.0.self_attn.o_proj.weight"
    weights[name] = weights[name].to(FP8_DTYPE)
    save_file(weights, str(path / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="stored as float8_e4m3fn, but the checkpoint's"):
        load(path)
