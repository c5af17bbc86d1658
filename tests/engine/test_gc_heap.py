"""The serving processes' garbage-collector settings: the start-up heap frozen out of the
collector's passes, and the pass counter the step benchmarks report."""

from __future__ import annotations

import gc
import logging

import pytest

from ember.engine.gc_heap import GcPauses, freeze_startup_heap


@pytest.fixture
def unfrozen():
    """Give the test process its collector back afterwards (other tests rely on it)."""
    yield
    gc.unfreeze()


class _Node:
    def __init__(self) -> None:
        self.other = None


def _cycle() -> _Node:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a


def test_freeze_moves_the_live_heap_out_of_the_passes(unfrozen):
    survivor = _cycle()
    frozen = freeze_startup_heap()
    # Frozen objects can still die (their count drops), but nothing joins them after the freeze.
    assert 0 < gc.get_freeze_count() <= frozen
    # A frozen object is no longer one a pass walks.
    assert not any(obj is survivor for obj in gc.get_objects())
    # Garbage made after the freeze is still collected: the collector stays on.
    _cycle()
    assert gc.collect() >= 2


def test_freeze_collects_start_up_garbage_first(unfrozen):
    """A cycle that was garbage before the freeze is collected, not kept forever."""
    gc.disable()  # no automatic pass may take it before the freeze does
    try:
        _cycle()
        before = gc.get_stats()[2]["collected"]
        freeze_startup_heap()
        assert gc.get_stats()[2]["collected"] >= before + 2
    finally:
        gc.enable()


def test_pauses_counts_passes_by_generation_while_the_block_runs():
    with GcPauses() as pauses:
        gc.collect(2)
        gc.collect(0)
    assert pauses.collections[2] == 1 and pauses.collections[0] >= 1
    assert pauses.pause_s[2] >= 0 and pauses.max_pause_s >= pauses.pause_s[2]
    summary = pauses.summary(steps=4)
    assert summary["gen2_collections"] == 1
    assert summary["gc_ms_per_step"] == pytest.approx(sum(pauses.pause_s) / 4 * 1e3)
    # Out of the block it counts nothing more.
    gc.collect(2)
    assert pauses.collections[2] == 1
    assert pauses._callback not in gc.callbacks


class _Survivor:
    pass


def test_a_slow_pass_is_logged_with_its_garbage_and_the_oldest_generation_by_type(unfrozen, caplog):
    freeze_startup_heap()
    survivors = [_Survivor() for _ in range(500)]
    gc.collect()  # the survivors now sit in the oldest generation, nearly alone
    _cycle()
    with (
        caplog.at_level(logging.WARNING, logger="ember.engine.gc_heap"),
        GcPauses(slow_pass_s=0.0) as pauses,  # every pass counts as slow
    ):
        gc.collect(2)
    [record] = [r for r in pauses.slow_passes if r["generation"] == 2]
    assert record["collected"] >= 2  # the cycle
    assert record["oldest_generation_objects"] >= len(survivors)
    assert 0 < gc.get_freeze_count() <= record["frozen_objects"]
    assert record["oldest_generation_top_types"][0] == ("_Survivor", len(survivors))
    assert pauses.summary(steps=1)["slow_passes"][-1] == record
    assert "slow garbage-collector pass" in caplog.text
    # Passes under the threshold are counted, not reported.
    with GcPauses(slow_pass_s=10.0) as quiet:
        gc.collect(2)
    assert quiet.collections[2] == 1 and not quiet.slow_passes


def test_front_end_freezes_once_the_engine_has_loaded(monkeypatch):
    """The server marks itself ready after freezing its start-up heap; a failed load does not
    freeze (the process is on its way out)."""
    import asyncio
    from types import SimpleNamespace

    from ember.server import app
    from ember.server.config import RestartPolicy
    from ember.server.engine_supervisor import EngineSupervisor

    calls = []
    monkeypatch.setattr(app, "freeze_startup_heap", lambda: calls.append("freeze") or 0)

    def state_after(loaded: bool):
        async def wait_loaded():
            return loaded

        lifecycle = SimpleNamespace(
            models_ready=False, request_exit=lambda code: calls.append(code)
        )
        client = SimpleNamespace(wait_loaded=wait_loaded, model_infos={}, failure="boom")
        models = SimpleNamespace(loaded=list)
        return SimpleNamespace(client=client, lifecycle=lifecycle, models=models)

    progress = SimpleNamespace(close=lambda: None)
    ready = state_after(True)
    app._on_engine_ready(ready, progress)
    assert calls == ["freeze"] and ready.lifecycle.models_ready
    calls.clear()
    failed = state_after(False)
    supervisor = EngineSupervisor(
        failed.client,
        on_first_ready=lambda: app._on_engine_ready(failed, progress),
        request_exit=failed.lifecycle.request_exit,
        stopping=lambda: False,
        policy=RestartPolicy(),
    )
    asyncio.run(supervisor.run())
    assert calls == [1] and not failed.lifecycle.models_ready
