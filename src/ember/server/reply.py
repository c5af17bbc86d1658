"""A chat reply read as it streams: the text the client sees (`content`), the model's reasoning
(`reasoning_content`) and its tool calls, in pieces (`ReplyDelta`) or whole (`Reply`).

A reader is one choice's state, fed the reply's text piece by piece and then finished: the
harmony reader of gpt-oss (`ember.server.harmony`), or `ToolCallReader` over a text tool-call
format (`ember.server.tool_calls`). Reading a whole reply is the same reader fed once, so the
streamed and the whole response agree by construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

from ember.server.tool_calls.base import ToolCallParser
from ember.server.tool_calls.calls import ToolCall
from ember.server.tool_calls.stream import ToolCallStream, ToolDelta


@dataclass
class CallDelta:
    """A piece of the `index`-th call of a reply: its first piece carries its id and name,
    every piece some of its arguments (a JSON object's text)."""

    index: int
    arguments: str = ""
    name: str | None = None
    id: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The entry of a stream delta's `tool_calls`, in OpenAI's shape."""
        entry: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            entry.update(id=self.id, type="function")
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        entry["function"] = function
        return entry


@dataclass
class ReplyDelta:
    """What a piece of the reply released."""

    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add_arguments(self, index: int, text: str) -> None:
        """Append ``text`` to call ``index``'s arguments (its last piece here, or a new one)."""
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].arguments += text
        else:
            self.calls.append(CallDelta(index, text))

    def extend(self, other: ReplyDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        for call in other.calls:
            if call.id is None:
                self.add_arguments(call.index, call.arguments)
            else:
                self.calls.append(dataclasses.replace(call))  # its own: add_arguments grows it


class ReplyReader(Protocol):
    """One choice's reply, fed piece by piece (`feed`), then `finish`ed."""

    def feed(self, text: str) -> ReplyDelta: ...

    def finish(self) -> ReplyDelta: ...


@dataclass
class Reply:
    """A whole reply. `content` is None when there is nothing but calls or reasoning;
    `reasoning` None when there is none."""

    content: str | None
    reasoning: str | None
    calls: list[ToolCall]


def read_reply(reader: ReplyReader, text: str) -> Reply:
    """A whole reply's content, reasoning and calls, read by a fresh ``reader``."""
    delta = reader.feed(text)
    delta.extend(reader.finish())
    calls: list[ToolCall] = []
    for piece in delta.calls:  # a call's first piece has its id; the others follow it
        if piece.id is not None:
            calls.append(ToolCall(piece.name or "", piece.arguments, piece.id))
        else:
            last = calls[-1]
            calls[-1] = ToolCall(last.name, last.arguments + piece.arguments, last.id)
    content = delta.content
    shown = content.strip() or not (calls or delta.reasoning)
    return Reply(content if shown else None, delta.reasoning or None, calls)


class ToolCallReader:
    """A text tool-call format's reader (`ToolCallStream`): content and whole calls."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._stream = ToolCallStream(parser)
        self._num_calls = 0

    def feed(self, text: str) -> ReplyDelta:
        return self._reply_delta(self._stream.feed(text))

    def finish(self) -> ReplyDelta:
        return self._reply_delta(self._stream.finish())

    def _reply_delta(self, read: ToolDelta) -> ReplyDelta:
        delta = ReplyDelta(read.content)
        for call in read.calls:  # each arrives whole: one piece
            delta.calls.append(CallDelta(self._num_calls, call.arguments, call.name, call.id))
            self._num_calls += 1
        return delta
