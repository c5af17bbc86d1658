"""Turn a request's generated token ids into text, a few tokens at a time.

Decoding tokens one by one is wrong: a character can span tokens (UTF-8 bytes split by
byte-level BPE or byte-fallback tokens), and some decoders change a token's text depending on
what precedes it (SentencePiece strips the space of a sequence's first word). So each step
decodes a short window of recent tokens twice over — the window up to the text already shown,
and the whole window — and shows the difference once it no longer ends in an incomplete
character ("\ufffd"). The window then slides forward, so a step costs the same whatever the
length of the output.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from ember.tokenizer.stop_strings import StopStringMatcher

REPLACEMENT_CHAR = "\ufffd"  # what decoding yields for the bytes of an unfinished character
# Prompt tokens decoded as context for the first generated token, so that its text is what it
# would be after the prompt (a leading space kept, not stripped as at a sequence start).
PROMPT_CONTEXT_TOKENS = 5


class SupportsDecode(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Streams one request's text: `add` per step, `flush` at the end.

    With stop strings, the text is cut at the first one (kept when
    `include_stop_str_in_output`); `finished` then turns true and `stop_reason` names it, so the
    caller can abort the request. Text that might be the start of a stop string is held back,
    so streamed text never contains part of one.
    """

    def __init__(
        self,
        tokenizer: SupportsDecode,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # _window holds the ids from the first one still needed as context; the text of
        # _window[:_read_offset] has been shown already (or belongs to the prompt).
        self._window = list(
            prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS) :]
        )
        self._read_offset = len(self._window)
        self._shown_text = self._decode(self._window)
        self._stop_matcher = StopStringMatcher(stop, include_stop_str_in_output)
        self._pieces: list[str] = []

    @property
    def finished(self) -> bool:
        """A stop string was met; further tokens are ignored."""
        return self._stop_matcher.finished

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._stop_matcher.stop_reason

    @property
    def text(self) -> str:
        """All text returned so far by `add` and `flush`."""
        return "".join(self._pieces)

    def add(self, new_token_ids: Iterable[int]) -> str:
        """Take newly generated token ids; return the text they complete (maybe "")."""
        if self.finished:
            return ""
        self._window.extend(new_token_ids)
        window_text = self._decode(self._window)
        if len(window_text) <= len(self._shown_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing visible yet, or a character still missing some of its bytes
        new_text = window_text[len(self._shown_text) :]
        # Slide: the tokens shown before this step are no longer needed as context.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self._shown_text = self._decode(self._window)
        return self._release(self._stop_matcher.feed(new_text))

    def flush(self) -> str:
        """The request ended: return the text still held back (an unfinished character too)."""
        if self.finished:
            return ""
        window_text = self._decode(self._window)
        new_text = window_text[len(self._shown_text) :]
        del self._window[: len(self._window)]
        self._read_offset, self._shown_text = 0, ""
        released = self._stop_matcher.feed(new_text)
        if not self.finished:
            released += self._stop_matcher.flush()
        return self._release(released)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _release(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text
