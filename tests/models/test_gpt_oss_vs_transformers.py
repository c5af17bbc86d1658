"""gpt-oss matches Hugging Face transformers on a tiny random-weight model: YaRN RoPE, q/k/v/o
biases, attention sinks, a sliding window (16 keys, shorter than the prompts) on every other
layer, a biased router and biased experts with the clamped SwiGLU. Its experts load from
transformers' layout (transposed, gate and up interleaved) and from an MXFP4 checkpoint as
OpenAI publishes them, which transformers dequantizes as it loads and ember keeps packed (the
reference dequantizes each expert as it runs it): the same logits as experts dequantized at
load, a quarter of their bytes."""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from helpers.prefill import (
    check_greedy_tokens,
    check_prefill_logits,
    ember_prefill_logits,
    prompts_of_lengths,
)
from helpers.tiny_models import make_tiny_model
from safetensors.torch import load_file, save_file

from ember import LLM
from ember.bench.make_model import GPT_OSS_MXFP4, mxfp4_experts
from ember.config import engine_config
from ember.engine.model_instance import ModelInstance
from ember.engine.model_plan import plan_model
from ember.layers.mxfp4 import Mxfp4Weight

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

WINDOW = 16
FORMS = ("bf16-layout", "mxfp4")


def write_mxfp4_checkpoint(source, out):
    """``source``'s model with its expert weights as MXFP4 blocks and scales (quantized from
    its own), under ``quant_method: mxfp4``."""
    shutil.copytree(source, out)
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        stacked = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        tensors.update(mxfp4_experts(name, tensor) if stacked else {name: tensor})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = GPT_OSS_MXFP4
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss")
    plain = make_tiny_model("GptOssForCausalLM", root / "plain", seed=5, sliding_window=WINDOW)
    return {"bf16-layout": plain, "mxfp4": write_mxfp4_checkpoint(plain, root / "mxfp4")}


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module", params=FORMS)
def tiny(request, model_dirs):
    path = model_dirs[request.param]
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    return hf_model(path), llm


def test_layers_attend_and_route_as_transformers_builds_them(tiny):
    hf, llm = tiny
    layers = llm.instance.model.layers
    assert [layer.self_attn.window for layer in layers] == [
        WINDOW if kind == "sliding_attention" else None for kind in hf.config.layer_types
    ]
    for ours, theirs in zip(layers, hf.model.layers):
        assert torch.equal(ours.self_attn.sinks, theirs.self_attn.sinks)
        assert torch.equal(ours.self_attn.o_proj.bias, theirs.self_attn.o_proj.bias)
        assert torch.equal(ours.mlp.gate.bias, theirs.mlp.router.bias)
        assert ours.mlp.activation == "swiglu_oai"


def dense_experts(mlp) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13, w2)`` of a layer's experts in float32, packed ones dequantized."""
    return tuple(
        w.dequantize(torch.float32) if isinstance(w, Mxfp4Weight) else w for w in mlp.experts()
    )


def test_experts_load_into_the_ops_layout(tiny):
    """w13's gate rows are transformers' even gate_up columns, its up rows the odd ones (packed
    MXFP4 experts: their dequantized values)."""
    hf, llm = tiny
    ours, theirs = llm.instance.model.layers[1].mlp, hf.model.layers[1].mlp.experts
    inter = theirs.intermediate_size
    w13, w2 = dense_experts(ours)
    assert torch.equal(w13[:, :inter], theirs.gate_up_proj[..., 0::2].mT)
    assert torch.equal(w13[:, inter:], theirs.gate_up_proj[..., 1::2].mT)
    assert torch.equal(
        ours.b13,
        torch.cat([theirs.gate_up_proj_bias[:, 0::2], theirs.gate_up_proj_bias[:, 1::2]], 1),
    )
    assert torch.equal(w2, theirs.down_proj.mT)
    assert torch.equal(ours.b2, theirs.down_proj_bias)


def test_mxfp4_experts_stay_packed(model_dirs):
    """The checkpoint's blocks and scales are the model's parameters (gate_up's rows put in the
    ops' order), and the plan counts their bytes: half a byte a value and a byte a 32."""
    path = model_dirs["mxfp4"]
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64)
    mlp = llm.instance.model.layers[0].mlp
    assert llm.instance.model_config.mxfp4_experts and not hasattr(mlp, "w13")
    stored = load_file(path / "model.safetensors")
    blocks = stored["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert mlp.w13_blocks.dtype == torch.uint8 and torch.equal(mlp.w2_scales, stored[
        "model.layers.0.mlp.experts.down_proj_scales"
    ])  # fmt: skip
    assert torch.equal(mlp.w13_blocks, torch.cat([blocks[:, 0::2], blocks[:, 1::2]], 1))
    plain = LLM(str(model_dirs["bf16-layout"]), dtype="float32", device="cpu", max_model_len=64)
    cfg = llm.instance.model_config
    values = cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    packed = values // 2 + values // 32
    assert plain.instance.plan.weight_bytes - llm.instance.plan.weight_bytes == 4 * values - packed
    assert llm.instance.plan.weight_bytes <= llm.instance.weight_bytes  # the arena, aligned


def dequantizing(path, **options) -> SimpleNamespace:
    """``path``'s model with its MXFP4 experts dequantized at load (a plan whose config says
    so), as an `LLM`'s ``instance``."""
    config = engine_config(str(path), dtype="float32", device="cpu", **options)
    plan = plan_model(config)
    model_config = dataclasses.replace(plan.model_config, mxfp4_experts=False)
    plan = dataclasses.replace(plan, model_config=model_config)
    return SimpleNamespace(instance=ModelInstance(config, plan=plan))


def test_packed_experts_give_the_logits_of_experts_dequantized_at_load(model_dirs):
    path = model_dirs["mxfp4"]
    packed = LLM(str(path), dtype="float32", device="cpu", max_model_len=128)
    widened = dequantizing(path, max_model_len=128)
    assert widened.instance.model.layers[0].mlp.w13.dtype == torch.float32
    assert widened.instance.plan.weight_bytes > packed.instance.plan.weight_bytes
    prompts = prompts_of_lengths((1, 9, 40), 400)
    for ours, theirs in zip(*(ember_prefill_logits(m, prompts) for m in (packed, widened))):
        assert torch.equal(ours, theirs)


def test_prefill_logits_match_transformers(tiny):
    check_prefill_logits(*tiny, lengths=(1, 7, 33, 70))


def test_greedy_generation_in_chunks_matches_transformers(tiny):
    """Decodes past the window, from prompts shorter and longer than it."""
    check_greedy_tokens(*tiny, max_tokens=10, lengths=(3, 11, 26, 50, 5))


@pytest.mark.parametrize("form", FORMS)
def test_tensor_by_tensor_load_gives_the_parallel_loaders_weights(model_dirs, form):
    """`load_weights` (tensors one at a time, converted as they land) and the engine's
    parallel loader (a layer at a time) fill every parameter alike."""
    llm = LLM(str(model_dirs[form]), dtype="float32", device="cpu", max_model_len=64)
    model = llm.instance.model
    loaded = {name: param.clone() for name, param in model.named_parameters()}
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan") if param.is_floating_point() else 0xFF)
    model.load_weights(llm.instance.plan.checkpoint.iter_tensors(torch.float32))
    for name, param in model.named_parameters():
        assert torch.equal(param, loaded[name]), name


def test_an_mxfp4_weight_without_its_scales_is_refused(model_dirs, tmp_path):
    path = shutil.copytree(model_dirs["mxfp4"], tmp_path / "no-scales")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_scales"):
        LLM(str(path), dtype="float32", device="cpu", max_model_len=64)


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ("packed", r"lacks 1 tensors, e.g. \['layers.0.mlp.w2_scales'\]"),
        ("dequantized", "lacks 'model.layers.0.mlp.experts.down_proj_scales'"),
    ],
)
def test_a_tensor_missing_from_a_load_is_refused_by_the_loader(model_dirs, form, message):
    """Packed experts miss a parameter; experts dequantized at load, their conversion's
    input."""
    path = model_dirs["mxfp4"]
    if form == "packed":
        llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64)
    else:
        llm = dequantizing(path, max_model_len=64)
    tensors = llm.instance.plan.checkpoint.iter_tensors(torch.float32)
    without_scales = (
        item for item in tensors if not item[0].endswith("0.mlp.experts.down_proj_scales")
    )
    with pytest.raises(ValueError, match=message):
        llm.instance.model.load_weights(without_scales)


def test_packed_blocks_stored_as_another_dtype_are_refused(model_dirs, tmp_path):
    path = shutil.copytree(model_dirs["mxfp4"], tmp_path / "int16-blocks")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_blocks"
    tensors[name] = tensors[name].to(torch.int16)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_blocks.* is stored as int16, expected uint8"):
        LLM(str(path), dtype="float32", device="cpu", max_model_len=64)
