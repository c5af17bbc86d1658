"""MXFP4 dequantization against transformers' own (its gpt-oss loader), and its exactness."""

from __future__ import annotations

import pytest
import torch

from ember.weights.mxfp4 import dequantize_mxfp4


def _random_mxfp4(gen, experts, rows, cols):
    blocks = torch.randint(
        0, 256, (experts, rows, cols // 32, 16), generator=gen, dtype=torch.uint8
    )
    # Exponents around 2**0, as trained weights' scales sit (115-130), plus the extremes' region.
    scales = torch.randint(110, 135, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_transformers_gpt_oss_loader(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks, scales = _random_mxfp4(gen, 3, 48, 96)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    # transformers returns gpt-oss's [E, cols, rows] parameter layout: the transpose of ours.
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    assert ours.shape == (3, 48, 96) and ours.dtype == dtype
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_values_by_hand():
    # One row of 32 columns: byte j holds columns 2j (low nibble) and 2j+1 (high nibble).
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2F  # column 0: code 15 (-6.0); column 1: code 2 (1.0)
    blocks[0, 0, 15] = 0x91  # column 30: code 1 (0.5); column 31: code 9 (-0.5)
    scales = torch.tensor([[127 + 3]], dtype=torch.uint8)  # times 8
    row = dequantize_mxfp4(blocks, scales, torch.float32)[0]
    assert row[0] == -48.0 and row[1] == 8.0 and row[30] == 4.0 and row[31] == -4.0
    assert not row[2:30].any()


def test_exact_in_bfloat16():
    gen = torch.Generator().manual_seed(1)
    blocks, scales = _random_mxfp4(gen, 2, 8, 64)
    as_bf16 = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    as_f32 = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(as_bf16.float(), as_f32)


def test_mismatched_shapes_are_refused():
    blocks = torch.zeros(2, 4, 3, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, torch.zeros(2, 4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.to(torch.int16), torch.zeros(2, 4, 3, dtype=torch.uint8))
