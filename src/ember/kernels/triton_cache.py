"""Triton's on-disk kernel cache, made relocatable.

Triton records each compiled kernel as a group file (``__grp__<name>.json``) listing its files by
absolute path. A cache directory that moves (a kernel cache published beside a model and
unpacked on another node, or under another ``--kernel-cache-dir``) keeps its files but loses
every kernel: the recorded paths point at the old place, so each lookup misses and compiles
again. `RelocatableCacheManager` reads a group's files from its own directory, by name, where
the recorded path does not exist. It writes what Triton writes, so a cache it fills is still
Triton's.
"""

from __future__ import annotations

import json
import os

import triton
from triton.runtime.cache import FileCacheManager


class RelocatableCacheManager(FileCacheManager):
    """A `FileCacheManager` whose groups resolve their files in this directory when the
    recorded absolute paths do not exist."""

    def get_group(self, filename: str) -> dict[str, str] | None:
        group_file = self.get_file(f"__grp__{filename}")
        if group_file is None:
            return None
        with open(group_file) as f:
            children = json.load(f).get("child_paths")
        if children is None:  # not a group Triton wrote
            return None
        found = {}
        for child, recorded in children.items():
            here = os.path.join(self.cache_dir, os.path.basename(recorded))
            for path in (recorded, here):
                if os.path.exists(path):
                    found[child] = path
                    break
        return found


def use_relocatable_cache() -> None:
    """Make this process's Triton look kernels up through `RelocatableCacheManager` (unless a
    cache manager of the user's own is configured: ``TRITON_CACHE_MANAGER``)."""
    knobs = triton.knobs.cache
    if knobs.manager_class is None:
        knobs.manager_class = RelocatableCacheManager
