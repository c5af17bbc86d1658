"""Sliding windows give blocks back: in a model whose every layer attends through a window, the
blocks every layer's window has passed return to the pool as a sequence advances, while every
key a scheduled query can see stays held; cached ones stay cached; on a tiny Mistral, the same
greedy tokens as transformers from a pool far smaller than its sequences, without preempting.
In a model that mixes windowed and full layers, the windowed ones' own pool does the same while
the full layers' table keeps every block; on a tiny gpt-oss, transformers' tokens."""

from __future__ import annotations

import pytest
import torch
from helpers.fake_runner import FakeRunner
from helpers.hf_reference import hf_greedy_tokens
from helpers.prefill import prompts_of_lengths
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.config import StepLimits
from ember.engine.kv_cache_manager import SCRATCH_BLOCK, KVCacheManager, LocalBlocks
from ember.engine.request import Request
from ember.engine.scheduler import Scheduler


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(rid, list(prompt), params, 0, max_tokens)


def windowed_scheduler(num_blocks, block_size=4, window=8, prefix_caching=False, **limits):
    kv = KVCacheManager(num_blocks, block_size, prefix_caching, window=window)
    limits = {"max_num_batched_tokens": 8, "max_num_seqs": 4, **limits}
    return Scheduler(StepLimits(**limits), kv)


def run_checking_windows(scheduler: Scheduler) -> int:
    """Step to the end; after each schedule, every key a scheduled query sees is in a block its
    request holds (not the scratch block), released entries lead each table, and the accounting
    holds. Returns the most blocks one request held."""
    kv, runner, most = scheduler.kv_cache, FakeRunner(), 0
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            return most
        out = scheduler.schedule()
        for request_id, fed in out.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            table = kv.block_ids(request_id)
            first_query = request.num_computed_tokens - fed
            lowest_key = max(0, first_query - kv.window + 1)
            for position in range(lowest_key, request.num_computed_tokens):
                assert table[position // kv.block_size] != SCRATCH_BLOCK, (request_id, position)
            released = request.num_released_blocks
            assert table[:released] == [SCRATCH_BLOCK] * released
            most = max(most, len(table) - released)
        runner.step(scheduler, out)
        scheduler.check_invariants()
    raise AssertionError("the scheduler did not finish")


def test_a_sequence_longer_than_the_pool_holds_only_its_window():
    # 15 usable blocks of 4 (60 tokens); three sequences of 70-89 tokens at once (61 blocks).
    s = windowed_scheduler(num_blocks=16, max_num_seqs=3)
    for i, (prompt, out) in enumerate([(40, 30), (25, 60), (9, 80)]):
        s.add_request(make_request(f"r{i}", range(1, prompt + 1), out))
    most = run_checking_windows(s)
    assert s.num_preemptions == 0
    # window 8 + a chunk of 8, over blocks of 4 not aligned to either: at most 5 blocks.
    assert most <= 5
    assert s.kv_cache.num_free_blocks == 15


def test_without_a_window_nothing_is_released():
    kv = KVCacheManager(64, 4)
    s = Scheduler(StepLimits(max_num_batched_tokens=8, max_num_seqs=2), kv)
    request = make_request("a", range(1, 30), 20)
    s.add_request(request)
    runner = FakeRunner()
    while s.has_unfinished():
        out = s.schedule()
        assert all(c.num_released_blocks == 0 for c in out.cached_requests)
        if request.status.name == "RUNNING":
            assert SCRATCH_BLOCK not in kv.block_ids("a")
        runner.step(s, out)
    assert request.num_released_blocks == 0


def test_released_blocks_stay_cached_for_a_later_prompt():
    s = windowed_scheduler(num_blocks=32, prefix_caching=True)
    prompt = list(range(1, 41))
    s.add_request(make_request("a", prompt, 4))
    run_checking_windows(s)
    cached = s.kv_cache.pool.num_cached
    assert cached >= 40 // 4 - 1  # released along the way, registered first
    later = make_request("b", prompt, 4)
    s.add_request(later)
    first = s.schedule()
    # It starts from the cached prefix (9 blocks: its last token is computed again) and at once
    # gives back the blocks below the window of its first query, at 36.
    assert first.num_scheduled_tokens["b"] == 4 and later.num_computed_tokens == 40
    assert later.num_released_blocks == (36 - 8 + 1) // 4
    (new,) = first.new_requests
    assert new.block_ids[: later.num_released_blocks] == [SCRATCH_BLOCK] * later.num_released_blocks
    s.check_invariants()


def test_a_preempted_request_gives_back_only_what_it_still_holds():
    s = windowed_scheduler(num_blocks=8)
    request = make_request("a", range(1, 50), 4)
    s.add_request(request)
    runner = FakeRunner()
    while request.num_released_blocks == 0:
        runner.step(s, s.schedule())
    s._preempt(request)
    assert request.num_released_blocks == 0 and s.kv_cache.block_ids("a") == []
    s.check_invariants()
    assert s.kv_cache.num_free_blocks == 7


@pytest.mark.slow
def test_mistral_decodes_from_a_pool_smaller_than_its_sequences(tmp_path):
    """A 12-key window, blocks of 4, 20 usable blocks (80 tokens) for three sequences of 36-56
    tokens at once (35 blocks in all): transformers' greedy tokens, and no request preempted."""
    transformers = pytest.importorskip("transformers")
    path = make_tiny_model("MistralForCausalLM", tmp_path, sliding_window=12)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_model_len=64,
        block_size=4,
        num_gpu_blocks_override=21,
        max_num_batched_tokens=16,
    )
    assert llm.instance.kv_manager.window == 12
    prompts = prompts_of_lengths((40, 30, 20), hf.config.vocab_size, 5)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, 16)
    assert llm.instance.scheduler.num_preemptions == 0
    llm.instance.scheduler.check_invariants()


@pytest.mark.slow
def test_a_windowed_model_serves_a_context_longer_than_its_pool(tmp_path):
    """The pool need hold only a window and a chunk: 8 usable blocks of 4 (32 tokens) serve a
    130-token sequence of a 12-key window with transformers' greedy tokens. A dense model is
    refused such a pool, with what one sequence needs."""
    transformers = pytest.importorskip("transformers")
    path = make_tiny_model("MistralForCausalLM", tmp_path / "mistral", sliding_window=12)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    options = {"max_model_len": 256, "block_size": 4, "max_num_batched_tokens": 16}
    # One block over the 27 positions of a window and a chunk, one more, and the scratch block.
    llm = LLM(str(path), dtype="float32", device="cpu", num_gpu_blocks_override=9, **options)
    assert llm.instance.plan.min_kv_blocks == 9
    (prompt,) = prompts_of_lengths((100,), hf.config.vocab_size, 6)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, 30)
    llm.instance.scheduler.check_invariants()
    dense = make_tiny_model("LlamaForCausalLM", tmp_path / "llama")
    with pytest.raises(ValueError, match=r"holds 32 tokens, fewer than one sequence of "):
        LLM(str(dense), dtype="float32", device="cpu", num_gpu_blocks_override=9, **options)


# -- a model mixing windowed and full layers: the windowed ones' own pool ----------------------


def hybrid_scheduler(
    num_blocks, local_blocks, block_size=4, window=8, prefix_caching=False, **limits
):
    kv = KVCacheManager(
        num_blocks, block_size, prefix_caching, local_blocks=LocalBlocks(local_blocks, window)
    )
    limits = {"max_num_batched_tokens": 8, "max_num_seqs": 4, **limits}
    return Scheduler(StepLimits(**limits), kv)


def run_checking_local_windows(scheduler: Scheduler) -> tuple[int, int]:
    """As `run_checking_windows`, for the local table: every key a scheduled query's window
    sees is in a local block its request holds, while its main table holds every block. Returns
    the most local blocks one request held and the most held in all."""
    kv, runner, most, most_in_all = scheduler.kv_cache, FakeRunner(), 0, 0
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            return most, most_in_all
        out = scheduler.schedule()
        for request_id, fed in out.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            table, local = kv.block_ids(request_id), kv.local_block_ids(request_id)
            assert len(local) == len(table) and SCRATCH_BLOCK not in table
            first_query = request.num_computed_tokens - fed
            lowest_key = max(0, first_query - kv.local_window + 1)
            for position in range(lowest_key, request.num_computed_tokens):
                assert local[position // kv.block_size] != SCRATCH_BLOCK, (request_id, position)
            released = request.num_released_blocks
            assert local[:released] == [SCRATCH_BLOCK] * released
            most = max(most, len(local) - released)
        most_in_all = max(most_in_all, kv.local_pool.capacity - kv.local_pool.num_free)
        runner.step(scheduler, out)
        scheduler.check_invariants()
    raise AssertionError("the scheduler did not finish")


def test_the_windowed_layers_pool_holds_only_windows_while_the_full_one_holds_all():
    # Main: 63 usable blocks for three sequences of 70-89 tokens (61 blocks). Local: 15 blocks.
    s = hybrid_scheduler(num_blocks=64, local_blocks=16, max_num_seqs=3)
    for i, (prompt, out) in enumerate([(40, 30), (25, 60), (9, 80)]):
        s.add_request(make_request(f"r{i}", range(1, prompt + 1), out))
    most, most_in_all = run_checking_local_windows(s)
    assert s.num_preemptions == 0
    assert most <= 5 and most_in_all <= 15
    assert s.kv_cache.num_free_blocks == 63 and s.kv_cache.local_pool.num_free == 15


def test_a_full_local_pool_preempts_as_a_full_main_pool_does():
    """Two sequences whose windows and chunks need more local blocks than there are: the newer
    is preempted and recomputed, every key still held when read, nothing lost."""
    s = hybrid_scheduler(num_blocks=64, local_blocks=6, max_num_seqs=2)
    for i in range(2):
        s.add_request(make_request(f"r{i}", range(1, 30), 20))
    run_checking_local_windows(s)
    assert s.num_preemptions > 0
    assert s.kv_cache.local_pool.num_free == 5


def test_a_cached_prefix_comes_back_with_its_windows_local_blocks():
    s = hybrid_scheduler(num_blocks=32, local_blocks=32, prefix_caching=True)
    prompt = list(range(1, 41))
    s.add_request(make_request("a", prompt, 4))
    run_checking_local_windows(s)
    assert s.kv_cache.pool.num_cached == 10 and s.kv_cache.local_pool.num_cached >= 9
    later = make_request("b", prompt, 4)
    s.add_request(later)
    first = s.schedule()
    # From the cached prefix (9 blocks): its main table all of them, its local one only the
    # blocks the window of its first query (at 36) reaches.
    assert first.num_scheduled_tokens["b"] == 4 and later.num_computed_tokens == 40
    (new,) = first.new_requests
    assert SCRATCH_BLOCK not in new.block_ids[:9]
    released = (36 - 8 + 1) // 4
    assert later.num_released_blocks == released
    assert new.local_block_ids[:released] == [SCRATCH_BLOCK] * released
    assert SCRATCH_BLOCK not in new.local_block_ids[released:]
    s.check_invariants()


def test_a_prefix_is_taken_back_only_as_far_as_the_local_pool_still_holds_its_window():
    """The local pool reused the blocks the prefix's last window needs: the claim falls back to
    the longest prefix whose window's local blocks are all still cached (here none)."""
    s = hybrid_scheduler(num_blocks=32, local_blocks=32, prefix_caching=True)
    prompt = list(range(1, 41))
    s.add_request(make_request("a", prompt, 4))
    run_checking_local_windows(s)
    local = s.kv_cache.local_pool
    local.allocate(local.num_free)  # every free local block reused: their keys are gone
    later = make_request("b", prompt, 4)
    assert s.kv_cache.claim_cached_prefix(later) == 0
    assert s.kv_cache.block_ids("b") == [] and later.num_released_blocks == 0


def test_the_plan_sizes_the_local_pool_for_every_running_window(tmp_path):
    """gpt-oss (windowed and full layers): at a large budget the local pool stops at what every
    running sequence's window and a step's chunks need, and the rest goes to the full layers;
    at a small one the two pools have as many blocks."""
    from ember.config import engine_config
    from ember.engine.model_plan import plan_model

    path = make_tiny_model("GptOssForCausalLM", tmp_path)
    plan = plan_model(engine_config(str(path), dtype="float32", device="cpu", max_model_len=256))
    local, window = plan.kv_local_layers
    assert local == frozenset({0}) and window == 16  # sliding, full (HF's layer_types)
    bound = plan.local_kv_bound
    big = plan.kv_bytes_for(10 * bound)
    assert plan.kv_blocks_for(big) == 10 * bound
    assert plan.local_kv_blocks(10 * bound) == bound
    # Half the layers keep only `bound` blocks: more full blocks than one pool for every layer.
    assert plan.kv_blocks_for(big) > big // plan.kv_block_bytes
    assert plan.kv_blocks_for(plan.kv_bytes_for(bound // 2)) == bound // 2
    assert plan.local_kv_blocks(bound // 2) == bound // 2


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_gpt_oss_decodes_with_its_windowed_layers_in_a_small_pool(tmp_path, prefix_caching):
    """A tiny gpt-oss (a 16-key window on every other layer), blocks of 4: its windowed layers'
    pool far smaller than the full layers' (26 blocks, 47 under prefix caching, against 80)
    serves three sequences of 36-56 tokens with transformers' greedy tokens (twice over the
    same prompts under prefix caching, the second time from the cache)."""
    transformers = pytest.importorskip("transformers")
    path = make_tiny_model("GptOssForCausalLM", tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_model_len=64,
        block_size=4,
        max_num_seqs=3,
        num_gpu_blocks_override=80,
        max_num_batched_tokens=16,
        enable_prefix_caching=prefix_caching,
    )
    kv = llm.instance.kv_manager
    assert kv.local_window == 16
    assert kv.local_pool.num_blocks == (47 if prefix_caching else 26) < kv.pool.num_blocks
    assert llm.instance.load_report.local_num_blocks == kv.local_pool.num_blocks
    prompts = prompts_of_lengths((40, 30, 20), hf.config.vocab_size, 5)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [hf_greedy_tokens(hf, prompt, 16) for prompt in prompts]
    for _ in range(2 if prefix_caching else 1):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [out.outputs[0].token_ids for out in outputs] == expected
        llm.instance.scheduler.check_invariants()
    if prefix_caching:
        # The second time each prompt takes back every whole block before its last token.
        assert kv.stats.hits == 4 * ((40 - 1) // 4 + (30 - 1) // 4 + (20 - 1) // 4)


@pytest.mark.slow
def test_a_woken_gpt_oss_gives_the_tokens_it_gave_before_sleeping(tmp_path):
    """Both pools go to sleep and come back (zeroed) with the model: the same greedy tokens."""
    from ember.api import Engine

    path = make_tiny_model("GptOssForCausalLM", tmp_path)
    engine = Engine()
    engine.add_model("gpt-oss", str(path), device="cpu", max_model_len=64, block_size=4)
    assert engine.instance("gpt-oss").kv_manager.local_pool is not None
    prompts = prompts_of_lengths((40, 30), 1000, 7)
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in engine.generate(batch, params, model="gpt-oss")]
    engine.sleep("gpt-oss")
    engine.wake("gpt-oss")
    after = [o.outputs[0].token_ids for o in engine.generate(batch, params, model="gpt-oss")]
    assert after == before
