"""Read weight files on several threads through pinned buffers onto several CUDA streams.

Going through `safetensors` one tensor at a time, every byte is copied twice on one thread
(file -> a pageable CPU tensor -> the GPU, the second copy synchronous and staged by the driver):
~2 GB/s. Here each tensor is cut into chunks; a pool of threads reads chunks straight from the
file into page-locked buffers (`os.preadv`, no GIL) and enqueues each buffer's copy into its
parameter on one of several streams, so reads, copies and the next reads overlap. A buffer is
reused once the event recorded after its copy has fired.

On a CPU the same threads read straight into the parameters (no staging) when the file holds the
parameter's dtype.

A tensor-parallel rank's slice of a tensor's columns is runs of bytes at a stride: runs shorter
than a page (an expert's down rows at tp 2: a few hundred bytes) are read a chunk's span at a
time and gathered on the host, one read instead of thousands (the file system reads whole pages
anyway); longer ones one read each.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ember.host_cpus import usable_cpus
from ember.weights.safetensors_layout import TensorExtent
from ember.weights.weight_files import LocalFiles, WeightFiles

# Chunk size: large enough that a read and a copy each amortise their fixed cost, small enough
# that a few buffers per thread stay cheap to pin (pinning runs at ~10 GB/s). A load's report
# (`weight_load_seconds`, `weight_wait_seconds`) measures these three
# (bench/results/README.md, "Parallel weight load").
DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_COPY_STREAMS = 4
MAX_READ_THREADS = 8
# Runs of a strided slice shorter than this are read as their chunk's whole span (a page).
SPAN_READ_RUN_BYTES = 4096

# Where a checkpoint tensor goes: its parameter (or a view of one) of the tensor's shape, or None
# for a tensor the model does not use.
TargetFor = Callable[[TensorExtent], torch.Tensor | None]


def default_read_threads() -> int:
    """One read thread per CPU this process may run on, up to MAX_READ_THREADS."""
    return max(1, min(usable_cpus(), MAX_READ_THREADS))


@dataclass(frozen=True)
class _Chunk:
    extent: TensorExtent
    target: torch.Tensor  # flat, contiguous: the elements this chunk fills
    first: int  # first element of the tensor in this chunk
    count: int  # elements


class _Staging:
    """A page-locked (CUDA) or plain (CPU) byte buffer, its copy stream and its copy's event."""

    def __init__(self, nbytes: int, stream: torch.cuda.Stream | None) -> None:
        self.stream = stream
        self.bytes = torch.empty(nbytes, dtype=torch.uint8, pin_memory=stream is not None)
        self.array = self.bytes.numpy()
        # Blocking: a thread waiting for a buffer sleeps instead of spinning a core.
        self.copied = torch.cuda.Event(blocking=True) if stream is not None else None

    def wait_free(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()


def load_extents(
    extents: Iterable[TensorExtent],
    target_for: TargetFor,
    device: torch.device,
    *,
    read_threads: int | None = None,
    copy_streams: int = DEFAULT_COPY_STREAMS,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    on_tensor: Callable[[int], None] | None = None,
    files: WeightFiles | None = None,
    group_of: Callable[[TensorExtent], Hashable] | None = None,
    after_group: Callable[[], None] | None = None,
) -> int:
    """Fill every tensor's target from its file; returns the bytes read.

    ``on_tensor(n)`` is called on this thread as the n-th tensor lands (or is skipped). A read
    error is a ValueError naming the file. Every copy has finished when this returns or raises.
    ``files`` reaches the files (default: on local disk); through a download, each chunk is read
    as soon as its bytes have arrived.

    ``group_of`` given, the tensors load one group at a time (groups in the order they first
    appear, each in file order): a group's targets are asked for only once the group before has
    landed and ``after_group()`` has run on this thread. On a GPU that needs no wait on the
    host: the current stream waits for the group's copies before ``after_group`` enqueues its
    work there, and the next group's copies wait for that work, so whatever a group's targets
    were (scratch) is free for the next group's.
    """
    threads = read_threads or default_read_threads()
    cuda = device.type == "cuda"
    streams = [torch.cuda.Stream(device) for _ in range(copy_streams)] if cuda else []
    free: queue.Queue[_Staging] = queue.Queue()
    for i in range(2 * threads if cuda else threads):
        free.put(_Staging(chunk_bytes, streams[i % len(streams)] if cuda else None))
    open_files = _OpenFiles(files or LocalFiles())
    total = landed = 0
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="weight-read") as pool:
            for group in _grouped(list(extents), group_of):
                chunks_per_tensor = [
                    (extent, _cut(extent, target, chunk_bytes) if target is not None else [])
                    for extent, target in ((e, target_for(e)) for e in group)
                ]
                for stream in streams:
                    # The targets were allocated (and maybe zeroed, or read by the previous
                    # group's work) on the current stream: copy after.
                    stream.wait_stream(torch.cuda.current_stream(device))
                futures = [
                    [pool.submit(_load_chunk, chunk, open_files, free, cuda) for chunk in chunks]
                    for _, chunks in chunks_per_tensor
                ]
                for (extent, _), tensor_futures in zip(chunks_per_tensor, futures, strict=True):
                    _wait_all(tensor_futures, futures)
                    total += extent.nbytes if tensor_futures else 0
                    landed += 1
                    if on_tensor is not None:
                        on_tensor(landed)
                if after_group is not None:
                    for stream in streams:
                        torch.cuda.current_stream(device).wait_stream(stream)
                    after_group()
    finally:
        for stream in streams:
            stream.synchronize()  # no copy may outlive its buffer
        open_files.close()
    return total


def _grouped(
    extents: list[TensorExtent], group_of: Callable[[TensorExtent], Hashable] | None
) -> list[list[TensorExtent]]:
    """``extents`` in groups by ``group_of`` (one group without it), in order of appearance."""
    if group_of is None:
        return [extents]
    groups: dict[Hashable, list[TensorExtent]] = {}
    for extent in extents:
        groups.setdefault(group_of(extent), []).append(extent)
    return list(groups.values())


def _cut(extent: TensorExtent, target: torch.Tensor, chunk_bytes: int) -> list[_Chunk]:
    if not target.is_contiguous() or target.numel() != extent.numel:
        raise ValueError(f"the target of {extent.name!r} is not a contiguous tensor of its size")
    flat = target.view(-1)
    step = max(1, chunk_bytes // extent.dtype.itemsize)
    if _reads_spans(extent):  # whole runs per chunk, their span within a chunk's bytes
        step = max(1, chunk_bytes // extent.row_stride) * extent.run_elements
    elif extent.row_stride:  # whole runs per chunk, one read per run
        run = extent.run_elements
        step = max(1, step // run) * run
    return [
        _Chunk(extent, flat[first : first + step], first, min(step, extent.numel - first))
        for first in range(0, extent.numel, step)
    ]


def _load_chunk(chunk: _Chunk, files: _OpenFiles, free: queue.Queue[_Staging], cuda: bool) -> None:
    extent = chunk.extent
    nbytes = chunk.count * extent.dtype.itemsize
    files.wait(extent.path, *extent.span(chunk.first, chunk.count))
    fd = files.fd(extent.path)
    if not cuda and chunk.target.dtype == extent.dtype:
        _read_elements(fd, _writable_bytes(chunk.target), extent, chunk.first, chunk.count)
        return
    staging = free.get()
    try:
        staging.wait_free()
        _read_elements(fd, staging.array[:nbytes], extent, chunk.first, chunk.count)
        source = staging.bytes[:nbytes].view(extent.dtype)
        if not cuda:
            chunk.target.copy_(source)
            return
        with torch.cuda.stream(staging.stream):
            if chunk.target.dtype == extent.dtype:
                chunk.target.copy_(source, non_blocking=True)
            else:
                # Cast on the GPU: a cross-device copy_ with a dtype change casts on the host.
                on_device = torch.empty_like(source, device=chunk.target.device)
                on_device.copy_(source, non_blocking=True)
                chunk.target.copy_(on_device)
            staging.copied.record(staging.stream)
    finally:
        free.put(staging)


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, writable, without numpy: a numpy view would make the
    tensor's storage unresizable, and a sleeping model's arena shrinks its storage to nothing
    (`ember.engine.device_arena.TorchArena`)."""
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr()))


def _reads_spans(extent: TensorExtent) -> bool:
    """Whether ``extent``'s runs are read a span at a time (short runs at a stride)."""
    return bool(extent.row_stride) and extent.run_bytes < SPAN_READ_RUN_BYTES


def _read_elements(fd: int, buffer, extent: TensorExtent, first: int, count: int) -> None:
    """Fill ``buffer`` with elements ``[first, first + count)`` of ``extent``: one read where
    they are contiguous, else one per run, or one of their span gathered (`_reads_spans`)."""
    if _reads_spans(extent):
        _read_span(fd, buffer, extent, first, count)
        return
    view, done = memoryview(buffer).cast("B"), 0
    for offset, nbytes in extent.segments(first, count):
        _read_into(fd, view[done : done + nbytes], offset, extent.path)
        done += nbytes


def _read_span(fd: int, buffer, extent: TensorExtent, first: int, count: int) -> None:
    """Read the runs of elements ``[first, first + count)`` with the gaps between them, then
    keep the runs, in order, in ``buffer``."""
    start, span = extent.span(first, count)
    runs, run_bytes, stride = count // extent.run_elements, extent.run_bytes, extent.row_stride
    raw = np.empty(runs * stride, dtype=np.uint8)  # the last run's gap is never read
    _read_into(fd, raw[:span], start, extent.path)
    out = np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8, count=runs * run_bytes)
    out.reshape(runs, run_bytes)[:] = raw.reshape(runs, stride)[:, :run_bytes]


def _read_into(fd: int, buffer, offset: int, path: Path) -> None:
    """Fill ``buffer`` (a writable numpy byte array) from ``fd`` at ``offset``."""
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise ValueError(f"{path}: cannot read weights: {exc}") from exc
        if got == 0:
            raise ValueError(f"{path}: ends before the bytes its header promises (truncated?)")
        done += got


def _wait_all(tensor_futures: list[Future], every: list[list[Future]]) -> None:
    """Wait for one tensor's chunks; on a failure cancel what has not started, then raise it."""
    finished, _ = wait(tensor_futures, return_when=FIRST_EXCEPTION)
    for future in finished:
        if future.exception() is not None:
            for futures in every:
                for pending in futures:
                    pending.cancel()
            raise future.exception()


class _OpenFiles:
    """One read-only descriptor per weight file, opened by the first chunk read from it and
    shared by the threads (`preadv` takes its own offset, so they do not race); closed once
    no thread reads any more."""

    def __init__(self, files: WeightFiles) -> None:
        self._files = files
        self._fds: dict[Path, int] = {}
        self._opening = threading.Lock()

    def wait(self, path: Path, start: int, end: int) -> None:
        self._files.wait(path, start, end)

    def fd(self, path: Path) -> int:
        with self._opening:
            if path not in self._fds:
                self._fds[path] = self._files.open(path)
            return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
