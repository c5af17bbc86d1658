"""Tool calls the model must make (tool_choice "required" or a named function), as a grammar:
the output is nothing but calls in the parser's format, each to one of the offered tools with
arguments that match that tool's parameters.

Parameters are compiled leniently (a JSON-schema keyword llguidance does not implement is
ignored rather than refusing the request), with ember's bounded JSON whitespace. A marker that
is one token of the model's vocabulary (Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]`) may be
written as that token or as its text (`ember.structured_output.lark.token_or_text`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ember.structured_output.grammar import json_options
from ember.structured_output.lark import lark_string, token_or_text
from ember.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from ember.server.tool_calls.base import ToolCallParser


def forced_calls(
    parser: ToolCallParser,
    tools: list[dict[str, Any]],
    parallel: bool,
    added_token_id: Callable[[str], int | None],
) -> StructuredOutputsParams:
    """The constraint holding a reply to calls of ``tools`` (OpenAI tool entries) in
    ``parser``'s format; ``added_token_id``: the id of a text that is one added token of the
    model's vocabulary (else None)."""
    schema = call_schema(tools, parser.argument_key)
    call = f"%json {json.dumps(schema)}"

    def marker(text: str) -> str:
        return token_or_text(text, added_token_id)

    return StructuredOutputsParams(grammar=parser.forced_grammar(call, parallel, marker))


def call_schema(tools: list[dict[str, Any]], argument_key: str) -> dict[str, Any]:
    """The JSON schema of one call object: a tool's name and its arguments under
    ``argument_key``, for any of ``tools``."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                argument_key: parameters_schema(tool),
            },
            "required": ["name", argument_key],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return with_call_options(schema)


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a tool's arguments (an OpenAI tool entry): its parameters, else any
    object."""
    return tool["function"].get("parameters") or {"type": "object"}


def with_call_options(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` compiled as calls are: lenient, with ember's bounded JSON whitespace."""
    return {**schema, "x-guidance": {**json_options(), "lenient": True}}


def lark_calls(call: str, separator: str | None) -> str:
    """A Lark grammar of one ``call`` (a Lark expression), or with ``separator`` of one or
    more separated by it."""
    if separator is None:
        return f"start: {call}\n"
    return f"start: call ({lark_string(separator)} call)*\ncall: {call}\n"
