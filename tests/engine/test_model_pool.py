"""Several models in one engine (`ember.engine.model_pool`), on the CPU: loading on demand under
one memory budget, sleep and wake with the same tokens as a model served alone, preempted
requests that resume, LRU eviction that spares pinned models, refusals, timeouts and failures
that leave the other models serving."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.pool_driver import by_model, drive, submit
from helpers.tiny_models import make_tiny_model
from safetensors.torch import load_file, save_file

from ember.api import Engine
from ember.config import MemoryConfig, engine_config
from ember.engine.model_pool import ModelPool, ModelState, ModelUnavailableError
from ember.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

KV_BYTES = 4 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 77], [21, 8, 90, 4], [1, 2, 3, 4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three tiny models of different architectures and weights."""
    root = tmp_path_factory.mktemp("pool-models")
    return {
        "llama": str(make_tiny_model("LlamaForCausalLM", root / "llama", seed=1)),
        "qwen": str(make_tiny_model("Qwen2ForCausalLM", root / "qwen", seed=2)),
        "mistral": str(make_tiny_model("MistralForCausalLM", root / "mistral", seed=3)),
    }


def options(**extra):
    return {"device": "cpu", "max_model_len": 128, "kv_cache_memory_bytes": KV_BYTES, **extra}


@pytest.fixture(scope="module")
def alone(models):
    """Each model's greedy tokens when it has an engine to itself."""
    expected = {}
    for name, path in models.items():
        engine = Engine()
        engine.add_model(name, path, **options())
        outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, model=name)
        expected[name] = [o.outputs[0].token_ids for o in outputs]
    return expected


def budget_for(engine: Engine, count: float, *names: str) -> None:
    """Give the engine room for ``count`` of the largest of ``names`` (set before any load)."""
    largest = max(engine.pool.footprint(name) for name in names)
    engine.pool.budget.total_bytes = int(largest * count)


def tokens(engine: Engine, name: str) -> list[list[int]]:
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, model=name)
    return [o.outputs[0].token_ids for o in outputs]


def check_blocks(engine: Engine) -> None:
    for slot in engine.pool.slots.values():
        if slot.instance is not None:
            slot.instance.scheduler.check_invariants()  # every block back in its pool


def test_a_budget_for_one_model_alternates_by_sleep_and_wake(models, alone):
    engine = Engine()
    for name in ("llama", "qwen"):
        engine.add_model(name, models[name], **options())
    budget_for(engine, 1.5, "llama", "qwen")
    for round_ in range(2):
        for name in ("llama", "qwen"):
            assert tokens(engine, name) == alone[name], (round_, name)
            other = "qwen" if name == "llama" else "llama"
            assert engine.state(name) == "loaded"
            assert engine.state(other) in ("sleeping", "unloaded")
            check_blocks(engine)
    statuses = {s.model: s for s in engine.pool.statuses()}
    assert statuses["llama"].transitions.sleeps >= 1 and statuses["llama"].transitions.wakes >= 1
    assert (
        statuses["qwen"].transitions.loads == 1
    )  # woken after its first sleep, never loaded twice
    assert engine.pool.budget.held_bytes <= engine.pool.budget.total_bytes


def test_a_sleeping_model_holds_its_weights_on_the_host_and_none_on_the_device(models):
    engine = Engine()
    engine.add_model("llama", models["llama"], **options())
    engine.load("llama")
    instance = engine.instance("llama")
    engine.sleep("llama")
    status = engine.pool.statuses()[0]
    assert status.state == "sleeping"
    assert status.host_bytes == instance.weight_bytes > 0
    assert status.device_bytes == 0  # no graphs on a CPU: nothing stays resident
    assert instance.weight_arena.buffer.untyped_storage().nbytes() == 0
    assert instance.kv_arena.buffer.untyped_storage().nbytes() == 0


def test_weights_dropped_when_host_memory_is_short_are_read_again(models, alone):
    engine = Engine(sleep_host_memory_bytes=1 << 20)  # less than one model's weights
    engine.add_model("llama", models["llama"], **options())
    engine.load("llama")
    engine.sleep("llama")
    assert engine.pool.statuses()[0].host_bytes == 0
    assert engine.pool.stash.allocated_bytes == 0
    engine.wake("llama")
    assert tokens(engine, "llama") == alone["llama"]


def test_a_request_running_when_its_model_sleeps_finishes_with_the_same_tokens(models, alone):
    pool = ModelPool(
        [engine_config(models["llama"], served_model_name="llama", **options())], MemoryConfig()
    )
    pool.min_residency_s = 0.0
    pool.command("llama", "load", lambda result: None)
    for i, prompt in enumerate(PROMPTS):
        pool.add_request("llama", f"r{i}", prompt, GREEDY)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}

    def collect(updates):
        for update in updates:
            got[update.request_id].extend(update.new_token_ids)

    for _ in range(4):
        collect(pool.step())
    assert all(0 < len(t) < GREEDY.max_tokens for t in got.values())
    results = []
    pool.command("llama", "sleep", results.append)
    assert results[0].status == 200 and pool.state("llama") is ModelState.SLEEPING
    collect(pool.step())  # what the sleep collected from the step in flight
    assert not pool.has_work()
    pool.command("llama", "wake", results.append)
    while pool.has_work():
        collect(pool.step())
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == alone["llama"]
    assert pool.instance("llama").scheduler.num_preemptions == len(PROMPTS)
    pool.instance("llama").scheduler.check_invariants()


def test_eviction_takes_the_least_recently_used_model_and_spares_a_pinned_one(models, alone):
    engine = Engine()
    engine.add_model("llama", models["llama"], **options(pinned=True))
    engine.add_model("qwen", models["qwen"], **options())
    engine.add_model("mistral", models["mistral"], **options())
    budget_for(engine, 2.5, "llama", "qwen", "mistral")
    tokens(engine, "llama")
    tokens(engine, "qwen")
    assert tokens(engine, "mistral") == alone["mistral"]
    # llama is the least recently used but pinned: qwen went to sleep.
    assert engine.state("llama") == "loaded"
    assert engine.state("qwen") == "sleeping"
    assert tokens(engine, "qwen") == alone["qwen"]
    assert engine.state("mistral") == "sleeping" and engine.state("llama") == "loaded"


def test_a_model_that_cannot_fit_is_refused_and_nothing_is_evicted(models):
    engine = Engine()
    engine.add_model("llama", models["llama"], **options(pinned=True))
    engine.add_model("qwen", models["qwen"], **options())
    budget_for(engine, 1.5, "llama", "qwen")
    engine.load("llama")
    with pytest.raises(RuntimeError, match="needs .* GiB"):
        engine.load("qwen")
    assert engine.state("llama") == "loaded" and engine.state("qwen") == "unloaded"
    with pytest.raises(RuntimeError, match="needs .* GiB"):
        engine.generate("hello", GREEDY, model="qwen")
    check_blocks(engine)


def test_a_model_that_fails_to_load_leaves_the_others_serving(models, alone, tmp_path):
    broken = make_tiny_model("LlamaForCausalLM", tmp_path / "broken", seed=4)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]  # the header is fine; the load fails
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    engine = Engine()
    engine.add_model("llama", models["llama"], **options())
    engine.add_model("broken", str(broken), **options())
    assert tokens(engine, "llama") == alone["llama"]
    with pytest.raises(ValueError, match="down_proj"):
        engine.load("broken")
    assert engine.state("broken") == "failed"
    assert "down_proj" in engine.pool.statuses()[1].error
    with pytest.raises(ModelUnavailableError, match="failed to load.*down_proj"):
        engine.generate("hello", GREEDY, model="broken")
    assert tokens(engine, "llama") == alone["llama"]
    assert engine.pool.budget.held_by("broken") == 0


def test_a_checkpoint_that_cannot_be_opened_fails_only_its_model(models, tmp_path):
    """In a server of several models (isolate_failure), a bad file fails its model alone."""
    broken = make_tiny_model("LlamaForCausalLM", tmp_path / "broken", seed=4)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    pool = ModelPool([], MemoryConfig())
    pool.add_model(engine_config(models["llama"], served_model_name="llama", **options()))
    pool.add_model(engine_config(str(broken), served_model_name="bad", **options()), True)
    assert pool.state("bad") is ModelState.FAILED and "truncated" in pool.slots["bad"].error
    assert [info.name for info in pool.infos()] == ["llama"]
    with pytest.raises(ModelUnavailableError, match="truncated"):
        pool.add_request("bad", "r0", PROMPTS[0], GREEDY)
    results = []
    pool.command("bad", "load", results.append)
    assert results[0].status == 503 and "truncated" in results[0].message
    pool.add_request("llama", "r1", PROMPTS[0], GREEDY)
    while pool.has_work():
        pool.step()
    assert pool.state("llama") is ModelState.LOADED


def test_an_idle_model_sleeps_after_its_timeout(models):
    engine = Engine()
    engine.add_model("llama", models["llama"], **options(idle_timeout_s=0.05))
    tokens(engine, "llama")
    assert engine.state("llama") == "loaded"
    time.sleep(0.1)
    engine.pool.poll()
    assert engine.state("llama") == "sleeping"


def test_requests_waiting_past_the_load_timeout_are_refused_with_retry_after(models):
    """A load that never finishes (held on the worker thread) times its requests out."""
    release = threading.Event()
    with ThreadPoolExecutor(1) as worker:
        pool = ModelPool(
            [engine_config(models["llama"], served_model_name="llama", **options())],
            MemoryConfig(),
            worker,
            load_timeout_s=0.05,
        )
        real_load = pool._load

        def held_load(slot):
            release.wait(10)
            return real_load(slot)

        pool._load = held_load
        pool.add_request("llama", "r0", PROMPTS[0], GREEDY)
        assert pool.state("llama") is ModelState.LOADING
        time.sleep(0.1)
        pool.poll()
        (rejection,) = pool.take_rejections()
        assert rejection.request_id == "r0" and rejection.retry_after_s is not None
        assert "not ready within" in rejection.message
        release.set()
        pool.wait_transitions()
        assert pool.state("llama") is ModelState.LOADED
        assert not pool.has_work()


def test_models_step_in_turn_while_another_loads_on_the_worker(models, alone):
    """The server's shape: loads on a worker thread; a loaded model keeps stepping while the
    other loads, and both finish with their own tokens."""
    with ThreadPoolExecutor(1) as worker:
        configs = [
            engine_config(models[name], served_model_name=name, **options())
            for name in ("llama", "qwen")
        ]
        pool = ModelPool(configs, MemoryConfig(), worker)
        pool.preload()
        pool.wait_transitions()
        pool.command("qwen", "unload", lambda result: None)
        pool.wait_transitions()
        got = submit(pool, ["llama", "qwen"], PROMPTS, GREEDY)
        steps_while_loading = drive(pool, got, loading="qwen")
        for name in ("llama", "qwen"):
            assert by_model(got, name, len(PROMPTS)) == alone[name]
        assert steps_while_loading > 0


def test_a_step_that_raises_ends_its_models_requests_and_the_others_keep_serving(models, alone):
    engine = Engine()
    for name in ("llama", "qwen"):
        engine.add_model(name, models[name], **options())
        engine.load(name)

    def broken_step():
        raise OverflowError("Python int too large to convert to C long")

    engine.pool.instance("llama").step = broken_step
    got = submit(engine.pool, ["llama", "qwen"], PROMPTS, GREEDY)
    drive(engine.pool, got, loading="qwen")
    rejections = engine.pool.take_rejections()
    assert {r.request_id for r in rejections} == {f"llama-{i}" for i in range(len(PROMPTS))}
    assert all("OverflowError" in r.message and r.retry_after_s for r in rejections)
    assert by_model(got, "qwen", len(PROMPTS)) == alone["qwen"]
    assert engine.state("llama") == "unloaded"
    assert engine.pool.budget.held_by("llama") == 0
    assert tokens(engine, "llama") == alone["llama"]  # loaded afresh by its next request
    check_blocks(engine)


def test_a_gguf_model_unloaded_then_asked_for_loads_again():
    from helpers.tiny_models import smollm2_gguf_path

    engine = Engine()
    engine.add_model("smol", str(smollm2_gguf_path()), **options(kv_cache_memory_bytes=16 << 20))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = engine.generate("The capital of France is", params, model="smol")[0].outputs[0]
    engine.unload("smol")
    again = engine.generate("The capital of France is", params, model="smol")[0].outputs[0]
    assert again.token_ids == first.token_ids and engine.state("smol") == "loaded"


def test_an_llm_gives_its_memory_back_when_closed_or_dropped(models):
    """The next engine of the process sizes its budget from what is free: a closed `LLM` has
    unloaded its model, and a dropped one leaves nothing that refers to its memory once
    collected (the budget collects before it measures)."""
    import gc
    import weakref

    from ember import LLM

    with LLM(models["llama"], **options()) as llm:
        pool = llm.engine.pool
        instance = llm.instance
    assert pool.slots[llm.model_name].instance is None
    assert pool.state(llm.model_name) is ModelState.UNLOADED
    with pytest.raises(AttributeError):
        llm.generate("Hi")  # closed: it serves nothing
    assert instance is not None
    dropped = LLM(models["qwen"], **options())
    weights = weakref.ref(dropped.instance.weight_arena)
    del dropped
    gc.collect()
    assert weights() is None


def test_the_model_with_the_fewest_requests_is_put_to_sleep_first(models):
    """Two busy models, room for two and a half: a third one's load would evict the less busy
    of them, not the least recently used; and neither before its time slice."""
    pool = ModelPool(
        [
            engine_config(models[name], served_model_name=name, **options())
            for name in ("llama", "qwen", "mistral")
        ],
        MemoryConfig(),
    )
    largest = max(pool.footprint(name) for name in pool.slots)
    pool.budget.total_bytes = int(largest * 2.5)
    long_run = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for name, count in (("llama", 3), ("qwen", 1)):
        pool.command(name, "load", lambda result: None)
        for i in range(count):
            pool.add_request(name, f"{name}{i}", PROMPTS[i], long_run)
    pool.step()
    pool.slots["llama"].last_used = 0.0  # llama is the least recently used, yet the busiest
    mistral = pool.slots["mistral"]
    need = pool.footprint("mistral")
    assert pool._victims(mistral, need, force=False) == (None, True)  # slices not yet over
    for name in ("llama", "qwen"):
        pool.slots[name].loaded_at -= pool.min_residency_s
    victims, possible = pool._victims(mistral, need, force=False)
    assert possible and [v.name for v in victims] == ["qwen"]
