"""Constraints on a gpt-oss reply, as grammars of the whole harmony reply: any number of
analysis messages, free, then the one message the constraint is about.

- `final_answer`: the final channel's message, its text held to a constraint (response_format,
  guided decoding): ``<|channel|>final<|message|>{answer}``.
- `forced_call`: a call to one of the tools, its arguments held to that tool's parameters:
  ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``, as gpt-oss
  writes a call (tool_choice "required", or a named function).

The prompt ends with ``<|start|>assistant``, so the reply's first header has no role and every
later one is opened by ``<|start|>assistant``. The grammar is complete once the constrained
message is whole: the request then ends, without the ``<|return|>`` or ``<|call|>`` the model
would write next (the reader closes the message at the reply's end).
"""

from __future__ import annotations

import json
from typing import Any

from ember.server.tool_calls.grammar import parameters_schema, with_call_options
from ember.structured_output.lark import AddedTokenId, exact_marker, lark_string, nested, text_until
from ember.tokenizer.harmony import CHANNEL, CONSTRAIN, END, MESSAGE, START


def final_answer(answer: str, added_token_id: AddedTokenId) -> str:
    """The Lark grammar of a reply whose final message follows ``answer`` (a whole Lark
    grammar); ``added_token_id``: the tokenizer's (harmony's markers are its tokens)."""
    marker = _markers(added_token_id)
    return (
        f'start: analysis* {marker[CHANNEL]} "final" {marker[MESSAGE]} answer\n'
        + _analysis_rules(marker, added_token_id)
        + nested("answer", answer)
    )


def forced_call(tools: list[dict[str, Any]], added_token_id: AddedTokenId) -> str:
    """The Lark grammar of a reply that calls one of ``tools`` (OpenAI tool entries) once."""
    marker = _markers(added_token_id)
    calls = []
    for tool in tools:
        header = lark_string(f"commentary to=functions.{tool['function']['name']} ")
        arguments = json.dumps(with_call_options(parameters_schema(tool)))
        calls.append(
            f'{marker[CHANNEL]} {header} {marker[CONSTRAIN]} "json" {marker[MESSAGE]} '
            f"%json {arguments}"
        )
    return (
        "start: analysis* call\ncall: "
        + "\n    | ".join(calls)
        + "\n"
        + _analysis_rules(marker, added_token_id)
    )


def _markers(added_token_id: AddedTokenId) -> dict[str, str]:
    """Harmony's markers as Lark expressions: each its token where the vocabulary has it."""
    return {
        text: exact_marker(text, added_token_id) for text in (START, CHANNEL, CONSTRAIN, MESSAGE)
    }


def _analysis_rules(marker: dict[str, str], added_token_id: AddedTokenId) -> str:
    """The rule `analysis`: one analysis message and the header that opens the next one."""
    return (
        f'analysis: {marker[CHANNEL]} "analysis" {marker[MESSAGE]} analysis_text '
        f'{marker[START]} "assistant"\n' + text_until("analysis_text", END, added_token_id)
    )
