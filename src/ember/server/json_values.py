"""Values that Python's `json` reads but JSON itself (RFC 8259) has no room for: the NaN and
±Infinity literals, and strings with lone surrogates ("\\ud800" escapes), which cannot become
UTF-8 for the tokenizer, the engine process or a reply. A request body holding one anywhere is
refused before any of its fields is used."""

from __future__ import annotations

import math
from typing import Any

# A path quoted back to the client is cut here: keys are the client's text, of any length.
MAX_PATH_CHARS = 200


def find_non_json_value(body: Any) -> tuple[str, str] | None:
    """``(path, reason)`` of one such value in `body` (path: keys and indexes joined by
    dots, as the server names parameters; "" for the body itself), or None if there is none.

    Iterative, so a deeply nested body cannot exhaust the stack.
    """
    reason = _scalar_problem(body)
    if reason is not None:
        return "", reason
    stack: list[tuple[tuple[str, ...], Any]] = [((), body)] if _is_container(body) else []
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            if not all(is_utf8(key) for key in node if isinstance(key, str)):
                return _dotted(path), "a key is not valid Unicode text (it has a lone surrogate)"
            items = node.items()
        else:
            items = enumerate(node)
        children = []
        for key, child in items:
            kind = type(child)
            if kind is int or kind is bool or child is None:
                continue  # the common case (token ids), settled first
            reason = _scalar_problem(child)
            if reason is not None:
                return _dotted((*path, str(key))), reason
            if _is_container(child):
                children.append(((*path, str(key)), child))
        stack.extend(reversed(children))  # depth first, in the body's order
    return None


def is_utf8(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (it has no lone surrogate)."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _scalar_problem(value: Any) -> str | None:
    if isinstance(value, str) and not is_utf8(value):
        return "not valid Unicode text (it has a lone surrogate)"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a JSON number"
    return None


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list))


def _dotted(path: tuple[str, ...]) -> str:
    text = ".".join(path)
    return text if len(text) <= MAX_PATH_CHARS else text[:MAX_PATH_CHARS] + "..."
