"""A request's structured output as an llguidance grammar, and whether that grammar is valid.

The front end validates every constraint here before it sends the request (a 400 names what is
wrong), so the engine only compiles grammars that compile. JSON is generated with bounded
whitespace: flexible JSON whitespace lets a model write spaces and line breaks forever, a known
way for constrained decoding to run to the length limit.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from ember.structured_output.params import StructuredOutputsParams

# Between two JSON tokens: at most one line break, then at most 16 spaces or tabs.
JSON_WHITESPACE = r"(\r?\n)?[\x20\x09]{0,16}"


def json_options(compact: bool = False) -> dict[str, Any]:
    """llguidance's JSON compile options (`x-guidance` in a schema) for ember's whitespace;
    ``compact``: none at all (disable_any_whitespace)."""
    if compact:
        return {"whitespace_flexible": False}
    return {"whitespace_pattern": JSON_WHITESPACE}


def grammar_for(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params`` (validated: one constraint). ValueError when the
    constraint cannot even be read (JSON schema text that is not JSON, GBNF that does not
    parse); whether the grammar compiles is `check_grammar`'s question."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _schema(params.json)
        options = json_options(params.disable_any_whitespace)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # A Lark string literal is a JSON string: json.dumps escapes it.
        lark = "start: " + " | ".join(json.dumps(option) for option in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    try:
        lark = any_to_lark(params.grammar)  # Lark passes as it is; GBNF is converted
    except Exception as exc:  # noqa: BLE001 - the converter raises its own parse errors
        raise ValueError(f"the grammar is neither Lark nor GBNF: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check_grammar(params: StructuredOutputsParams) -> None:
    """ValueError saying what is wrong when ``params``' grammar does not compile (a schema
    llguidance cannot follow, a regex or grammar that does not parse)."""
    error = llguidance.LLMatcher.validate_grammar(grammar_for(params))
    if error:
        raise ValueError(_first_lines(error))


def _schema(value: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    if isinstance(schema, dict):
        return schema
    raise ValueError("the JSON schema must be a JSON object")


def _first_lines(error: str, limit: int = 5) -> str:
    """llguidance's error without its parser dump (a message for a client, not a trace)."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return "\n".join(lines[:limit])
