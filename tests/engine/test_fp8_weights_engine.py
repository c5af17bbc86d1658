"""FP8-weight models in the engine's lifecycle on the CPU: a model quantized at load sleeps and
wakes with the same tokens (its weights kept on the host, or dropped and quantized again from
the checkpoint), an FP8 checkpoint's KV-cache scales survive a reload, the memory budget charges
an FP8 model its smaller weights, and a quantization outside the choices is refused before
anything loads."""

from __future__ import annotations

import pytest
import torch
from helpers.fp8_checkpoints import fp8_checkpoint
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.api import Engine
from ember.config import engine_config

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 77], [21, 8, 90, 4, 600, 31]]
OPTIONS = {"device": "cpu", "max_model_len": 128, "kv_cache_memory_bytes": 4 << 20}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("fp8-engine") / "llama")


def tokens(engine: Engine, name: str) -> list[list[int]]:
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, model=name)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("host_bytes", [None, 1 << 10], ids=["stashed", "dropped"])
def test_a_model_quantized_at_load_wakes_with_the_same_tokens(tiny_llama, host_bytes):
    engine = Engine(sleep_host_memory_bytes=host_bytes)
    try:
        engine.add_model("fp8", str(tiny_llama), quantization="fp8", **OPTIONS)
        before = tokens(engine, "fp8")
        weight = engine.instance("fp8").model.layers[0].mlp.down_proj.weight
        assert weight.dtype == torch.float8_e4m3fn
        weight_bytes = engine.instance("fp8").weight_bytes
        engine.sleep("fp8")
        assert engine.pool.statuses()[0].host_bytes == (0 if host_bytes else weight_bytes)
        engine.wake("fp8")
        assert tokens(engine, "fp8") == before
        engine.instance("fp8").scheduler.check_invariants()
    finally:
        engine.close()


def test_an_fp8_checkpoints_kv_scales_are_set_again_when_its_weights_are_read_again(
    tiny_llama, tmp_path
):
    path = fp8_checkpoint(tiny_llama, tmp_path / "fp8", "fp8", kv_scales=(0.5, 2.0))
    engine = Engine(sleep_host_memory_bytes=1 << 10)  # too little: the weights are dropped
    try:
        engine.add_model("fp8", str(path), kv_cache_dtype="fp8", **OPTIONS)
        before = tokens(engine, "fp8")
        attention = engine.instance("fp8").model.layers[1].self_attn
        attention.k_scale = attention.v_scale = 1.0  # what a reload must put back
        engine.sleep("fp8")
        engine.wake("fp8")
        assert (attention.k_scale, attention.v_scale) == (0.5, 2.0)
        assert tokens(engine, "fp8") == before
    finally:
        engine.close()


def test_the_budget_charges_an_fp8_model_its_smaller_weights(tiny_llama):
    engine = Engine()
    try:
        engine.add_model("plain", str(tiny_llama), dtype="bfloat16", **OPTIONS)
        engine.add_model("fp8", str(tiny_llama), dtype="bfloat16", quantization="fp8", **OPTIONS)
        plain, fp8 = (engine.pool.slots[name].plan for name in ("plain", "fp8"))
        saved = plain.weight_bytes - fp8.weight_bytes
        assert saved > 0
        assert engine.pool.footprint("plain") - engine.pool.footprint("fp8") == saved
        engine.load("fp8")
        assert engine.instance("fp8").weight_bytes < plain.weight_bytes
    finally:
        engine.close()


@pytest.mark.parametrize("value", ["int8", "awq", "FP8"])
def test_a_quantization_outside_the_choices_is_refused_before_loading(value, tmp_path):
    message = f"quantization must be one of fp8 \\(or left out\\), not '{value}'"
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "no-model"), device="cpu", quantization=value)
    with pytest.raises(ValueError, match=message):
        engine_config("m", quantization=value)
