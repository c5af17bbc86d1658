"""The step sampler on logits in the model's dtype: the greedy argmax reads them as they are,
everything that computes with them (bias, penalties, the seeded draw, logprobs) runs in float32,
so bf16 logits give what their float32 values give."""

from __future__ import annotations

import torch

from ember.config import StepLimits
from ember.layers.ops import reference_ops
from ember.runner.sampler import FixedSamplingRow, Sampler
from ember.sampling_params import SamplingParams

VOCAB = 500


def _row(seed: int = 0, **params) -> FixedSamplingRow:
    return FixedSamplingRow(
        params=SamplingParams(**params),
        seed=seed,
        step=0,
        prompt_token_ids=[1, 2, 3],
        stop_ids_until_min_tokens=(0,),
    )


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=gen) * 3).to(torch.bfloat16)


def _sample(logits, rows):
    return Sampler(reference_ops(), VOCAB, torch.device("cpu"))(logits, rows)


def test_greedy_bf16_logits_pick_the_argmax_of_their_float32_values():
    logits = _logits(4)
    logits[2, [11, 400]] = logits[2].max() + 1  # a bf16 tie: the first index wins
    rows = [_row(temperature=0.0, logprobs=2) for _ in range(4)]
    tokens, logprobs = _sample(logits, rows)
    assert torch.equal(tokens, logits.float().argmax(dim=-1)) and tokens[2] == 11
    expected = torch.log_softmax(logits.float(), dim=-1)
    for i, lp in enumerate(logprobs):
        assert lp.token_id == tokens[i] and abs(lp.logprob - expected[i, tokens[i]].item()) < 1e-6


def test_processing_and_sampling_run_in_float32():
    logits = _logits(3, seed=1)
    target = int(logits[0].float().argmin())
    rows = [
        _row(temperature=0.0, logit_bias={target: 100.0}),  # the bias must move the argmax
        _row(seed=5, temperature=0.9, top_k=40),
        _row(seed=6, temperature=0.7, top_p=0.8, min_tokens=2),  # min_tokens masks token 0
    ]
    tokens, _ = _sample(logits, rows)
    assert tokens[0] == target
    same_as_float32, _ = _sample(logits.float(), rows)
    assert torch.equal(tokens, same_as_float32)
    assert tokens[2] != 0


def test_warm_up_launches_every_row_count_in_both_logit_dtypes_and_a_draw():
    """Each kernel variant a step may launch (the argmax specialises on the row count) is run
    at start-up, not first met by a request."""
    import dataclasses

    reference = reference_ops()
    greedy_shapes, draws = [], []

    def recording_argmax(logits):
        greedy_shapes.append((logits.shape[0], logits.dtype))
        return reference.greedy_argmax(logits)

    def recording_sample(logits, *rows):
        draws.append(logits.shape)
        return reference.sample(logits, *rows)

    ops = dataclasses.replace(reference, greedy_argmax=recording_argmax, sample=recording_sample)
    Sampler(ops, VOCAB, torch.device("cpu"), StepLimits(max_num_seqs=6)).warm_up(torch.bfloat16)
    expected = {(rows, dtype) for rows in range(1, 7) for dtype in (torch.bfloat16, torch.float32)}
    assert set(greedy_shapes) == expected
    assert draws == [(1, VOCAB)]
