"""Find a model in the local Hugging Face hub cache, without any network access.

The hub cache stores a repository as `models--{org}--{name}/` with `refs/{branch}` files that
name a commit and `snapshots/{commit}/` directories holding the files. ember only reads this
cache; it never downloads, so a model that is not there is an error telling where we looked.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

DEFAULT_REVISION = "main"
_COMMIT_HASH = re.compile(r"[0-9a-f]{40}")
# "name" or "org/name": letters, digits, '-', '_', '.'; no path tricks like "..".
_MODEL_ID = re.compile(r"[\w][\w.-]*(/[\w][\w.-]*)?")


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a local path nor in the local Hugging Face cache."""


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The hub cache directory, chosen the way `huggingface_hub` chooses it."""
    env = os.environ if environ is None else environ
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):  # the second is the legacy name
        if env.get(variable):
            return Path(env[variable]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache_home = Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return cache_home / "huggingface" / "hub"


def is_model_id(text: str) -> bool:
    """Whether `text` has the shape of a hub model id ("org/name" or "name")."""
    return _MODEL_ID.fullmatch(text) is not None and ".." not in text


def find_cached_model(
    model_id: str, revision: str | None = None, cache_dir: Path | None = None
) -> Path:
    """The snapshot directory of `model_id` at `revision` (a branch, tag or commit hash).

    With no revision, "main" is used; a cache filled for one pinned commit has no refs/main, so
    then its only snapshot is taken.
    """
    if not is_model_id(model_id):
        raise ModelNotFoundError(f"{model_id!r} is neither an existing path nor a model id")
    if revision is not None and (not revision or ".." in revision.split("/")):
        raise ValueError(f"invalid revision {revision!r}")
    cache = cache_dir if cache_dir is not None else hub_cache_dir()
    repo_dir = cache / ("models--" + model_id.replace("/", "--"))
    if not repo_dir.is_dir():
        raise ModelNotFoundError(
            f"model {model_id!r} is not a local path and is not in the Hugging Face cache "
            f"(looked for {repo_dir}). ember never downloads models: fetch it first "
            f"(e.g. `hf download {model_id}`), set HF_HUB_CACHE or HF_HOME, or pass a local path."
        )
    snapshot = repo_dir / "snapshots" / _commit_for(repo_dir, model_id, revision)
    if not snapshot.is_dir():
        raise ModelNotFoundError(
            f"model {model_id!r}: the cache names snapshot {snapshot} but it is missing; "
            "the cache is incomplete (ember never downloads)"
        )
    return snapshot


def _commit_for(repo_dir: Path, model_id: str, revision: str | None) -> str:
    wanted = revision or DEFAULT_REVISION
    ref_file = repo_dir / "refs" / wanted
    if ref_file.is_file():
        return ref_file.read_text(encoding="utf-8").strip()
    if _COMMIT_HASH.fullmatch(wanted):
        return wanted
    snapshots = sorted(p.name for p in (repo_dir / "snapshots").glob("*") if p.is_dir())
    if revision is None and len(snapshots) == 1:
        return snapshots[0]
    raise ModelNotFoundError(
        f"model {model_id!r}: revision {wanted!r} is not in the Hugging Face cache "
        f"(looked for {ref_file}; snapshots present: {', '.join(snapshots) or 'none'}). "
        "ember never downloads models."
    )
