"""The masks of a step's grammar rows: bit t of a row allows token t; rows without a grammar
allow everything; applying them sets every other token's logit to -inf in place, the same on
the host (numpy unpacks the bits) as on a device (torch does)."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import SMOLLM2_VOCAB_SIZE

from ember.layers.ops import reference_ops
from ember.runner.sampler import FixedSamplingRow, Sampler
from ember.sampling_params import SamplingParams
from ember.structured_output.bitmask import GrammarMasks, TokenMask, allowed_tokens
from ember.structured_output.params import StructuredOutputsParams as Params

SHIFTS = torch.arange(32, dtype=torch.int32)


def reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bit by bit, in Python."""
    words = bitmask.tolist()
    return torch.tensor(
        [[(row[t // 32] >> (t % 32)) & 1 == 1 for t in range(vocab)] for row in words]
    )


@pytest.mark.parametrize("vocab", [64, 70, 96])
def test_unpacking_follows_the_bit_order_on_the_host_and_with_torch_ops(vocab):
    generator = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
    expected = reference_allowed(bitmask, vocab)
    assert torch.equal(allowed_tokens(bitmask, vocab, SHIFTS), expected)  # numpy, on the CPU
    meta_like = bitmask.clone()
    bits = (meta_like.unsqueeze(-1) >> SHIFTS) & 1  # the device path's ops, run here
    assert torch.equal(bits.view(3, -1)[:, :vocab].bool(), expected)


def test_apply_refuses_exactly_the_clear_bits_in_place():
    logits = torch.randn(2, 40)
    bitmask = torch.tensor([[0b1011, 0b1], [-1, -1]], dtype=torch.int32)
    original = logits.clone()
    TokenMask(bitmask, SHIFTS).apply(logits)
    allowed = {0, 1, 3, 32}
    for t in range(40):
        expected = original[0, t] if t in allowed else float("-inf")
        assert logits[0, t] == expected
    assert torch.equal(logits[1], original[1])  # all ones: the row is unchanged


def test_rows_without_a_grammar_allow_every_token(compiler):
    masks = GrammarMasks(compiler.vocab_size, 4, torch.device("cpu"))
    grammar = compiler.matcher(Params(choice=["yes", "no"]))
    mask = masks.fill([grammar], [2], 3)
    allowed = allowed_tokens(mask.bitmask, SMOLLM2_VOCAB_SIZE, SHIFTS)
    assert allowed[0].all() and allowed[1].all()
    assert 1 < int(allowed[2].sum()) < 10  # the first token of "yes" or "no"


def test_a_masked_draw_takes_an_allowed_token_and_logprobs_stay_the_models(compiler):
    """Greedy and random draws land on allowed tokens; the logprobs are those of the logits
    before the mask (the model's own distribution)."""
    sampler = Sampler(reference_ops(), SMOLLM2_VOCAB_SIZE, torch.device("cpu"))
    masks = GrammarMasks(compiler.vocab_size, 2, torch.device("cpu"))
    logits = torch.randn(2, SMOLLM2_VOCAB_SIZE, generator=torch.Generator().manual_seed(0))
    rows = [
        FixedSamplingRow(SamplingParams(temperature=0, logprobs=0)),
        FixedSamplingRow(SamplingParams(temperature=1.0, logprobs=0), seed=3),
    ]
    grammars = [compiler.matcher(Params(regex="[0-9]+")) for _ in rows]
    mask = masks.fill(grammars, [0, 1], 2)
    allowed = allowed_tokens(mask.bitmask, SMOLLM2_VOCAB_SIZE, SHIFTS)
    tokens, logprobs = sampler(logits.clone(), rows, mask)
    for i, token in enumerate(tokens.tolist()):
        assert allowed[i, token]
        expected = torch.log_softmax(logits[i], dim=-1)[token].item()
        assert logprobs[i].logprob == pytest.approx(expected, abs=1e-5)
    assert tokens[0] == torch.where(allowed[0], logits[0], float("-inf")).argmax()
