"""Automatic prefix caching: the block keys, the pool's reuse order, the scheduler's claims, and
on a tiny model the same greedy tokens as without the cache, under preemption and abort."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.fake_runner import FakeRunner
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.config import StepLimits
from ember.engine.block_hashes import BlockHasher, new_secret
from ember.engine.kv_cache_manager import BlockPool, KVCacheManager
from ember.engine.request import Request
from ember.engine.scheduler import Scheduler


def make_request(rid: str, prompt: list[int], max_tokens: int = 3, **params) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params)
    return Request(rid, list(prompt), sampling, 0, max_tokens)


def cached_scheduler(num_blocks: int = 64, block_size: int = 4, **limits) -> Scheduler:
    limits = {"max_num_batched_tokens": 64, "max_num_seqs": 8, **limits}
    return Scheduler(StepLimits(**limits), KVCacheManager(num_blocks, block_size, True))


def run(scheduler: Scheduler, runner: FakeRunner | None = None, max_steps: int = 10_000):
    """Step until every request is done, checking the block accounting after each step; the
    tokens scheduled for each request, per step."""
    runner = runner or FakeRunner()
    fed: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return fed
        out = scheduler.schedule()
        for request_id, n in out.num_scheduled_tokens.items():
            fed.setdefault(request_id, []).append(n)
        runner.step(scheduler, out)
        scheduler.check_invariants()
    raise AssertionError("the scheduler did not finish")


# -- keys ------------------------------------------------------------------------------------------


def test_a_key_names_the_whole_prefix_and_the_secret():
    hasher = BlockHasher(4, new_secret())
    a, b, c = [], [], []
    hasher.extend(a, [1, 2, 3, 4, 5, 6, 7, 8], [], 2)
    hasher.extend(b, [9, 9, 9, 9, 5, 6, 7, 8], [], 2)  # same second block, other first
    hasher.extend(c, [1, 2, 3, 4], [5, 6, 7, 8, 0], 2)  # the same tokens, half of them outputs
    assert a[0] != b[0] and a[1] != b[1]
    assert c == a
    other = []
    BlockHasher(4, new_secret()).extend(other, [1, 2, 3, 4, 5, 6, 7, 8], [], 2)
    assert not set(other) & set(a)  # another cache's keys are unrelated


def test_keys_are_extended_not_recomputed():
    hasher = BlockHasher(2, new_secret())
    whole, grown = [], []
    tokens = list(range(10))
    hasher.extend(whole, tokens, [], 5)
    for n in range(1, 6):
        hasher.extend(grown, tokens[:4], tokens[4:], n)
    assert grown == whole


# -- the pool ------------------------------------------------------------------------------------


def test_unkeyed_free_blocks_are_reused_before_keyed_ones_and_keyed_ones_oldest_first():
    pool = BlockPool(7)
    a, b, c = pool.allocate(2), pool.allocate(2), pool.allocate(2)
    pool.register(a[0], b"a0")
    pool.register(c[0], b"c0")
    pool.release(a)
    pool.release(b)  # unkeyed: reused first
    pool.release(c)
    order = pool.allocate(6)
    assert set(order[:4]) == {a[1], b[0], b[1], c[1]}  # unkeyed ones first
    assert order[4:] == [a[0], c[0]]  # then the keyed ones, the first released first
    assert pool.num_cached == 0  # reused: their keys are gone


def test_a_shared_block_is_freed_only_by_its_last_holder():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.register(block, b"k")
    pool.share([block])
    pool.release([block])
    assert block not in pool.free
    pool.release([block])
    assert block in pool.free and pool.block_of[b"k"] == block


# -- the scheduler -------------------------------------------------------------------------------


def test_a_later_request_with_the_same_prefix_computes_only_what_is_new():
    s = cached_scheduler()
    prefix = list(range(100, 120))  # 5 full blocks of 4
    s.add_request(make_request("a", prefix + [1, 2]))
    run(s)
    s.add_request(make_request("b", prefix + [3, 4, 5]))
    out = s.schedule()
    (new,) = out.new_requests
    assert out.num_scheduled_tokens == {"b": 3}  # 20 of its 23 tokens were cached
    assert new.request.num_computed_tokens == 23
    assert s.kv_cache.stats.hits == 20 and s.kv_cache.stats.queries == 22 + 23


def test_a_prompt_cached_whole_still_computes_its_last_token():
    s = cached_scheduler()
    prompt = list(range(100, 116))  # exactly 4 blocks
    s.add_request(make_request("a", prompt))
    run(s)
    s.add_request(make_request("b", prompt))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 4}  # 3 blocks claimed; the 4th is computed again
    assert out.new_requests[0].block_ids[:3] == s.kv_cache.block_ids("b")[:3]


def test_generated_tokens_are_cached_too():
    s = cached_scheduler()
    runner = FakeRunner()
    s.add_request(make_request("a", list(range(100, 106)), max_tokens=8))
    run(s, runner)
    # FakeRunner samples token 7 for every step: a's sequence is its prompt then eight 7s, all
    # but the last fed back (13 tokens computed: three full blocks).
    follow_up = list(range(100, 106)) + [7] * 6 + [9]
    s.add_request(make_request("b", follow_up))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 1}  # 12 of 13 tokens: three blocks cached


def test_requests_that_want_prompt_logprobs_compute_every_position():
    s = cached_scheduler()
    s.add_request(make_request("a", list(range(100, 120))))
    run(s)
    s.add_request(make_request("b", list(range(100, 120)), prompt_logprobs=0))
    assert s.schedule().num_scheduled_tokens == {"b": 20}


def test_a_claim_is_given_back_when_the_rest_does_not_fit():
    s = cached_scheduler(num_blocks=9, max_num_batched_tokens=64)  # 8 usable blocks
    prefix = list(range(100, 112))  # 3 blocks
    runner = FakeRunner()
    s.add_request(make_request("a", prefix))
    run(s, runner)
    s.add_request(make_request("long", list(range(500, 516)), max_tokens=8))
    runner.step(s, s.schedule())  # holds 4 blocks, then 5
    s.add_request(make_request("b", prefix + list(range(300, 312))))  # needs 3 cached + 3 new
    out = s.schedule()
    assert "b" not in out.num_scheduled_tokens
    waiting = s.waiting[0]
    assert waiting.num_computed_tokens == 0 and not s.kv_cache.block_ids("b")
    # The claim went back to the cache: a's blocks are still there for b's next try.
    assert all(key in s.kv_cache.pool.block_of for key in waiting.block_hashes[:3])
    s.check_invariants()
    runner.step(s, out)
    run(s, runner)
    assert s.kv_cache.num_free_blocks == s.kv_cache.pool.capacity


def test_cache_off_claims_nothing():
    s = Scheduler(StepLimits(), KVCacheManager(64, 4))
    s.add_request(make_request("a", list(range(100, 120))))
    run(s)
    s.add_request(make_request("b", list(range(100, 120))))
    assert s.schedule().num_scheduled_tokens == {"b": 20}
    assert s.kv_cache.pool.num_cached == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_with_shared_prefixes_preemption_and_aborts_keeps_every_block(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    s = cached_scheduler(
        num_blocks=rng.randint(12, 40) * (4 if block_size == 1 else 1),
        block_size=block_size,
        max_num_batched_tokens=rng.choice([8, 32, 64]),
    )
    prefixes = [[rng.randint(3, 500) for _ in range(rng.randint(0, 24))] for _ in range(3)]
    runner = FakeRunner()
    next_id = 0
    for _ in range(400):
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randint(3, 500) for _ in range(rng.randint(1, 9))]
            s.add_request(make_request(f"r{next_id}", prompt, max_tokens=rng.randint(1, 10)))
            next_id += 1
        if s.requests and rng.random() < 0.05:
            s.abort(rng.choice(list(s.requests)))
        out = s.schedule()
        runner.step(s, out)
        s.check_invariants()
    run(s, runner)
    assert s.kv_cache.num_free_blocks == s.kv_cache.pool.capacity
    assert s.kv_cache.stats.hits > 0 or block_size == 16


def test_resetting_the_cache_forgets_every_key():
    s = cached_scheduler()
    s.add_request(make_request("a", list(range(100, 120))))
    run(s)
    assert s.kv_cache.pool.num_cached == 5
    s.kv_cache.reset_prefix_cache()
    assert s.kv_cache.pool.num_cached == 0
    s.add_request(make_request("b", list(range(100, 120))))
    assert s.schedule().num_scheduled_tokens == {"b": 20}


# -- on a model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def prompts():
    """Conversations that grow turn by turn, and prompts that share a system prefix."""
    g = torch.Generator().manual_seed(11)
    system = torch.randint(3, 4000, (37,), generator=g).tolist()
    turns = [torch.randint(3, 4000, (int(n),), generator=g).tolist() for n in (9, 14, 5, 21)]
    growing = [system + [t for turn in turns[: i + 1] for t in turn] for i in range(len(turns))]
    siblings = [system + torch.randint(3, 4000, (7,), generator=g).tolist() for _ in range(6)]
    return growing + siblings


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def generate_one_by_one(llm: LLM, prompts) -> list[list[int]]:
    tokens = []
    for p in prompts:
        (out,) = llm.generate([{"prompt_token_ids": p}], GREEDY)
        tokens.append(out.outputs[0].token_ids)
        llm.instance.scheduler.check_invariants()
    return tokens


@pytest.fixture(scope="module")
def uncached(model_dir, prompts):
    llm = LLM(str(model_dir), device="cpu", max_model_len=128, enable_prefix_caching=False)
    return generate_one_by_one(llm, prompts)


@pytest.mark.parametrize("overlap", [False, True])
def test_cached_prefixes_give_the_tokens_of_an_uncached_run(model_dir, prompts, uncached, overlap):
    llm = LLM(str(model_dir), device="cpu", max_model_len=128, block_size=8, overlap=overlap)
    assert generate_one_by_one(llm, prompts) == uncached
    stats = llm.instance.kv_manager.stats
    assert stats.hits >= 32 * (len(prompts) - 1)  # every prompt after the first: 4 blocks at least


def test_a_batch_sharing_prefixes_under_preemption_gives_the_same_tokens(
    model_dir, prompts, uncached
):
    # 16 usable blocks of 8 tokens: a few requests at a time, so running ones get preempted.
    llm = LLM(
        str(model_dir), device="cpu", max_model_len=128, block_size=8, num_gpu_blocks_override=17
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == uncached
    inst = llm.instance
    assert inst.scheduler.num_preemptions > 0 and inst.kv_manager.stats.hits > 0
    inst.scheduler.check_invariants()
    assert inst.kv_manager.num_free_blocks == inst.kv_manager.pool.capacity


def test_aborted_requests_leave_the_others_tokens_and_every_block(model_dir, prompts, uncached):
    llm = LLM(str(model_dir), device="cpu", max_model_len=128, block_size=8, overlap=True)
    inst = llm.instance
    for i, p in enumerate(prompts):
        inst.add_request(f"r{i}", p, GREEDY)
    outputs: dict[str, list[int]] = {}
    for step in range(200):
        if step == 3:
            for i in range(0, len(prompts), 3):
                assert inst.abort(f"r{i}")
        for update in inst.step():
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        inst.scheduler.check_invariants()
        if not inst.has_work():
            break
    for i in range(len(prompts)):
        if i % 3:
            assert outputs[f"r{i}"] == uncached[i]
    assert inst.kv_manager.num_free_blocks == inst.kv_manager.pool.capacity
