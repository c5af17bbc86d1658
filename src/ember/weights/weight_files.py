"""How a loader reaches the bytes of weight files: at once (local files), or as they arrive
(files still being downloaded, `ember.weights.object_download`).

A loader opens a file through `WeightFiles.open` and, before it reads a byte range, calls
`WeightFiles.wait` for it; for a local file that returns at once, for a downloading one it blocks
until the range has been written (or raises the download's error).
"""

from __future__ import annotations

import bisect
import os
import threading
from pathlib import Path
from typing import Protocol


class WeightFiles(Protocol):
    def open(self, path: Path) -> int:
        """A new read-only descriptor of ``path``'s bytes; the caller closes it."""

    def wait(self, path: Path, start: int, end: int) -> None:
        """Return once bytes [start, end) of ``path`` can be read; raise if they never will."""


class LocalFiles:
    """Files already whole on local storage."""

    def open(self, path: Path) -> int:
        try:
            return os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise ValueError(f"{path}: cannot open weights: {exc}") from exc

    def wait(self, path: Path, start: int, end: int) -> None:
        return None


class ArrivingBytes:
    """Which byte ranges of one file have been written, for readers that wait on them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = []  # disjoint, sorted, merged ranges [start, end)
        self._ends: list[int] = []
        self._error: BaseException | None = None
        self._descriptor: int | None = None  # of the file being written, once it exists
        self._changed = threading.Condition()

    def attach(self, fd: int) -> None:
        """The file being written now exists, open as ``fd`` (owned by the writer)."""
        with self._changed:
            self._descriptor = fd
            self._changed.notify_all()

    def descriptor(self) -> int | None:
        """Wait until the file is being written (its descriptor) or already whole (None)."""
        with self._changed:
            self._changed.wait_for(
                lambda: (
                    self._error is not None
                    or self._descriptor is not None
                    or self.has(0, self.size)
                )
            )
            if self._descriptor is not None:
                return self._descriptor
            if self.has(0, self.size):
                return None
            raise self._error

    def add(self, start: int, end: int) -> None:
        """Bytes [start, end) are written."""
        with self._changed:
            i = bisect.bisect_left(self._ends, start)  # first range that ends at or after start
            j = bisect.bisect_right(self._starts, end)  # ranges from i up to j touch [start, end)
            if i < j:
                start = min(start, self._starts[i])
                end = max(end, self._ends[j - 1])
            self._starts[i:j] = [start]
            self._ends[i:j] = [end]
            self._changed.notify_all()

    def add_all(self) -> None:
        self.add(0, self.size)

    def fail(self, error: BaseException) -> None:
        """No more bytes will come: every waiter (now or later) raises ``error``."""
        with self._changed:
            if self._error is None:
                self._error = error
            self._changed.notify_all()

    def has(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self._starts, start) - 1
        return end <= start or (i >= 0 and self._ends[i] >= end)

    @property
    def complete(self) -> bool:
        with self._changed:
            return self.has(0, self.size)

    def wait(self, start: int, end: int, timeout: float | None = None) -> None:
        with self._changed:
            if not self._changed.wait_for(
                lambda: self._error is not None or self.has(start, end), timeout
            ):
                raise TimeoutError(f"bytes [{start}, {end}) did not arrive in {timeout} s")
            if self._error is not None and not self.has(start, end):
                raise self._error
