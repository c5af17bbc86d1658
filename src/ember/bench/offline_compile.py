"""Compile the engine's Triton kernels for an NVIDIA GPU on a machine without one.

Inside `compile_offline`, Triton's active driver is a stand-in that names the target GPU
(``GPUTarget("cuda", arch, 32)``) and nothing else, and `ember.kernels.compile_ahead` turns
every `launch` into Triton's ``warmup``: the launch's real arguments (CPU tensors stand in for
GPU ones: only their dtypes, strides and 16-byte alignment count) give the same specialisation
a launch on that GPU would compile, and no kernel runs. Each compiled kernel is recorded with
its cubin, which `ember.bench.sass` reads.

It relies on Triton's driver interface (``triton.runtime.driver.set_active``, the driver's
``get_current_target`` / ``get_current_device`` / ``get_current_stream``), as of Triton 3.6.
Kernels must be compiled, not interpreted: run it with ``TRITON_INTERPRET=0`` (the test suite's
interpreter defines every kernel as an interpreted function).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.kernels.compile_ahead import compile_ahead, kernels_interpreted


@dataclass(frozen=True)
class CompiledKernel:
    """One specialisation compiled for the target: the kernel's name, its constexprs by name,
    launch options, the shared memory a block asks for, and where its cubin is (Triton's
    cache)."""

    name: str
    constants: dict[str, Any]
    num_warps: int
    num_stages: int
    shared_bytes: int
    cubin: Path


class _TargetOnlyDriver:
    """What Triton's JIT asks of the active driver to compile for a target, and no more. Its
    device is a number of its own: a kernel's in-memory cache is per device, so each block
    meets every specialisation anew (Triton's disk cache still serves it) and records it."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.device = uuid.uuid4().int >> 64

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def launcher_cls(self, src: Any, metadata: Any) -> None:
        """`compile_ahead` builds each kernel's launcher: there is nothing to launch here."""


def _recorded(src: Any, metadata: dict, metadata_group: dict[str, str]) -> CompiledKernel:
    names = src.fn.arg_names
    constants = {names[key[0]]: value for key, value in src.constants.items() if len(key) == 1}
    [cubin] = [path for file, path in metadata_group.items() if file.endswith(".cubin")]
    return CompiledKernel(
        src.fn.__name__,
        constants,
        metadata["num_warps"],
        metadata["num_stages"],
        metadata["shared"],
        Path(cubin),
    )


@contextmanager
def compile_offline(arch: int = 90) -> Iterator[list[CompiledKernel]]:
    """Within the block, launches compile for ``sm_<arch>`` and run nothing; the list it yields
    holds every kernel compiled (or found in Triton's cache) once the block has exited."""
    import triton
    from triton.runtime import driver

    if kernels_interpreted():
        raise RuntimeError(
            "kernels are interpreted (TRITON_INTERPRET=1): compiling for a GPU needs them "
            "defined as Triton JIT functions; run with TRITON_INTERPRET=0"
        )
    compiled: list[CompiledKernel] = []

    def listener(*, src, metadata, metadata_group, **_: Any) -> None:
        compiled.append(_recorded(src, metadata, metadata_group))

    try:
        driver_before = driver.active
    except RuntimeError:  # no GPU driver on this machine: back to none afterwards
        driver_before = None
    knobs = triton.knobs.compilation
    listener_before = knobs.listener
    driver.set_active(_TargetOnlyDriver(arch))
    knobs.listener = listener
    try:
        with compile_ahead(1):
            yield compiled
    finally:
        knobs.listener = listener_before
        driver.set_active(driver_before)
