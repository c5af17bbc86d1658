"""Where each tensor's bytes sit in a safetensors file, for loaders that read them directly.

The `safetensors` library reads a tensor into memory it allocates; a loader that streams bytes
into pinned buffers on several threads needs the byte ranges instead. The format makes that
cheap: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
``data_offsets`` (relative to the end of the header), then the data
(https://huggingface.co/docs/safetensors, "Format").
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

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
    """One tensor of a weight file: its name, dtype and shape, and its bytes in the file."""

    name: str
    path: Path
    offset: int  # from the start of the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_extents(path: Path) -> list[TensorExtent]:
    """The tensors of one safetensors file in file order; ValueError naming the file if its
    header is malformed or points past the file's end."""
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: safetensors header of {header_len} bytes does not fit")
        try:
            header = json.loads(file.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable safetensors header: {exc}") from exc
    if isinstance(header, dict):
        data_start = 8 + header_len
        extents = [
            _extent(path, name, entry, data_start, size)
            for name, entry in header.items()
            if name != "__metadata__"
        ]
        return sorted(extents, key=lambda extent: extent.offset)
    raise ValueError(f"{path}: the safetensors header is not a JSON object")


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
