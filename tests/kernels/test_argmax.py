"""The split greedy argmax against torch.argmax: first maximum, ragged vocabularies, ties across
chunks, -inf chunks, every split count the heuristic picks."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.argmax import greedy_argmax, num_argmax_splits


@pytest.mark.parametrize(
    ("batch", "vocab"),
    [(1, 128256), (3, 50000), (8, 4097), (64, 9000), (64, 3000), (300, 2000), (2, 1)],
)
def test_matches_torch_argmax(batch, vocab, device, gen):
    logits = torch.randn(batch, vocab, generator=gen).to(device)
    assert torch.equal(greedy_argmax(logits).cpu(), logits.cpu().argmax(dim=-1))


def test_ties_across_chunks_resolve_to_the_first(device, gen):
    batch, vocab = 5, 70000
    assert num_argmax_splits(batch, vocab) > 4  # the maxima land in different chunks
    logits = torch.randn(batch, vocab, generator=gen)
    # Different chunks; the same chunk, other lanes; the same lane one loop step apart.
    ties = [(5, 65000), (40000, 12000), (69999, 3), (17, 18), (100, 1124)]
    for row, positions in enumerate(ties):
        logits[row, list(positions)] = 10.0
    expected = torch.tensor([5, 12000, 3, 17, 100])
    assert torch.equal(greedy_argmax(logits.to(device)).cpu(), expected)


def test_neg_inf_chunks_and_rows(device, gen):
    vocab = 60000
    logits = torch.randn(3, vocab, generator=gen)
    logits[0, :50000] = float("-inf")  # the maximum sits in the last chunks
    logits[1] = float("-inf")  # nothing but -inf: index 0, as torch
    logits[2, 1:] = float("-inf")
    out = greedy_argmax(logits.to(device)).cpu()
    assert torch.equal(out, logits.argmax(dim=-1))
    assert out[1] == 0 and out[2] == 0


def test_strided_rows_and_bad_input(device, gen):
    wide = torch.randn(5, 9000, generator=gen).to(device)
    rows = wide[:, :7000]  # row stride 9000
    assert torch.equal(greedy_argmax(rows).cpu(), rows.cpu().argmax(dim=-1))
    assert greedy_argmax(torch.empty(0, 10, device=device)).shape == (0,)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        greedy_argmax(wide.double())
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        greedy_argmax(wide.t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 8, 65])  # 65: past the split kernel, torch.argmax
def test_half_logits_give_the_argmax_of_their_float32_values(device, gen, dtype, batch):
    """The model's logits as they are: bf16 rounds many near values to one, so ties are common
    and must still go to the first index."""
    logits = (torch.randn(batch, 20000, generator=gen) * 4).to(dtype)
    logits[0, [7, 19000]] = logits[0].max() + 1  # a tie across chunks in row 0
    expected = logits.float().argmax(dim=-1)
    assert expected[0] == 7
    assert torch.equal(greedy_argmax(logits.to(device)).cpu(), expected)


def test_split_count_is_a_power_of_two_within_bounds():
    for batch in (1, 2, 5, 8, 31, 64):
        for vocab in (1, 4096, 4097, 32000, 128256, 152064):
            splits = num_argmax_splits(batch, vocab)
            assert splits & (splits - 1) == 0 and 1 <= splits <= 64
            assert batch * splits <= max(256, batch)
