"""Prompt logprobs (`SamplingParams.prompt_logprobs`) on a tiny random model (CPU, float32):
each prompt token's logprob, rank and top alternatives equal transformers' log_softmax of the
logits at the position before it, whether the prompt is fed in one step or in chunks, with or
without overlap, across a preemption; a prompt-only request (max_tokens 0) samples nothing; a
request that does not ask is untouched by one that does."""

from __future__ import annotations

import pytest
import torch
from helpers.eager_graphs import EagerStepGraphs, llm_with_planned_attention
from helpers.hf_reference import prompt_log_softmax
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams

PROMPT = [5, 9, 14, 3, 77, 21, 8, 90, 4, 1, 2, 3, 4, 5, 6, 7, 8, 300, 41, 99, 12, 6, 50, 7, 33]
TOP = 3
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("prompt-lp"), seed=3)


@pytest.fixture(scope="module")
def reference(model_path) -> torch.Tensor:
    return prompt_log_softmax(model_path, PROMPT)


def make_llm(model_path, **options) -> LLM:
    options = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64, **options}
    return LLM(str(model_path), device="cpu", **options)


def assert_matches_reference(prompt_logprobs, reference: torch.Tensor, top: int = TOP) -> None:
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for j in range(1, len(PROMPT)):
        row, entry = reference[j - 1], prompt_logprobs[j]
        token = PROMPT[j]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=TOLERANCE)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        values, ids = row.topk(top)
        for rank, (token_id, value) in enumerate(zip(ids.tolist(), values.tolist()), start=1):
            assert entry[token_id].logprob == pytest.approx(value, abs=TOLERANCE)
            if token_id != token:
                assert entry[token_id].rank == rank
        assert set(entry) <= {token, *ids.tolist()}


def test_prompt_logprobs_equal_transformers(model_path, reference):
    llm = make_llm(model_path)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, params)
    assert_matches_reference(out.prompt_logprobs, reference)
    assert len(out.outputs[0].token_ids) == 2
    assert out.prompt_logprobs[1][PROMPT[1]].decoded_token == llm.get_tokenizer().decode(
        [PROMPT[1]], skip_special_tokens=False
    )


@pytest.mark.parametrize(
    ("overlap", "chunk"), [(False, 8), (True, 8), (False, 1)], ids=["8", "8-overlap", "1"]
)
def test_a_prompt_longer_than_the_step_budget_is_scored_chunk_by_chunk(
    model_path, reference, overlap, chunk
):
    llm = make_llm(
        model_path,
        max_num_batched_tokens=8,
        max_num_seqs=8,
        long_prefill_token_threshold=chunk,
        overlap=overlap,
    )
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, params)
    assert llm.instance.scheduler.step_counts.prefill_steps == -(-len(PROMPT) // chunk)
    assert_matches_reference(out.prompt_logprobs, reference)


def test_a_one_token_prompt_has_only_the_leading_none(model_path):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    (out,) = make_llm(model_path).generate({"prompt_token_ids": [7]}, params)
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_zero_give_the_prompt_token_alone(model_path, reference):
    llm = make_llm(model_path, max_num_batched_tokens=8, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, params)
    assert all(list(entry) == [PROMPT[j]] for j, entry in enumerate(out.prompt_logprobs) if j)
    assert_matches_reference(out.prompt_logprobs, reference, top=0)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(model_path, reference):
    llm = make_llm(model_path, max_num_batched_tokens=8, max_num_seqs=8)
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, params)
    completion = out.outputs[0]
    assert completion.token_ids == [] and completion.text == ""
    assert completion.finish_reason == "length"
    assert_matches_reference(out.prompt_logprobs, reference, top=1)
    llm.instance.scheduler.check_invariants()


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="^max_tokens"):
        SamplingParams(max_tokens=0)
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match="^prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_preemption_scores_each_prompt_position_once(model_path, reference):
    """Preempted mid-prompt and again after the first token: one update carries the prompt
    logprobs, and they are the reference's."""
    instance = make_llm(model_path, max_num_batched_tokens=8, max_num_seqs=8).instance
    scheduler = instance.scheduler
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=TOP, ignore_eos=True)
    instance.add_request("a", PROMPT, params)
    updates = []
    for preempt_after in (2, 5):  # steps: into the prompt, then past the first sample
        for _ in range(preempt_after):
            updates += instance.step()
        updates += instance.loop.drain()
        scheduler.preempt_all()
    while instance.has_work():
        updates += instance.step()
    carrying = [u for u in updates if u.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is updates[0]
    assert scheduler.num_preemptions == 2
    assert len([t for u in updates for t in u.new_token_ids]) == 4
    from ember.logprobs import prompt_logprob_dicts

    entries = prompt_logprob_dicts(carrying[0].prompt_logprobs, str)
    assert_matches_reference(entries, reference)


def test_a_request_without_prompt_logprobs_is_untouched_by_one_with(model_path):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=5)
    other = [{"prompt_token_ids": [11, 12, 13, 14, 15, 16, 17]}]
    llm = make_llm(model_path, max_num_batched_tokens=16, max_num_seqs=8)
    (alone,) = llm.generate(other, greedy)
    both = llm.generate(other + [{"prompt_token_ids": PROMPT}], [greedy, scored])
    assert both[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert both[0].prompt_logprobs is None and alone.prompt_logprobs is None
    assert len(both[1].prompt_logprobs) == len(PROMPT)


def test_steps_that_score_prompt_rows_run_eagerly_beside_graphs(model_path, reference, monkeypatch):
    """With (CPU stand-in) CUDA graphs: the steps with prompt rows to score run eagerly, the
    rest replay graphs, and tokens are those of a run without graphs."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=TOP)
    prompts = [{"prompt_token_ids": [11, 12, 13, 14, 15, 16, 17]}, {"prompt_token_ids": PROMPT}]

    def run(params: list[SamplingParams], graphs: bool):
        llm = llm_with_planned_attention(
            monkeypatch,
            str(model_path),
            device="cpu",
            max_model_len=64,
            max_num_seqs=8,
            max_num_batched_tokens=16,
        )
        replayed = EagerStepGraphs.install(llm, max_tokens=16).replayed if graphs else []
        outs = llm.generate(prompts, params)
        llm.instance.scheduler.check_invariants()
        return outs, replayed

    plain, plain_replayed = run([greedy, greedy], graphs=True)
    outs, replayed = run([greedy, scored], graphs=True)
    eager, _ = run([greedy, scored], graphs=False)
    tokens = [[o.outputs[0].token_ids for o in r] for r in (plain, outs, eager)]
    assert tokens[0] == tokens[1] == tokens[2]
    assert_matches_reference(outs[1].prompt_logprobs, reference)
    # Steps 1 and 2 feed prompt chunks (mixed graphs), then every step is one token a sequence,
    # the prompt's last one included (decode graphs, with no prompt row left to score).
    kinds = [[key.decode for key, _ in r] for r in (plain_replayed, replayed)]
    assert kinds[0] == [False, False] + kinds[1] and kinds[1] and all(kinds[1])
