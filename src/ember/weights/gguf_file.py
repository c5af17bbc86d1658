"""Reading the GGUF container: header, metadata and tensor table, with tensor bytes memory-mapped.

We parse the container ourselves instead of using `gguf.GGUFReader`: the reader builds two numpy
views per metadata string, which takes ~4 s for a 49k-token vocabulary on a small CPU, while a
plain `struct` walk over the mapped file takes ~0.1 s. The `gguf` package still supplies the type
tables (value types, quantization block sizes), so no format constant is restated here.
"""

from __future__ import annotations

import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

if TYPE_CHECKING:
    import torch

# Scalar value types: struct format (little-endian) and the numpy dtype used for arrays of them.
_SCALAR_FORMATS: dict[GGUFValueType, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.BOOL: ("<?", np.dtype("?")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """The file is not a readable GGUF file (wrong magic, truncated, or inconsistent)."""

    def __init__(self, path: os.PathLike | str, reason: str):
        super().__init__(f"{os.fspath(path)}: not a valid GGUF file: {reason}")
        self.path = os.fspath(path)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table. `shape` is in PyTorch order (outermost first)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """A GGUF file opened read-only: `metadata`, `tensors` and the raw bytes of each tensor.

    Metadata values are Python scalars and strings; arrays of numbers are numpy arrays and
    arrays of strings are lists. The file stays mapped until `close()`.
    """

    def __init__(self, path: os.PathLike | str):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                # Read-only: a private writable mapping would count the whole file against the
                # commit limit, which refuses files larger than RAM + swap.
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # mmap refuses empty files
            raise GGUFFormatError(self.path, str(exc)) from exc
        try:
            self.metadata, self.tensors = _parse(self._map, self.path)
        except BaseException:
            self._map.close()
            raise

    def raw(self, info: GGUFTensorInfo) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor viewing the mapped file (no copy; never write)."""
        import torch  # here, not at module level: the front end reads GGUF metadata only

        with warnings.catch_warnings():
            # torch warns that the buffer is read-only; nothing writes through these views.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            return torch.frombuffer(
                self._map, dtype=torch.uint8, count=info.nbytes, offset=info.offset
            )

    def close(self) -> None:
        """Unmap the file. Tensors returned by `raw()` must be gone by then."""
        self._map.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Cursor:
    """Sequential little-endian reads over the mapped file, failing with the file's name."""

    def __init__(self, buf: mmap.mmap, path: str):
        self.buf, self.path, self.pos = buf, path, 0

    def fail(self, reason: str) -> GGUFFormatError:
        return GGUFFormatError(self.path, f"{reason} (at byte {self.pos})")

    def need(self, nbytes: int) -> None:
        if self.pos + nbytes > len(self.buf):
            raise self.fail(f"truncated: needs {nbytes} more bytes, file has {len(self.buf)}")

    def u32(self) -> int:
        self.need(4)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        self.need(8)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def string(self) -> str:
        size = self.u64()
        self.need(size)
        raw = self.buf[self.pos : self.pos + size]
        self.pos += size
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"string is not UTF-8: {exc}") from exc

    def value_type(self) -> GGUFValueType:
        code = self.u32()
        try:
            return GGUFValueType(code)
        except ValueError:
            raise self.fail(f"unknown metadata value type {code}") from None

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            return self.array()
        fmt, dtype = _SCALAR_FORMATS[kind]
        self.need(dtype.itemsize)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += dtype.itemsize
        return value

    def array(self) -> Any:
        kind = self.value_type()
        count = self.u64()
        if kind in _SCALAR_FORMATS:
            dtype = _SCALAR_FORMATS[kind][1]
            self.need(count * dtype.itemsize)
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return values.tolist() if kind == GGUFValueType.BOOL else values
        # Every string or nested array takes at least 8 bytes: reject absurd counts up front.
        self.need(count * 8)
        return [self.value(kind) for _ in range(count)]


def _parse(buf: mmap.mmap, path: str) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    cur = _Cursor(buf, path)
    if cur.u32() != GGUF_MAGIC:
        raise GGUFFormatError(path, "bad magic (expected 'GGUF')")
    version = cur.u32()
    if version not in (2, 3):
        hint = " (big-endian files are not supported)" if version & 0xFFFF == 0 else ""
        raise GGUFFormatError(path, f"unsupported GGUF version {version}{hint}")
    tensor_count, kv_count = cur.u64(), cur.u64()
    cur.need(tensor_count * 24 + kv_count * 12)  # smallest possible entries

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        metadata[key] = cur.value(cur.value_type())

    entries = [_read_tensor_entry(cur) for _ in range(tensor_count)]
    alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, ggml_type, shape, rel_offset in entries:
        block_elems, block_bytes = GGML_QUANT_SIZES[ggml_type]
        numel = int(np.prod(shape, dtype=np.int64))
        if shape and shape[-1] % block_elems:
            raise GGUFFormatError(
                path, f"tensor {name!r} rows are not whole {ggml_type.name} blocks"
            )
        info = GGUFTensorInfo(
            name, ggml_type, shape, data_start + rel_offset, numel // block_elems * block_bytes
        )
        if info.offset + info.nbytes > len(buf):
            raise GGUFFormatError(
                path,
                f"truncated: tensor {name!r} ends at byte {info.offset + info.nbytes}, "
                f"file has {len(buf)}",
            )
        tensors[name] = info
    return metadata, tensors


def _read_tensor_entry(cur: _Cursor) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
    name = cur.string()
    n_dims = cur.u32()
    if n_dims > 8:
        raise cur.fail(f"tensor {name!r} claims {n_dims} dimensions")
    dims = [cur.u64() for _ in range(n_dims)]
    code = cur.u32()
    try:
        ggml_type = GGMLQuantizationType(code)
    except ValueError:
        raise cur.fail(f"tensor {name!r} has unknown ggml type {code}") from None
    # GGUF lists dimensions innermost first; PyTorch shapes are outermost first.
    return name, ggml_type, tuple(reversed(dims)), cur.u64()
