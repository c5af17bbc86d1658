"""MXFP4 weight tiles widened in registers, for kernels whose weights are packed
(`ember.layers.mxfp4`): Hopper has no FP4 tensor-core product, so a tile is read packed (half
a byte a value, a byte of scale per 32), decoded to the activations' dtype and fed to `tl.dot`.

Decoding is exact and cheap: an e2m1 code (a sign, a 2-bit exponent, a 1-bit mantissa: 0, 0.5,
1, 1.5, 2, 3, 4, 6) with its exponent and mantissa bits shifted into a float32's lowest exponent
bits and its sign into the sign bit is the value times 2^-126 (a subnormal for the exponent-0
codes: the CUDA cores keep subnormals): three integer operations a value, where an arithmetic
decode takes about a dozen. Times 2^126 and the group's scale ``2^(x - 127)`` (built from its
bits), it is what `ember.weights.mxfp4.dequantize_mxfp4` computes, rounded to the dtype once
(exact in bf16 and fp32).
"""

from __future__ import annotations

import triton
import triton.language as tl

# 2^-127, e8m0's smallest scale (its float32 is subnormal: no exponent bits to build it from).
_SMALLEST_SCALE = tl.constexpr(5.877471754111438e-39)


# float32 bit patterns: the sign bit, and where a code's exponent and mantissa bits go (the
# exponent's lowest two bits and the mantissa's top one).
_SIGN_BIT = tl.constexpr(-2147483648)
_CODE_BITS = tl.constexpr(0x01C00000)
_TWO_POW_126 = tl.constexpr(2.0**126)


@triton.jit
def e2m1_pairs_times_2_neg126(packed):
    """Float32 ``(low, high)`` values times 2^-126 of the two e2m1 codes of each byte of
    ``packed`` (code bits 0-2: mantissa, then exponent; bit 3: the sign; the low nibble first).
    """
    p = packed.to(tl.int32)
    low = ((p << 22) & _CODE_BITS) | ((p << 28) & _SIGN_BIT)
    high = ((p << 18) & _CODE_BITS) | ((p << 24) & _SIGN_BIT)
    return low.to(tl.float32, bitcast=True), high.to(tl.float32, bitcast=True)


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
    low, high = e2m1_pairs_times_2_neg126(packed)
    # (value * 2^126) first: a normal float32, which the scale moves exactly.
    even = (low * _TWO_POW_126 * scale).to(dtype)
    odd = (high * _TWO_POW_126 * scale).to(dtype)
    return even, odd
