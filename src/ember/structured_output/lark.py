"""Pieces of Lark grammars (llguidance's dialect) that the server writes around a reply's
structure: string literals, markers that may be one token of the vocabulary, free text up to
a marker, and a whole grammar nested as one rule.

A marker that is an added token must be written as that token (`<[id]>`): llguidance reads
every added token as special, so its text alone would forbid the token the model was trained to
write. Where the vocabulary lacks it, the marker is its text.
"""

from __future__ import annotations

import json
from collections.abc import Callable

# What a regex must escape to match a character as itself (`/` ends a Lark regex).
_REGEX_SPECIAL = frozenset("\\.+*?()|[]{}^$/")
# Every byte sequence of valid UTF-8, line breaks included (special tokens are not text).
ANY_TEXT = "/(?s:.*)/"

AddedTokenId = Callable[[str], "int | None"]


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal (the escapes of a JSON string)."""
    return json.dumps(text)


def token_or_text(text: str, added_token_id: AddedTokenId) -> str:
    """A Lark expression of the marker ``text``: its token where it is one, or its text."""
    token_id = added_token_id(text)
    return lark_string(text) if token_id is None else f"(<[{token_id}]> | {lark_string(text)})"


def exact_marker(text: str, added_token_id: AddedTokenId) -> str:
    """A Lark expression of the marker ``text``: its token alone where it is one (so free text
    before it ends there), else its text."""
    token_id = added_token_id(text)
    return lark_string(text) if token_id is None else f"<[{token_id}]>"


def text_until(rule: str, marker: str, added_token_id: AddedTokenId) -> str:
    """The Lark rule ``rule``: any text, then the marker ``marker`` (its token where it is
    one). A marker that is text ends the rule at its first occurrence (a lazy terminal)."""
    token_id = added_token_id(marker)
    if token_id is not None:  # no text can hold the token: the text ends where it comes
        return f"{rule}: {ANY_TEXT} <[{token_id}]>\n"
    return f"{rule}[lazy]: /(?s:.*){_regex_literal(marker)}/\n"


def nested(rule: str, grammar: str) -> str:
    """The Lark rule ``rule``: the whole Lark grammar ``grammar`` (its own `start`, rules and
    terminals, which may reuse the outer grammar's names)."""
    return f"{rule}: %lark {{\n{grammar.rstrip()}\n}}\n"


def _regex_literal(text: str) -> str:
    """``text`` matched literally inside a Lark `/.../` regex."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)
