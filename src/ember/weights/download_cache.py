"""Where downloaded models live on local disk, and how a cached file is known to be whole.

One directory per model URL, laid out like a Hugging Face model directory so that it loads as
one; beside the files, ``.ember-download/`` holds one record per file (the object's ETag and
size, and the file's size and modification time once complete), the in-progress ``.part``
files, the per-file locks that let several processes share one download, and the listing of the
last complete download (so a start with the store unreachable can serve from the cache).

A file counts as cached only if its record names the object's current ETag and size and the file
on disk still has that size and the modification time recorded when it was completed: a file
cut short or written to since is fetched again.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

from ember.weights.object_store import ObjectUrl

STATE_DIR = ".ember-download"
MANIFEST_FILE = "manifest.json"


def default_download_dir() -> Path:
    """ember's directory in the user's cache directory."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("ember")) / "models"


@dataclass(frozen=True)
class RemoteFile:
    """One object of a model: its path under the model's prefix, size and ETag."""

    name: str
    size: int
    etag: str


@dataclass(frozen=True)
class _Record:
    etag: str
    size: int
    mtime_ns: int


class DownloadCache:
    """The cache directory of one model URL."""

    def __init__(self, root: Path, url: ObjectUrl, endpoint: str | None) -> None:
        host = urlparse(endpoint).netloc.replace(":", "_") if endpoint else "s3"
        self.model_dir = root / host / url.bucket / url.prefix
        self.state_dir = self.model_dir / STATE_DIR

    def path(self, name: str) -> Path:
        return self.model_dir / name

    def part_path(self, name: str) -> Path:
        return self.state_dir / (name.replace("/", "%2F") + ".part")

    def lock_path(self, name: str) -> Path:
        return self.state_dir / (name.replace("/", "%2F") + ".lock")

    def _record_path(self, name: str) -> Path:
        return self.state_dir / (name.replace("/", "%2F") + ".json")

    def prepare(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)

    def is_cached(self, remote: RemoteFile) -> bool:
        """Whether ``remote`` is whole on disk, as it is in the store now."""
        record = self._read_record(remote.name)
        if record is None or record.etag != remote.etag or record.size != remote.size:
            return False
        try:
            stat = self.path(remote.name).stat()
        except OSError:
            return False
        return stat.st_size == record.size and stat.st_mtime_ns == record.mtime_ns

    def complete(self, remote: RemoteFile, part: Path) -> None:
        """Move a verified ``.part`` file into place and record it."""
        final = self.path(remote.name)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, final)
        record = _Record(remote.etag, remote.size, final.stat().st_mtime_ns)
        _write_atomically(self._record_path(remote.name), json.dumps(asdict(record)))

    def forget(self, name: str) -> None:
        """Drop the record of a file (it will be fetched again)."""
        self._record_path(name).unlink(missing_ok=True)

    def save_manifest(self, url: ObjectUrl, files: list[RemoteFile]) -> None:
        payload = {"url": str(url), "files": [asdict(f) for f in files]}
        _write_atomically(self.state_dir / MANIFEST_FILE, json.dumps(payload, indent=1))

    def cached_manifest(self) -> list[RemoteFile] | None:
        """The files of the last complete download, if every one is still whole."""
        try:
            payload = json.loads((self.state_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
            files = [RemoteFile(**entry) for entry in payload["files"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return files if all(self.is_cached(f) for f in files) else None

    def _read_record(self, name: str) -> _Record | None:
        try:
            return _Record(**json.loads(self._record_path(name).read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)
