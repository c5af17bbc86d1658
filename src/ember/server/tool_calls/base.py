"""What every tool-call format answers about the text at a position (`ToolCallParser`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from ember.server.tool_calls.calls import ToolCall, call_from_object
from ember.server.tool_calls.json_extent import INVALID, json_extent


class Read(Enum):
    CALLS = "calls"  # one or more whole calls, ending at `end`
    NEED_MORE = "need_more"  # may still become a call: hold the text back
    NOT_A_CALL = "not_a_call"  # cannot be a call: the text is content


@dataclass(frozen=True)
class CallRead:
    status: Read
    calls: list[ToolCall] = field(default_factory=list)
    end: int = 0


NEED_MORE = CallRead(Read.NEED_MORE)
NOT_A_CALL = CallRead(Read.NOT_A_CALL)


class ToolCallParser(Protocol):
    """One model family's tool-call format."""

    # A JSON value opening with this character is read as a call where the output starts or
    # right after a call, without a marker (a marker that is a special token is skipped when
    # the request keeps skip_special_tokens); None: calls always open with a marker.
    bare_opener: str | None
    # Characters that may separate calls (and lead the output) without being content.
    separators: str
    # The key of a call object holding its arguments, as this format writes it.
    argument_key: str

    def find_start(self, text: str, pos: int) -> int | None:
        """The first index at or after `pos` where a call's marker (or the start of one, at the
        end of `text`) is; None if there is none."""
        ...

    def read_call(self, text: str, start: int, final: bool) -> CallRead:
        """Read the call(s) at `text[start:]`; `final` when no more text will come."""
        ...

    def forced_grammar(self, call: str, parallel: bool, marker: Callable[[str], str]) -> str:
        """A Lark grammar of output that is only calls in this format (one, or with
        `parallel` one or more): `call` is the Lark expression of one call object, `marker`
        gives the Lark expression of a marker's text (its token where it is one)."""
        ...


def find_marker(text: str, pos: int, marker: str) -> int | None:
    """Where `marker` is at or after `pos`, or where a prefix of it ends `text`."""
    found = text.find(marker, pos)
    if found >= 0:
        return found
    for size in range(min(len(marker) - 1, len(text) - pos), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return None


def skip_marker(text: str, start: int, marker: str, final: bool) -> int | CallRead:
    """The index past `marker` and the whitespace after it at `start`, or the read for a text
    that is still a prefix of the marker (or not it at all)."""
    if text.startswith(marker, start):
        end = start + len(marker)
        while end < len(text) and text[end].isspace():
            end += 1
        return end
    if marker.startswith(text[start:]) and not final:
        return NEED_MORE
    return NOT_A_CALL


def read_json(text: str, start: int, final: bool) -> tuple[Any, int] | CallRead:
    """The JSON object or array at `start` (after whitespace) and its end, or the read that
    says it is unfinished or not JSON."""
    if start == len(text):
        return NOT_A_CALL if final else NEED_MORE
    end = json_extent(text, start)
    if end == INVALID:
        return NOT_A_CALL
    if end is None:
        return NOT_A_CALL if final else NEED_MORE
    try:
        return json.loads(text[start:end]), end
    except ValueError:
        return NOT_A_CALL


def read_call_objects(value: Any, end: int, argument_keys: tuple[str, ...]) -> CallRead:
    """An object, or a non-empty list of objects, each a whole call: CALLS; else NOT_A_CALL."""
    objects = value if isinstance(value, list) else [value]
    calls = [call_from_object(v, argument_keys) for v in objects]
    if not calls or None in calls:
        return NOT_A_CALL
    return CallRead(Read.CALLS, calls, end)  # type: ignore[arg-type]
