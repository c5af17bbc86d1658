"""float8 e4m3 tiles widened to bf16 for `tl.dot`.

Triton widens e4m3 to bf16 in two conversions: e4m3 pairs to fp16 (one instruction a pair),
then each fp16 to bf16 (one instruction a value), so the skinny GEMM's K loop over an FP8 weight
issues 1.5 conversions a weight value (`ember bench isa --sections linear`). Conversions run at
16 results a clock per SM (the CUDA programming guide's throughput table, "all other type
conversions"), against 64 for integer logic and 128 for fp32 arithmetic: 1.5 a value caps an
SM at about 11 weight values a clock, where an H200's bandwidth brings 18 (4.8 TB/s over 132
SMs at 1.98 GHz). The measured FP8 decode step sits at 0.45 of its bytes floor.

``IN_REGISTERS`` widens four codes in eight instructions on the integer and bf16 units
instead (`_E4M3X4_TO_BF16X4`; about as many instructions a value as the conversions, so whether
it pays depends on which limit binds, a question for the GPU). A byte permute spreads two codes
over a register's 16-bit halves, each code's sign replicated into its high byte; shifted left
by 4 and masked, each half holds the code's sign, exponent and mantissa in a bf16's sign, lowest
exponent and top mantissa bits, which is its value times 2^-120 (e4m3's exponent bias is 7,
bf16's 127; a subnormal for the exponent-0 codes, which bf16 arithmetic keeps); one bf16x2
multiply by 2^120 makes both exact.
Every finite code widens to the value the conversion gives; the NaN codes (0x7F, 0xFF) read as
+-480, which weights and caches never hold (they store values clamped to +-448). The
interpreter (no inline assembly) and other dtypes take the conversion.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ember.kernels.compile_ahead import kernels_interpreted

# $0, $1: the bf16x2 results of codes 0-1 and 2-3 of $2 (four e4m3 codes, code 0 lowest).
# prmt 0x9180: bytes (code 0, its sign replicated, code 1, its sign replicated); 0xB3A2 the
# same for codes 2 and 3. 0x87F087F0: each half's sign, exponent-low and mantissa bits after
# the shift. 0x7B80: 2^120 in bf16; 0x80008000: -0.0, fma's identity.
_E4M3X4_TO_BF16X4 = tl.constexpr("""
{
.reg .b32 lo, hi, scale, zero;
mov.b32 scale, 0x7B807B80;
mov.b32 zero, 0x80008000;
prmt.b32 lo, $2, 0, 0x9180;
prmt.b32 hi, $2, 0, 0xB3A2;
shl.b32 lo, lo, 4;
shl.b32 hi, hi, 4;
and.b32 lo, lo, 0x87F087F0;
and.b32 hi, hi, 0x87F087F0;
fma.rn.bf16x2 $0, lo, scale, zero;
fma.rn.bf16x2 $1, hi, scale, zero;
}
""")


@triton.jit
def widen_e4m3(x, dtype: tl.constexpr, IN_REGISTERS: tl.constexpr):
    """``x`` (float8e4nv) in ``dtype``; bf16 ``IN_REGISTERS`` through the bits (the module
    docstring), otherwise by Triton's conversion."""
    if IN_REGISTERS and dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(
            _E4M3X4_TO_BF16X4,
            "=r,=r,r",
            [x.to(tl.uint8, bitcast=True)],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )
    return x.to(dtype)


def fp8_in_registers(requested: bool) -> bool:
    """Whether a launch widens FP8 in registers: as ``requested``, except in the interpreter,
    which runs no inline assembly."""
    return requested and not kernels_interpreted()
