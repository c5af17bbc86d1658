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
    ``row_stride``: a slice along a later dimension than the first (`slice_extent`) is runs of
    ``run_elements`` elements, one every ``row_stride`` bytes from ``offset``; 0: the bytes are
    contiguous."""

    name: str
    path: Path
    offset: int  # from the start of the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    row_stride: int = 0
    run_elements: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def run_bytes(self) -> int:
        """Bytes of one run of a strided extent."""
        return self.run_elements * self.dtype.itemsize

    def span(self, first: int, count: int) -> tuple[int, int]:
        """``(offset, nbytes)``: the file's bytes from the first of elements ``[first, first +
        count)`` to the last, with the gaps between a strided extent's runs."""
        itemsize = self.dtype.itemsize
        if not self.row_stride:
            return self.offset + first * itemsize, count * itemsize
        first_run, runs = first // self.run_elements, count // self.run_elements
        start = self.offset + first_run * self.row_stride
        return start, (runs - 1) * self.row_stride + self.run_bytes

    def segments(self, first: int, count: int) -> list[tuple[int, int]]:
        """The file's byte ranges ``(offset, nbytes)`` that hold elements ``[first, first +
        count)`` in order; a strided extent's must start and end on whole runs."""
        itemsize = self.dtype.itemsize
        if not self.row_stride:
            return [(self.offset + first * itemsize, count * itemsize)]
        run = self.run_elements
        if first % run or count % run:
            raise ValueError(f"a read of {self.name!r} must cover whole runs of its slice")
        return [
            (self.offset + r * self.row_stride, run * itemsize)
            for r in range(first // run, (first + count) // run)
        ]


def slice_extent(
    extent: TensorExtent, dim: int, start: int, length: int, parts: int = 1
) -> TensorExtent:
    """The part of ``extent`` (a contiguous tensor) that holds indices ``[start, start +
    length)`` of each of the ``parts`` equal parts of dimension ``dim`` (a tensor-parallel
    rank's slice, `ember.parallel.sharding`; two parts: gate and up stacked along one
    dimension). Contiguous where nothing comes before the slice's dimension (the first
    dimension, in one part); otherwise runs of bytes at a stride, one per index of the
    dimensions before it (and per part)."""
    shape, itemsize = list(extent.shape), extent.dtype.itemsize
    fits = 0 <= dim < len(shape) and parts >= 1 and shape[dim] % parts == 0
    if extent.row_stride or not fits or not 0 <= start <= start + length <= shape[dim] // parts:
        raise ValueError(
            f"cannot take [{start}, {start + length}) of {parts} part(s) of dim {dim} of "
            f"{extent.name!r} {tuple(shape)}"
        )
    inner = math.prod(shape[dim + 1 :])  # elements per index of the dimension
    runs = math.prod(shape[:dim]) * parts
    part_elements = shape[dim] // parts * inner
    shape[dim] = parts * length
    sliced = dataclasses.replace(
        extent,
        offset=extent.offset + start * inner * itemsize,
        nbytes=runs * length * inner * itemsize,
        shape=tuple(shape),
    )
    if runs == 1:
        return sliced
    return dataclasses.replace(
        sliced, row_stride=part_elements * itemsize, run_elements=length * inner
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
