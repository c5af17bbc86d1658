"""A Triton kernel cache that moves keeps its kernels (`ember.kernels.triton_cache`): Triton's
own manager loses them, since its group files hold absolute paths."""

from __future__ import annotations

import shutil

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

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


def _add(x, y, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, tl.load(x + i, mask=i < n) + tl.load(y + i, mask=i < n), mask=i < n)


def test_a_kernel_compiled_for_a_gpu_is_found_after_its_cache_moved(tmp_path, monkeypatch):
    """A real compile for an H100/H200 (sm90; no GPU needed to compile), its cache directory
    moved: with the relocatable manager, the next compile is a cache hit."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    add = JITFunction(_add)  # compiled, whether or not the tests interpret kernels

    hits = []

    def listener(*, cache_hit, **_):
        hits.append(cache_hit)

    signature = {"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    target = GPUTarget("cuda", 90, 32)
    monkeypatch.setattr(triton.knobs.cache, "manager_class", RelocatableCacheManager)
    monkeypatch.setattr(triton.knobs.compilation, "listener", listener)
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "first"))
    triton.compile(ASTSource(add, signature, constexprs={"BLOCK": 256}), target=target)
    shutil.move(tmp_path / "first", tmp_path / "moved")
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "moved"))
    kernel = triton.compile(ASTSource(add, signature, constexprs={"BLOCK": 256}), target=target)
    assert hits == [False, True]
    assert kernel.asm["cubin"][:4] == b"\x7fELF"
