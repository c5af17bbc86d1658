"""Turn what the user typed after `--model` into an open `Checkpoint`.

Accepted, in this order: nothing (the bundled default model), an ``s3://bucket/prefix`` URL
(an S3-compatible object store, through the local download cache), an existing `.gguf` file, an
existing directory (a Hugging Face model directory, or a directory with a single `.gguf`), and
a Hugging Face model id found in the local cache.
"""

from __future__ import annotations

import os
from pathlib import Path

from ember.weights.checkpoint import Checkpoint
from ember.weights.hf_cache import ModelNotFoundError, find_cached_model, is_model_id
from ember.weights.hf_checkpoint import HFDirCheckpoint
from ember.weights.object_store import is_object_url

GGUF_SUFFIX = ".gguf"


def open_checkpoint(
    model: str | os.PathLike[str] | None,
    revision: str | None = None,
    *,
    download_dir: str | os.PathLike[str] | None = None,
    weights: bool = True,
) -> Checkpoint:
    """Open `model`; `revision` (branch, tag or commit) applies only to HF cache ids.

    ``download_dir`` is where an object store's models are cached (default: the user's cache
    directory). ``weights=False`` opens what a process that never reads tensors needs (config,
    tokenizer): a model directory's weight files are not looked for (it may have none), an
    object-store model downloads none, unless it is a GGUF file.
    """
    if is_object_url(model):
        if revision is not None:
            raise ValueError(f"{model}: a revision applies only to Hugging Face model ids")
        return _open_object(str(model), download_dir, weights)
    if model is None:
        if revision is not None:
            raise ValueError("a revision needs a model id")
        # Imported here: the default model's module pulls in GGUF support, needed only now.
        from ember.weights.default_model import default_model_path

        return open_path(Path(default_model_path()))
    path = Path(model).expanduser()
    if path.exists():
        if revision is not None:
            raise ValueError(f"{path}: a revision applies only to Hugging Face model ids")
        return open_path(path, weights=weights)
    text = os.fspath(model)
    if not is_model_id(text) or text.endswith(GGUF_SUFFIX):
        raise ModelNotFoundError(f"{text}: no such file or directory")
    return open_path(find_cached_model(text, revision), name=text, weights=weights)


def open_path(path: Path, name: str | None = None, *, weights: bool = True) -> Checkpoint:
    """Open an existing `.gguf` file or model directory (``weights=False``: its metadata only,
    as `open_checkpoint`'s)."""
    if path.is_file():
        if path.suffix.lower() != GGUF_SUFFIX:
            raise ValueError(f"{path}: not a .gguf file; pass a .gguf file or a model directory")
        return _open_gguf(path)
    if not path.is_dir():
        raise ValueError(f"{path}: neither a file nor a directory")
    gguf_files = sorted(path.glob("*" + GGUF_SUFFIX))
    has_safetensors = any(path.glob("*.safetensors"))
    if gguf_files and not has_safetensors:
        if len(gguf_files) > 1:
            listing = ", ".join(p.name for p in gguf_files)
            raise ValueError(f"{path}: holds several .gguf files ({listing}); pass one of them")
        return _open_gguf(gguf_files[0])
    return HFDirCheckpoint(path, name=name, weights=weights)


def _open_object(
    url: str, download_dir: str | os.PathLike[str] | None, weights: bool
) -> Checkpoint:
    """A model in an object store: synced into the cache; safetensors weights stream in while
    the checkpoint is open (closing it stops the download), a GGUF file is fetched whole."""
    from ember.weights.download_cache import default_download_dir
    from ember.weights.object_download import ModelDownload

    root = Path(download_dir).expanduser() if download_dir else default_download_dir()
    download = ModelDownload(url, root, weights=weights).start()
    try:
        names = download.weight_names()
        ggufs = [name for name in names if name.endswith(GGUF_SUFFIX)]
        if ggufs and not any(name.endswith(".safetensors") for name in names):
            if len(ggufs) > 1:
                raise ValueError(f"{url}: holds several .gguf files ({', '.join(ggufs)})")
            download.wait_all()
            download.close()
            return _open_gguf(download.model_dir / ggufs[0])
        if not weights:
            download.close()
            return HFDirCheckpoint(download.model_dir, name=url, weights=False)
        return HFDirCheckpoint(download.model_dir, name=url, weight_files=download, arriving=names)
    except BaseException:
        download.close()
        raise


def _open_gguf(path: Path) -> Checkpoint:
    # Imported lazily: GGUF support is only needed for GGUF models.
    from ember.weights.gguf_checkpoint import GGUFCheckpoint

    return GGUFCheckpoint(path)
