"""MXFP4 weight tiles widened in registers, for kernels whose weights are packed
(`ember.layers.mxfp4`): Hopper has no FP4 tensor-core product, so a tile is read packed (half
a byte a value, a byte of scale per 32), decoded to the activations' dtype and fed to `tl.dot`.

Decoding is exact: an e2m1 code (a sign, a 2-bit exponent, a 1-bit mantissa: 0, 0.5, 1, 1.5,
2, 3, 4, 6) is decoded in integers, the group's scale ``2^(x - 127)`` built from its bits; their
product in float32 is what `ember.weights.mxfp4.dequantize_mxfp4` computes, rounded to the
dtype once (exact in bf16 and fp32).
"""

from __future__ import annotations

import triton
import triton.language as tl

# 2^-127, e8m0's smallest scale (its float32 is subnormal: no exponent bits to build it from).
_SMALLEST_SCALE = tl.constexpr(5.877471754111438e-39)


@triton.jit
def e2m1_to_float(codes):
    """Float32 values of 4-bit e2m1 ``codes`` (an integer tensor, 0-15): exponent 0 gives
    0 or 0.5, exponent e > 0 gives (1 + m/2) 2^(e-1); bit 3 is the sign (code 8 is -0)."""
    codes = codes.to(tl.int32)
    exponent = (codes >> 1) & 3
    mantissa = codes & 1
    # 4x the magnitude as an integer: (2 [normal] + m) << max(e, 1).
    quads = (tl.where(exponent > 0, 2, 0) + mantissa) << tl.maximum(exponent, 1)
    magnitude = quads.to(tl.float32) * 0.25
    sign = (codes & 8) << 28  # float32's sign bit (a negative zero too)
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_float(exponents):
    """Float32 ``2^(x - 127)`` of e8m0 bytes ``x`` (255, the format's NaN, reads as +inf)."""
    bits = exponents.to(tl.int32) << 23
    return tl.where(exponents == 0, _SMALLEST_SCALE, bits.to(tl.float32, bitcast=True))


@triton.jit
def mxfp4_tile(
    row_ptrs,
    scale_row_ptrs,
    k0,
    k_size,
    dtype: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The weight tile ``[BLOCK_N, BLOCK_K]`` at K offset ``k0`` (a multiple of 32) in
    ``dtype``, as its even and odd columns (``[BLOCK_N, BLOCK_K / 2]`` each): ``row_ptrs``
    ``[BLOCK_N, 1]`` point at each row's packed bytes (uint8, two values a byte, the even one in
    the low nibble), ``scale_row_ptrs`` at its scales (one byte per 32 values). Past ``k_size``
    (unless ``EVEN_K``) the tile holds zeros."""
    cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte columns
    groups = cols // 16  # each byte's scale: 16 bytes a group (read again from L1)
    if EVEN_K:
        packed = tl.load(row_ptrs + cols[None, :])
        scales = tl.load(scale_row_ptrs + groups[None, :])
    else:
        valid = cols[None, :] < k_size // 2
        packed = tl.load(row_ptrs + cols[None, :], mask=valid, other=0)
        scales = tl.load(scale_row_ptrs + groups[None, :], mask=valid, other=127)
    scale = e8m0_to_float(scales)
    even = (e2m1_to_float(packed & 0xF) * scale).to(dtype)
    odd = (e2m1_to_float(packed >> 4) * scale).to(dtype)
    return even, odd
