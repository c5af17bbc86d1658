"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or in the newer tokenizers
(v11+) `[TOOL_CALLS]name[ARGS]{...}` once per call."""

from __future__ import annotations

from collections.abc import Callable

from ember.server.tool_calls.base import (
    NEED_MORE,
    NOT_A_CALL,
    CallRead,
    Read,
    find_marker,
    read_call_objects,
    read_json,
    skip_marker,
)
from ember.server.tool_calls.calls import call_from_object

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ARGUMENT_KEYS = ("arguments", "parameters")


class MistralParser:
    bare_opener = "["
    separators = " \t\r\n"
    argument_key = "arguments"

    def find_start(self, text: str, pos: int) -> int | None:
        return find_marker(text, pos, TOOL_CALLS)

    def read_call(self, text: str, start: int, final: bool) -> CallRead:
        if TOOL_CALLS.startswith(text[start : start + len(TOOL_CALLS)]):
            body = skip_marker(text, start, TOOL_CALLS, final)
            if isinstance(body, CallRead):
                return body
        else:
            body = start  # a bare array: the marker was a skipped special token
        if body < len(text) and text[body] not in "[{":
            return _read_named_call(text, body, final)
        found = read_json(text, body, final)
        if isinstance(found, CallRead):
            return found
        return read_call_objects(found[0], found[1], _ARGUMENT_KEYS)

    def forced_grammar(self, call: str, parallel: bool, marker: Callable[[str], str]) -> str:
        # The array form, which every Mistral tokenizer's template reads back.
        calls = 'call (", " call)*' if parallel else "call"
        return f'start: {marker(TOOL_CALLS)} "[" {calls} "]"\ncall: {call}\n'


def _read_named_call(text: str, body: int, final: bool) -> CallRead:
    """`name[ARGS]{...}` (v11+ tokenizers)."""
    args = text.find(ARGS, body)
    name = text[body:] if args < 0 else text[body:args]
    if not name.replace("_", "a").replace("-", "a").replace(".", "a").isalnum():
        # `[ARGS]` may still be arriving at the end of the name
        pending = args < 0 and any(name.endswith(ARGS[:k]) for k in range(1, len(ARGS)))
        return NEED_MORE if pending and not final else NOT_A_CALL
    if args < 0:
        return NOT_A_CALL if final else NEED_MORE
    found = read_json(text, args + len(ARGS), final)
    if isinstance(found, CallRead):
        return found
    call = call_from_object({"name": name, "arguments": found[0]}, _ARGUMENT_KEYS)
    return CallRead(Read.CALLS, [call], found[1]) if call else NOT_A_CALL
