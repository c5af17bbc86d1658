"""Split a model's output, as it streams, into content and tool calls.

Text that cannot begin a call is released as content at once; from where a call may begin
(a marker, a prefix of one at the end, or the format's bare JSON opener where the reply starts
or a call ended) the text is held until the parser says it is whole calls or not a call.
Whitespace (and the format's separators) between calls is not content. Reading the whole
output at once is the same machine fed once, so both paths agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.server.tool_calls.base import Read, ToolCallParser
from ember.server.tool_calls.calls import ToolCall


@dataclass
class ToolDelta:
    """What a piece of output released: content text and whole calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ParsedOutput:
    """A whole output: its content (None when there is none besides calls) and its calls."""

    content: str | None
    calls: list[ToolCall]


class ToolCallStream:
    """One choice's output, fed piece by piece (`feed`), then `finish`ed."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._text = ""
        self._released = 0  # text before this index is content or calls already given out
        self._at_boundary = True  # the output's start, or right after a call
        self.num_calls = 0

    def feed(self, text: str) -> ToolDelta:
        self._text += text
        return self._advance(final=False)

    def finish(self) -> ToolDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ToolDelta:
        delta = ToolDelta()
        text, parser = self._text, self._parser
        while self._released < len(text):
            if self._at_boundary:
                if self._read_at_boundary(delta, final):
                    continue
                if self._at_boundary:
                    break  # held: it may still become a call
            start = parser.find_start(text, self._released)
            if start is None:
                start = len(text)
            delta.content += text[self._released : start]
            self._released = start
            if start == len(text):
                break
            read = parser.read_call(text, start, final)
            if read.status is Read.NEED_MORE:
                break
            if read.status is Read.NOT_A_CALL:
                delta.content += text[start]  # the marker's first character is content
                self._released = start + 1
                continue
            self._take(delta, read.calls, read.end)
        return delta

    def _read_at_boundary(self, delta: ToolDelta, final: bool) -> bool:
        """Read a call right at the boundary; True when calls were taken, False when the text
        is held (still at the boundary) or turned out to be content (no longer at it)."""
        text, parser = self._text, self._parser
        start = self._released
        while start < len(text) and text[start] in parser.separators:
            start += 1
        if start == len(text):
            if not final:
                return False
            if self.num_calls:  # trailing whitespace after calls is not content
                self._released = start
                return True
            self._at_boundary = False
            return False
        opens = text[start] == parser.bare_opener or parser.find_start(text, start) == start
        read = parser.read_call(text, start, final) if opens else None
        if read is not None and read.status is Read.CALLS:
            self._take(delta, read.calls, read.end)
            return True
        if read is None or read.status is Read.NOT_A_CALL:
            self._at_boundary = False
        return False

    def _take(self, delta: ToolDelta, calls: list[ToolCall], end: int) -> None:
        delta.calls.extend(calls)
        self.num_calls += len(calls)
        self._released = end
        self._at_boundary = True


def parse_output(parser: ToolCallParser, text: str) -> ParsedOutput:
    """A whole output's content and calls."""
    stream = ToolCallStream(parser)
    first, last = stream.feed(text), stream.finish()
    content = first.content + last.content
    calls = first.calls + last.calls
    return ParsedOutput(content if content.strip() or not calls else None, calls)
