"""Random weights made on the device (`--load-format dummy`, as vLLM's): a model runs from its
config.json (and tokenizer) alone, so a shape whose checkpoint does not fit the disk, or has not
been written, can be served and benchmarked. Its outputs mean nothing; its step costs are those
of the real weights, whose bytes and shapes it has.

Each parameter is drawn in turn from one generator on the parameters' device, seeded by the
engine's ``seed``: the same seed gives the same weights on the same kind of device (a model
whose sleep dropped its weights makes them again on wake), another seed other weights. The
values are those `ember bench make-model` writes: N(0, 1) embeddings, other matrices N(0,
1/fan_in) (the fan-in: a weight's last dimension), norm weights 1; other vectors (biases,
attention sinks) 0, and any non-float parameter 0. An FP8 weight is drawn in float32 a block of
rows at a time and quantized by `quantize_rows` into the weight and its row scales, as
``--quantization fp8`` quantizes a checkpoint's; MXFP4 experts (a config whose
``quant_method`` is mxfp4) alike by `quantize_mxfp4` into their packed blocks and scales, as
make-model writes them. Rows of the output head past the tokenizer's ids are zero, as make-model
writes them, so that greedy decoding picks ids that decode to text.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.layers.fp8 import Fp8Weight, held_fp8_weights, quantize_rows
from ember.layers.mxfp4 import Mxfp4Weight, held_mxfp4_weights
from ember.weights.mxfp4 import quantize_mxfp4

# Elements of an FP8 weight drawn (in float32) and quantized at once: 64 MiB, beside the KV
# cache, which holds the device's free memory by the time the weights are made.
_FP8_BLOCK_ELEMENTS = 1 << 24
# The same for an MXFP4 weight, whose quantization holds a few float32 copies of the block.
_MXFP4_BLOCK_ELEMENTS = 1 << 22


@torch.no_grad()
def fill_dummy_weights(
    model: nn.Module, seed: int, output_head: torch.Tensor, text_ids: int | None = None
) -> None:
    """Fill every parameter of ``model`` with seeded random values (the module docstring).
    ``output_head``: the parameter whose rows are the logits' (the output projection, or the
    tied embeddings); its rows from ``text_ids`` on are zero (None: none)."""
    fp8 = {id(weight.weight): weight for weight in held_fp8_weights(model)}
    mxfp4 = {id(weight.blocks): weight for weight in held_mxfp4_weights(model)}
    scales = {id(weight.scale) for weight in fp8.values()}
    scales |= {id(weight.scales) for weight in mxfp4.values()}
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if id(param) in scales:
            continue  # filled with its weight
        if id(param) in fp8:
            _fill_fp8(fp8[id(param)], generator)
        elif id(param) in mxfp4:
            _fill_mxfp4(mxfp4[id(param)], generator)
        elif not param.is_floating_point():
            param.zero_()
        elif param.dim() == 1:
            param.fill_(1.0 if "norm" in name.rsplit(".", 1)[-1] else 0.0)
        else:
            std = 1.0 if "embed_tokens" in name else param.shape[-1] ** -0.5
            param.normal_(0.0, std, generator=generator)
    if text_ids is not None:
        output_head[text_ids:] = 0


def _fill_fp8(weight: Fp8Weight, generator: torch.Generator) -> None:
    """N(0, 1/fan_in) rows quantized into ``weight`` and its scales, a block at a time."""
    rows = weight.weight.view(-1, weight.weight.shape[-1])
    scales = weight.scale.view(-1)
    std = rows.shape[1] ** -0.5
    block = max(1, _FP8_BLOCK_ELEMENTS // rows.shape[1])
    for first in range(0, rows.shape[0], block):
        count = min(block, rows.shape[0] - first)
        drawn = torch.randn(
            count, rows.shape[1], generator=generator, device=rows.device, dtype=torch.float32
        )
        quantized, scale = quantize_rows(drawn * std)
        rows[first : first + count] = quantized
        scales[first : first + count] = scale[:, 0]


def _fill_mxfp4(weight: Mxfp4Weight, generator: torch.Generator) -> None:
    """N(0, 1/fan_in) rows quantized into packed MXFP4 ``weight``, a block at a time."""
    blocks = weight.blocks.view(-1, *weight.blocks.shape[-2:])
    scales = weight.scales.view(-1, weight.scales.shape[-1])
    cols = weight.shape[-1]
    block = max(1, _MXFP4_BLOCK_ELEMENTS // cols)
    for first in range(0, blocks.shape[0], block):
        count = min(block, blocks.shape[0] - first)
        drawn = torch.randn(
            count, cols, generator=generator, device=blocks.device, dtype=torch.float32
        )
        packed, scale = quantize_mxfp4(drawn * cols**-0.5)
        blocks[first : first + count] = packed
        scales[first : first + count] = scale
