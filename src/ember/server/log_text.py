"""Text from a request, made safe to put in a log line: escaped as `repr` escapes it (so a
newline, a terminal control sequence or a lone surrogate cannot forge a line or break the
log's encoding) and cut to a bound (so no request can fill the log)."""

from __future__ import annotations

from collections.abc import Sequence

MAX_LOG_TEXT_CHARS = 100
MAX_LOG_ITEMS = 10


def log_text(text: str, limit: int = MAX_LOG_TEXT_CHARS) -> str:
    """`text` quoted and escaped, its first `limit` characters only, saying how long it was."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} chars)"


def log_texts(texts: Sequence[str], limit: int = MAX_LOG_ITEMS) -> str:
    """The first `limit` of `texts`, each through `log_text`, comma-separated, with a count of
    the rest."""
    shown = ", ".join(log_text(text) for text in texts[:limit])
    rest = len(texts) - limit
    return f"{shown} and {rest} more" if rest > 0 else shown
