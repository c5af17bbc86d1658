"""Llama 4 in the engine, on the CPU: its weights, reordered once loaded (q/k rows for RoPE,
the experts transposed), are reordered again when they are read again after a sleep that
dropped them, and not when a sleep kept them; a multimodal checkpoint's plan counts its text
model's bytes only."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tiny_models import make_tiny_model
from safetensors import safe_open

from ember import LLM, SamplingParams
from ember.api import Engine

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 128}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("Llama4ForConditionalGeneration", tmp_path_factory.mktemp("llama4"))


def tokens(engine: Engine) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 4000, (n,), generator=g).tolist()} for n in (6, 40)
    ]
    return [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, model="llama4")]


@pytest.mark.parametrize(
    "host_bytes", [None, 1 << 10], ids=["weights-kept-on-the-host", "weights-read-again"]
)
def test_a_woken_model_gives_the_tokens_it_gave_before_sleeping(model_dir, host_bytes):
    engine = Engine(sleep_host_memory_bytes=host_bytes)
    try:
        engine.add_model("llama4", str(model_dir), **OPTIONS)
        before = tokens(engine)
        engine.sleep("llama4")
        kept = engine.pool.statuses()[0].host_bytes
        assert kept == (engine.instance("llama4").weight_bytes if host_bytes is None else 0)
        engine.wake("llama4")
        assert tokens(engine) == before
    finally:
        engine.close()


def test_the_plan_counts_the_text_models_bytes_only(model_dir):
    llm = LLM(str(model_dir), **OPTIONS)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = [name for name in list(f.keys()) if name.startswith("language_model.")]
        text = [f.get_slice(name).get_shape() for name in names]
    assert llm.instance.plan.weight_bytes == sum(math.prod(shape) * 4 for shape in text)
