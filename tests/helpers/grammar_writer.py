"""A stand-in for a model under a grammar: it writes a scripted start (say, a reasoning model's
thinking) as far as the grammar allows it, then draws each token at random among those the
grammar allows, until the grammar is complete, an end-of-sequence token is drawn or the
token limit is reached. The masks are the engine's (`GrammarMasks`), so what it writes is what
a real model could write under the same grammar."""

from __future__ import annotations

import numpy as np
import torch

from ember.structured_output.bitmask import GrammarMasks, allowed_tokens
from ember.structured_output.compiler import GrammarCompiler
from ember.structured_output.matcher import GrammarMatcher


class GrammarWriter:
    """Writes under one model's grammars: ``compiler`` over its vocabulary."""

    def __init__(self, compiler: GrammarCompiler, eos_token_ids: tuple[int, ...]) -> None:
        self.compiler = compiler
        self.eos_token_ids = eos_token_ids
        self._masks = GrammarMasks(compiler.vocab_size, 1, torch.device("cpu"))

    def allowed(self, grammar: GrammarMatcher) -> np.ndarray:
        """bool ``[vocab]``: the tokens ``grammar`` allows next."""
        mask = self._masks.fill([grammar], [0], 1)
        return allowed_tokens(mask.bitmask, self.compiler.vocab_size, mask.shifts)[0].numpy()

    def write(
        self, grammar: GrammarMatcher, script: list[int], seed: int, max_tokens: int
    ) -> tuple[list[int], str]:
        """The tokens written and the finish reason ("stop" or "length")."""
        rng = np.random.default_rng(seed)
        out: list[int] = []
        for token in script:
            if len(out) == max_tokens or not self.allowed(grammar)[token]:
                break
            out.append(token)
            grammar.catch_up(out)
        while len(out) < max_tokens and not grammar.terminated:
            allowed = self.allowed(grammar)
            scores = np.where(allowed, rng.random(allowed.shape[0]), -1.0)
            token = int(scores.argmax())
            out.append(token)
            if token in self.eos_token_ids:
                return out, "stop"
            grammar.catch_up(out)
        return out, "stop" if grammar.terminated else "length"
