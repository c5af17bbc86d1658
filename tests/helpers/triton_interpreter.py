"""Run Triton kernels on the CPU through Triton's interpreter, with fixes for its known bugs.

`TRITON_INTERPRET` must be set before any `@triton.jit` function is defined, so the root
conftest calls `configure()` before anything imports `ember.kernels`.
"""

import os

import numpy as np
import torch


def configure() -> None:
    """Interpret kernels unless a GPU is present or the caller chose (TRITON_INTERPRET=0/1)."""
    os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
    if _interpreting():
        _patch_interpreter_for_numpy_2_4()
        _patch_interpreter_bf16_dot()
        _patch_interpreter_bf16_rounding()
        _patch_interpreter_fp8_conversions()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _patch_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter calls ``int()`` on 1-element arrays, which numpy >= 2.4 refuses
    (triton-lang/triton#9171, fixed upstream after 3.6), breaking ``range`` over runtime bounds.
    Re-register ``__index__`` with an explicit element read."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_ember_numpy_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._ember_numpy_fix = True
    interpreter._patch_lang_tensor = patched


def _patch_interpreter_bf16_dot() -> None:
    """The interpreter stores bfloat16 as uint16 and its ``tl.dot`` multiplies those bit patterns
    (triton-lang/triton#11584, unsupported upstream). Upcast bf16 operands to fp32 first, which
    is exact and is what the tensor cores do (fp32 accumulation of exact products)."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_ember_bf16_fix", False):
        return

    def as_fp32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    create_dot._ember_bf16_fix = True
    builder.create_dot = create_dot


def _patch_interpreter_bf16_rounding() -> None:
    """The interpreter narrows float32 to bfloat16 by truncation (its cast passes no rounding
    mode), where the GPU rounds to nearest even; round with torch instead."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original_cast, original_fp_to_fp = builder.cast_impl, builder.create_fp_to_fp
    if getattr(original_cast, "_ember_bf16_fix", False):
        return

    def to_bf16(handle):
        values = torch.from_numpy(np.ascontiguousarray(handle.data, dtype=np.float32))
        bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(bits, tl.bfloat16)

    def narrows_to_bf16(src, dst_type):
        return src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16

    def cast_impl(self, src, dst_type):
        return (
            to_bf16(src) if narrows_to_bf16(src, dst_type) else original_cast(self, src, dst_type)
        )

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if narrows_to_bf16(src, dst_type):
            return to_bf16(src)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    cast_impl._ember_bf16_fix = True
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp


def _patch_interpreter_fp8_conversions() -> None:
    """The interpreter converts to float8 by its own bit arithmetic (`_convert_float`), which
    rounds ties away from zero, loses the carry of a mantissa rounded up into the exponent
    (-124.1 becomes -64, not -128) and truncates subnormals (0.001 becomes 0); and it reads
    e4m3fn's NaN (0x7f) as 480. The GPU converts to nearest even (``cvt.rn.satfinite``), as
    torch does: convert to and from float8 with torch instead (reads were exact but for NaN)."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp
    if getattr(original, "_ember_fp8_fix", False):
        return
    fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    floats = {
        **fp8,
        tl.bfloat16: torch.bfloat16,
        tl.float16: torch.float16,
        tl.float32: torch.float32,
        tl.float64: torch.float64,
    }
    # float8 and bfloat16 are stored as raw bits (uint8, uint16): read through a signed view.
    raw_bits = {**dict.fromkeys(fp8, torch.int8), tl.bfloat16: torch.int16}

    def as_torch(handle):
        scalar = handle.dtype.scalar
        data = torch.from_numpy(np.ascontiguousarray(handle.data).reshape(handle.data.shape))
        return data.view(raw_bits[scalar]).view(floats[scalar]) if scalar in raw_bits else data

    def from_torch(values, scalar):
        if scalar in raw_bits:
            storage = interpreter._get_np_dtype(scalar)
            return interpreter.TensorHandle(
                values.view(raw_bits[scalar]).numpy().view(storage), scalar
            )
        return interpreter.TensorHandle(values.numpy(), scalar)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_scalar, dst_scalar = src.dtype.scalar, dst_type.scalar
        to_nearest = rounding_mode in (None, interpreter._ir.ROUNDING_MODE.RTNE)
        known = src_scalar in floats and dst_scalar in floats
        if (src_scalar in fp8 or dst_scalar in fp8) and known and to_nearest:
            return from_torch(as_torch(src).to(floats[dst_scalar]), dst_scalar)
        return original(self, src, dst_type, rounding_mode)

    create_fp_to_fp._ember_fp8_fix = True
    builder.create_fp_to_fp = create_fp_to_fp
