"""One request's grammar: it has consumed exactly the request's recorded outputs, says when it
is complete, and fails once, by its first refused token. The compiler builds one per request
over the model's vocabulary, compiling each grammar once."""

from __future__ import annotations

import pytest
import tokenizers
import torch
from helpers.tiny_models import SMOLLM2_EOS_ID

from ember.structured_output.bitmask import GrammarMasks, allowed_tokens
from ember.structured_output.compiler import GrammarCompiler
from ember.structured_output.grammar import check_grammar
from ember.structured_output.matcher import GrammarError
from ember.structured_output.params import StructuredOutputsParams as Params
from ember.tokenizer.tokenizer import Tokenizer

YES_NO = Params(choice=["yes", "no"])


def allowed(compiler, grammar) -> set[int]:
    """The tokens ``grammar`` allows next."""
    mask = GrammarMasks(compiler.vocab_size, 1, torch.device("cpu")).fill([grammar], [0], 1)
    row = allowed_tokens(mask.bitmask, compiler.vocab_size, mask.shifts)[0]
    return set(row.nonzero().flatten().tolist())


def test_catch_up_consumes_only_the_outputs_recorded_since_the_last_call(compiler, smol_tokenizer):
    grammar = compiler.matcher(Params(regex="[a-z]+ [0-9]+"))
    outputs = smol_tokenizer.encode("abc 12", add_special_tokens=False)
    grammar.catch_up(outputs[:1])
    grammar.catch_up(outputs[:1])  # nothing new: nothing consumed twice
    assert grammar.num_consumed == 1
    grammar.catch_up(outputs)
    assert grammar.num_consumed == len(outputs) and not grammar.terminated
    assert grammar.matcher.is_accepting()  # more digits may follow, or the end


def test_a_complete_grammar_is_terminated_and_allows_only_eos(compiler, smol_tokenizer):
    grammar = compiler.matcher(YES_NO)
    grammar.catch_up(smol_tokenizer.encode("yes", add_special_tokens=False))
    assert grammar.terminated
    assert allowed(compiler, grammar) == {SMOLLM2_EOS_ID}


def test_a_refused_token_fails_once_and_stops_consuming(compiler, smol_tokenizer):
    grammar = compiler.matcher(YES_NO)
    maybe = smol_tokenizer.encode("maybe", add_special_tokens=False)
    with pytest.raises(GrammarError, match="doesn't satisfy the grammar"):
        grammar.catch_up(maybe)
    assert grammar.error and "\n" not in grammar.error  # one line, not the parser's dump
    grammar.catch_up([*maybe, 5])  # already failed: no second error
    assert not grammar.terminated


def test_each_request_gets_its_own_copy_of_a_grammar_compiled_once(compiler, smol_tokenizer):
    first, second = compiler.matcher(YES_NO), compiler.matcher(YES_NO)
    assert first.matcher is not second.matcher
    first.catch_up(smol_tokenizer.encode("no", add_special_tokens=False))
    assert first.terminated and not second.terminated and second.num_consumed == 0
    assert len(allowed(compiler, second)) > 1


def test_a_grammar_that_needs_what_the_vocabulary_lacks_fails_for_this_model(compiler):
    """Without a tokenizer the grammar is valid; over SmolLM2's vocabulary it names a special
    token that does not exist: the engine refuses the request (a 400), never a step."""
    params = Params(grammar='start: <|no_such_token|> "x"')
    check_grammar(params)
    with pytest.raises(ValueError, match="unknown special token"):
        compiler.check(params)


def test_a_tokenizer_llguidance_cannot_read_refuses_structured_requests_only():
    unreadable = Tokenizer(tokenizers.Tokenizer(tokenizers.models.Unigram([("a", 0.0)])), {})
    compiler = GrammarCompiler(unreadable, 1, (0,))
    with pytest.raises(ValueError, match="structured output is not available for this model"):
        compiler.check(YES_NO)
