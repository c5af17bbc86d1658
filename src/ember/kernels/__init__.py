"""Triton kernels for the GPU fast path, one concern per module.

Each op has a plain-PyTorch twin with the same signature in ``ember.layers.reference_ops``; the
kernels are tested against those on a CPU under ``TRITON_INTERPRET=1``. Nothing is imported
here: the CPU path runs without Triton, so only the modules a caller names load it.
"""
