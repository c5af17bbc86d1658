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
