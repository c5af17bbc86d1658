"""One request's grammar state: an llguidance matcher that has consumed exactly the request's
recorded output tokens.

The runner brings it up to date with the request's outputs when it collects a step
(`catch_up`), so a sample dropped in flight (a preemption, an abort) is never consumed and a
request recomputed after a preemption keeps its state: its outputs are kept, and so is what the
matcher consumed of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import llguidance


class GrammarError(Exception):
    """The grammar refused a sampled token (or went past its limits): the request fails."""


class GrammarMatcher:
    """``matcher``: a fresh llguidance matcher of the request's grammar; ``vocab_size``: the
    width of its masks (in tokens)."""

    __slots__ = ("error", "matcher", "num_consumed", "terminated", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_consumed = 0
        # The grammar is complete: nothing may follow (the request ends with "stop").
        self.terminated = False
        self.error: str | None = None

    def catch_up(self, output_token_ids: list[int]) -> None:
        """Consume the outputs recorded since the last call. GrammarError the first time the
        grammar refuses one; after that the matcher consumes nothing more."""
        if self.error is not None or len(output_token_ids) == self.num_consumed:
            return
        new = output_token_ids[self.num_consumed :]
        self.num_consumed = len(output_token_ids)
        if not self.matcher.consume_tokens(new):
            # llguidance's first line says which token failed; the rest is its parser's state.
            self.error = self.matcher.get_error().strip().splitlines()[0]
            raise GrammarError(self.error)
        self.terminated = self.matcher.is_stopped()
