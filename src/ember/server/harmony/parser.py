"""gpt-oss's reply, in the harmony format, split into reasoning, content and tool calls as its
text streams in.

The prompt ends with ``<|start|>assistant``, so the reply opens with the rest of a message
header, e.g. ``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
<|message|>...<|return|>``, or a call: ``<|channel|>commentary to=functions.NAME <|constrain|>
json<|message|>{...}<|call|>``. Where a message goes is read from its header:

- to ``functions.NAME``: a tool call (its body the arguments), when the request offers tools;
- to any other recipient (a built-in tool ember does not run), or on ``analysis``: reasoning;
- on ``final``, on ``commentary`` without a recipient (a preamble meant for the user), or
  without a channel: content.

The markers arrive as text (the reply is detokenized with its special tokens), whole or, where
text is split, in pieces: a piece that may be the start of a marker is held until the next
one says. A reply that does not open with harmony markup is content, as written.
"""

from __future__ import annotations

import re
from enum import Enum

from ember.server.reply import CallDelta, ReplyDelta
from ember.server.tool_calls.calls import new_call_id
from ember.tokenizer.harmony import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    END_OF_TEXT,
    MESSAGE,
    RETURN,
    START,
)

# What ends a message (<|endoftext|>: an EOS outside harmony, shown with the special tokens).
_MESSAGE_ENDS = (END, RETURN, CALL, END_OF_TEXT)
# What ends a message's body: its end markers, or a new message begun without one.
_BODY_ENDS = (*_MESSAGE_ENDS, START)
# What ends a message's header: its body's start, or (malformed) an end marker.
_HEADER_ENDS = (MESSAGE, *_MESSAGE_ENDS)
# The reply's first message has its role already: its header opens with one of these.
_FIRST_HEADER_OPENERS = (CHANNEL, MESSAGE, " to=")
# What text between messages may be the start of (held until it is known).
_BETWEEN_MARKERS = (START, CHANNEL, *_HEADER_ENDS, " to=")
# A header runs to a few dozen characters; past this without its end it is text, not held.
_MAX_HEADER_CHARS = 512
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_FUNCTIONS = "functions."


class _State(Enum):
    BETWEEN = "between"  # before a message (the reply's start, or after a message ended)
    HEADER = "header"  # reading a header, up to <|message|>
    BODY = "body"  # inside a message's body


class _Route(Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    CALL = "call"


class HarmonyReader:
    """One choice's harmony reply, fed piece by piece (`feed`), then `finish`ed.

    ``read_calls``: whether messages to ``functions.NAME`` become tool calls (the request
    offered tools); without, they are reasoning.
    """

    def __init__(self, read_calls: bool = True) -> None:
        self._read_calls = read_calls
        self._buffer = ""  # text received and not yet consumed
        self._state = _State.BETWEEN
        self._at_start = True  # nothing consumed yet: the reply's first header has no role
        self._route = _Route.CONTENT
        self._num_calls = 0
        self._call_started = False  # the current call has shown some arguments
        self._call_spaces = ""  # whitespace held at the end of the current call's arguments

    def feed(self, text: str) -> ReplyDelta:
        self._buffer += text
        delta = ReplyDelta()
        self._advance(delta, final=False)
        return delta

    def finish(self) -> ReplyDelta:
        delta = ReplyDelta()
        self._advance(delta, final=True)
        if self._state is _State.BODY:
            self._close_message(delta)  # cut short: max_tokens, a stop string
        self._state = _State.BETWEEN  # an unfinished header says nothing: dropped
        self._buffer = ""
        return delta

    def _advance(self, delta: ReplyDelta, final: bool) -> None:
        while self._buffer:
            if self._state is _State.BETWEEN:
                moved = self._read_between(final)
            elif self._state is _State.HEADER:
                moved = self._read_header(delta)
            else:
                moved = self._read_body(delta, final)
            if not moved:
                return

    def _read_between(self, final: bool) -> bool:
        buffer = self._buffer
        openers = _FIRST_HEADER_OPENERS if self._at_start else (CHANNEL, MESSAGE)
        if buffer.startswith(START):
            self._consume(len(START))
            self._state = _State.HEADER
        elif buffer.startswith(openers):
            self._state = _State.HEADER  # its text is the header's
        elif buffer.startswith(_MESSAGE_ENDS):  # an end with no message: nothing to close
            self._consume(next(len(m) for m in _MESSAGE_ENDS if buffer.startswith(m)))
        elif not final and any(m.startswith(buffer) for m in _BETWEEN_MARKERS):
            return False  # may still become a marker
        else:  # text outside any message: content, as written
            self._route = _Route.CONTENT
            self._state = _State.BODY
        self._at_start = False
        return True

    def _read_header(self, delta: ReplyDelta) -> bool:
        found = _first_of(self._buffer, _HEADER_ENDS)
        if found is None:
            if len(self._buffer) <= _MAX_HEADER_CHARS:
                return False  # the header is held whole until its end arrives
            self._route = _Route.CONTENT  # no header after all: content, as written
            self._state = _State.BODY
            return True
        at, marker = found
        header = self._buffer[:at]
        self._consume(at + len(marker))
        if marker != MESSAGE:
            self._state = _State.BETWEEN  # a header with no body: nothing to say
            return True
        self._open_message(header, delta)
        return True

    def _read_body(self, delta: ReplyDelta, final: bool) -> bool:
        found = _first_of(self._buffer, _BODY_ENDS)
        if found is None:
            held = 0 if final else _marker_prefix_length(self._buffer, _BODY_ENDS)
            text = self._buffer[: len(self._buffer) - held]
            self._consume(len(text))
            self._emit(text, delta)
            return False
        at, marker = found
        self._emit(self._buffer[:at], delta)
        self._consume(at + len(marker))
        self._close_message(delta)
        self._state = _State.HEADER if marker == START else _State.BETWEEN
        return True

    def _open_message(self, header: str, delta: ReplyDelta) -> None:
        header = header.replace(START, "").replace(CONSTRAIN, " ")
        recipient = _RECIPIENT.search(header)
        _, has_channel, after = header.partition(CHANNEL)
        channel = after.split()[0] if has_channel and after.split() else None
        self._state = _State.BODY
        if recipient is None:
            analysis = channel == "analysis"
            self._route = _Route.REASONING if analysis else _Route.CONTENT
            return
        name = recipient.group(1)
        if not (self._read_calls and name.startswith(_FUNCTIONS) and len(name) > len(_FUNCTIONS)):
            self._route = _Route.REASONING
            return
        self._route = _Route.CALL
        self._call_started = False
        self._call_spaces = ""
        delta.calls.append(CallDelta(self._num_calls, "", name[len(_FUNCTIONS) :], new_call_id()))
        self._num_calls += 1

    def _emit(self, text: str, delta: ReplyDelta) -> None:
        if not text:
            return
        if self._route is _Route.CONTENT:
            delta.content += text
        elif self._route is _Route.REASONING:
            delta.reasoning += text
        else:  # arguments without the whitespace around them
            text = self._call_spaces + (text if self._call_started else text.lstrip())
            kept = text.rstrip()
            self._call_spaces = text[len(kept) :]
            if kept:
                self._call_started = True
                delta.add_arguments(self._num_calls - 1, kept)

    def _close_message(self, delta: ReplyDelta) -> None:
        if self._route is _Route.CALL and not self._call_started:
            delta.add_arguments(self._num_calls - 1, "{}")  # a call with no arguments
        self._route = _Route.CONTENT

    def _consume(self, size: int) -> None:
        self._buffer = self._buffer[size:]


def _first_of(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The first of ``markers`` in ``text``: where it is and which; None if none is."""
    found = [(at, marker) for marker in markers if (at := text.find(marker)) >= 0]
    return min(found) if found else None


def _marker_prefix_length(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that a marker starts with (0 if none)."""
    start = text.find("<", max(0, len(text) - max(map(len, markers)) + 1))
    while start >= 0:
        tail = text[start:]
        if any(marker.startswith(tail) for marker in markers):
            return len(tail)
        start = text.find("<", start + 1)
    return 0
