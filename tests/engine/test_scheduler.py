"""The scheduler and the KV block manager as a specification, without any model."""

from __future__ import annotations

import random

import pytest
from helpers.fake_runner import FakeRunner

from ember.config import StepLimits
from ember.engine.kv_cache_manager import KVCacheManager
from ember.engine.request import Request
from ember.engine.scheduler import Scheduler
from ember.engine.step_types import SchedulerOutput
from ember.sampling_params import SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, eos=()) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Request(rid, list(range(1, prompt_len + 1)), params, 0, max_tokens, tuple(eos))


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    runner = FakeRunner()
    outs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outs
        out = scheduler.schedule()
        outs.append(out)
        runner.step(scheduler, out)
        scheduler.check_invariants()
    raise AssertionError("scheduler did not finish")


def test_decodes_first_then_prompt_chunks_under_budget():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(StepLimits(max_num_batched_tokens=10, max_num_seqs=8), kv)
    s.add_request(make_request("a", 3, max_tokens=5))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 3}
    FakeRunner().step(s, first)
    s.add_request(make_request("b", 25))
    second = s.schedule()
    # a's decode comes first, then b takes the rest of the 10-token budget as a chunk.
    assert list(second.num_scheduled_tokens.items()) == [("a", 1), ("b", 9)]
    assert second.total_num_scheduled_tokens <= 10


def test_step_counts_tell_decode_steps_from_prompt_steps():
    """Steps that feed any prompt token count as prefill steps, the rest as decode-only; a
    decode feeds one token, a prompt's last one-token chunk is still prompt."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(StepLimits(max_num_batched_tokens=10, max_num_seqs=8), kv)
    s.add_request(make_request("a", 3, max_tokens=4))
    s.add_request(make_request("b", 18, max_tokens=2))
    outs = run_to_completion(s)
    counts = s.step_counts
    # a: 3 prompt tokens, then 3 decodes; b: 18 prompt tokens in chunks of 7, 9 and 2 (the
    # 10-token budget less a's decode), then 1 decode: three steps with prompt tokens, then one
    # of decodes only.
    assert [sum(o.num_scheduled_tokens.values()) for o in outs] == [10, 10, 3, 2]
    assert (counts.prefill_tokens, counts.decode_tokens) == (3 + 18, 3 + 1)
    assert (counts.prefill_steps, counts.decode_only_steps) == (3, 1)


def test_several_prompts_share_one_step():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(StepLimits(max_num_batched_tokens=32, max_num_seqs=8), kv)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 8))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r0": 8, "r1": 8, "r2": 8}
    assert [n.request.request_id for n in out.new_requests] == ["r0", "r1", "r2"]


def test_max_num_seqs_limits_running():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(StepLimits(max_num_batched_tokens=100, max_num_seqs=2), kv)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4))
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert len(s.waiting) == 1


def test_chunked_prefill_samples_only_after_the_last_chunk():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(StepLimits(max_num_batched_tokens=4, max_num_seqs=8), kv)
    s.add_request(make_request("a", 10, max_tokens=2))
    chunks, runner = [], FakeRunner()
    while s.has_unfinished():
        out = s.schedule()
        chunks.append(out.num_scheduled_tokens.get("a"))
        runner.step(s, out)
    assert chunks == [4, 4, 2, 1]


def test_preemption_frees_blocks_and_recomputes():
    kv = KVCacheManager(num_blocks=7, block_size=4)  # 6 usable blocks = 24 tokens
    s = Scheduler(StepLimits(max_num_batched_tokens=64, max_num_seqs=8), kv)
    s.add_request(make_request("old", 8, max_tokens=12))
    s.add_request(make_request("new", 8, max_tokens=12))
    outs = run_to_completion(s)
    assert s.num_preemptions > 0
    preempted_steps = [o for o in outs if "new" in o.finished_request_ids]
    assert preempted_steps, "the newest request is the one preempted"
    assert kv.num_free_blocks == kv.pool.capacity


def test_abort_returns_blocks_and_tells_the_runner():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    s = Scheduler(StepLimits(max_num_batched_tokens=64), kv)
    s.add_request(make_request("a", 9, max_tokens=50))
    out = s.schedule()
    FakeRunner().step(s, out)
    assert kv.num_free_blocks < kv.pool.capacity
    assert s.abort("a")
    assert not s.abort("a")
    assert kv.num_free_blocks == kv.pool.capacity
    assert "a" in s.schedule().finished_request_ids
    s.check_invariants()


def test_abort_of_waiting_request():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    s = Scheduler(StepLimits(max_num_batched_tokens=64), kv)
    s.add_request(make_request("w", 5))
    assert s.abort("w")
    assert not s.has_unfinished()
    assert s.schedule().is_empty


def test_eos_and_max_tokens_finish():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    s = Scheduler(StepLimits(max_num_batched_tokens=64), kv)
    s.add_request(make_request("eos", 4, max_tokens=10, eos=(7,)))
    s.add_request(make_request("len", 4, max_tokens=3))
    runner = FakeRunner()
    updates = runner.step(s, s.schedule())
    by_id = {u.request_id: u for u in updates}
    assert by_id["eos"].finish_reason == "stop"
    assert by_id["len"].finish_reason is None
    while s.has_unfinished():
        runner.step(s, s.schedule())
    s.check_invariants()


def test_duplicate_request_id_is_rejected():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    s = Scheduler(StepLimits(), kv)
    s.add_request(make_request("x", 3))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("x", 3))


def test_overlapped_scheduling_feeds_pending_samples():
    """Step N+1 may be scheduled before step N's tokens are reported back."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    s = Scheduler(StepLimits(max_num_batched_tokens=64), kv)
    s.add_request(make_request("a", 5, max_tokens=3))
    runner = FakeRunner()
    first = s.schedule()
    first_launched = runner.launch(first)
    second = s.schedule()  # before update(first): a's first sample is pending
    assert second.num_scheduled_tokens == {"a": 1}
    assert s.requests["a"].num_pending_tokens == 2
    second_launched = runner.launch(second)
    s.update(first, runner.collect(first_launched, [11]))
    third = s.schedule()
    assert third.num_scheduled_tokens == {"a": 1}
    third_launched = runner.launch(third)
    s.update(second, runner.collect(second_launched, [12]))
    fourth = s.schedule()
    assert fourth.is_empty  # max_tokens=3: the last token is on its way
    updates = s.update(third, runner.collect(third_launched, [13]))
    assert updates[0].finish_reason == "length"
    assert not s.has_unfinished()
    s.check_invariants()


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_never_leaks_blocks(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=rng.randint(12, 40), block_size=rng.choice([1, 4, 16]))
    cfg = StepLimits(max_num_batched_tokens=rng.randint(8, 64), max_num_seqs=rng.randint(1, 8))
    s = Scheduler(cfg, kv)
    runner = FakeRunner()
    limit = (kv.pool.capacity * kv.block_size) // 2
    for i in range(30):
        s.add_request(make_request(f"r{i}", rng.randint(1, limit - 8), rng.randint(1, 8)))
    for step in range(5000):
        if not s.has_unfinished():
            break
        if rng.random() < 0.05 and s.requests:
            s.abort(rng.choice(list(s.requests)))
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(s.running) <= cfg.max_num_seqs
        runner.step(s, out, token=rng.randint(0, 9))
        s.check_invariants()
    assert not s.has_unfinished()
    assert kv.num_free_blocks == kv.pool.capacity


def _overlapped_run(seed: int, one_token_path: bool, monkeypatch) -> tuple[list, int]:
    """A random workload scheduled one step ahead of its results (as the engine overlaps),
    under KV pressure, with aborts; returns what every step scheduled and reported."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=rng.randint(12, 40), block_size=rng.choice([1, 4, 16]))
    cfg = StepLimits(max_num_batched_tokens=rng.randint(8, 64), max_num_seqs=rng.randint(1, 8))
    s = Scheduler(cfg, kv)
    taken = []
    one_token = s._feed_one_token

    def feed_one_token(request, out) -> bool:
        fed = one_token_path and one_token(request, out)
        taken.append(fed)
        return fed

    monkeypatch.setattr(s, "_feed_one_token", feed_one_token)
    limit = (kv.pool.capacity * kv.block_size) // 2
    for i in range(30):
        s.add_request(make_request(f"r{i}", rng.randint(1, limit - 8), rng.randint(1, 8), eos=(3,)))
    trace, in_flight, runner = [], [], FakeRunner()
    for _ in range(5000):
        if not s.has_unfinished() and not in_flight:
            break
        if rng.random() < 0.03 and s.requests:
            s.abort(rng.choice(sorted(s.requests)))
        out = s.schedule()
        trace.append(
            (
                dict(out.num_scheduled_tokens),
                sorted(out.finished_request_ids),
                [(c.request_id, c.new_block_ids) for c in out.cached_requests],
            )
        )
        in_flight.append((out, runner.launch(out)))
        if len(in_flight) == 2 or out.is_empty:
            done, launched = in_flight.pop(0)
            tokens = [rng.randint(0, 9) for _ in launched]
            updates = s.update(done, runner.collect(launched, tokens))
            trace.append([(u.request_id, u.new_token_ids, u.finish_reason) for u in updates])
        s.check_invariants()
    assert not s.has_unfinished() and kv.num_free_blocks == kv.pool.capacity
    return trace + [vars(s.step_counts)], sum(taken)


@pytest.mark.parametrize("seed", range(4))
def test_one_token_path_schedules_as_the_general_path(seed, monkeypatch):
    """The decode fast path (`_feed_one_token`) changes the cost, not the schedule: a
    workload with pending samples, preemptions, aborts and stop tokens gets the same steps,
    blocks and results through the general path alone."""
    fast, taken = _overlapped_run(seed, True, monkeypatch)
    general, _ = _overlapped_run(seed, False, monkeypatch)
    assert taken > 0
    assert fast == general
