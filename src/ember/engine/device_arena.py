"""A model's device memory as one byte range that can be released while the model sleeps and
restored when it wakes.

Weights (and, in an arena of its own, the KV cache) are views into one flat buffer, so putting a
model to sleep is one copy of one range, whatever its parameters look like. Two kinds:

- `VirtualArena` (CUDA): the virtual address range is reserved once, through CUDA's virtual
  memory management (the driver API, called with ctypes); sleeping unmaps and frees the
  physical memory, waking maps new physical memory at the same addresses. Every pointer a CUDA
  graph baked in stays valid, so a woken model keeps its graphs.
- `TorchArena` (CPU, and CUDA where the driver lacks virtual memory management): an ordinary
  tensor whose storage is freed and allocated again. The addresses change on wake, so the
  model's CUDA graphs must be captured again (`keeps_addresses` is False).
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

ALIGNMENT = 256  # bytes between views: what the GEMM and TMA paths expect of a pointer


def aligned(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of consecutive byte ranges of ``sizes``, each aligned; and the total."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += aligned(size)
    return offsets, total


class TorchArena:
    """A flat byte buffer from the torch allocator; released by shrinking its storage to 0."""

    keeps_addresses = False

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.resident = True

    def release(self) -> None:
        """Free the memory; the views keep their shapes but must not be read until restore."""
        self.buffer.untyped_storage().resize_(0)
        self.resident = False

    def restore(self) -> None:
        """Allocate the memory again (contents undefined); views see it at their offsets."""
        self.buffer.untyped_storage().resize_(self.nbytes)
        self.resident = True

    def close(self) -> None:
        self.release()


class _CudaPointer:
    """A device byte range as `__cuda_array_interface__`, for `torch.as_tensor`; ``owner`` lives
    as long as the tensor (torch holds this object until the storage is freed), so memory behind
    a view is never given back while the view exists."""

    def __init__(self, address: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_ALLOCATION_TYPE_PINNED = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_READ_WRITE = 3
_GRANULARITY_RECOMMENDED = 1


class CudaDriver:
    """The few driver calls of virtual memory management, through ctypes."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        u64, size_t = ctypes.c_uint64, ctypes.c_size_t
        signatures = {
            "cuMemGetAllocationGranularity": [
                ctypes.POINTER(size_t),
                ctypes.POINTER(_AllocationProp),
                ctypes.c_int,
            ],
            "cuMemAddressReserve": [ctypes.POINTER(u64), size_t, size_t, u64, u64],
            "cuMemAddressFree": [u64, size_t],
            "cuMemCreate": [ctypes.POINTER(u64), size_t, ctypes.POINTER(_AllocationProp), u64],
            "cuMemRelease": [u64],
            "cuMemMap": [u64, size_t, size_t, u64, u64],
            "cuMemUnmap": [u64, size_t],
            "cuMemSetAccess": [u64, size_t, ctypes.POINTER(_AccessDesc), size_t],
            "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
            "cuCtxSetCurrent": [ctypes.c_void_p],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, argtypes in signatures.items():
            function = getattr(self.lib, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int

    def check(self, result: int, call: str) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(text))
            message = text.value.decode() if text.value else f"error {result}"
            raise RuntimeError(f"{call} failed: {message}")

    def make_current(self, device_index: int) -> None:
        """Make the device's primary context current on this thread (a worker thread that has
        made no CUDA call yet has none)."""
        current = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value:
            return
        context = ctypes.c_void_p()
        self.check(
            self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device_index),
            "cuDevicePrimaryCtxRetain",
        )
        self.check(self.lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")

    def prop(self, device_index: int) -> _AllocationProp:
        prop = _AllocationProp()
        prop.type = _ALLOCATION_TYPE_PINNED
        prop.location = _Location(_LOCATION_TYPE_DEVICE, device_index)
        return prop

    def granularity(self, device_index: int) -> int:
        value = ctypes.c_size_t()
        prop = self.prop(device_index)
        self.check(
            self.lib.cuMemGetAllocationGranularity(
                ctypes.byref(value), ctypes.byref(prop), _GRANULARITY_RECOMMENDED
            ),
            "cuMemGetAllocationGranularity",
        )
        return int(value.value)


class _VirtualRange:
    """A reserved virtual range and the physical memory mapped into it: freed by `close`, or
    when nothing refers to it any more (the arena and every tensor viewing it are gone), so a
    model dropped without being closed still gives its memory back."""

    def __init__(self, nbytes: int, index: int, driver: CudaDriver) -> None:
        self.closed = True  # until the range is reserved: nothing for `__del__` to free
        self.index = index
        self._driver = driver
        driver.make_current(index)
        self.nbytes = aligned(max(nbytes, 1), driver.granularity(index))
        address = ctypes.c_uint64()
        driver.check(
            driver.lib.cuMemAddressReserve(ctypes.byref(address), self.nbytes, 0, 0, 0),
            "cuMemAddressReserve",
        )
        self.address = int(address.value)
        self._handle: int | None = None
        self.resident = False
        self.closed = False

    def restore(self) -> None:
        """Map fresh physical memory at the reserved addresses (contents undefined)."""
        if self.resident:
            return
        driver, lib = self._driver, self._driver.lib
        driver.make_current(self.index)
        handle = ctypes.c_uint64()
        prop = driver.prop(self.index)
        driver.check(
            lib.cuMemCreate(ctypes.byref(handle), self.nbytes, ctypes.byref(prop), 0),
            f"cuMemCreate of {self.nbytes / 2**30:.2f} GiB",
        )
        try:
            driver.check(lib.cuMemMap(self.address, self.nbytes, 0, handle.value, 0), "cuMemMap")
        except RuntimeError:
            lib.cuMemRelease(handle.value)
            raise
        access = _AccessDesc(_Location(_LOCATION_TYPE_DEVICE, self.index), _ACCESS_READ_WRITE)
        driver.check(
            lib.cuMemSetAccess(self.address, self.nbytes, ctypes.byref(access), 1),
            "cuMemSetAccess",
        )
        self._handle = int(handle.value)
        self.resident = True

    def release(self) -> None:
        """Unmap and free the physical memory; the addresses stay reserved for `restore`."""
        if not self.resident:
            return
        driver = self._driver
        driver.make_current(self.index)
        driver.check(driver.lib.cuMemUnmap(self.address, self.nbytes), "cuMemUnmap")
        driver.check(driver.lib.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None
        self.resident = False

    def close(self) -> None:
        """Release the memory and the addresses."""
        if self.closed:
            return
        self.release()
        self._driver.check(
            self._driver.lib.cuMemAddressFree(self.address, self.nbytes), "cuMemAddressFree"
        )
        self.closed = True

    def __del__(self) -> None:
        if self.closed or sys.is_finalizing():  # at exit the driver gives everything back
            return
        torch.cuda.synchronize(self.index)  # no kernel still reads the range
        self.close()


class VirtualArena:
    """A reserved virtual range whose physical memory is mapped while resident."""

    keeps_addresses = True

    def __init__(self, nbytes: int, device: torch.device, driver: CudaDriver) -> None:
        self.device = device
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._range = _VirtualRange(nbytes, index, driver)
        self._range.restore()
        self.nbytes = self._range.nbytes
        self.address = self._range.address
        pointer = _CudaPointer(self.address, nbytes, owner=self._range)
        self.buffer = torch.as_tensor(pointer, device=device)

    @property
    def resident(self) -> bool:
        return self._range.resident

    def restore(self) -> None:
        """Map fresh physical memory at the reserved addresses (contents undefined)."""
        self._range.restore()

    def release(self) -> None:
        """Unmap and free the physical memory; the addresses stay reserved for `restore`.
        The caller has synchronised every stream that may still touch the range."""
        self._range.release()

    def close(self) -> None:
        """Release the memory and the addresses (the model is gone; no view may be read)."""
        self._range.close()


Arena = TorchArena | VirtualArena


class ArenaFactory:
    """Makes arenas for one device: virtual ones where the CUDA driver offers them."""

    def __init__(self, device: torch.device, use_virtual_memory: bool = True) -> None:
        self.device = device
        self._driver: CudaDriver | None = None
        if device.type == "cuda" and use_virtual_memory:
            try:
                self._driver = CudaDriver()
            except (OSError, AttributeError) as exc:
                logger.warning(
                    "CUDA virtual memory management is unavailable (%s): a woken model "
                    "captures its CUDA graphs again",
                    exc,
                )

    @property
    def keeps_addresses(self) -> bool:
        return self._driver is not None

    def make(self, nbytes: int) -> Arena:
        if self._driver is not None:
            return VirtualArena(nbytes, self.device, self._driver)
        return TorchArena(nbytes, self.device)


def carve(
    arena: Arena, shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]
) -> list[torch.Tensor]:
    """Views of ``arena`` holding tensors of these shapes and dtypes, laid out by `layout`."""
    sizes = [_nbytes(shape, dtype) for shape, dtype in shapes]
    offsets, total = layout(sizes)
    assert total <= arena.buffer.numel(), "the arena is smaller than its layout"
    return [
        arena.buffer[offset : offset + size].view(dtype).view(shape)
        for offset, size, (shape, dtype) in zip(offsets, sizes, shapes)
    ]


def arena_bytes(shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> int:
    return layout([_nbytes(shape, dtype) for shape, dtype in shapes])[1]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * torch.empty((), dtype=dtype).element_size()
