"""Find stop strings in streamed text without ever streaming part of one.

Text arrives in pieces. A stop string may span pieces, so the end of the text that could still
grow into a stop string is held back until the next piece decides it, and released by `flush`
when the stream ends. Only the held-back tail and the new piece are searched, so each piece
costs time in proportion to its length and the stop strings', not the whole output's.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    """Cuts a stream of text at the first stop string."""

    def __init__(self, stop: Iterable[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = tuple(dict.fromkeys(s for s in stop if s))  # "" would match everywhere
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_reason: str | None = None
        self._held = ""

    @property
    def finished(self) -> bool:
        """A stop string was found; later text is discarded."""
        return self.stop_reason is not None

    def feed(self, piece: str) -> str:
        """Take the next piece of text; return what may be shown now."""
        if self.finished:
            return ""
        text = self._held + piece
        if not self.stop:
            return text
        cut = self._find_stop(text)
        if cut is not None:
            self._held = ""
            return text[:cut]
        keep = self._partial_stop_length(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The stream ended: release the held-back text (it can no longer become a stop)."""
        held, self._held = self._held, ""
        return "" if self.finished else held

    def _find_stop(self, text: str) -> int | None:
        """Record the stop string that completes first in `text`; return where to cut."""
        # The stop that ends first is the one a character-by-character stream would meet first
        # (so the result does not depend on how the text was split); on a tie, the longest.
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                best = candidate if best is None or candidate < best else best
        if best is None:
            return None
        end, start, self.stop_reason = best
        return end if self.include_stop_str_in_output else start

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest end of `text` that is the beginning of some stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
