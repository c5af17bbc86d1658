"""Each constraint becomes an llguidance grammar; one that does not compile is a ValueError
saying what is wrong (the front end's 400)."""

from __future__ import annotations

import pytest

from ember.structured_output.grammar import check_grammar, constraint_lark
from ember.structured_output.lark import nested
from ember.structured_output.params import StructuredOutputsParams as Params

COMPILES = [
    Params(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    Params(json='{"type": "array", "items": {"type": "string"}}'),
    Params(json_object=True),
    Params(regex=r"\d{3}-[a-z]+"),
    Params(choice=["yes", 'a "quoted" one', "ünïcode", ""]),
    Params(grammar='start: item+\nitem: "a" | "b"'),
    Params(grammar='root ::= "yes" | "no"'),  # GBNF, as llama.cpp writes it
]

FAILS = [
    (Params(json={"type": "objectx"}), "objectx"),
    (Params(json="{not json"), "not valid JSON"),
    (Params(json="[1, 2]"), "must be a JSON object"),
    (Params(json={"type": "string", "pattern": "(("}), "unclosed group"),
    (Params(regex="a(("), "unclosed group"),
    (Params(grammar="start: missing_rule"), "unknown name"),
    (Params(grammar='root ::= ("yes"'), r"neither Lark nor GBNF: Expected '\)'"),
    (Params(grammar="root ::= answer"), "Rule 'answer' not found"),
]


@pytest.mark.parametrize("params", COMPILES, ids=lambda p: p.kind)
def test_valid_constraints_compile(params):
    check_grammar(params)


@pytest.mark.parametrize(("params", "message"), FAILS)
def test_invalid_constraints_say_what_is_wrong(params, message):
    with pytest.raises(ValueError, match=message):
        check_grammar(params)


def test_json_whitespace_is_bounded_unless_disabled(compiler):
    """A line break and up to 16 spaces between JSON tokens, never more: a model cannot run
    to its length limit on whitespace. disable_any_whitespace allows none."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    texts = {
        '{"a": 1}': (True, False),
        '{\n  "a": 1\n}': (True, False),
        '{"a":1}': (True, True),
        "{" + " " * 17 + '"a": 1}': (False, False),
    }
    for compact in (False, True):
        params = Params(json=schema, disable_any_whitespace=compact)
        for text, accepted in texts.items():
            grammar = compiler.matcher(params)
            tokens = compiler.ll_tokenizer.tokenize_str(text)
            ok = grammar.matcher.consume_tokens(tokens) and grammar.matcher.is_accepting()
            assert ok == accepted[compact], (text, compact)


def accepts(compiler, params: Params, text: str) -> bool:
    grammar = compiler.matcher(params)
    tokens = compiler.ll_tokenizer.tokenize_str(text)
    return grammar.matcher.consume_tokens(tokens) and grammar.matcher.is_accepting()


SAMPLES = {
    "json": (
        Params(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        ['{"a": 1}', '{\n  "a": 2\n}', '{"a": "x"}', "{" + " " * 17 + '"a": 1}', "[]"],
    ),
    "json_compact": (
        Params(json={"type": "object"}, disable_any_whitespace=True),
        ['{"b":[1]}', '{"b": [1]}'],
    ),
    "json_object": (Params(json_object=True), ["{}", '{"k": null}', "1"]),
    "regex": (Params(regex=r"\d{2}/[a-z]+"), ["12/ab", "1/ab", "12/"]),
    "choice": (Params(choice=["yes", 'a "q"', ""]), ["yes", 'a "q"', "", "no"]),
    "lark": (Params(grammar='%ignore " "\nstart: item+\nitem: "a" | "b"'), ["a b", "ab", "c"]),
    "gbnf": (Params(grammar='root ::= "yes" | "no"'), ["yes", "no", "maybe"]),
}


@pytest.mark.parametrize("case", SAMPLES)
def test_the_lark_form_of_a_constraint_nests_with_the_same_language(compiler, case):
    """`constraint_lark`, nested as the server nests an answer, accepts what the constraint's
    own grammar accepts, and nothing else."""
    params, texts = SAMPLES[case]
    nested_params = Params(grammar="start: answer\n" + nested("answer", constraint_lark(params)))
    for text in texts:
        assert accepts(compiler, nested_params, text) == accepts(compiler, params, text), text
    assert any(accepts(compiler, params, text) for text in texts)
    assert not all(accepts(compiler, params, text) for text in texts)
