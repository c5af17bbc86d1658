"""The runner's structured-output hook, step by step on a tiny model (CPU).

A row with a grammar draws under its mask, computed once the forward pass is enqueued and only
after the step in flight is collected (its grammar has consumed its newest sample); a step of
rows without grammars never collects early. The grammar consumes exactly the recorded outputs,
whatever overlap or preemption does, and a grammar that refuses a sample ends its request
alone, with the reason.
"""

from __future__ import annotations

import pytest
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.structured_output.matcher import GrammarError, GrammarMatcher
from ember.structured_output.params import StructuredOutputsParams

DIGITS = StructuredOutputsParams(regex="[0-9]{12}")
CONSTRAINED = SamplingParams(temperature=0, max_tokens=20, structured_outputs=DIGITS)
PLAIN = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("grammar-rows"))


def overlapped(model_path, **options) -> LLM:
    return LLM(
        str(model_path), device="cpu", max_model_len=64, max_num_seqs=4, overlap=True, **options
    )


def launch_two_steps(instance, params: SamplingParams):
    """Schedule and launch a prefill, then the decode that feeds its sample (still in flight
    on a GPU): the handles and the request."""
    instance.add_request("r", [5, 6, 7, 8], params)
    request = instance.scheduler.requests["r"]
    first = instance.runner.launch(instance.scheduler.schedule())
    second = instance.runner.launch(instance.scheduler.schedule())
    return first, second, request


def test_a_grammar_row_collects_the_step_in_flight_before_its_mask(model_path):
    instance = overlapped(model_path).instance
    first, second, request = launch_two_steps(instance, CONSTRAINED)
    assert first.result is not None  # collected inside the second launch
    assert request.grammar.num_consumed == len(request.output_token_ids) == 1
    assert second.grammar_states == [instance.runner.states["r"]]
    instance.runner.collect(second)
    assert request.grammar.num_consumed == 2


def test_a_step_without_grammar_rows_never_collects_early(model_path):
    instance = overlapped(model_path).instance
    first, second, request = launch_two_steps(instance, PLAIN)
    assert first.result is None and request.output_token_ids == []
    assert second.grammar_states is None


def digits(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], CONSTRAINED)
    llm.instance.scheduler.check_invariants()
    texts = [out.outputs[0].text for out in outputs]
    assert all(text.isdigit() and len(text) == 12 for text in texts), texts
    return [out.outputs[0].token_ids for out in outputs]


PROMPTS = [list(range(5, 30)), list(range(40, 60)), [7, 8, 9]]


def test_overlap_and_preemption_keep_each_grammar_in_step_with_its_outputs(model_path):
    """The same tokens one step at a time, overlapped, and with a pool so small that requests
    are preempted mid-output and recomputed (their grammars keep what they consumed)."""
    plain = digits(LLM(str(model_path), device="cpu", max_model_len=64), PROMPTS)
    assert digits(overlapped(model_path), PROMPTS) == plain
    tight = overlapped(model_path, block_size=4, num_gpu_blocks_override=19)
    assert digits(tight, PROMPTS) == plain
    assert tight.instance.scheduler.num_preemptions > 0


class RefusesTheThirdToken(GrammarMatcher):
    """A grammar that refuses its request's third sample (as a desynchronised one would)."""

    __slots__ = ()

    def catch_up(self, output_token_ids: list[int]) -> None:
        if len(output_token_ids) >= 3 and self.error is None:
            self.error = "token 3 refused"
            raise GrammarError(self.error)
        super().catch_up(output_token_ids)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_refused_sample_fails_its_request_alone_with_the_reason(model_path, overlap):
    llm = LLM(str(model_path), device="cpu", max_model_len=64, overlap=overlap)
    pool = llm.engine.pool
    failing = pool.add_request(llm.model_name, "failing", [5, 6, 7], CONSTRAINED)
    failing.grammar = RefusesTheThirdToken(failing.grammar.matcher, failing.grammar.vocab_size)
    healthy = pool.add_request(llm.model_name, "healthy", [8, 9], CONSTRAINED)
    rejections = []
    while pool.has_work():
        pool.step()
        rejections += pool.take_rejections()
    assert [(r.request_id, r.message) for r in rejections] == [
        ("failing", "structured output failed: token 3 refused")
    ]
    assert failing.is_finished and failing.finish_reason.value == "abort"
    assert healthy.finish_reason.value == "stop" and len(healthy.output_token_ids) == 12
    llm.instance.scheduler.check_invariants()
