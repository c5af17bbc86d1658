"""`--load-format dummy`: a folder holding only a config and tokenizer (`ember bench make-model
--config-only`) serves on random weights made on the device, seeded (the same seed the same
weights, another seed others, and again after a sleep that dropped them), FP8 ones quantized
as a checkpoint's are at load, MXFP4 experts (a gpt-oss config of quant_method mxfp4) packed as
make-model writes them; a folder without a config is refused, saying why."""

from __future__ import annotations

import pytest
import torch
from helpers.prefill import ember_prefill_logits

from ember import LLM, SamplingParams
from ember.bench.make_model import make_model
from ember.config import EngineConfig
from ember.layers.fp8 import FP8_DTYPE, dense_weight, held_fp8_weights, quantize_rows
from ember.layers.mxfp4 import Mxfp4Weight, held_mxfp4_weights
from ember.weights.mxfp4 import quantize_mxfp4

PROMPTS = [[5, 9, 14, 3, 77, 21, 8], [400, 12]]


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """The tiny presets' config and tokenizer files, no weight."""
    root = tmp_path_factory.mktemp("config-only")
    presets = {
        preset: make_model(preset, root / preset, config_only=True)
        for preset in ("tiny", "tiny-qwen3-moe", "tiny-llama4")
    }
    mxfp4 = make_model("tiny-gpt-oss", root / "mxfp4", config_only=True, quantization="mxfp4")
    fp8 = make_model("tiny-llama4", root / "llama4-fp8", config_only=True, quantization="fp8")
    return {**presets, "tiny-gpt-oss-mxfp4": mxfp4, "tiny-llama4-fp8": fp8}


def load(path, **options) -> LLM:
    return LLM(
        str(path),
        load_format="dummy",
        device="cpu",
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        **options,
    )


def parameters(llm: LLM) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in llm.instance.model.named_parameters()}


def test_make_model_config_only_writes_no_weight(config_only):
    files = {path.name for path in config_only["tiny"].iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= files
    assert not any(name.endswith(".safetensors") or "index" in name for name in files)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-moe"])
def test_a_folder_with_only_a_config_generates_from_dummy_weights(config_only, preset):
    llm = load(config_only[preset])
    model = llm.instance.model
    assert torch.equal(model.layers[1].input_layernorm, torch.ones_like(model.norm))
    assert torch.equal(model.norm, torch.ones_like(model.norm))
    down = model.layers[1].mlp.w2 if preset != "tiny" else model.layers[1].mlp.down_proj.weight
    assert 0.5 < down.std() * down.shape[-1] ** 0.5 < 2  # N(0, 1/fan_in)
    assert all(torch.isfinite(logits).all() for logits in ember_prefill_logits(llm, PROMPTS))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(len(out.outputs[0].token_ids) == 5 for out in outputs)


def test_the_seed_decides_the_weights(config_only):
    one, again, other = (parameters(load(config_only["tiny"], seed=s)) for s in (0, 0, 1))
    assert all(torch.equal(one[name], again[name]) for name in one)
    weights = [name for name in one if one[name].dim() == 2]
    assert weights and not any(torch.equal(one[name], other[name]) for name in weights)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-llama4"])
def test_fp8_dummy_weights_are_what_quantizing_them_gives(config_only, preset):
    """With --quantization fp8, every projection and expert is FP8 (Llama 4's shared expert
    too): each row quantizes to itself (its scale maps its largest value onto 448), and the
    model computes."""
    llm = load(config_only[preset], quantization="fp8")
    model = llm.instance.model
    held = held_fp8_weights(model)
    assert model.layers[1].mlp.w13.dtype == FP8_DTYPE and len(held) > 4
    for weight in held:
        rows = dense_weight(weight, torch.float32).reshape(-1, weight.weight.shape[-1])
        again, scale = quantize_rows(rows)
        assert torch.equal(
            again.view(torch.uint8), weight.weight.reshape(again.shape).view(torch.uint8)
        )
        torch.testing.assert_close(scale[:, 0], weight.scale.reshape(-1), rtol=1e-6, atol=0)
    assert model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert all(torch.isfinite(logits).all() for logits in ember_prefill_logits(llm, PROMPTS))


def test_an_fp8_llama4_config_draws_what_quantization_fp8_draws_and_generates(config_only):
    """make-model --quantization fp8 --config-only (llm-compressor's config: the benchmarks'
    Scout) and --quantization fp8 on the bf16 config: the same FP8 weights, the router in the
    model's dtype, generation on them."""
    from_config = load(config_only["tiny-llama4-fp8"])
    asked = load(config_only["tiny-llama4"], quantization="fp8")
    block = from_config.instance.model.layers[1].mlp
    assert block.w13.dtype == block.shared_expert.down_proj.weight.dtype == FP8_DTYPE
    assert block.gate.weight.dtype == torch.float32
    ours, theirs = parameters(from_config), parameters(asked)
    assert ours.keys() == theirs.keys()
    assert all(ours[name].view(torch.uint8).equal(theirs[name].view(torch.uint8)) for name in ours)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outputs = from_config.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(len(out.outputs[0].token_ids) == 5 for out in outputs)


def test_mxfp4_dummy_experts_are_packed_as_make_model_writes_them(config_only, tmp_path):
    """A gpt-oss config of quant_method mxfp4: every expert is packed, its values quantize to
    themselves, are N(0, 1/fan_in)-sized, the model computes, and the plan counts what
    a written MXFP4 checkpoint of the preset holds."""
    llm = load(config_only["tiny-gpt-oss-mxfp4"])
    held = held_mxfp4_weights(llm.instance.model)
    cfg = llm.instance.model_config
    assert cfg.mxfp4_experts and len(held) == 2 * cfg.num_layers
    for weight in held:
        assert weight.blocks.dtype == torch.uint8 and weight.blocks.any()
        values = weight.dequantize(torch.float32)
        assert 0.5 < values.std() * values.shape[-1] ** 0.5 < 2
        # The same values again (not always the same bytes: -0 comes back +0, and a group whose
        # largest value rounded down may take the smaller scale).
        again = Mxfp4Weight(*quantize_mxfp4(values))
        assert torch.equal(again.dequantize(torch.float32), values)
    assert all(torch.isfinite(logits).all() for logits in ember_prefill_logits(llm, PROMPTS))
    written = make_model("tiny-gpt-oss", tmp_path / "written", device="cpu", quantization="mxfp4")
    checkpoint = LLM(str(written), device="cpu", max_model_len=128, kv_cache_memory_bytes=8 << 20)
    assert llm.instance.plan.weight_bytes == checkpoint.instance.plan.weight_bytes


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt-oss-mxfp4"])
def test_a_sleep_that_drops_the_weights_makes_the_same_ones_on_wake(config_only, preset):
    llm = load(config_only[preset], seed=7)
    before = parameters(llm)
    llm.instance.sleep(None)  # no host stash: the weights are dropped
    llm.instance.wake(None)
    after = parameters(llm)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_output_rows_past_the_tokenizer_are_zero(tmp_path):
    """A vocabulary larger than the tokenizer's (the real presets' 128k beside SmolLM2's 49k):
    the head's rows past its ids are zero, so greedy decoding keeps to ids that decode."""
    path = make_model("tiny", tmp_path / "tiny", config_only=True)
    config = path / "config.json"
    config.write_text(config.read_text().replace('"vocab_size": 49152', '"vocab_size": 50000'))
    llm = load(path)
    head = llm.instance.model.embed_tokens.weight  # tied
    vocab = llm.instance.tokenizer.vocab_size
    assert vocab < 50000 and not head[vocab:].any() and head[:vocab].abs().sum(1).all()


def test_dummy_weights_need_a_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="dummy makes the weights from the model's config.json: "):
        load(tmp_path / "empty")


def test_an_unknown_load_format_is_refused():
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        EngineConfig(load_format="pt")
