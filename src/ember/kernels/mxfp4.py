"""MXFP4 weight tiles widened in registers, for kernels whose weights are packed
(`ember.layers.mxfp4`): Hopper has no FP4 tensor-core product, so a tile is read packed (half
a byte a value, a byte of scale per 32), decoded to the activations' dtype and fed to `tl.dot`.

`mxfp4_tile_k_major` decodes to bf16 in PTX (`_E2M1_BYTES_TO_BF16`, compiled kernels only):
a byte permute puts bytes 0 and 1 of four (2 and 3) 16 bits apart, so one shift and mask place
two codes' exponent and mantissa bits in a bf16 pair's lowest exponent and top mantissa bits
and another their signs (each half then holds its value times 2^-126, as below), and one bf16x2
multiply by 2^126 makes both exact: about 2.5 instructions a value where `tl.dot_scaled`'s
upcast takes 8.5 (`ember bench isa`). Its tile is K-major (``[BLOCK_K / 2, BLOCK_N]``, the
dot's right operand as it stands), which spares the transpose a row-major tile takes through
shared memory one value at a time.

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


def _codes_to_bf16_pair(out: str, source: str, code_shift: int, sign_shift: int) -> str:
    """PTX: two codes of ``source`` 16 bits apart, as the bf16 pair ``out``: their mantissa and
    exponent bits shifted to bits 6-8 of each half, their signs to bit 15, times 2^126."""
    return (
        f"shl.b32 {out}, {source}, {code_shift};\n"
        f"shl.b32 s, {source}, {sign_shift};\n"
        f"and.b32 {out}, {out}, 0x01C001C0;\n"
        "and.b32 s, s, 0x80008000;\n"
        f"or.b32 {out}, {out}, s;\n"
        f"fma.rn.bf16x2 {out}, {out}, scale, zero;\n"
    )


# $0, $1: the low nibbles' values (even K columns) of bytes 0-1 and 2-3 of $4, as bf16 pairs;
# $2, $3: the high nibbles' (odd columns). prmt 0x3120 orders the bytes 0, 2, 1, 3: bytes 0 and
# 1 (and, shifted down 8 into b, 2 and 3) sit 16 bits apart. A low nibble's code takes a shift
# of 6, its sign (bit 3) 12; a high nibble's 2 and 8. fma by 2^126 (bf16 0x7E80) with -0.0
# added makes each value.
_E2M1_BYTES_TO_BF16 = tl.constexpr(
    "{\n.reg .b32 a, b, s, scale, zero;\n"
    "mov.b32 scale, 0x7E807E80;\n"
    "mov.b32 zero, 0x80008000;\n"
    "prmt.b32 a, $4, 0, 0x3120;\n"
    "shr.b32 b, a, 8;\n"
    + _codes_to_bf16_pair("$0", "a", 6, 12)
    + _codes_to_bf16_pair("$1", "b", 6, 12)
    + _codes_to_bf16_pair("$2", "a", 2, 8)
    + _codes_to_bf16_pair("$3", "b", 2, 8)
    + "}"
)
# bf16 bits of 2^-127, e8m0's smallest scale (a subnormal: no exponent bits to build it from).
_SMALLEST_SCALE_BF16_BITS = tl.constexpr(0x40)


@triton.jit
def e8m0_to_bf16(exponents):
    """bf16 ``2^(x - 127)`` of e8m0 bytes ``x`` (255, the format's NaN, reads as +inf)."""
    bits = exponents.to(tl.int16) << 7
    bits = tl.where(exponents == 0, _SMALLEST_SCALE_BF16_BITS, bits).to(tl.int16)
    return bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def mxfp4_tile_k_major(
    col_ptrs, scale_col_ptrs, k0, k_size, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The weight tile at K offset ``k0`` (a multiple of 32) in bf16, K-major: its even and
    odd K columns as ``[BLOCK_K / 2, BLOCK_N]`` tiles, ready as `tl.dot`'s right operand.
    ``col_ptrs`` ``[1, BLOCK_N]`` point at each weight row's packed bytes, ``scale_col_ptrs`` at
    its scales; past ``k_size`` (unless ``EVEN_K``) the tile holds zeros. Decoded in PTX
    (`_E2M1_BYTES_TO_BF16`): compiled kernels only, the interpreter runs `mxfp4_tile`."""
    rows = k0 // 2 + tl.arange(0, BLOCK_K // 2)[:, None]  # byte columns, down the tile
    groups = rows // 16
    if EVEN_K:
        packed = tl.load(col_ptrs + rows)
        scales = tl.load(scale_col_ptrs + groups)
    else:
        valid = rows < k_size // 2
        packed = tl.load(col_ptrs + rows, mask=valid, other=0)
        scales = tl.load(scale_col_ptrs + groups, mask=valid, other=127)
    even, odd = tl.inline_asm_elementwise(
        _E2M1_BYTES_TO_BF16,
        "=r,=r,=r,=r,r",
        [packed],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )
    scale = e8m0_to_bf16(scales)
    return even * scale, odd * scale
