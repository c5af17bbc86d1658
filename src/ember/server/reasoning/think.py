"""A reply whose reasoning sits between `<think>` and `</think>` (Qwen3, QwQ, DeepSeek-R1 and
its distillations), split into reasoning and the answer as its text streams in.

Where the reply starts is `ThinkTags`' question: inside the block (the prompt opened it, as
DeepSeek-R1's templates and Qwen3's thinking-only ones do; or the format says so:
``deepseek_r1``), or before it, when a `<think>` that opens the reply opens the block and a
reply that opens with anything else is all answer (Qwen3 with thinking disabled writes no
block). The block runs to `</think>`; a reply cut short inside it is all reasoning.

The reasoning loses the whitespace at its two ends, the answer the whitespace after
`</think>`, as Qwen3's template does when it reads a reply back. The answer goes to another
reader where the request has one (tool calls in a text format), else it is content.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ember.server.reply import ReplyDelta, ReplyReader
from ember.server.tool_calls.base import find_marker

OPEN = "<think>"
CLOSE = "</think>"


@dataclass(frozen=True)
class ThinkTags:
    """How one request's replies hold their reasoning: ``starts_inside``, the reply begins
    inside the `<think>` block (else a `<think>` first may open it)."""

    starts_inside: bool


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt whose rendered end is ``prompt_tail`` leaves a `<think>` block open
    (a thinking template's generation prompt), rather than closed (`<think>\\n\\n</think>`:
    thinking disabled) or absent."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


class _Part(Enum):
    START = "start"  # nothing read yet: a <think> may open the reply
    REASONING = "reasoning"
    ANSWER = "answer"


class ThinkReader:
    """One choice's reply, fed piece by piece (`feed`), then `finish`ed. ``answer``: the
    reader of what follows the reasoning (None: it is content)."""

    def __init__(self, tags: ThinkTags, answer: ReplyReader | None = None) -> None:
        self._tags = tags
        self._answer = answer
        self._part = _Part.START
        self._buffer = ""  # text received and not yet released
        self._reasoning_begun = False  # some reasoning released: later whitespace is kept
        self._spaces = ""  # whitespace at the end of the reasoning, held until text follows
        self._after_close = False  # right after </think>: whitespace is dropped

    def feed(self, text: str) -> ReplyDelta:
        self._buffer += text
        delta = ReplyDelta()
        self._advance(delta, final=False)
        return delta

    def finish(self) -> ReplyDelta:
        delta = ReplyDelta()
        self._advance(delta, final=True)
        if self._answer is not None:
            delta.extend(self._answer.finish())
        return delta

    def _advance(self, delta: ReplyDelta, final: bool) -> None:
        while self._buffer:
            if self._part is _Part.START:
                moved = self._read_start(final)
            elif self._part is _Part.REASONING:
                moved = self._read_reasoning(delta, final)
            else:
                moved = self._read_answer(delta, final)
            if not moved:
                return

    def _read_start(self, final: bool) -> bool:
        opening = self._buffer.lstrip()
        if opening.startswith(OPEN):
            self._buffer = opening[len(OPEN) :]
            self._part = _Part.REASONING
        elif not final and OPEN.startswith(opening):
            return False  # whitespace, or the start of a <think>: held until it is known
        else:
            self._part = _Part.REASONING if self._tags.starts_inside else _Part.ANSWER
        return True

    def _read_reasoning(self, delta: ReplyDelta, final: bool) -> bool:
        at = find_marker(self._buffer, 0, CLOSE)
        if at is not None and self._buffer.startswith(CLOSE, at):
            self._emit_reasoning(self._buffer[:at], delta)
            self._buffer = self._buffer[at + len(CLOSE) :]
            self._spaces = ""  # the reasoning's trailing whitespace is dropped
            self._part = _Part.ANSWER
            self._after_close = True
            return True
        released = len(self._buffer) if at is None or final else at  # a "</thi" is held
        self._emit_reasoning(self._buffer[:released], delta)
        self._buffer = self._buffer[released:]
        return False

    def _read_answer(self, delta: ReplyDelta, final: bool) -> bool:
        text, self._buffer = self._buffer, ""
        if self._after_close:
            text = text.lstrip()
            if not text:
                return False  # only whitespace yet: the answer has not begun
            self._after_close = False
        if self._answer is None:
            delta.content += text
        else:
            delta.extend(self._answer.feed(text))
        return False

    def _emit_reasoning(self, text: str, delta: ReplyDelta) -> None:
        text = self._spaces + (text if self._reasoning_begun else text.lstrip())
        kept = text.rstrip()
        self._spaces = text[len(kept) :]
        if kept:
            self._reasoning_begun = True
            delta.reasoning += kept
