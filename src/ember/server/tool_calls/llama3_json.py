"""Llama 3.1-3.3 JSON tool calls: `{"name": ..., "parameters": {...}}` where the reply starts
(or after `<|python_tag|>`), several separated by `;`."""

from __future__ import annotations

from collections.abc import Callable

from ember.server.tool_calls.base import (
    CallRead,
    find_marker,
    read_call_objects,
    read_json,
    skip_marker,
)
from ember.server.tool_calls.grammar import lark_calls

PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonParser:
    bare_opener = "{"
    separators = " \t\r\n;"
    argument_key = "parameters"

    def find_start(self, text: str, pos: int) -> int | None:
        return find_marker(text, pos, PYTHON_TAG)

    def read_call(self, text: str, start: int, final: bool) -> CallRead:
        body = start
        if not text.startswith(self.bare_opener, start):
            skipped = skip_marker(text, start, PYTHON_TAG, final)
            if isinstance(skipped, CallRead):
                return skipped
            body = skipped
        found = read_json(text, body, final)
        if isinstance(found, CallRead):
            return found  # after <|python_tag|>, code for a built-in tool is not a JSON call
        return read_call_objects(found[0], found[1], _ARGUMENT_KEYS)

    def forced_grammar(self, call: str, parallel: bool, marker: Callable[[str], str]) -> str:
        # Bare JSON, as the Llama 3.1 template shows it (<|python_tag|> opens built-in tools).
        return lark_calls(call, "; " if parallel else None)
