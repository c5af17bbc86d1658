"""MXFP4 dequantization against transformers' own (its gpt-oss loader), and its exactness;
quantization to the nearest MXFP4 value of each group's scale."""

from __future__ import annotations

import pytest
import torch

from ember.weights.mxfp4 import dequantize_mxfp4, quantize_mxfp4


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


def test_quantized_values_are_the_nearest_of_their_groups_grid():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(2, 6, 96, generator=gen) * torch.rand(2, 6, 1, generator=gen)
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (2, 6, 3, 16) and scales.shape == (2, 6, 3)
    restored = dequantize_mxfp4(blocks, scales, torch.float32)
    # Each group's scale is the smallest power of two bringing its largest value within 6.
    groups = weight.view(2, 6, 3, 32).abs().amax(-1)
    step = torch.exp2(scales.float() - 127)
    assert (groups <= 6 * step).all() and (groups > 3 * step).all()
    # Every value within half the grid's gap around it (the widest gap, between 4 and 6, is 2).
    error = (restored - weight).abs().view(2, 6, 3, 32)
    assert (error <= step[..., None]).all()
    assert (restored.sign() * weight.sign() >= 0).all()


def test_values_on_the_grid_quantize_to_themselves():
    gen = torch.Generator().manual_seed(3)
    blocks, scales = _random_mxfp4(gen, 2, 4, 64)
    values = dequantize_mxfp4(blocks, scales, torch.float32)
    again = dequantize_mxfp4(*quantize_mxfp4(values), torch.float32)
    assert torch.equal(again, values)


def test_zero_groups_quantize_to_zero():
    blocks, scales = quantize_mxfp4(torch.zeros(1, 2, 32))
    assert not blocks.any()
    assert not dequantize_mxfp4(blocks, scales, torch.float32).any()
