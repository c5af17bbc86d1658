"""Every output of a constrained request follows its constraint: hundreds of samples of a
random-weight model (whose own distribution follows nothing) with SmolLM2's real tokenizer,
greedy from random prompts and drawn at a temperature, in batches. A request without a
constraint gets the same tokens beside constrained ones as alone."""

from __future__ import annotations

import ast
import json
import random
import re

import jsonschema
import pytest
from helpers.tiny_models import make_tiny_model
from helpers.tools import function_tool

from ember import LLM, SamplingParams
from ember.server.tool_calls.registry import PARSERS
from ember.server.tool_calls.request import tool_use
from ember.server.tool_calls.schema import ChatTool, NamedToolChoice
from ember.server.tool_calls.stream import parse_output
from ember.structured_output.params import StructuredOutputsParams as Params

pytestmark = pytest.mark.slow

GREEDY_SAMPLES = 40  # per constraint, one batch of random prompts
DRAWN_SAMPLES = 4  # per constraint at temperature 1 (a CPU draw costs ~30 ms a row)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"type": ["number", "null"]},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)"
COLORS = ["red", "green", "blue", "light blue"]
ARITHMETIC = """start: sum
sum: product (("+" | "-") product){0,2}
product: atom (("*" | "/") atom){0,2}
atom: NUMBER | "(" NUMBER ("+" NUMBER){0,2} ")"
NUMBER: /[1-9][0-9]{0,2}/
"""
PAIRS_GBNF = 'root ::= "[" pair ("," pair)? "]"\npair ::= [a-z] "=" [0-9]'


def valid_person(text: str) -> bool:
    jsonschema.validate(json.loads(text), PERSON)
    return True


def valid_expression(text: str) -> bool:
    ast.parse(text, mode="eval")  # SyntaxError unless it is an expression
    return re.fullmatch(r"[0-9()+\-*/]+", text) is not None


CASES = {
    "json_schema": (Params(json=PERSON), valid_person),
    "json_compact": (Params(json=PERSON, disable_any_whitespace=True), valid_person),
    "regex": (Params(regex=EMAIL), lambda text: re.fullmatch(EMAIL, text) is not None),
    "choice": (Params(choice=COLORS), lambda text: text in COLORS),
    "lark": (Params(grammar=ARITHMETIC), valid_expression),
    "gbnf": (
        Params(grammar=PAIRS_GBNF),
        lambda text: re.fullmatch(r"\[[a-z]=\d(,[a-z]=\d)?\]", text),
    ),
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("constrained"), seed=4)
    return LLM(
        str(path),
        device="cpu",
        max_model_len=256,
        max_num_seqs=GREEDY_SAMPLES,
        max_num_batched_tokens=1024,
    )


def random_prompts(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(100, 40_000) for _ in range(rng.randrange(2, 12))]}
        for _ in range(count)
    ]


def completions(llm: LLM, prompts: list[dict], params: SamplingParams):
    outputs = [out.outputs[0] for out in llm.generate(prompts, params)]
    llm.instance.scheduler.check_invariants()
    return outputs


@pytest.mark.parametrize("case", CASES)
def test_every_output_follows_its_constraint(llm, case):
    constraint, valid = CASES[case]
    greedy = SamplingParams(temperature=0, max_tokens=120, structured_outputs=constraint)
    drawn = SamplingParams(temperature=1.0, max_tokens=120, structured_outputs=constraint)
    outputs = completions(llm, random_prompts(GREEDY_SAMPLES, seed=len(case)), greedy)
    outputs += completions(llm, random_prompts(DRAWN_SAMPLES, seed=99), drawn)
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        assert valid(output.text), output.text
    assert len({output.text for output in outputs}) > 1  # the prompts lead somewhere else


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(llm):
    params = SamplingParams(
        temperature=0, max_tokens=50, ignore_eos=True, structured_outputs=Params(choice=COLORS)
    )
    for output in completions(llm, random_prompts(8, seed=5), params):
        assert output.finish_reason == "stop" and output.text in COLORS
        assert llm.get_tokenizer().decode(output.token_ids) == output.text  # no EOS drawn


WEATHER = function_tool(
    "get_weather",
    city={"type": "string", "maxLength": 10},
    unit={"enum": ["celsius", "fahrenheit"]},
)
ADD = function_tool("add", a={"type": "integer", "maximum": 999}, b={"type": "integer"})
NAMED_ADD = NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}})


@pytest.mark.parametrize("parser", sorted(PARSERS))
@pytest.mark.parametrize("choice", ["required", NAMED_ADD], ids=["required", "named"])
def test_a_demanded_tool_call_is_always_made_with_valid_arguments(llm, parser, choice):
    tools = [ChatTool.model_validate(tool) for tool in (WEATHER, ADD)]
    use = tool_use(tools, choice, False, parser, None)
    constraint = use.forced_output(llm.get_tokenizer().added_token_id)
    params = SamplingParams(temperature=0, max_tokens=160, structured_outputs=constraint)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, ADD)}
    for output in completions(llm, random_prompts(12, seed=len(parser)), params):
        assert output.finish_reason == "stop", output.text
        (call,) = parse_output(use.parser, output.text).calls
        assert choice == "required" or call.name == "add"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_unconstrained_requests_get_the_same_tokens_beside_constrained_ones(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts(6, seed=11)
    alone = [output.token_ids for output in completions(llm, prompts, plain)]
    constrained = SamplingParams(
        temperature=0, max_tokens=12, structured_outputs=Params(json=PERSON)
    )
    mixed = [plain, constrained] * len(prompts)
    outputs = completions(llm, [p for p in prompts for _ in range(2)], mixed)
    assert [output.token_ids for output in outputs[::2]] == alone
    assert all(
        valid_person(output.text) for output in outputs[1::2] if output.finish_reason == "stop"
    )
