"""Where a JSON value that is still being generated ends: strings, escapes and nesting
tracked, so that a streamed call is known complete, incomplete or impossible."""

from __future__ import annotations

# The result when the brackets cannot belong to one JSON value (a `}` closing a `[`, ...).
INVALID = -1

_CLOSERS = {"{": "}", "[": "]"}


def json_extent(text: str, start: int) -> int | None:
    """The index just past the object or array that opens at `text[start]`, None while it is
    unfinished, or INVALID when no continuation can make it whole."""
    if start >= len(text) or text[start] not in _CLOSERS:
        return INVALID
    expected: list[str] = []
    in_string = escaped = False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in _CLOSERS:
            expected.append(_CLOSERS[char])
        elif char in "}]":
            if char != expected.pop():
                return INVALID
            if not expected:
                return i + 1
    return None
