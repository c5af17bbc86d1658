"""The runner against the scheduler's contract, driven step by step on a tiny model (CPU).

The runner records each sample into its request when the step is collected and takes back the
in-flight count the scheduler added; a sample of a request that ended or was handed over again
while its step ran is dropped. With overlap, step N+1 is launched before step N is collected and
feeds N's sample on the device.
"""

from __future__ import annotations

import pytest
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("runner"))


@pytest.fixture
def instance(model_path):
    llm = LLM(
        str(model_path), device="cpu", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32
    )
    return llm.instance


def test_samples_are_recorded_at_collect_and_the_in_flight_count_returns(instance):
    scheduler, runner = instance.scheduler, instance.runner
    instance.add_request("a", [5, 6, 7, 8], GREEDY)
    request = scheduler.requests["a"]
    first = scheduler.schedule()
    first_handle = runner.launch(first)
    assert request.num_pending_tokens == 1 and request.output_token_ids == []
    second = scheduler.schedule()  # feeds the first sample, still on the device
    assert second.num_scheduled_tokens == {"a": 1}
    second_handle = runner.launch(second)
    assert request.num_pending_tokens == 2
    assert runner.states["a"].step == 1  # the second sample follows one generated token
    result = runner.collect(first_handle)
    assert result.request_ids == ["a"] and request.output_token_ids == result.sampled_token_ids
    assert request.num_pending_tokens == 1
    assert runner.collect(first_handle) is result  # collecting again changes nothing
    assert len(request.output_token_ids) == 1
    scheduler.update(first, result)
    scheduler.update(second, runner.collect(second_handle))
    assert request.num_pending_tokens == 0 and len(request.output_token_ids) == 2


def test_overlapped_steps_give_the_tokens_of_steps_run_one_at_a_time(model_path):
    prompts = [[5, 6, 7, 8], [9, 10], list(range(20, 45))]

    def tokens(overlap: bool) -> list[list[int]]:
        llm = LLM(
            str(model_path),
            device="cpu",
            max_model_len=64,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            overlap=overlap,
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        llm.instance.scheduler.check_invariants()
        return [o.outputs[0].token_ids for o in outs]

    assert tokens(overlap=True) == tokens(overlap=False)


def test_a_sample_of_a_request_aborted_while_its_step_runs_is_dropped(instance):
    scheduler, runner = instance.scheduler, instance.runner
    instance.add_request("a", [5, 6, 7], GREEDY)
    instance.add_request("b", [8, 9], GREEDY)
    request = scheduler.requests["a"]
    step = scheduler.schedule()
    handle = runner.launch(step)
    assert instance.abort("a")
    after = scheduler.schedule()
    assert "a" in after.finished_request_ids and "a" not in after.num_scheduled_tokens
    runner.launch(after)  # the runner forgets "a" before the earlier step is collected
    result = runner.collect(handle)
    assert result.request_ids == ["b"]
    assert request.output_token_ids == []
    scheduler.update(step, result)
    assert "a" not in runner.states


def test_a_preempted_request_resumes_with_its_outputs_fed_again(model_path):
    """A pool too small for both requests: the newest is preempted mid-decode, then recomputed
    from its prompt and the outputs it had; its tokens are those of a run alone."""
    prompts = [list(range(5, 30)), list(range(40, 60))]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)

    def run(**options) -> tuple[list[list[int]], int]:
        llm = LLM(str(model_path), device="cpu", max_model_len=64, block_size=4, **options)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.instance.scheduler.check_invariants()
        return [o.outputs[0].token_ids for o in outs], llm.instance.scheduler.num_preemptions

    roomy, none = run()
    tight, preemptions = run(num_gpu_blocks_override=19)
    assert none == 0 and preemptions > 0
    assert tight == roomy
