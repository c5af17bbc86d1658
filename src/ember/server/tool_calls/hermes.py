"""Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
tagged object per call, as many as the model writes."""

from __future__ import annotations

import json
from collections.abc import Callable

from ember.server.tool_calls.base import (
    NEED_MORE,
    NOT_A_CALL,
    CallRead,
    find_marker,
    read_call_objects,
    read_json,
    skip_marker,
)
from ember.server.tool_calls.grammar import lark_calls

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_ARGUMENT_KEYS = ("arguments", "parameters")


class HermesParser:
    bare_opener = None
    separators = " \t\r\n"
    argument_key = "arguments"

    def find_start(self, text: str, pos: int) -> int | None:
        return find_marker(text, pos, OPEN)

    def read_call(self, text: str, start: int, final: bool) -> CallRead:
        body = skip_marker(text, start, OPEN, final)
        if isinstance(body, CallRead):
            return body
        close = text.find(CLOSE, body)
        if close < 0:
            if not final:
                return NEED_MORE
            # The output ended before the closing tag (a stop token or string took it).
            found = read_json(text, body, final)
            if isinstance(found, CallRead) or text[found[1] :].strip():
                return NOT_A_CALL
            return read_call_objects(found[0], len(text), _ARGUMENT_KEYS)
        try:
            value = json.loads(text[body:close])
        except ValueError:
            return NOT_A_CALL
        if isinstance(value, list):
            return NOT_A_CALL  # one object per tag
        return read_call_objects(value, close + len(CLOSE), _ARGUMENT_KEYS)

    def forced_grammar(self, call: str, parallel: bool, marker: Callable[[str], str]) -> str:
        # As Qwen2.5's template writes a call: each tag on a line of its own.
        tagged = f'{marker(OPEN)} "\\n" {call} "\\n" {marker(CLOSE)}'
        return lark_calls(tagged, "\n" if parallel else None)
