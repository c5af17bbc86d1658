"""The grammars of a constrained gpt-oss reply: analysis messages are free (any text until
`<|end|>`, then the next header), and only the final message's text, or the call's arguments,
follow the constraint. Checked on the engine's masks, with harmony's markers as tokens (gpt-oss)
and as text (a tokenizer without them, read as harmony by the flag)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers.grammar_writer import GrammarWriter
from helpers.harmony import harmony_tokenizer, plain_byte_tokenizer

from ember.server.harmony.grammar import final_answer, forced_call
from ember.server.harmony.parser import HarmonyReader
from ember.server.reply import read_reply
from ember.structured_output.compiler import GrammarCompiler
from ember.structured_output.grammar import constraint_lark
from ember.structured_output.params import StructuredOutputsParams as Params
from ember.tokenizer.harmony import harmony_stop_token_ids

POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
    "required": ["x"],
    "additionalProperties": False,
}
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
PARAMETERS = {"move": POINT, "stop": NOTHING}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": parameters}}
    for name, parameters in PARAMETERS.items()
]
ANALYSIS = "<|channel|>analysis<|message|>Two {steps}: think, <b>then</b> answer.<|end|>"


def writer_for(tokenizer) -> GrammarWriter:
    eos = harmony_stop_token_ids(tokenizer.added_token_id) or (0,)
    return GrammarWriter(GrammarCompiler(tokenizer, tokenizer.vocab_size, eos), eos)


def allowed(writer: GrammarWriter, grammar) -> set[int]:
    return set(writer.allowed(grammar).nonzero()[0].tolist())


@pytest.mark.parametrize(
    "tokenizer", [harmony_tokenizer(), plain_byte_tokenizer()], ids=["tokens", "text"]
)
def test_the_final_message_follows_the_schema_after_free_analysis(tokenizer):
    writer = writer_for(tokenizer)
    params = Params(
        grammar=final_answer(constraint_lark(Params(json=POINT)), tokenizer.added_token_id)
    )
    script = tokenizer.encode(
        ANALYSIS + "<|start|>assistant<|channel|>final<|message|>", add_special_tokens=False
    )
    for seed in range(3):
        ids, finish = writer.write(writer.compiler.matcher(params), script, seed, 300)
        assert ids[: len(script)] == script and finish == "stop"
        reply = read_reply(HarmonyReader(), tokenizer.decode(ids, skip_special_tokens=False))
        assert reply.reasoning == "Two {steps}: think, <b>then</b> answer."
        jsonschema.validate(json.loads(reply.content), POINT)


def test_the_analysis_allows_any_text_and_its_end_marker_only():
    tokenizer = harmony_tokenizer()
    writer = writer_for(tokenizer)
    end = tokenizer.added_token_id("<|end|>")
    params = Params(
        grammar=final_answer(constraint_lark(Params(json=POINT)), tokenizer.added_token_id)
    )
    grammar = writer.compiler.matcher(params)
    free = writer.compiler.matcher(Params(regex="(?s:.*)"))
    header = tokenizer.encode("<|channel|>analysis<|message|>", add_special_tokens=False)
    grammar.catch_up(header)
    text = tokenizer.encode("Zürich {is} <|end> ", add_special_tokens=False)
    for step in range(len(text) + 1):
        grammar.catch_up(header + text[:step])
        free.catch_up(text[:step])
        expected = allowed(writer, free) - set(writer.eos_token_ids)
        if allowed(writer, free) & set(writer.eos_token_ids):  # between characters
            expected.add(end)
        assert allowed(writer, grammar) == expected


@pytest.mark.parametrize(
    "tokenizer", [harmony_tokenizer(), plain_byte_tokenizer()], ids=["tokens", "text"]
)
def test_a_forced_call_names_an_offered_tool_with_valid_arguments(tokenizer):
    writer = writer_for(tokenizer)
    params = Params(grammar=forced_call(TOOLS, tokenizer.added_token_id))
    # (the writer drawing after a bare header could add analysis messages of random text)
    script = tokenizer.encode(
        ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.", add_special_tokens=False
    )
    names = set()
    for seed in range(6):
        ids, finish = writer.write(writer.compiler.matcher(params), script, seed, 300)
        assert finish == "stop"
        reply = read_reply(HarmonyReader(), tokenizer.decode(ids, skip_special_tokens=False))
        (call,) = reply.calls
        names.add(call.name)
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    assert names == {"move", "stop"}
