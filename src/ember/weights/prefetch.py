"""Start reading a local model's weight files into the page cache before the engine needs them.

The engine process spends seconds importing torch, initialising CUDA and planning the model
before its loader reads the first weight; from a cold page cache those reads then wait on the
disk. Asking the kernel to read the files ahead (``POSIX_FADV_WILLNEED``, a segment at a time, in
file order, on a background thread) as the process starts lets the disk work during all of that;
the loader later finds the bytes in memory, or in flight. Best effort: any failure only means the
loader reads from the disk itself.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 256 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".gguf")


def local_weight_files(source: str | None) -> list[Path]:
    """The weight files of a local source (a model directory, a GGUF file, or an HF cache id);
    empty for anything else (the default model, an object-store URL, a missing path)."""
    if source is None or source.startswith("s3://"):
        return []
    path = Path(source).expanduser()
    if not path.exists():
        from ember.weights.hf_cache import find_cached_model, is_model_id

        if not is_model_id(source):
            return []
        try:
            path = find_cached_model(source)
        except (OSError, ValueError):
            return []
    if path.is_file():
        return [path] if path.suffix == ".gguf" else []
    return sorted(p for p in path.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES))


def prefetch(paths: Iterable[Path]) -> threading.Thread | None:
    """Start reading ``paths`` ahead on a daemon thread; None if there is nothing to read or
    the platform cannot."""
    files = list(paths)
    if not files or not hasattr(os, "posix_fadvise"):
        return None
    thread = threading.Thread(target=_read_ahead, args=(files,), name="prefetch", daemon=True)
    thread.start()
    return thread


def _read_ahead(files: list[Path]) -> None:
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            for offset in range(0, size, SEGMENT_BYTES):
                os.posix_fadvise(fd, offset, SEGMENT_BYTES, os.POSIX_FADV_WILLNEED)
        except OSError as exc:
            logger.debug("%s: read-ahead stopped: %s", path, exc)
        finally:
            os.close(fd)
