"""Hugging Face model directories, the local HF cache, and `open_checkpoint` resolution."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import make_tiny_model, smollm2_gguf_path
from safetensors.torch import load_file, save_file

from ember.weights.hf_cache import ModelNotFoundError, find_cached_model, hub_cache_dir
from ember.weights.hf_checkpoint import HFDirCheckpoint
from ember.weights.resolve import open_checkpoint

MODEL_ID = "TinyOrg/tiny-qwen2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory) -> Path:
    return make_tiny_model("Qwen2ForCausalLM", tmp_path_factory.mktemp("single"), seed=3)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    return make_tiny_model("Qwen2ForCausalLM", out, seed=3, max_shard_size="4MB")


def tensors_of(checkpoint, dtype=torch.float32) -> dict[str, torch.Tensor]:
    tensors = dict(checkpoint.iter_tensors(dtype))
    assert len(tensors) == len(list(checkpoint.iter_tensors(dtype)))  # no name twice
    return tensors


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- a model directory ----


def test_single_file_dir_reads_config_and_tensors(single_dir):
    ckpt = HFDirCheckpoint(single_dir)
    assert ckpt.name == single_dir.name
    assert ckpt.hf_config == json.loads((single_dir / "config.json").read_text())
    assert ckpt.shard_files == [single_dir / "model.safetensors"]
    assert ckpt.total_bytes == (single_dir / "model.safetensors").stat().st_size
    expected = load_file(single_dir / "model.safetensors")
    got = tensors_of(ckpt)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_sharded_dir_gives_the_same_tensors_as_one_file(single_dir, sharded_dir):
    sharded = HFDirCheckpoint(sharded_dir)
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(sharded.shard_files) > 1
    assert {p.name for p in sharded.shard_files} == set(index["weight_map"].values())
    assert sharded.total_bytes == sum(p.stat().st_size for p in sharded.shard_files)
    got = tensors_of(sharded)
    assert got.keys() == index["weight_map"].keys()
    expected = tensors_of(HFDirCheckpoint(single_dir))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_iter_tensors_casts_floating_tensors_only(tmp_path):
    save_file(
        {"w": torch.randn(3, 4), "ids": torch.arange(5, dtype=torch.int64)},
        tmp_path / "model.safetensors",
    )
    (tmp_path / "config.json").write_text("{}")
    got = tensors_of(HFDirCheckpoint(tmp_path), torch.bfloat16)
    assert got["w"].dtype == torch.bfloat16
    assert got["ids"].dtype == torch.int64


def test_tokenizer_files_and_generation_config(single_dir):
    ckpt = HFDirCheckpoint(single_dir)
    assert ckpt.tokenizer.get_vocab_size() == 49152
    assert ckpt.tokenizer_config["eos_token"] == "<|im_end|>"
    template = (single_dir / "chat_template.jinja").read_text()
    assert ckpt.tokenizer_config["chat_template"] == template
    assert ckpt.generation_config["eos_token_id"] == 2


def test_chat_template_sources(single_dir, tmp_path):
    model = copy_model(single_dir, tmp_path / "m")
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").unlink()
    assert "chat_template" not in HFDirCheckpoint(model).tokenizer_config

    (model / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert HFDirCheckpoint(model).tokenizer_config["chat_template"] == template

    (model / "chat_template.json").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'inline' }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert HFDirCheckpoint(model).tokenizer_config["chat_template"] == "{{ 'inline' }}"

    # A separate file wins over the entry in tokenizer_config.json, as in transformers.
    (model / "chat_template.jinja").write_text(template)
    assert HFDirCheckpoint(model).tokenizer_config["chat_template"] == template

    extra = model / "additional_chat_templates"
    extra.mkdir()
    (extra / "tool_use.jinja").write_text("{{ 'tools' }}")
    named = HFDirCheckpoint(model).tokenizer_config["chat_template"]
    assert named == [
        {"name": "default", "template": template},
        {"name": "tool_use", "template": "{{ 'tools' }}"},
    ]


def test_optional_files_may_be_missing(single_dir, tmp_path):
    model = copy_model(single_dir, tmp_path / "m")
    (model / "generation_config.json").unlink()
    (model / "tokenizer_config.json").unlink()
    ckpt = HFDirCheckpoint(model)
    assert ckpt.generation_config == {}
    assert set(ckpt.tokenizer_config) == {"chat_template"}


# ---- refusals and damaged files ----


def test_pickled_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02not really a pickle")
    with pytest.raises(ValueError, match="only safetensors"):
        HFDirCheckpoint(tmp_path)


def test_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no model.safetensors"):
        HFDirCheckpoint(tmp_path)


def test_missing_or_corrupt_config_names_the_file(single_dir, tmp_path):
    model = copy_model(single_dir, tmp_path / "m")
    (model / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: invalid JSON"):
        HFDirCheckpoint(model)
    (model / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json: missing"):
        HFDirCheckpoint(model)


def test_truncated_shard_names_the_file(sharded_dir, tmp_path):
    model = copy_model(sharded_dir, tmp_path / "m")
    shard = sorted(model.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=shard.name + ".*truncated or corrupt"):
        HFDirCheckpoint(model)


def test_garbage_weights_file_names_the_file(single_dir, tmp_path):
    model = copy_model(single_dir, tmp_path / "m")
    (model / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        HFDirCheckpoint(model)


def test_shard_missing_from_disk_names_the_file(sharded_dir, tmp_path):
    model = copy_model(sharded_dir, tmp_path / "m")
    shard = min(model.glob("model-*.safetensors"))
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name + r": missing \(listed in"):
        HFDirCheckpoint(model)


def test_shard_lacking_an_indexed_tensor_names_the_file(sharded_dir, tmp_path):
    model = copy_model(sharded_dir, tmp_path / "m")
    shard = min(model.glob("model-*.safetensors"))
    tensors = load_file(shard)
    tensors.pop(next(iter(tensors)))
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=shard.name + ".*lacks 1 tensor"):
        HFDirCheckpoint(model)


# ---- the local Hugging Face cache ----


def make_cache(root: Path, model_dir: Path, refs: dict[str, str], commits: list[str]) -> Path:
    """Lay out `model_dir` as the hub cache does: snapshots/{commit}/ and refs/{name}."""
    repo = root / ("models--" + MODEL_ID.replace("/", "--"))
    for commit in commits:
        shutil.copytree(model_dir, repo / "snapshots" / commit)
    for name, commit in refs.items():
        (repo / "refs" / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / name).write_text(commit)
    return repo


def test_hub_cache_dir_follows_huggingface_hub_rules():
    assert hub_cache_dir({"HF_HUB_CACHE": "/a", "HF_HOME": "/b"}) == Path("/a")
    assert hub_cache_dir({"HF_HOME": "/b"}) == Path("/b/hub")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/huggingface/hub")
    assert hub_cache_dir({}) == Path("~/.cache/huggingface/hub").expanduser()


def test_cached_model_opens_by_id(single_dir, tmp_path, monkeypatch):
    make_cache(tmp_path, single_dir, {"main": COMMIT}, [COMMIT])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    ckpt = open_checkpoint(MODEL_ID)
    assert isinstance(ckpt, HFDirCheckpoint)
    assert ckpt.name == MODEL_ID
    assert ckpt.path.name == COMMIT
    assert ckpt.hf_config["architectures"] == ["Qwen2ForCausalLM"]


def test_cached_model_found_through_hf_home(single_dir, tmp_path, monkeypatch):
    make_cache(tmp_path / "hub", single_dir, {"main": COMMIT}, [COMMIT])
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert find_cached_model(MODEL_ID).name == COMMIT


def test_cached_revisions(single_dir, tmp_path):
    other = "f" * 40
    repo = make_cache(tmp_path, single_dir, {"main": COMMIT, "v1.0": other}, [COMMIT, other])
    assert find_cached_model(MODEL_ID, cache_dir=tmp_path) == repo / "snapshots" / COMMIT
    assert find_cached_model(MODEL_ID, "v1.0", cache_dir=tmp_path).name == other
    assert find_cached_model(MODEL_ID, other, cache_dir=tmp_path).name == other
    with pytest.raises(ModelNotFoundError, match="revision 'v2' is not in the Hugging Face cache"):
        find_cached_model(MODEL_ID, "v2", cache_dir=tmp_path)


def test_cache_pinned_to_one_commit_without_refs(single_dir, tmp_path):
    make_cache(tmp_path, single_dir, {}, [COMMIT])
    assert find_cached_model(MODEL_ID, cache_dir=tmp_path).name == COMMIT


def test_uncached_model_says_where_it_looked_and_that_it_never_downloads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError) as info:
        open_checkpoint("SomeOrg/absent-model")
    message = str(info.value)
    assert str(tmp_path / "models--SomeOrg--absent-model") in message
    assert "never downloads" in message


# ---- open_checkpoint ----


def test_open_local_dir_and_gguf(single_dir, tmp_path):
    assert isinstance(open_checkpoint(str(single_dir)), HFDirCheckpoint)
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    (gguf_dir / "model.gguf").symlink_to(smollm2_gguf_path())
    from ember.weights.gguf_checkpoint import GGUFCheckpoint

    assert isinstance(open_checkpoint(gguf_dir), GGUFCheckpoint)
    assert isinstance(open_checkpoint(gguf_dir / "model.gguf"), GGUFCheckpoint)
    assert isinstance(open_checkpoint(None), GGUFCheckpoint)


def test_open_checkpoint_errors(single_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        open_checkpoint(str(tmp_path / "absent"))
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        open_checkpoint("absent.gguf")
    text_file = tmp_path / "notes.txt"
    text_file.write_text("hello")
    with pytest.raises(ValueError, match="not a .gguf file"):
        open_checkpoint(text_file)
    with pytest.raises(ValueError, match="revision applies only"):
        open_checkpoint(single_dir, revision="main")
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"several \.gguf files \(a\.gguf, b\.gguf\)"):
        open_checkpoint(two)
