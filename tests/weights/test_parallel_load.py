"""Reading safetensors weights on several threads (`ember.weights.parallel_load`), checked on a
CPU against the `safetensors` library; the pinned-buffer, multi-stream path runs in tests/gpu.
Also the instance's start-up order: the weights load while the kernels compile."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import make_tiny_model
from safetensors.torch import load_file, save_file

from ember import LLM, SamplingParams
from ember.config import MemoryConfig, engine_config
from ember.engine import model_instance, model_parts
from ember.engine.model_pool import ModelPool
from ember.weights.hf_checkpoint import HFDirCheckpoint
from ember.weights.parallel_load import load_extents
from ember.weights.safetensors_layout import read_extents


def mixed_file(path: Path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    tensors = {
        "a.weight": torch.randn(37, 19, generator=generator).to(torch.bfloat16),
        "b.weight": torch.randn(1000, generator=generator),
        "c.ids": torch.randint(-5, 5, (3, 4, 5), generator=generator),
        "d.scalar": torch.tensor(2.5, dtype=torch.float16),
        "e.empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_extents_match_the_safetensors_library(tmp_path):
    path = tmp_path / "w.safetensors"
    tensors = mixed_file(path)
    extents = read_extents(path)
    assert {e.name for e in extents} == set(tensors)  # __metadata__ is not a tensor
    assert [e.offset for e in extents] == sorted(e.offset for e in extents)
    raw = path.read_bytes()
    for extent in extents:
        expected = tensors[extent.name]
        assert extent.dtype == expected.dtype and extent.shape == tuple(expected.shape)
        assert extent.nbytes == expected.numel() * expected.element_size()
        data = bytearray(raw[extent.offset : extent.offset + extent.nbytes])
        if extent.nbytes:
            got = torch.frombuffer(data, dtype=extent.dtype).reshape(extent.shape)
            assert torch.equal(got, expected), extent.name


@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20])
def test_load_fills_targets_bit_exactly_in_chunks(tmp_path, chunk_bytes):
    path = tmp_path / "w.safetensors"
    tensors = mixed_file(path)
    targets = {name: torch.full_like(t, 9) for name, t in tensors.items()}
    seen = []
    open_fds = fd_count()
    read = load_extents(
        read_extents(path),
        lambda e: targets[e.name],
        torch.device("cpu"),
        read_threads=3,
        chunk_bytes=chunk_bytes,
        on_tensor=seen.append,
    )
    for name, tensor in tensors.items():
        assert torch.equal(targets[name], tensor), name
    assert seen == list(range(1, len(tensors) + 1))
    assert read == sum(t.numel() * t.element_size() for t in tensors.values())
    assert fd_count() == open_fds


def test_load_casts_to_the_targets_dtype_and_skips_unused_tensors(tmp_path):
    path = tmp_path / "w.safetensors"
    tensors = mixed_file(path)
    target = torch.zeros(1000, dtype=torch.bfloat16)
    seen = []

    def target_for(extent):
        return target if extent.name == "b.weight" else None

    load_extents(
        read_extents(path), target_for, torch.device("cpu"), chunk_bytes=256, on_tensor=seen.append
    )
    assert torch.equal(target, tensors["b.weight"].to(torch.bfloat16))
    assert seen == list(range(1, len(tensors) + 1))  # skipped tensors count as landed


def test_a_grouped_load_lands_each_group_before_asking_for_the_next(tmp_path):
    """Groups load in the order they first appear in the file, each landed and handed to
    ``after_group`` before the next group's targets are asked for: every group can reuse one
    scratch. Here the file interleaves the groups (``a.0, a.1, a.2, b.0, ...``)."""
    generator = torch.Generator().manual_seed(3)
    tensors = {
        f"{part}.{group}": torch.randn(50, 7, generator=generator)
        for part in ("a", "b")
        for group in range(3)
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    scratch = {"a": torch.empty(50, 7), "b": torch.empty(50, 7)}
    events, landed, seen = [], {}, []

    def target_for(extent):
        events.append(extent.name)
        return scratch[extent.name.split(".")[0]]

    def after_group():
        group = events[-1].split(".")[1]
        events.append(f"after {group}")
        landed.update({f"{part}.{group}": t.clone() for part, t in scratch.items()})

    load_extents(
        read_extents(path),
        target_for,
        torch.device("cpu"),
        read_threads=2,
        chunk_bytes=512,
        on_tensor=seen.append,
        group_of=lambda extent: extent.name.split(".")[1],
        after_group=after_group,
    )
    assert events == [e for g in "012" for e in (f"a.{g}", f"b.{g}", f"after {g}")]
    assert all(torch.equal(landed[name], tensor) for name, tensor in tensors.items())
    assert seen == list(range(1, len(tensors) + 1))


def test_a_file_truncated_after_its_header_was_read_fails_by_name(tmp_path):
    path = tmp_path / "w.safetensors"
    tensors = mixed_file(path)
    extents = read_extents(path)
    os.truncate(path, path.stat().st_size - 100)
    targets = {name: torch.empty_like(t) for name, t in tensors.items()}
    open_fds = fd_count()
    with pytest.raises(ValueError, match=r"w\.safetensors: ends before"):
        load_extents(extents, lambda e: targets[e.name], torch.device("cpu"), chunk_bytes=64)
    assert fd_count() == open_fds
    # Read afresh, the header itself says the data runs past the file's end.
    with pytest.raises(ValueError, match="run past the file's end"):
        read_extents(path)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"[1, 2]", "not a JSON object"),
        (b"{not json", "unreadable safetensors header"),
        (
            json.dumps({"x": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}).encode(),
            "unsupported dtype 'Q9'",
        ),
        (
            json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode(),
            "do not hold",
        ),
        (json.dumps({"x": {"shape": [2]}}).encode(), "malformed header entry"),
    ],
)
def test_malformed_headers_are_refused_by_name(tmp_path, header, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    with pytest.raises(ValueError, match=message):
        read_extents(path)


def test_a_header_longer_than_the_file_is_refused(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 20) + b"{}")
    with pytest.raises(ValueError, match="does not fit"):
        read_extents(path)


def test_a_checkpoints_extents_cover_every_shard(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "m", max_shard_size="200KB")
    ckpt = HFDirCheckpoint(path)
    assert len(ckpt.shard_files) > 1
    extents = ckpt.tensor_extents()
    assert len(extents) == ckpt.num_tensors
    assert {e.path for e in extents} == set(ckpt.shard_files)
    expected = {}
    for shard in ckpt.shard_files:
        expected.update(load_file(shard))
    assert {e.name: e.shape for e in extents} == {n: tuple(t.shape) for n, t in expected.items()}


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_the_model_loads_the_same_weights_as_through_iter_tensors(tmp_path, quantization):
    """Also quantized at load: a layer at a time in the parallel loader (its tensors across
    shards), a tensor at a time through the iterator."""
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "m", max_shard_size="200KB")
    llm = LLM(str(path), device="cpu", max_model_len=64, max_num_seqs=4, quantization=quantization)
    model = llm.instance.model
    reference = llm.instance._allocate_model(zeroed=True)
    reference.load_weights(HFDirCheckpoint(path).iter_tensors(torch.float32))
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert llm.instance.load_report.weight_load_seconds > 0


def test_a_missing_tensor_fails_the_load_with_its_name(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "m", num_hidden_layers=1)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.0.mlp.down_proj.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj"):
        LLM(str(path), device="cpu", max_model_len=64)


def test_weights_load_while_the_kernels_compile(tmp_path, monkeypatch):
    """The compile pass starts before the weights have landed, and its garbage outputs change
    nothing: the loader waits until the pass has begun (a sequential start-up would time out)."""
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "m", num_hidden_layers=2)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 14, 3, 77, 21, 8]}
    expected = LLM(str(path), device="cpu", max_model_len=64).generate([prompt], params)

    compiling = threading.Event()
    loaded_before_compile = []
    real_load = model_parts.load_extents

    def load_after_the_pass_began(*args, **kwargs):
        assert compiling.wait(timeout=30), "the compile pass never started during the load"
        return real_load(*args, **kwargs)

    def compile_kernels(runner, workers):
        loaded_before_compile.append(any(p.any() for p in runner.model.parameters()))
        compiling.set()

    monkeypatch.setattr(model_parts, "load_extents", load_after_the_pass_began)
    monkeypatch.setattr(model_instance.ModelRunner, "compile_kernels", compile_kernels)
    monkeypatch.setattr(model_instance.ModelInstance, "_compile_workers", lambda self: 2)
    llm = LLM(str(path), device="cpu", max_model_len=64)
    assert loaded_before_compile == [False]  # zeroed, not yet read
    got = llm.generate([prompt], params)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert llm.instance.load_report.weight_wait_seconds >= 0


def test_load_progress_counts_every_tensor(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "m", num_hidden_layers=1)
    done: list[int] = []
    config = engine_config(str(path), device="cpu", max_model_len=64)
    pool = ModelPool([config], MemoryConfig())
    pool.set_progress(lambda name: done.append)
    results = []
    pool.command(str(path), "load", results.append)
    assert results[0].status == 200
    total = HFDirCheckpoint(path).num_tensors
    assert done[-1] == total and len(done) == total
    assert done == sorted(done)


def test_prefetch_finds_a_local_models_weight_files_and_reads_them_ahead(tmp_path):
    from ember.weights.prefetch import local_weight_files, prefetch

    (tmp_path / "config.json").write_text("{}")
    for name in ("model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    files = local_weight_files(str(tmp_path))
    assert [p.name for p in files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert local_weight_files("s3://bucket/model") == []
    assert local_weight_files(str(tmp_path / "missing")) == []
    assert local_weight_files(None) == []
    thread = prefetch(files)
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive()
    assert prefetch([]) is None
