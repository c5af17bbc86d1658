"""Several models on one GPU: sleep and wake keep a model's CUDA graphs (its memory comes back
at the same addresses), the tokens after a wake are those of the model served alone, and a model
loads on the worker thread (its graphs captured there) while another keeps stepping.

Skipped without a CUDA GPU; `tools/gpu_run.sh` runs these on the H200.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers.pool_driver import by_model, drive, submit
from helpers.tiny_models import make_tiny_model

from ember.api import Engine
from ember.config import MemoryConfig, engine_config
from ember.engine.model_pool import ModelPool
from ember.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 77, 21], [8, 90, 4], list(range(3, 60))]
OPTIONS = {"device": "cuda", "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-pool")
    return {
        "llama": str(make_tiny_model("LlamaForCausalLM", root / "llama", seed=21)),
        "qwen": str(make_tiny_model("Qwen2ForCausalLM", root / "qwen", seed=22)),
    }


def tokens(engine: Engine, name: str) -> list[list[int]]:
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, model=name)
    return [o.outputs[0].token_ids for o in outputs]


def test_sleep_and_wake_keep_the_graphs_and_the_tokens(models):
    engine = Engine()
    engine.add_model("llama", models["llama"], **OPTIONS)
    before = tokens(engine, "llama")
    instance = engine.instance("llama")
    assert engine.pool.arenas.keeps_addresses, "CUDA virtual memory management is unavailable"
    graphs = dict(instance.runner.graphs._graphs)
    weights_at = instance.weight_arena.buffer.data_ptr()
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep("llama")
    freed = torch.cuda.mem_get_info()[0] - free_awake
    assert freed >= instance.weight_bytes + instance.kv_cache_bytes
    engine.wake("llama")
    assert instance.weight_arena.buffer.data_ptr() == weights_at
    assert instance.runner.graphs._graphs == graphs  # the very same graphs: none recaptured
    assert tokens(engine, "llama") == before
    instance.scheduler.check_invariants()


def test_two_models_alternate_under_a_budget_for_one(models):
    alone = {}
    for name, path in models.items():
        engine = Engine()
        engine.add_model(name, path, **OPTIONS)
        alone[name] = tokens(engine, name)
    engine = Engine()
    for name, path in models.items():
        engine.add_model(name, path, **OPTIONS)
    largest = max(engine.pool.footprint(name) for name in models)
    engine.pool.budget.total_bytes = int(largest * 1.5)
    for _ in range(2):
        for name in models:
            assert tokens(engine, name) == alone[name]
    statuses = {s.model: s for s in engine.pool.statuses()}
    assert statuses["llama"].transitions.wakes >= 1 and statuses["qwen"].transitions.sleeps >= 1


def test_a_model_loads_on_the_worker_while_another_steps(models):
    with ThreadPoolExecutor(1) as worker:
        configs = [
            engine_config(path, served_model_name=name, **OPTIONS) for name, path in models.items()
        ]
        pool = ModelPool(configs[:1], MemoryConfig(), worker)
        pool.preload()
        pool.wait_transitions()
        pool.add_model(configs[1])
        expected = {}
        for name, path in models.items():
            engine = Engine()
            engine.add_model(name, path, **OPTIONS)
            expected[name] = tokens(engine, name)
        got = submit(pool, list(models), PROMPTS, GREEDY)
        steps_while_loading = drive(pool, got, loading="qwen")
        for name in models:
            assert by_model(got, name, len(PROMPTS)) == expected[name]
        assert pool.instance("qwen").runner.graphs.captured  # captured on the worker thread
        assert steps_while_loading > 0
