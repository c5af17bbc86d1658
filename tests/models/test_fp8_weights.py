"""FP8 weights on the CPU (the reference path, which dequantizes them): checkpoints in both
layouts users have compute what their dequantized weights compute, a float checkpoint quantized
at load stays within a stated bound of itself, norms fold in before quantizing, the weights take
one byte an element in the memory plan, and a checkpoint ember cannot load fails by name.

The bounds are on every position's logits of four prompts (1-70 tokens) of the tiny random
Llama, whose logits have a standard deviation of 1.6 (largest 9.5): mean difference at most 0.3,
largest at most 4.0 (the measured ones: bench/results/README.md, "FP8 accuracy"). FP8 rounds a
weight by up to 2**-4 of itself, and this model's weights are large (initializer range 0.2)
and its distributions nearly flat, so greedy tokens part early; the SmolLM2 test
(tests/test_default_model_fp8.py) measures a real model's perplexity.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math

import pytest
import torch
from helpers.fp8_checkpoints import (
    STATIC_INPUT_SCALE,
    WEIGHTS,
    dequantized_checkpoint,
    fp8_checkpoint,
)
from helpers.prefill import ember_prefill_logits
from helpers.tiny_models import make_tiny_model
from safetensors.torch import load_file, save_file

from ember import LLM
from ember.config import engine_config
from ember.engine.model_plan import plan_model
from ember.layers.fp8 import FP8_DTYPE, quantize_rows
from ember.layers.ops import reference_ops

MEAN_BOUND, MAX_BOUND = 0.3, 4.0
KV_SCALES = (0.5, 2.0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8-weights")


@pytest.fixture(scope="module")
def tiny_llama(root):
    return make_tiny_model("LlamaForCausalLM", root / "llama")


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (1, 7, 33, 70)]


def load(path, **options) -> LLM:
    return LLM(str(path), device="cpu", max_model_len=128, kv_cache_memory_bytes=8 << 20, **options)


def logits(llm: LLM, prompts) -> torch.Tensor:
    return torch.cat(ember_prefill_logits(llm, prompts))


@pytest.fixture(scope="module")
def float_logits(tiny_llama, prompts):
    return logits(load(tiny_llama), prompts)


def assert_within_bounds(fp8: torch.Tensor, reference: torch.Tensor) -> None:
    difference = (fp8 - reference).abs()
    assert 0.02 < difference.mean() <= MEAN_BOUND  # above 0.02: the weights were rounded
    assert difference.max() <= MAX_BOUND


@pytest.mark.parametrize("layout", ["compressed-tensors", "fp8"])
def test_an_fp8_checkpoint_computes_what_its_dequantized_weights_compute(
    root, tiny_llama, prompts, float_logits, layout
):
    path = fp8_checkpoint(tiny_llama, root / f"{layout}-a", layout)
    llm = load(path)
    model = llm.instance.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale.dtype == torch.float32
    assert model.embed_tokens.weight.dtype == model.lm_head.dtype == torch.float32
    assert not model.defers_norms  # never folded into weights already rounded to FP8
    ours = logits(llm, prompts)
    reference = logits(load(dequantized_checkpoint(path, root / f"{layout}-dequantized")), prompts)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    assert_within_bounds(ours, float_logits)


def test_per_tensor_scales_keep_each_fused_shards_own(root, tiny_llama):
    """quant_method fp8: q, k and v (gate and up) each have one scale; the fused projection's
    row scales hold each shard's over its rows. The static input scales are read and checked,
    and the KV-cache scales land in their layers' attention."""
    path = fp8_checkpoint(tiny_llama, root / "fp8-b", "fp8", kv_scales=KV_SCALES)
    llm = load(path, kv_cache_dtype="fp8")
    model, cfg = llm.instance.model, llm.instance.model_config
    weights = load_file(str(path / WEIGHTS))
    assert weights["model.layers.0.self_attn.q_proj.input_scale"] == STATIC_INPUT_SCALE
    scales = (
        model.layers[1]
        .self_attn.qkv_proj.weight_scale.detach()
        .split([cfg.q_size, cfg.kv_size, cfg.kv_size])
    )
    for shard, name in zip(scales, ("q_proj", "k_proj", "v_proj"), strict=True):
        expected = weights[f"model.layers.1.self_attn.{name}.weight_scale"]
        assert torch.equal(shard, expected.expand(shard.shape))
    assert len({float(s[0]) for s in scales}) == 3
    for layer in model.layers:
        assert (layer.self_attn.k_scale, layer.self_attn.v_scale) == KV_SCALES
    out = llm.generate([{"prompt_token_ids": [5, 9, 14]}])[0].outputs[0]
    assert out.token_ids  # an FP8 cache read with these scales


def test_quantized_at_load_each_row_gets_its_own_scale(root, tiny_llama, prompts, float_logits):
    llm = load(tiny_llama, quantization="fp8")
    model, cfg = llm.instance.model, llm.instance.model_config
    assert cfg.fp8 is not None and not cfg.fp8.from_checkpoint
    source = load_file(str(tiny_llama / WEIGHTS))["model.layers.1.mlp.up_proj.weight"]
    expected_weight, expected_scale = quantize_rows(source)
    gate_up = model.layers[1].mlp.gate_up_proj
    up_rows = slice(cfg.intermediate_size, None)
    assert torch.equal(gate_up.weight[up_rows].view(torch.uint8), expected_weight.view(torch.uint8))
    assert torch.equal(gate_up.weight_scale[up_rows], expected_scale[:, 0])
    assert_within_bounds(logits(llm, prompts), float_logits)


def test_norms_fold_into_the_float_weights_before_they_are_quantized(
    tiny_llama, prompts, float_logits, monkeypatch
):
    """Deferring the norms (the Triton path's default), each decoder norm's weight is folded
    into its projection's float weight, then quantized once: the FP8 q/k/v is the
    quantization of ``W diag(g)``. The deferred form and the plain one agree on those weights,
    and both stay within the bound of the float model."""
    instance_module = importlib.import_module("ember.engine.model_instance")
    monkeypatch.setattr(instance_module, "select_ops", lambda *a, **k: reference_ops(True))
    llm = load(tiny_llama, quantization="fp8")
    model = llm.instance.model
    assert model.defers_norms
    layer = model.layers[0]
    assert torch.equal(layer.input_layernorm, torch.ones_like(layer.input_layernorm))
    weights = load_file(str(tiny_llama / WEIGHTS))
    folded = (
        weights["model.layers.0.self_attn.q_proj.weight"]
        * (weights["model.layers.0.input_layernorm.weight"][None, :])
    )
    expected_weight, expected_scale = quantize_rows(folded)
    q_rows = slice(0, llm.instance.model_config.q_size)
    qkv = layer.self_attn.qkv_proj
    assert torch.equal(qkv.weight[q_rows].view(torch.uint8), expected_weight.view(torch.uint8))
    assert torch.equal(qkv.weight_scale[q_rows], expected_scale[:, 0])
    deferred = logits(llm, prompts)
    plain_ops = dataclasses.replace(reference_ops(True), defer_norms_max_rows=0)
    monkeypatch.setattr(instance_module, "select_ops", lambda *a, **k: plain_ops)
    plain = logits(load(tiny_llama, quantization="fp8"), prompts)
    torch.testing.assert_close(deferred, plain, atol=1e-4, rtol=1e-4)
    assert_within_bounds(deferred, float_logits)


def test_the_memory_plan_counts_an_fp8_weight_at_one_byte_an_element(tiny_llama):
    """In bf16 (the GPU's dtype): embeddings, head and norms at two bytes, each projection's
    weight at one and its row scales at four."""
    plans = {
        quantization: plan_model(
            engine_config(str(tiny_llama), device="cpu", dtype="bfloat16", quantization=q)
        )
        for quantization, q in (("bf16", None), ("fp8", "fp8"))
    }
    cfg = plans["fp8"].model_config
    linear = cfg.num_layers * (
        cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size)
        + cfg.q_size * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    rows = cfg.num_layers * (
        cfg.q_size + 2 * cfg.kv_size + cfg.hidden_size + 2 * cfg.intermediate_size + cfg.hidden_size
    )
    others = plans["bf16"].weight_bytes - 2 * linear
    assert plans["fp8"].weight_bytes == others + linear + 4 * rows
    instance = load(tiny_llama, dtype="bfloat16", quantization="fp8").instance
    assert plans["fp8"].weight_bytes <= instance.weight_bytes < plans["bf16"].weight_bytes


# --- what ember cannot load: refused by name --------------------------------------------------


def edit(path, change_weights=None, **config_changes):
    if change_weights is not None:
        weights = load_file(str(path / WEIGHTS))
        change_weights(weights)
        save_file(weights, str(path / WEIGHTS), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(config_changes)
    (path / "config.json").write_text(json.dumps(config))


def test_block_wise_scales_are_refused_before_loading(root, tiny_llama):
    path = fp8_checkpoint(tiny_llama, root / "block", "fp8")
    edit(path, weight_block_size=[128, 128])
    with pytest.raises(ValueError, match="block-wise FP8 scales"):
        load(path)


def test_a_float_weight_in_an_fp8_checkpoint_is_named(root, tiny_llama):
    path = fp8_checkpoint(tiny_llama, root / "bf16-weight", "compressed-tensors")
    name = "model.layers.1.mlp.down_proj.weight"

    def unquantize(weights):
        weights[name] = weights[name].to(torch.bfloat16)

    edit(path, unquantize)
    with pytest.raises(ValueError, match=f"tensor '{name}' is stored as bfloat16"):
        load(path)


def test_a_missing_scale_is_named_before_anything_is_allocated(root, tiny_llama):
    path = fp8_checkpoint(tiny_llama, root / "no-scale", "compressed-tensors")
    name = "model.layers.0.self_attn.k_proj.weight_scale"
    edit(path, lambda weights: weights.pop(name))
    with pytest.raises(ValueError, match=f"no tensor '{name}'"):
        load(path)


def test_a_nan_in_an_fp8_weight_is_named(root, tiny_llama):
    path = fp8_checkpoint(tiny_llama, root / "nan", "compressed-tensors")
    name = "model.layers.0.mlp.gate_proj.weight"

    def damage(weights):
        weights[name].view(torch.uint8).view(-1)[11] = 0x7F  # e4m3fn's NaN

    edit(path, damage)
    with pytest.raises(ValueError, match=f"'{name}' holds NaN or infinite values"):
        load(path)


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf])
def test_a_kv_scale_that_is_not_a_positive_number_is_named(root, tiny_llama, value):
    path = fp8_checkpoint(tiny_llama, root / f"kv-{value}", "fp8", kv_scales=KV_SCALES)
    name = "model.layers.1.self_attn.v_scale"
    edit(path, lambda weights: weights.update({name: torch.tensor(value)}))
    with pytest.raises(ValueError, match=f"'{name}'"):
        load(path)
