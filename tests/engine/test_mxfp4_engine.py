"""A gpt-oss model with packed MXFP4 experts in the engine's lifecycle on the CPU: it sleeps and
wakes with the same tokens (its packed weights kept on the host, or dropped and read again from
the checkpoint, gate/up's rows put in order again), and its plan and the model pool count its
packed bytes."""

from __future__ import annotations

import pytest
import torch

from ember import SamplingParams
from ember.api import Engine
from ember.bench.make_model import make_model

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 77], [21, 8, 90, 4, 600, 31]]
OPTIONS = {"device": "cpu", "max_model_len": 128, "kv_cache_memory_bytes": 4 << 20}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4-engine")
    return {
        form: make_model("tiny-gpt-oss", root / form, device="cpu", quantization=quantization)
        for form, quantization in (("bf16", None), ("mxfp4", "mxfp4"))
    }


def tokens(engine: Engine, name: str) -> list[list[int]]:
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, model=name)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("host_bytes", [None, 1 << 10], ids=["stashed", "dropped"])
def test_packed_experts_wake_with_the_same_tokens(checkpoints, host_bytes):
    engine = Engine(sleep_host_memory_bytes=host_bytes)
    try:
        engine.add_model("oss", str(checkpoints["mxfp4"]), **OPTIONS)
        before = tokens(engine, "oss")
        mlp = engine.instance("oss").model.layers[0].mlp
        assert mlp.w13_blocks.dtype == torch.uint8
        packed = {name: p.clone() for name, p in engine.instance("oss").model.named_parameters()}
        weight_bytes = engine.instance("oss").weight_bytes
        engine.sleep("oss")
        assert engine.pool.statuses()[0].host_bytes == (0 if host_bytes else weight_bytes)
        engine.wake("oss")
        woken = dict(engine.instance("oss").model.named_parameters())
        assert all(torch.equal(packed[name], woken[name]) for name in packed)
        assert tokens(engine, "oss") == before
    finally:
        engine.close()


def test_the_plan_and_the_pool_count_packed_experts_bytes(checkpoints):
    engine = Engine()
    try:
        for form, path in checkpoints.items():
            engine.add_model(form, str(path), **OPTIONS)
        plain, packed = engine.instance("bf16"), engine.instance("mxfp4")
        cfg = packed.model_config
        values = cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        saved = plain.plan.weight_bytes - packed.plan.weight_bytes
        # On the CPU the model runs in float32: four bytes a value against 17/32 of one.
        assert saved == 4 * values - values * 17 // 32
        statuses = {s.model: s for s in engine.pool.statuses()}
        assert statuses["mxfp4"].weight_bytes < statuses["bf16"].weight_bytes
    finally:
        engine.close()
