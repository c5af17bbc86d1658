"""Bring a model's files from an object store into the local cache, the weights streamed.

`ModelDownload.start` lists the model's objects, fetches the small files (config, tokenizer,
templates) at once, and starts the weight files in the background: each is split into ranges
fetched by parallel GETs (each pinned to the listed ETag, so every byte comes from one version of
the object), written into a ``.part`` file of the full size as they arrive. The download is a
`WeightFiles`: a loader reads a tensor as soon as its bytes have been written, while later bytes
are still on the way. A file is moved to its final name only once every byte is written and
synced; one that fails is deleted, so nothing ever looks complete that is not.

A per-file lock shares one download between processes: the second to ask for a file waits for
the first to finish it, then reads the cached copy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from ember.kernels import kernel_cache
from ember.kernels.kernel_cache import ARCHIVE_SUFFIX, KERNELS_PREFIX
from ember.weights.download_cache import DownloadCache, RemoteFile
from ember.weights.object_store import (
    ObjectStoreError,
    ObjectUrl,
    StoreUnreachableError,
    open_store,
    store_error,
)
from ember.weights.weight_files import ArrivingBytes, LocalFiles

logger = logging.getLogger(__name__)

# Range GETs: big enough that a request's fixed cost (a round trip, a signature) is amortised,
# small enough that many run at once on a file and a loader waits little for the first tensor.
DEFAULT_RANGE_BYTES = 32 << 20
DEFAULT_CONNECTIONS = 16
# Bytes a range hands over at a time: each is written and marked arrived on its own.
STREAM_CHUNK_BYTES = 4 << 20
WEIGHT_SUFFIXES = (".safetensors", ".gguf")
# Files a model directory may hold that ember reads; anything else under the prefix (pickled
# weights, an "original/" copy in another format, images) is not fetched.
_FETCHED_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken") + WEIGHT_SUFFIXES
_FETCHED_DIRS = ("additional_chat_templates/",)


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


@dataclass
class DownloadStats:
    """What this process fetched (cached files count nothing), and when (time.time())."""

    files: int = 0
    bytes: int = 0
    started_at: float = 0.0
    small_files_done_at: float = 0.0  # config and tokenizer here: a checkpoint can open
    finished_at: float = 0.0  # every weight file whole


class ModelDownload:
    """One model URL synced into its cache directory; a `WeightFiles` over its weight files."""

    def __init__(
        self,
        url: str,
        download_dir: Path,
        *,
        weights: bool = True,
        range_bytes: int = DEFAULT_RANGE_BYTES,
        connections: int = DEFAULT_CONNECTIONS,
        environ: dict[str, str] | None = None,
    ) -> None:
        self.url = ObjectUrl.parse(url)
        env = dict(os.environ) if environ is None else environ
        endpoint = next(
            (env[v] for v in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if env.get(v)), None
        )
        self.cache = DownloadCache(download_dir, self.url, endpoint)
        self._environ = env
        self._weights = weights
        self._range_bytes = range_bytes
        self._connections = connections
        self._store: Any = None
        self._arriving: dict[Path, ArrivingBytes] = {}
        self._descriptors: list[int] = []  # of the .part files, held open until close
        self._stopped = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        self._planner: threading.Thread | None = None
        self._stats_lock = threading.Lock()
        self.stats = DownloadStats()
        self.files: list[RemoteFile] = []
        self.kernel_archives: dict[str, RemoteFile] = {}  # compiled kernels, by cache key
        self.from_cache_only = False  # the store did not answer; everything came from the cache

    # -- the sync ---------------------------------------------------------------------------------

    def start(self) -> ModelDownload:
        """List the model, fetch its small files, and start its weight files in the background;
        returns once a checkpoint can be opened on `model_dir`. `ObjectStoreError` (naming the
        URL) if the store refuses, lacks the model, or is down with no complete cached copy."""
        self.stats.started_at = time.time()
        self.cache.prepare()
        try:
            self._store = open_store(self.url, self._environ)
            self.files = self._list()
        except StoreUnreachableError as unreachable:
            cached = self.cache.cached_manifest()
            if cached is None:
                raise ObjectStoreError(f"{unreachable}; and no complete copy is cached") from None
            logger.warning("%s; serving the copy cached in %s", unreachable, self.cache.model_dir)
            self.files, self.from_cache_only = cached, True
        # A GGUF file holds the tokenizer too: the weights are fetched even for metadata.
        with_weights = self._weights or not any(f.name.endswith(".safetensors") for f in self.files)
        wanted = [f for f in self.files if with_weights or not is_weight_file(f.name)]
        small = [f for f in wanted if not is_weight_file(f.name)]
        large = [f for f in wanted if is_weight_file(f.name)]
        for remote in large:
            self._arriving[self.cache.path(remote.name)] = ArrivingBytes(remote.size)
        self._pool = ThreadPoolExecutor(self._connections, thread_name_prefix="object-get")
        # Small files in parallel, then the weights: every file's first range (its header: the
        # model is planned from all of them), then the rest in file order (a loader reads in
        # that order).
        for future in [self._pool.submit(self._fetch_whole, remote) for remote in small]:
            future.result()
        self.stats.small_files_done_at = time.time()
        if large:
            self._planner = threading.Thread(
                target=self._fetch_weights, args=(large,), name="object-download", daemon=True
            )
            self._planner.start()
        else:
            self.stats.finished_at = time.time()
            if self._weights and not self.from_cache_only:
                self.cache.save_manifest(self.url, self.files)
        return self

    @property
    def model_dir(self) -> Path:
        return self.cache.model_dir

    def weight_names(self) -> list[str]:
        return [f.name for f in self.files if is_weight_file(f.name)]

    def wait_all(self, timeout: float | None = None) -> None:
        """Block until every weight file is whole (or raise why it never will be)."""
        for arriving in self._arriving.values():
            arriving.wait(0, arriving.size, timeout)
        if self._planner is not None:
            self._planner.join(timeout)

    def close(self) -> None:
        """Stop what is still downloading (its ``.part`` files are deleted) and let go of the
        files. Safe to call twice."""
        self._stopped.set()
        if self._planner is not None:
            self._planner.join()
            self._planner = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for fd in self._descriptors:
            os.close(fd)
        self._descriptors.clear()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fetch_kernels(self, key: str, directory: Path) -> int:
        """Unpack the model's published kernels for ``key`` into ``directory``, once per
        archive version; returns the files written. Best effort: without them the kernels
        compile as on any cold start."""
        import obstore

        remote = self.kernel_archives.get(key)
        if remote is None or kernel_cache.fetched_mark(directory, remote.etag).exists():
            return 0
        url = self.url.object(remote.name)
        try:
            data = obstore.get(self._store, self.url.key(remote.name)).bytes()
            written = kernel_cache.unpack(bytes(data), directory, remote.etag)
        except Exception as exc:  # noqa: BLE001 - a missing archive costs a compile, not a start
            logger.warning("%s: compiled kernels not fetched: %s", url, exc)
            return 0
        logger.info("%s: %d compiled kernels unpacked into %s", url, written, directory)
        return written

    # -- WeightFiles ----------------------------------------------------------------------------

    def open(self, path: Path) -> int:
        arriving = self._arriving.get(path)
        if arriving is None:
            return LocalFiles().open(path)
        if arriving.complete and path.is_file():  # moved into place: read it where it is now
            return LocalFiles().open(path)
        fd = arriving.descriptor()
        # None: the file was whole in the cache (or another process fetched it meanwhile).
        return LocalFiles().open(path) if fd is None else os.dup(fd)

    def wait(self, path: Path, start: int, end: int) -> None:
        arriving = self._arriving.get(path)
        if arriving is not None:
            arriving.wait(start, end)

    # -- listing and fetching -------------------------------------------------------------------

    def _list(self) -> list[RemoteFile]:
        import obstore

        prefix = self.url.key("") if self.url.prefix else None
        found: list[RemoteFile] = []
        try:
            for batch in obstore.list(self._store, prefix=prefix, chunk_size=1000):
                for meta in batch:
                    name = self.url.relative(meta["path"])
                    remote = RemoteFile(name, int(meta["size"]), meta["e_tag"] or "")
                    if _is_fetched(name):
                        found.append(remote)
                    elif name.startswith(KERNELS_PREFIX) and name.endswith(ARCHIVE_SUFFIX):
                        key = name[len(KERNELS_PREFIX) : -len(ARCHIVE_SUFFIX)]
                        self.kernel_archives[key] = remote
        except Exception as exc:
            raise store_error(exc, str(self.url)) from exc
        if not found:
            raise ObjectStoreError(f"{self.url}: no model files under this prefix")
        return sorted(found, key=lambda f: f.name)

    def _fetch_whole(self, remote: RemoteFile) -> None:
        """Fetch one small file (under its lock) unless it is cached."""
        with self._file_lock(remote.name):
            if self.cache.is_cached(remote):
                return
            part = self._new_part(remote)
            fd = os.open(part, os.O_RDWR)
            try:
                self._get_range(remote, fd, 0, remote.size, lambda start, end: None)
                self._finish(remote, part, fd)
            except BaseException:
                part.unlink(missing_ok=True)
                raise
            finally:
                os.close(fd)

    def _fetch_weights(self, files: Iterable[RemoteFile]) -> None:
        """Runs on its own thread: takes each weight file's lock in turn and queues its ranges,
        the first range of every file before the others: it holds the file's header, which a
        checkpoint reads when it opens (every tensor's place), so the model is planned and its
        memory allocated while the bulk still arrives. The last range of a file completes it."""
        pending: list[Future] = []
        jobs: list[tuple[_FileJob, list[int]]] = []
        submit = self._pool.submit
        try:
            for remote in files:
                arriving = self._arriving[self.cache.path(remote.name)]
                try:
                    started = self._start_weight_file(remote, arriving)
                except BaseException as exc:
                    arriving.fail(_as_store_error(exc, self.url.object(remote.name)))
                    raise
                if started is not None:
                    job, ranges = started
                    pending.append(submit(self._fetch_range, job, ranges[0]))
                    jobs.append((job, ranges[1:]))
            for job, rest in jobs:
                pending += [submit(self._fetch_range, job, start) for start in rest]
            for future in pending:
                future.result()
            self.stats.finished_at = time.time()
            if not self.from_cache_only:
                self.cache.save_manifest(self.url, self.files)
        except Exception as exc:  # noqa: BLE001 - each waiter hears it through its ArrivingBytes
            if not self._stopped.is_set():
                logger.error("%s: download failed: %s", self.url, exc)
            for arriving in self._arriving.values():
                arriving.fail(_as_store_error(exc, str(self.url)))

    def _start_weight_file(
        self, remote: RemoteFile, arriving: ArrivingBytes
    ) -> tuple[_FileJob, list[int]] | None:
        """Lock a weight file and open its ``.part`` file; the job and the start of each of its
        ranges, or None when the file is cached whole."""
        lock = self._file_lock(remote.name)
        self._acquire(lock, remote)
        try:
            if self.cache.is_cached(remote):
                lock.release()
                arriving.add_all()
                return None
            part = self._new_part(remote)
            fd = os.open(part, os.O_RDWR)
        except BaseException:
            lock.release()
            raise
        self._descriptors.append(fd)
        arriving.attach(fd)
        job = _FileJob(remote, part, fd, lock, arriving)
        ranges = list(range(0, remote.size, self._range_bytes)) or [0]
        job.remaining = len(ranges)
        return job, ranges

    def _fetch_range(self, job: _FileJob, start: int) -> None:
        end = min(start + self._range_bytes, job.remote.size)
        try:
            if job.failed:
                return
            self._get_range(job.remote, job.fd, start, end, job.arriving.add)
            with job.counter:
                job.remaining -= 1
                last = job.remaining == 0
            if last:
                self._finish(job.remote, job.part, job.fd)
                job.lock.release()
        except BaseException as exc:
            error = _as_store_error(exc, self.url.object(job.remote.name))
            with job.counter:
                first_failure = not job.failed
                job.failed = True
            if first_failure:
                job.part.unlink(missing_ok=True)
                job.lock.release()
            job.arriving.fail(error)
            raise error from exc

    def _get_range(
        self, remote: RemoteFile, fd: int, start: int, end: int, arrived: Callable[[int, int], None]
    ) -> None:
        """GET bytes [start, end) of ``remote`` (pinned to its ETag) into ``fd`` at ``start``."""
        import obstore

        if end <= start:
            return
        url = self.url.object(remote.name)
        options: dict[str, Any] = {"range": (start, end)}
        if remote.etag:
            options["if_match"] = remote.etag
        offset = start
        try:
            result = obstore.get(self._store, self.url.key(remote.name), options=options)
            for chunk in result.stream(min_chunk_size=STREAM_CHUNK_BYTES):
                if self._stopped.is_set():
                    raise ObjectStoreError(f"{url}: download stopped")
                view = memoryview(chunk)
                if offset + len(view) > end:
                    raise ObjectStoreError(f"{url}: the store sent more bytes than were asked for")
                written = 0
                while written < len(view):
                    written += os.pwrite(fd, view[written:], offset + written)
                arrived(offset, offset + len(view))
                offset += len(view)
        except ObjectStoreError:
            raise
        except Exception as exc:
            raise store_error(exc, url) from exc
        if offset != end:
            raise ObjectStoreError(
                f"{url}: the store sent {offset - start} of the {end - start} bytes asked for "
                "(the connection closed early)"
            )
        with self._stats_lock:
            self.stats.bytes += end - start

    def _new_part(self, remote: RemoteFile) -> Path:
        """An empty ``.part`` file of the object's full size."""
        part = self.cache.part_path(remote.name)
        with open(part, "wb") as file:
            file.truncate(remote.size)
        self.cache.forget(remote.name)
        return part

    def _finish(self, remote: RemoteFile, part: Path, fd: int) -> None:
        """Verify a fully written ``.part`` file, sync it and move it into place."""
        size = os.fstat(fd).st_size
        if size != remote.size:
            raise ObjectStoreError(
                f"{self.url.object(remote.name)}: {size} bytes on disk, the store lists "
                f"{remote.size}"
            )
        os.fdatasync(fd)  # the rename must never publish bytes still only in memory
        self.cache.complete(remote, part)
        with self._stats_lock:
            self.stats.files += 1

    def _acquire(self, lock: Any, remote: RemoteFile) -> None:
        """Take a file's lock, waiting (for another process's download of it) until stopped."""
        from filelock import Timeout

        while True:
            if self._stopped.is_set():
                raise ObjectStoreError(f"{self.url.object(remote.name)}: download stopped")
            try:
                lock.acquire(timeout=0.5)
                return
            except Timeout:
                continue

    def _file_lock(self, name: str):
        from filelock import FileLock

        # Not thread-local: a weight file's lock is taken by the planner thread and released by
        # whichever download thread finishes the file.
        return FileLock(self.cache.lock_path(name), thread_local=False)


@dataclass(eq=False)
class _FileJob:
    remote: RemoteFile
    part: Path
    fd: int
    lock: Any
    arriving: ArrivingBytes
    remaining: int = 0
    failed: bool = False

    def __post_init__(self) -> None:
        self.counter = threading.Lock()


def _is_fetched(name: str) -> bool:
    if "/" in name and not name.startswith(_FETCHED_DIRS):
        return False
    return name.endswith(_FETCHED_SUFFIXES) and not name.startswith(".")


def _as_store_error(exc: BaseException, what: str) -> ObjectStoreError:
    if isinstance(exc, ObjectStoreError):
        return exc
    if isinstance(exc, OSError):
        return ObjectStoreError(f"{what}: cannot write the download: {exc}")
    return store_error(exc, what)
