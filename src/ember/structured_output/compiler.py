"""One model's grammar compiler: its vocabulary as llguidance sees it, and a matcher per request.

The llguidance tokenizer is built from the model's own tokenizer (HF tokenizer.json, or the one
ember builds from GGUF metadata) on the first structured request: it costs a fraction of a
second to a few seconds, which a model that never sees one should not pay. Compiled grammars are
kept (the most recent few): a request whose grammar was seen before gets a copy of the compiled
matcher, which costs microseconds instead of a compile.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import llguidance

from ember.structured_output.grammar import grammar_for
from ember.structured_output.matcher import GrammarMatcher
from ember.structured_output.params import StructuredOutputsParams
from ember.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

COMPILED_GRAMMARS_KEPT = 64


class GrammarCompiler:
    """Compiles structured outputs over the vocabulary of one model: ``vocab_size`` its
    logits' width, ``eos_token_ids`` the ids that end its output."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        self._tokenizer = tokenizer
        # Masks cover every logit, and every id the tokenizer knows (ids past the logits
        # are never sampled).
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (ValueError, which refuses
        the request, where llguidance cannot read the tokenizer)."""
        if self._ll_tokenizer is None:
            started = time.perf_counter()
            try:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=self._eos_token_ids,
                )
            except ValueError as exc:
                raise ValueError(
                    f"structured output is not available for this model: llguidance cannot "
                    f"read its tokenizer ({exc})"
                ) from None
            logger.info("grammar tokenizer built in %.2f s", time.perf_counter() - started)
        return self._ll_tokenizer

    def check(self, params: StructuredOutputsParams) -> None:
        """ValueError, saying why, if ``params``' grammar does not compile for this model (say,
        a special token its vocabulary lacks); the compiled grammar is kept for `matcher`."""
        self._compiled_matcher(params)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher of ``params``' grammar (ValueError as `check`)."""
        return GrammarMatcher(self._compiled_matcher(params).deep_copy(), self.vocab_size)

    def _compiled_matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        grammar = grammar_for(params)
        compiled = self._compiled.get(grammar)
        if compiled is not None:
            self._compiled.move_to_end(grammar)
            return compiled
        compiled = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise ValueError(f"structured_outputs: {compiled.get_error().strip()}")
        self._compiled[grammar] = compiled
        if len(self._compiled) > COMPILED_GRAMMARS_KEPT:
            self._compiled.popitem(last=False)
        return compiled
