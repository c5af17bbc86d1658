"""Where each tensor's bytes sit in a safetensors file, for loaders that read them directly.

The `safetensors` library reads a tensor into memory it allocates; a loader that streams bytes
into pinned buffers on several threads needs the byte ranges instead. The format makes that
cheap: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
``data_offsets`` (relative to the end of the header), then the data
(https://huggingface.co/docs/safetensors, "Format").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ember.weights.weight_files import LocalFiles, WeightFiles

# The format's dtype names. Only dtypes torch can hold are listed: a file with another one is
# refused by name rather than read as the wrong type.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# A header larger than this is not a safetensors file (the library refuses past 100 MB too).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorExtent:
    """One tensor of a weight file: its name, dtype and shape, and its bytes in the file.
    ``row_stride``: a slice of a tensor's columns (`slice_extent`) is ``shape[0]`` rows of
    ``nbytes / shape[0]`` bytes each, one every ``row_stride`` bytes from ``offset``; 0: the
    bytes are contiguous."""

    name: str
    path: Path
    offset: int  # from the start of the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    row_stride: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_elements(self) -> int:
        """Elements of one row (of the first dimension); 1 for a scalar."""
        return math.prod(self.shape[1:])

    def segments(self, first: int, count: int) -> list[tuple[int, int]]:
        """The file's byte ranges ``(offset, nbytes)`` that hold elements ``[first, first +
        count)`` in order; a strided extent's must start and end on whole rows."""
        itemsize = self.dtype.itemsize
        if not self.row_stride:
            return [(self.offset + first * itemsize, count * itemsize)]
        row = self.row_elements
        if first % row or count % row:
            raise ValueError(f"a read of {self.name!r} must cover whole rows of its slice")
        return [
            (self.offset + r * self.row_stride, row * itemsize)
            for r in range(first // row, (first + count) // row)
        ]


def slice_extent(extent: TensorExtent, dim: int, start: int, length: int) -> TensorExtent:
    """The part of ``extent`` (a contiguous tensor) that holds indices ``[start, start +
    length)`` of dimension ``dim``: contiguous for the first dimension, a row-strided extent for
    the second of a matrix (a tensor-parallel rank's slice, `ember.parallel.sharding`)."""
    shape, itemsize = list(extent.shape), extent.dtype.itemsize
    if extent.row_stride or not 0 <= start <= start + length <= shape[dim]:
        raise ValueError(f"cannot take [{start}, {start + length}) of dim {dim} of {extent.name!r}")
    if dim == 0:
        row_bytes = math.prod(shape[1:]) * itemsize
        shape[0] = length
        return dataclasses.replace(
            extent,
            offset=extent.offset + start * row_bytes,
            nbytes=length * row_bytes,
            shape=tuple(shape),
        )
    if dim != 1 or len(shape) != 2:
        raise ValueError(f"only rows, or a matrix's columns, of {extent.name!r} can be sliced")
    rows, columns = shape
    return dataclasses.replace(
        extent,
        offset=extent.offset + start * itemsize,
        nbytes=rows * length * itemsize,
        shape=(rows, length),
        row_stride=columns * itemsize,
    )


def read_extents(path: Path, files: WeightFiles | None = None) -> list[TensorExtent]:
    """The tensors of one safetensors file in file order; ValueError naming the file if its
    header is malformed or points past the file's end. ``files`` reaches the file (default: on
    local disk); a file still downloading is read once its header has arrived."""
    files = files or LocalFiles()
    fd = files.open(path)
    try:
        size = os.fstat(fd).st_size
        files.wait(path, 0, min(8, size))
        prefix = os.pread(fd, 8, 0)
        if len(prefix) != 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: safetensors header of {header_len} bytes does not fit")
        files.wait(path, 8, 8 + header_len)
        try:
            header = json.loads(_pread_all(fd, header_len, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable safetensors header: {exc}") from exc
    finally:
        os.close(fd)
    if isinstance(header, dict):
        data_start = 8 + header_len
        extents = [
            _extent(path, name, entry, data_start, size)
            for name, entry in header.items()
            if name != "__metadata__"
        ]
        return sorted(extents, key=lambda extent: extent.offset)
    raise ValueError(f"{path}: the safetensors header is not a JSON object")


def _pread_all(fd: int, nbytes: int, offset: int) -> bytes:
    parts = []
    while nbytes > 0:
        part = os.pread(fd, nbytes, offset)
        if not part:
            break
        parts.append(part)
        nbytes -= len(part)
        offset += len(part)
    return b"".join(parts)


def _extent(path: Path, name: str, entry: object, data_start: int, size: int) -> TensorExtent:
    try:
        dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        shape = tuple(int(dim) for dim in shape)
    except (TypeError, KeyError, ValueError) as exc:
        raise ValueError(f"{path}: malformed header entry for {name!r}: {exc!r}") from exc
    dtype = SAFETENSORS_DTYPES.get(dtype_name)
    if dtype is None:
        raise ValueError(f"{path}: tensor {name!r} has an unsupported dtype {dtype_name!r}")
    nbytes = end - begin
    expected = math.prod(shape) * dtype.itemsize
    if begin < 0 or nbytes != expected or data_start + end > size:
        raise ValueError(
            f"{path}: tensor {name!r} claims bytes [{begin}, {end}) of the data, which do not "
            f"hold {shape} {dtype_name} or run past the file's end (truncated file?)"
        )
    return TensorExtent(name, path, data_start + begin, nbytes, dtype, shape)
