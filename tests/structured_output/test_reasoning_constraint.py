"""A constraint on a reasoning model's answer, through the engine (a tiny random model with
SmolLM2's tokenizer plus Qwen3's `<think>` tags as tokens): while the reasoning runs, the
grammar rows draw what they would draw without a grammar (the mask allows any text and
`</think>`); from the token after `</think>`, they draw the answer the constraint allows. With
overlap, each grammar still consumes exactly its request's recorded tokens."""

from __future__ import annotations

import codecs
import json
import random

import jsonschema
import pytest
from helpers.think import make_think_model

from ember import LLM, SamplingParams
from ember.server.reasoning.think import ThinkTags
from ember.server.reasoning.think_grammar import after_thinking
from ember.structured_output.grammar import constraint_lark
from ember.structured_output.params import StructuredOutputsParams as Params

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_think_model(tmp_path_factory.mktemp("think"))


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "overlap"])
def llm(model_path, request):
    return LLM(str(model_path), device="cpu", max_model_len=256, overlap=request.param)


def after_reasoning(llm: LLM, answer: Params) -> Params:
    tokenizer = llm.get_tokenizer()
    grammar = after_thinking(constraint_lark(answer), ThinkTags(True), tokenizer.added_token_id)
    return Params(grammar=grammar)


def random_prompts(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(100, 40_000) for _ in range(rng.randrange(2, 12))]}
        for _ in range(count)
    ]


def test_the_reasoning_draws_what_it_would_draw_without_a_grammar(llm):
    prompts = random_prompts(8, seed=2)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0, max_tokens=24, structured_outputs=after_reasoning(llm, Params(json=PERSON))
    )
    free = [out.outputs[0].token_ids for out in llm.generate(prompts, plain)]
    held = [out.outputs[0] for out in llm.generate(prompts, constrained)]
    llm.instance.scheduler.check_invariants()
    compared = 0
    for tokens, output in zip(free, held):
        length = text_length(llm, tokens)
        assert output.token_ids[:length] == tokens[:length]
        assert output.finish_reason == "length"  # still reasoning: no answer yet
        compared += length
    assert compared > 8 * 24 // 2  # most of the reasoning was compared


def text_length(llm: LLM, tokens: list[int]) -> int:
    """How many of ``tokens`` a reasoning may hold: text up to the first special token (an EOS,
    a tag) or the first token that breaks UTF-8 (a random model writes stray bytes, which
    text under a grammar never holds)."""
    tokenizer = llm.get_tokenizer()
    special = set(tokenizer.all_special_ids) | set(range(49152, 49160))
    ll_tokenizer = llm.instance.plan.grammars.ll_tokenizer
    decoder = codecs.getincrementaldecoder("utf-8")()
    for index, token in enumerate(tokens):
        if token in special:
            return index
        try:
            decoder.decode(ll_tokenizer.decode_bytes([token]))
        except UnicodeDecodeError:
            return index
    return len(tokens)


def test_after_the_reasoning_ends_the_answer_follows_the_schema(llm):
    tokenizer = llm.get_tokenizer()
    close = tokenizer.added_token_id("</think>")
    # The model is pushed to close its reasoning at once; once closed, the tag is refused.
    params = SamplingParams(
        temperature=0,
        max_tokens=120,
        logit_bias={close: 100.0},
        structured_outputs=after_reasoning(llm, Params(json=PERSON)),
    )
    outputs = [out.outputs[0] for out in llm.generate(random_prompts(8, seed=3), params)]
    llm.instance.scheduler.check_invariants()
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        assert output.token_ids[0] == close and close not in output.token_ids[1:]
        answer = tokenizer.decode(output.token_ids[1:])
        jsonschema.validate(json.loads(answer), PERSON)
    assert len({output.text for output in outputs}) > 1
