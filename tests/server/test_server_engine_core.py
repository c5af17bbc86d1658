"""The engine loop and its IPC, without a model: fake instances, in a pool of loaded models,
that emit one token per step."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import msgspec
import zmq

from ember.engine.engine_core import EngineCore
from ember.engine.ipc import (
    AbortRequests,
    AddRequest,
    EngineChannel,
    FrontendMessage,
    IpcAddresses,
    Shutdown,
    StepOutputs,
    UnreadableRequest,
)
from ember.engine.kv_cache_manager import PrefixCacheStats
from ember.engine.model_instance import LoadReport
from ember.engine.model_pool import ModelState, UnknownModelError
from ember.engine.scheduler import StepCounts
from ember.engine.step_types import RequestUpdate
from ember.sampling_params import SamplingParams


class FakeInstance:
    """Every request gets token 7 per step until it has `max_tokens` of them."""

    def __init__(self, vocab_size: int = 100) -> None:
        self.vocab_size = vocab_size
        self.requests: dict[str, list] = {}
        self.scheduler = SimpleNamespace(
            running=[], waiting=[], num_preemptions=0, step_counts=StepCounts()
        )
        self.kv_manager = SimpleNamespace(
            pool=SimpleNamespace(capacity=10), num_free_blocks=10, stats=PrefixCacheStats()
        )
        self.load_report = LoadReport(seconds=0.1, weight_bytes=0, kv_cache_bytes=0, num_blocks=10)

    def add_request(self, request_id, prompt_token_ids, params):
        if any(t >= self.vocab_size for t in prompt_token_ids):
            raise ValueError("token id outside the vocabulary")
        self.requests[request_id] = [params.max_tokens, 0, len(prompt_token_ids)]
        self._sync()

    def abort(self, request_id):
        found = self.requests.pop(request_id, None) is not None
        self._sync()
        return found

    def has_work(self):
        return bool(self.requests)

    def step(self):
        updates = []
        for request_id, state in list(self.requests.items()):
            state[1] += 1
            done = state[1] >= state[0]
            updates.append(
                RequestUpdate(request_id, [7], [None], "length" if done else None, state[2])
            )
            if done:
                del self.requests[request_id]
        self._sync()
        return updates

    def _sync(self):
        self.scheduler.running = list(self.requests)
        self.kv_manager.num_free_blocks = 10 - len(self.requests)


class FakePool:
    """The `ModelPool` surface the engine loop uses, over fake instances that are all loaded."""

    def __init__(self, instances: dict[str, FakeInstance]) -> None:
        self.instances = instances
        self.slots = {
            name: SimpleNamespace(
                name=name, state=ModelState.LOADED, error=None, instance=inst, queued=[], plan=None
            )
            for name, inst in instances.items()
        }
        self.states_changed = False

    def has_work(self):
        return any(instance.has_work() for instance in self.instances.values())

    def next_deadline(self):
        return None

    def poll(self):
        pass

    def step(self):
        return [u for i in self.instances.values() if i.has_work() for u in i.step()]

    def add_request(self, model, request_id, prompt_token_ids, params):
        if model not in self.instances:
            raise UnknownModelError(model)
        self.instances[model].add_request(request_id, prompt_token_ids, params)

    def abort(self, request_id):
        return any(instance.abort(request_id) for instance in self.instances.values())

    def take_rejections(self):
        return []

    def statuses(self):
        return []

    def infos(self):
        return []


def run_core(instances: dict[str, FakeInstance], channel: ScriptedChannel) -> None:
    EngineCore(FakePool(instances), channel).run()


def step_outputs(channel: ScriptedChannel) -> list[StepOutputs]:
    return [m for m in channel.sent if isinstance(m, StepOutputs)]


class ScriptedChannel:
    """Feeds the loop message batches; records what it sends."""

    def __init__(self, batches: list[list[FrontendMessage]]) -> None:
        self.batches = batches
        self.sent: list[StepOutputs] = []
        self.parent_alive = True
        self.blocking_receives = 0

    def receive(self, block: bool, timeout_s: float | None = None):
        if block:
            self.blocking_receives += 1
        if self.batches:
            return self.batches.pop(0)
        return [Shutdown()] if block else []

    def send(self, message):
        self.sent.append(message)


def add(request_id: str, model: str, max_tokens: int, prompt=(1, 2, 3)) -> AddRequest:
    return AddRequest(request_id, model, list(prompt), SamplingParams(max_tokens=max_tokens))


def test_steps_every_model_and_reports_tokens_until_done():
    a, b = FakeInstance(), FakeInstance()
    channel = ScriptedChannel([[add("r1", "a", 2), add("r2", "b", 3)]])
    run_core({"a": a, "b": b}, channel)
    updates = [u for m in step_outputs(channel) for u in m.updates]
    assert [(u.request_id, u.finish_reason) for u in updates] == [
        ("r1", None),
        ("r2", None),
        ("r1", "length"),
        ("r2", None),
        ("r2", "length"),
    ]
    # Idle at the end: a stats message settles the gauges at zero, then the loop blocks.
    last = step_outputs(channel)[-1]
    assert last.stats is not None
    assert {s.model: s.kv_blocks_used for s in last.stats} == {"a": 0, "b": 0}
    assert channel.blocking_receives >= 1
    # The process's collector passes ride with every stats message, and only with those.
    assert all((m.gc is not None) == (m.stats is not None) for m in step_outputs(channel))
    gc = last.gc
    assert len(gc.passes) == len(gc.pause_seconds) == 3


def test_collector_passes_during_the_loop_reach_the_stats():
    """A generation-2 pass inside the loop (here forced by an instance's step) is counted in
    the next stats message, and the counting stops with the loop."""
    import gc as collector

    class CollectingInstance(FakeInstance):
        def step(self):
            collector.collect(2)
            return super().step()

    channel = ScriptedChannel([[add("r1", "a", 2)]])
    run_core({"a": CollectingInstance()}, channel)
    assert step_outputs(channel)[-1].gc.passes[2] >= 2
    assert step_outputs(channel)[-1].gc.pause_seconds[2] > 0
    assert not any(
        getattr(cb, "__self__", None).__class__.__name__ == "GcPauses" for cb in collector.callbacks
    )


def test_invalid_request_and_unknown_model_are_rejected_not_fatal():
    channel = ScriptedChannel([[add("bad", "a", 2, prompt=[500]), add("x", "nope", 2)]])
    run_core({"a": FakeInstance()}, channel)
    rejected = [r for m in step_outputs(channel) for r in m.rejected]
    assert [r.request_id for r in rejected] == ["bad", "x"]
    assert "vocabulary" in rejected[0].message and "nope" in rejected[1].message


def test_a_request_the_channel_could_not_read_is_refused_by_its_id():
    channel = ScriptedChannel([[UnreadableRequest("r9", "invalid request: seed too large")]])
    run_core({"a": FakeInstance()}, channel)
    (rejected,) = [r for m in step_outputs(channel) for r in m.rejected]
    assert rejected.request_id == "r9" and "seed" in rejected.message


def test_abort_stops_a_request_between_steps():
    instance = FakeInstance()
    channel = ScriptedChannel([[add("r1", "a", 100)], [AbortRequests(["r1", "unknown"])]])
    run_core({"a": instance}, channel)
    updates = [u for m in step_outputs(channel) for u in m.updates]
    assert len(updates) == 1 and not instance.requests


def test_channel_round_trip_and_parent_death():
    addresses = IpcAddresses.fresh()
    context = zmq.Context()
    requests = context.socket(zmq.PUSH)
    requests.bind(addresses.requests)
    outputs = context.socket(zmq.PULL)
    outputs.bind(addresses.outputs)
    read_end, write_end = os.pipe()
    channel = EngineChannel(addresses, parent_death_fd=read_end)
    try:
        requests.send(msgspec.msgpack.encode(add("r1", "a", 4)))
        (message,) = channel.receive(block=True)
        assert message == add("r1", "a", 4)
        # Parameters that fail their checks on the engine's side refuse that request only.
        bad = add("r2", "a", 4)
        bad.params.temperature = -1.0  # set after the checks, as a buggy front end might
        requests.send(msgspec.msgpack.encode(bad))
        (message,) = channel.receive(block=True)
        assert message.request_id == "r2" and "temperature" in message.message
        channel.send(StepOutputs([RequestUpdate("r1", [5], [None], None, 3)]))
        decoded = msgspec.msgpack.decode(outputs.recv(), type=StepOutputs)
        assert decoded.updates[0].new_token_ids == [5]
        # The parent's end of the pipe closes when it dies: a blocked receive wakes up.
        threading.Timer(0.1, os.close, args=(write_end,)).start()
        assert channel.receive(block=True) == [] and not channel.parent_alive
    finally:
        channel.close()
        os.close(read_end)
        requests.close(0)
        outputs.close(0)
        context.term()
        addresses.cleanup()
