"""A request's structured output as an llguidance grammar, and whether that grammar is valid;
`constraint_lark` writes it as a Lark grammar, for the server to nest where a reply's answer
goes (after a reasoning model's thinking).

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
    return llguidance.LLMatcher.grammar_from_lark(_lark(params.grammar))


def constraint_lark(params: StructuredOutputsParams) -> str:
    """``params``' constraint (validated: one) as a whole Lark grammar of the same language as
    `grammar_for`'s, to nest in a larger one (`ember.structured_output.lark.nested`). ValueError
    as `grammar_for`."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _schema(params.json)
        # The schema's own compile options win, as llguidance's defaults= gives them.
        own = schema.get("x-guidance")
        options = {
            **json_options(params.disable_any_whitespace),
            **(own if isinstance(own, dict) else {}),
        }
        return f"start: %json {json.dumps({**schema, 'x-guidance': options})}\n"
    if kind == "regex":
        return f"start: /{llguidance.regex_to_lark(params.regex)}/\n"
    if kind == "choice":
        return "start: " + " | ".join(json.dumps(option) for option in params.choice) + "\n"
    return _lark(params.grammar)


def check_grammar(params: StructuredOutputsParams) -> None:
    """ValueError saying what is wrong when ``params``' grammar does not compile (a schema
    llguidance cannot follow, a regex or grammar that does not parse)."""
    error = llguidance.LLMatcher.validate_grammar(grammar_for(params))
    if error:
        raise ValueError(_first_lines(error))


def _lark(grammar: str) -> str:
    """A Lark or GBNF grammar as Lark (Lark passes as it is; GBNF is converted)."""
    try:
        return any_to_lark(grammar)
    except Exception as exc:  # noqa: BLE001 - the converter raises its own parse errors
        raise ValueError(f"the grammar is neither Lark nor GBNF: {exc}") from None


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
