"""Compiled kernels kept between starts, and shared through the object store with the weights.

Triton caches every compiled kernel on disk, keyed by its source, its specialisation (the
model's shapes and dtypes reach it as constexprs and argument types), the GPU's architecture and
Triton's version; a second start on the same machine compiles nothing. ember points that cache
at one directory per GPU model and software versions (`cache_key`), under ember's cache
directory (``--kernel-cache-dir``, else the user's cache directory), unless the user has chosen
one with ``TRITON_CACHE_DIR``. One directory per key is what makes the cache portable:
`publish` puts it beside a model in the object store as ``.ember-kernels/<key>.tar``, and a node
starting that model from the store with the same GPU and versions fetches it before its kernels
compile (`prepare`), so its first start is a warm one.
"""

from __future__ import annotations

import io
import logging
import os
import re
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

KERNELS_PREFIX = ".ember-kernels/"
ARCHIVE_SUFFIX = ".tar"
_FETCHED_MARK = ".fetched-"


def cache_root(configured: str | os.PathLike[str] | None = None) -> Path:
    if configured:
        return Path(configured).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("ember")) / "kernels"


def cache_key(device: torch.device) -> str:
    """The GPU model, its architecture and the versions that decide what a compile produces."""
    import torch
    import triton

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        hardware = f"{name}-sm{major}{minor}"
    else:
        hardware = device.type
    versions = f"triton{triton.__version__}-torch{torch.__version__}-cuda{torch.version.cuda}"
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", f"{hardware}-{versions}")


def managed_dir(key: str, root: Path) -> Path | None:
    """Where Triton should cache this key's kernels; None when the user has pointed
    ``TRITON_CACHE_DIR`` outside ``root`` (theirs is used as it is, not published or fetched)."""
    chosen = os.environ.get("TRITON_CACHE_DIR")
    if chosen and not Path(chosen).expanduser().is_relative_to(root):
        return None
    return root / key


def prepare(
    device: torch.device, checkpoint: Any, root: str | os.PathLike[str] | None = None
) -> Path | None:
    """Point Triton's cache at this GPU's directory and, for a model from an object store that
    carries kernels compiled for this GPU and these versions, fetch them first. Returns the
    directory (None: the user's ``TRITON_CACHE_DIR`` is used)."""
    try:
        from ember.kernels.triton_cache import use_relocatable_cache
    except ImportError:  # no Triton: nothing compiles, nothing to cache
        pass
    else:
        use_relocatable_cache()  # a directory published, fetched or moved keeps its kernels
    key = cache_key(device)
    directory = managed_dir(key, cache_root(root))
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    # Triton reads this variable whenever it looks for a kernel.
    os.environ["TRITON_CACHE_DIR"] = str(directory)
    download = getattr(checkpoint, "weight_files", None)
    fetch = getattr(download, "fetch_kernels", None)
    if fetch is not None:
        fetch(key, directory)
    return directory


def publish(url: str, device: torch.device, root: str | os.PathLike[str] | None = None) -> str:
    """Put this GPU's kernel cache (under ``root``, or the user's ``TRITON_CACHE_DIR``) beside
    the model at ``url`` (``s3://bucket/prefix``); returns the archive's URL."""
    import obstore

    from ember.weights.object_store import ObjectUrl, open_store, store_error

    key = cache_key(device)
    directory = managed_dir(key, cache_root(root)) or Path(os.environ["TRITON_CACHE_DIR"])
    if not directory.is_dir() or not any(directory.iterdir()):
        raise ValueError(f"{directory}: no compiled kernels to publish; serve the model first")
    target = ObjectUrl.parse(url)
    name = KERNELS_PREFIX + key + ARCHIVE_SUFFIX
    try:
        obstore.put(open_store(target), target.key(name), archive(directory))
    except Exception as exc:
        raise store_error(exc, target.object(name)) from exc
    return target.object(name)


def archive(directory: Path) -> bytes:
    """The kernel cache directory as an uncompressed tar (cubins compress poorly)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(directory.rglob("*")):
            if path.is_file() and not path.name.startswith(_FETCHED_MARK):
                tar.add(path, arcname=path.relative_to(directory).as_posix())
    return buffer.getvalue()


def unpack(data: bytes, directory: Path, etag: str) -> int:
    """Unpack a published archive into ``directory`` (files already there are kept); returns the
    files written. The archive may only hold plain files under the directory."""
    written = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for member in tar.getmembers():
            target = directory / member.name
            if not member.isfile() or target.exists():
                continue
            tar.extract(member, directory, filter="data")  # refuses paths outside, links...
            written += 1
    fetched_mark(directory, etag).touch()
    return written


def fetched_mark(directory: Path, etag: str) -> Path:
    """A marker that this archive version was unpacked here (so it is fetched once)."""
    return directory / (_FETCHED_MARK + re.sub(r"[^A-Za-z0-9]+", "", etag or "none"))
