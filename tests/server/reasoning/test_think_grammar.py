"""A constraint on a `<think>` reply holds its answer only: the reasoning before `</think>` is
free (every text token allowed at every step), and from the first token after it the answer
follows the constraint. Checked on the engine's masks over a tokenizer whose tags are tokens (as
Qwen3's) and over one where they are text."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers.grammar_writer import GrammarWriter
from helpers.harmony import plain_byte_tokenizer
from helpers.think import think_tokenizer

from ember.server.reasoning.think import ThinkReader, ThinkTags
from ember.server.reasoning.think_grammar import after_thinking
from ember.server.reply import ToolCallReader, read_reply
from ember.server.tool_calls.registry import PARSERS
from ember.server.tool_calls.request import tool_use
from ember.server.tool_calls.schema import ChatTool
from ember.structured_output.compiler import GrammarCompiler
from ember.structured_output.grammar import constraint_lark
from ember.structured_output.params import StructuredOutputsParams as Params

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"enum": [1, 2, 3]}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
SCHEMA = Params(json=CITY)
REASONING = "The user wants {JSON}; I'll say Paris </thinking> <b>.\n"


def writer_for(tokenizer) -> GrammarWriter:
    eos = (tokenizer.added_token_id("<|im_end|>") or 0,)
    return GrammarWriter(GrammarCompiler(tokenizer, tokenizer.vocab_size, eos), eos)


def constraint(tokenizer, tags: ThinkTags, answer: Params = SCHEMA) -> Params:
    return Params(grammar=after_thinking(constraint_lark(answer), tags, tokenizer.added_token_id))


def allowed(writer: GrammarWriter, grammar) -> set[int]:
    return set(writer.allowed(grammar).nonzero()[0].tolist())


@pytest.mark.parametrize(
    "tokenizer", [think_tokenizer(), plain_byte_tokenizer()], ids=["tags", "text"]
)
@pytest.mark.parametrize("tags", [ThinkTags(True), ThinkTags(False)], ids=["inside", "before"])
def test_the_reasoning_is_free_and_the_answer_follows_the_schema(tokenizer, tags):
    writer = writer_for(tokenizer)
    opening = "" if tags.starts_inside else "<think>\n"
    script = tokenizer.encode(f"{opening}{REASONING}</think>\n\n", add_special_tokens=False)
    for seed in range(4):
        grammar = writer.compiler.matcher(constraint(tokenizer, tags))
        ids, finish = writer.write(grammar, script, seed, max_tokens=600)
        assert ids[: len(script)] == script and finish == "stop"
        reply = read_reply(ThinkReader(tags), tokenizer.decode(ids))
        assert reply.reasoning == REASONING.strip()
        jsonschema.validate(json.loads(reply.content), CITY)


def test_the_mask_allows_any_text_until_the_reasoning_ends():
    tokenizer = think_tokenizer()
    writer = writer_for(tokenizer)
    open_, close = tokenizer.added_token_id("<think>"), tokenizer.added_token_id("</think>")
    grammar = writer.compiler.matcher(constraint(tokenizer, ThinkTags(True)))
    free = writer.compiler.matcher(Params(regex="(?s:.*)"))  # any text, and nothing else
    eos = set(writer.eos_token_ids)
    reasoning = tokenizer.encode(REASONING + "Zürich", add_special_tokens=False)
    assert allowed(writer, grammar) == allowed(writer, free) - eos | {open_, close}
    for step in range(1, len(reasoning) + 1):
        grammar.catch_up(reasoning[:step])
        free.catch_up(reasoning[:step])
        # Whatever text may come, and </think> where the text may end (not within a
        # character's bytes); no end of sequence.
        text = allowed(writer, free)
        assert allowed(writer, grammar) == text - eos | ({close} if text & eos else set())
    grammar.catch_up([*reasoning, close])
    after = {tokenizer.decode([t]) for t in allowed(writer, grammar)}
    assert after == {" ", "\t", "\r", "\n", "{"}  # whitespace, or the JSON object


def test_a_model_that_opens_no_block_answers_at_once_under_qwen3():
    tokenizer = think_tokenizer()
    writer = writer_for(tokenizer)
    grammar = writer.compiler.matcher(constraint(tokenizer, ThinkTags(False)))
    first = {tokenizer.decode([t]) for t in allowed(writer, grammar)}
    assert first == {"<think>", "{"}  # the block, or the answer at once
    ids, finish = writer.write(grammar, [], seed=1, max_tokens=600)
    assert finish == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(ids)), CITY)


@pytest.mark.parametrize(
    "answer",
    [Params(regex=r"[a-z]{3}@x\.org"), Params(choice=["yes", "no way"]), Params(json_object=True)],
    ids=["regex", "choice", "json_object"],
)
def test_every_kind_of_constraint_holds_the_answer(answer):
    tokenizer = think_tokenizer()
    writer = writer_for(tokenizer)
    script = tokenizer.encode("Hmm.</think>\n", add_special_tokens=False)
    grammar = writer.compiler.matcher(constraint(tokenizer, ThinkTags(True), answer))
    ids, finish = writer.write(grammar, script, seed=3, max_tokens=600)
    content = read_reply(ThinkReader(ThinkTags(True)), tokenizer.decode(ids)).content
    assert finish == "stop"
    assert writer.compiler.matcher(answer).matcher.validate_tokens(
        tokenizer.encode(content, add_special_tokens=False)
    ) == len(tokenizer.encode(content, add_special_tokens=False))


def test_a_demanded_hermes_call_follows_the_reasoning():
    tokenizer = think_tokenizer()
    writer = writer_for(tokenizer)
    tool = {
        "type": "function",
        "function": {"name": "find", "parameters": CITY},
    }
    use = tool_use([ChatTool.model_validate(tool)], "required", False, "hermes", None)
    calls = use.forced_output(tokenizer.added_token_id)
    grammar = writer.compiler.matcher(constraint(tokenizer, ThinkTags(False), calls))
    script = tokenizer.encode("<think>\nA call.\n</think>\n\n", add_special_tokens=False)
    ids, finish = writer.write(grammar, script, seed=5, max_tokens=600)
    reply = read_reply(
        ThinkReader(ThinkTags(False), ToolCallReader(PARSERS["hermes"])),
        tokenizer.decode(ids),
    )
    (call,) = reply.calls
    assert finish == "stop" and reply.reasoning == "A call." and call.name == "find"
    jsonschema.validate(json.loads(call.arguments), CITY)
