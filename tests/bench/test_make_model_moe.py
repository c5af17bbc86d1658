"""`ember bench make-model`'s mixture-of-experts presets: the real ones have their models'
published parameter counts (every expert counted), the tiny ones load and generate; as
transformers reads them too."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from ember import LLM, SamplingParams
from ember.bench.make_model import DENSE_PRESETS, PRESETS, hf_config, make_model
from ember.config import ModelConfig
from ember.models.registry import model_class

pytestmark = pytest.mark.slow


def parameter_count(preset: str) -> int:
    cfg = ModelConfig.from_hf_dict(hf_config(preset))
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, SimpleNamespace(defer_norms=False), None)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("preset", "billions"),
    # Qwen3-30B-A3B: 30.5 B. Mixtral-8x7B: 46.7 B, plus 0.14 B for the padded vocabulary.
    # gpt-oss-20b: 20.91 B, gpt-oss-120b: 116.83 B (OpenAI's model card).
    # Llama-4-Scout-17B-16E: 109 B, less its vision tower and projector (0.87 B).
    [
        ("qwen3-30b-a3b", 30.5),
        ("mixtral-8x7b", 46.7 + 0.14),
        ("gpt-oss-20b", 20.91),
        ("gpt-oss-120b", 116.83),
        ("llama-4-scout-17b-16e", 109 - 0.87),
    ],
)
def test_real_presets_have_their_models_parameter_counts(preset, billions):
    assert parameter_count(preset) / 1e9 == pytest.approx(billions, rel=5e-3)
    assert preset not in DENSE_PRESETS


@pytest.mark.parametrize(
    ("preset", "quantization"),
    [
        ("tiny-qwen3-moe", None),
        ("tiny-mixtral", None),
        ("tiny-gpt-oss", None),
        ("tiny-gpt-oss", "mxfp4"),
        ("tiny-llama4", None),
    ],
)
def test_tiny_presets_load_and_generate_as_transformers_does(preset, quantization, tmp_path):
    import transformers

    out = make_model(preset, tmp_path / preset, device="cpu", quantization=quantization)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == PRESETS[preset]["architectures"]
    llm = LLM(str(out), dtype="float32", max_model_len=128)
    prompt = [5, 9, 14, 3, 77, 21, 8]
    ours = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, experts_implementation="eager"
    )
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    assert ours[0].outputs[0].token_ids == theirs[0, len(prompt) :].tolist()


def test_mxfp4_is_for_gpt_oss_presets_only(tmp_path):
    with pytest.raises(ValueError, match="not made for this preset"):
        make_model("tiny-mixtral", tmp_path / "m", device="cpu", quantization="mxfp4")


@pytest.mark.parametrize(
    ("preset", "expert", "router"),
    [
        ("tiny-qwen3-moe", "mlp.experts.15.down_proj", "mlp.gate"),
        ("tiny-mixtral", "block_sparse_moe.experts.7.w3", "block_sparse_moe.gate"),
        # Llama 4: stacked in bf16, one tensor per expert in FP8 (llm-compressor's layout)
        ("tiny-llama4", "feed_forward.experts.7.up_proj", "feed_forward.router"),
    ],
)
def test_fp8_presets_write_each_experts_weights_in_fp8_and_load(preset, expert, router, tmp_path):
    from safetensors import safe_open

    from ember.layers.fp8 import FP8_DTYPE

    out = make_model(preset, tmp_path / preset, device="cpu", quantization="fp8")
    config = json.loads((out / "config.json").read_text())
    assert f"re:.*{router}$" in config["quantization_config"]["ignore"]
    (weights,) = out.glob("*.safetensors")
    with safe_open(str(weights), framework="pt") as reader:
        layer = "model.layers.1"
        assert reader.get_tensor(f"{layer}.{expert}.weight").dtype == FP8_DTYPE
        scale = reader.get_tensor(f"{layer}.{expert}.weight_scale")
        assert scale.dtype == torch.bfloat16 and scale.shape[1] == 1
        assert reader.get_tensor(f"{layer}.{router}.weight").dtype == torch.bfloat16
    llm = LLM(str(out), max_model_len=128)
    block = llm.instance.model.layers[1].mlp
    assert block.w13.dtype == FP8_DTYPE and block.gate.weight.dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert (
        len(llm.generate([{"prompt_token_ids": [5, 9, 14]}], params)[0].outputs[0].token_ids) == 4
    )


def test_llama4_scout_fp8_config_plans_fp8_weights_that_fit_an_h200(tmp_path):
    """`make-model --preset llama-4-scout-17b-16e --quantization fp8 --config-only`, served with
    --load-format dummy: its experts, shared experts and attention in FP8 (the router left in
    bf16), 110 GB of weights (bf16: 216 GB, two H200s) beside a 141 GB H200's KV cache."""
    from ember.config import engine_config
    from ember.engine.model_plan import plan_model

    paths = {
        form: make_model(
            "llama-4-scout-17b-16e", tmp_path / str(form), quantization=form, config_only=True
        )
        for form in (None, "fp8")
    }
    config = json.loads((paths["fp8"] / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["lm_head", "re:.*feed_forward.router$"]
    plans = {
        form: plan_model(
            engine_config(str(path), device="cpu", dtype="bfloat16", load_format="dummy")
        )
        for form, path in paths.items()
    }
    fp8 = plans["fp8"].model_config.fp8
    assert fp8.from_checkpoint and not fp8.float_attention
    assert plans[None].model_config.fp8 is None
    assert plans["fp8"].weight_bytes / 1e9 == pytest.approx(109.9, abs=0.1)
    assert plans["fp8"].weight_bytes < 0.8 * 141e9  # room for the KV cache on an H200
    assert plans[None].weight_bytes / 1e9 == pytest.approx(215.5, abs=0.1)
