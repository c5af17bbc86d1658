"""A Triton kernel cache that moves keeps its kernels (`ember.kernels.triton_cache`): Triton's
own manager loses them, since its group files hold absolute paths."""

from __future__ import annotations

import shutil

import pytest

triton = pytest.importorskip("triton")

from triton.runtime.cache import FileCacheManager

from ember.kernels.triton_cache import RelocatableCacheManager, use_relocatable_cache

KEY = "kernelhash"
FILES = {"add.json": '{"name": "add"}', "add.cubin": b"\x7fELF cubin", "add.ptx": "// ptx"}


def _fill(manager: FileCacheManager) -> None:
    paths = {name: manager.put(data, name) for name, data in FILES.items()}
    manager.put_group("add.json", paths)


def test_a_moved_cache_directory_keeps_its_kernels(tmp_path, monkeypatch):
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "first"))
    _fill(FileCacheManager(KEY))
    shutil.move(tmp_path / "first", tmp_path / "moved")
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "moved"))
    # Triton's own manager finds the group but none of its files: a miss, a compile.
    assert FileCacheManager(KEY).get_group("add.json") == {}
    group = RelocatableCacheManager(KEY).get_group("add.json")
    assert sorted(group) == sorted(FILES)
    for name, path in group.items():
        assert path.startswith(str(tmp_path / "moved"))
        data = FILES[name]
        mode = "rb" if isinstance(data, bytes) else "r"
        with open(path, mode) as f:
            assert f.read() == data


def test_a_cache_in_place_reads_as_triton_reads_it(tmp_path, monkeypatch):
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    _fill(RelocatableCacheManager(KEY))
    assert RelocatableCacheManager(KEY).get_group("add.json") == FileCacheManager(KEY).get_group(
        "add.json"
    )
    assert RelocatableCacheManager(KEY).get_group("missing.json") is None


def test_the_engine_installs_it_unless_the_user_chose_a_manager(monkeypatch):
    monkeypatch.setattr(triton.knobs.cache, "manager_class", None)
    use_relocatable_cache()
    assert triton.knobs.cache.manager_class is RelocatableCacheManager

    class Theirs(FileCacheManager):
        pass

    monkeypatch.setattr(triton.knobs.cache, "manager_class", Theirs)
    use_relocatable_cache()
    assert triton.knobs.cache.manager_class is Theirs


# Run in a fresh interpreter: the tests before it may leave Triton's process-wide knobs (its
# interpreter, its listener) as they need them.
_COMPILE_TWICE = """
import json, shutil, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ember.kernels.triton_cache import use_relocatable_cache

@triton.jit
def add(x, y, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, tl.load(x + i, mask=i < n) + tl.load(y + i, mask=i < n), mask=i < n)

root = sys.argv[1]
hits = []
triton.knobs.compilation.listener = lambda *, cache_hit, **_: hits.append(cache_hit)
if sys.argv[2] == "relocatable":
    use_relocatable_cache()
signature = {"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32", "BLOCK": "constexpr"}
target = GPUTarget("cuda", 90, 32)  # an H100/H200; no GPU is needed to compile for one
triton.knobs.cache.dir = root + "/first"
triton.compile(ASTSource(add, signature, constexprs={"BLOCK": 256}), target=target)
shutil.move(root + "/first", root + "/moved")
triton.knobs.cache.dir = root + "/moved"
kernel = triton.compile(ASTSource(add, signature, constexprs={"BLOCK": 256}), target=target)
print(json.dumps({"hits": hits, "elf": kernel.asm["cubin"][:4] == b"\\x7fELF"}))
"""


@pytest.mark.parametrize("manager", ["relocatable", "triton"])
def test_a_kernel_compiled_for_a_gpu_is_found_after_its_cache_moved(tmp_path, manager):
    """A real compile for sm90, its cache directory moved, compiled again: a cache hit with the
    relocatable manager, a miss (a compile) with Triton's own."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env.pop("TRITON_CACHE_DIR", None)
    script = tmp_path / "compile_twice.py"  # a file: Triton reads a kernel's source from it
    script.write_text(_COMPILE_TWICE)
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path), manager],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["elf"]
    assert result["hits"] == ([False, True] if manager == "relocatable" else [False, False])
