"""s3:// sources against a real S3-compatible HTTP server (moto's, started by the test): the model
loads and answers, the cache serves a later start with the store down, damaged cached files are
fetched again, failures are clear errors naming the URL and leave nothing that looks complete,
and two processes starting the same model download it once."""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path

import pytest
from helpers.s3_server import S3Server
from helpers.tiny_models import make_tiny_model

from ember.weights.download_cache import STATE_DIR
from ember.weights.object_download import ModelDownload
from ember.weights.object_store import ObjectStoreError, ObjectUrl, store_settings
from ember.weights.resolve import open_checkpoint
from ember.weights.weight_files import ArrivingBytes

BUCKET = "models"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("tiny"), seed=5)


@pytest.fixture
def server(tiny_dir, monkeypatch):
    with S3Server() as s3:
        s3.create_bucket(BUCKET)
        s3.upload(BUCKET, "llama/tiny", tiny_dir)
        for name, value in s3.environ.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        yield s3


URL = f"s3://{BUCKET}/llama/tiny"


def greedy_tokens(model: str, download_dir: Path | None = None) -> list[int]:
    from ember import LLM, SamplingParams

    options = {"download_dir": str(download_dir)} if download_dir else {}
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=64, **options)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids


def test_a_model_in_the_store_loads_and_answers_like_the_local_copy(server, tiny_dir, tmp_path):
    assert greedy_tokens(URL, tmp_path) == greedy_tokens(str(tiny_dir))
    cached = next(tmp_path.rglob("model.safetensors"))
    assert cached.read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
    assert not list(tmp_path.rglob("*.part"))


def test_a_later_start_serves_from_the_cache_with_the_store_down(server, tiny_dir, tmp_path):
    with ModelDownload(URL, tmp_path) as first:
        first.wait_all()
    assert first.stats.bytes > 0
    server.kill()
    with ModelDownload(URL, tmp_path) as second:
        second.wait_all()
    assert second.from_cache_only and second.stats.bytes == 0
    assert greedy_tokens(URL, tmp_path) == greedy_tokens(str(tiny_dir))


@pytest.mark.parametrize("damage", ["truncate", "alter"])
def test_a_damaged_cached_file_is_fetched_again(server, tiny_dir, tmp_path, damage):
    with ModelDownload(URL, tmp_path) as first:
        first.wait_all()
    cached = first.model_dir / "model.safetensors"
    original = cached.read_bytes()
    if damage == "truncate":
        cached.write_bytes(original[: len(original) // 2])
    else:
        with open(cached, "r+b") as file:
            file.seek(len(original) // 2)
            file.write(b"\xff" * 16)
    with ModelDownload(URL, tmp_path) as second:
        second.wait_all()
    assert second.stats.files == 1 and second.stats.bytes == len(original)
    assert cached.read_bytes() == original


def test_the_store_dying_mid_download_is_a_clear_error_and_leaves_no_file(server, tmp_path):
    payload = os.urandom(24 << 20)
    source = tmp_path / "source"
    source.mkdir()
    (source / "model.safetensors").write_bytes(payload)
    (source / "config.json").write_text("{}")
    server.upload(BUCKET, "big", source)
    cache = tmp_path / "cache"
    download = ModelDownload(f"s3://{BUCKET}/big", cache, range_bytes=1 << 20, connections=1)
    download.start()
    try:
        target = download.model_dir / "model.safetensors"
        download.wait(target, 0, 1 << 20)  # the first range has arrived: now the store dies
        server.kill()
        with pytest.raises(ObjectStoreError, match=f"s3://{BUCKET}/big/model.safetensors"):
            download.wait_all(timeout=120)
    finally:
        download.close()
    assert not target.exists()
    assert not list(cache.rglob("*.part"))


def test_every_weight_files_header_range_comes_before_the_bulk(server, tmp_path, monkeypatch):
    """A checkpoint is planned from every weight file's header: those (each file's first
    range) are fetched first, then the rest in file order."""
    source = tmp_path / "source"
    source.mkdir()
    names = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    for name in names:
        (source / name).write_bytes(os.urandom(3 << 20))
    (source / "config.json").write_text("{}")
    server.upload(BUCKET, "sharded", source)
    fetched: list[tuple[str, int]] = []
    get_range = ModelDownload._get_range

    def recording(self, remote, fd, start, end, arrived):
        fetched.append((remote.name, start))
        return get_range(self, remote, fd, start, end, arrived)

    monkeypatch.setattr(ModelDownload, "_get_range", recording)
    url = f"s3://{BUCKET}/sharded"
    with ModelDownload(url, tmp_path / "cache", range_bytes=1 << 20, connections=1) as download:
        download.wait_all(timeout=120)
    first, second = names
    assert [f for f in fetched if f[0] != "config.json"] == [
        (first, 0),
        (second, 0),
        (first, 1 << 20),
        (first, 2 << 20),
        (second, 1 << 20),
        (second, 2 << 20),
    ]


def test_a_missing_key_or_bucket_names_the_url(server, tmp_path):
    with pytest.raises(ObjectStoreError, match=f"s3://{BUCKET}/no/such/model"):
        open_checkpoint(f"s3://{BUCKET}/no/such/model", download_dir=tmp_path)
    with pytest.raises(ObjectStoreError, match="s3://no-such-bucket/llama.*not found"):
        open_checkpoint("s3://no-such-bucket/llama", download_dir=tmp_path)


def test_wrong_credentials_name_the_url(tmp_path, monkeypatch):
    with S3Server(check_credentials=True) as s3:
        for name, value in s3.environ.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        with pytest.raises(ObjectStoreError, match=f"s3://{BUCKET}/llama.*access denied"):
            open_checkpoint(URL, download_dir=tmp_path)


def _download_in_child(url: str, cache: str, environ: dict[str, str], start, results) -> None:
    os.environ.update(environ)
    start.wait()
    with ModelDownload(url, Path(cache), range_bytes=256 << 10, connections=2) as download:
        download.wait_all()
        results.put(download.stats.bytes)


def test_two_processes_starting_one_model_download_it_once(server, tiny_dir, tmp_path):
    context = multiprocessing.get_context("spawn")
    start, results = context.Event(), context.Queue()
    children = [
        context.Process(
            target=_download_in_child, args=(URL, str(tmp_path), server.environ, start, results)
        )
        for _ in range(2)
    ]
    for child in children:
        child.start()
    start.set()
    fetched = [results.get(timeout=300) for _ in children]
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    total = sum(p.stat().st_size for p in tiny_dir.rglob("*") if p.is_file())
    assert sum(fetched) == total, fetched
    cached = next(tmp_path.rglob("model.safetensors"))
    assert cached.read_bytes() == (tiny_dir / "model.safetensors").read_bytes()


def test_the_front_end_fetches_no_weights(server, tmp_path):
    checkpoint = open_checkpoint(URL, download_dir=tmp_path, weights=False)
    assert checkpoint.tokenizer is not None and checkpoint.hf_config["architectures"]
    assert not list(tmp_path.rglob("*.safetensors"))


def test_a_tensor_is_readable_before_the_whole_file_has_arrived():
    arriving = ArrivingBytes(100)
    woke = threading.Event()

    def reader() -> None:
        arriving.wait(10, 30)
        woke.set()

    thread = threading.Thread(target=reader)
    thread.start()
    arriving.add(0, 20)
    assert not woke.wait(0.2)
    arriving.add(20, 40)
    thread.join(5)
    assert woke.is_set() and arriving.has(0, 40) and not arriving.complete
    arriving.add(60, 100)
    arriving.add(40, 60)
    assert arriving.complete
    failing = ArrivingBytes(10)
    failing.add(0, 5)
    failing.fail(ObjectStoreError("s3://b/k: gone"))
    failing.wait(0, 5)  # what arrived stays readable
    with pytest.raises(ObjectStoreError, match="gone"):
        failing.wait(0, 10)


def test_settings_come_from_the_environment_then_the_shared_files(tmp_path):
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws/credentials").write_text(
        "[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = FILESECRET\n"
        "[other]\naws_access_key_id = OTHERKEY\naws_secret_access_key = OTHERSECRET\n"
    )
    (tmp_path / ".aws/config").write_text(
        "[default]\nregion = eu-west-3\n[profile other]\nendpoint_url = http://minio:9000\n"
    )
    assert store_settings({}, tmp_path) == {
        "access_key_id": "FILEKEY",
        "secret_access_key": "FILESECRET",
        "region": "eu-west-3",
    }
    # The environment's own values win; its key is never paired with a file's secret.
    assert store_settings({"AWS_ACCESS_KEY_ID": "ENVKEY", "AWS_REGION": "x"}, tmp_path) == {}
    assert store_settings({"AWS_REGION": "x"}, tmp_path) == {
        "access_key_id": "FILEKEY",
        "secret_access_key": "FILESECRET",
    }
    assert store_settings({"AWS_PROFILE": "other"}, tmp_path) == {
        "access_key_id": "OTHERKEY",
        "secret_access_key": "OTHERSECRET",
        "endpoint": "http://minio:9000",
    }


def test_urls_are_parsed_strictly():
    assert ObjectUrl.parse("s3://bucket/a/b/") == ObjectUrl("bucket", "a/b")
    assert ObjectUrl.parse("s3://bucket") == ObjectUrl("bucket", "")
    assert ObjectUrl.parse("s3://bucket/a").object("config.json") == "s3://bucket/a/config.json"
    for bad in ("s3://", "s3:///prefix", "s3://bucket/a/../b"):
        with pytest.raises(ValueError):
            ObjectUrl.parse(bad)
    assert STATE_DIR.startswith(".")  # the cache's own files never look like model files


def test_published_kernels_are_fetched_once_with_the_model(server, tmp_path, monkeypatch):
    import torch

    from ember.kernels import kernel_cache

    cpu = torch.device("cpu")
    key = kernel_cache.cache_key(cpu)
    compiled = tmp_path / "node-a" / key / "0f1e2d"
    compiled.mkdir(parents=True)
    (compiled / "kernel.cubin").write_bytes(b"\x7fELF compiled")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "node-a" / key))
    published = kernel_cache.publish(URL, cpu, tmp_path / "node-a")
    assert published == f"{URL}/.ember-kernels/{key}.tar"

    monkeypatch.delenv("TRITON_CACHE_DIR")
    checkpoint = open_checkpoint(URL, download_dir=tmp_path / "models")
    try:
        assert not any(".ember-kernels" in name for name in checkpoint.weight_files.weight_names())
        directory = kernel_cache.prepare(cpu, checkpoint, tmp_path / "node-b")
        assert directory == tmp_path / "node-b" / key
        assert os.environ["TRITON_CACHE_DIR"] == str(directory)
        assert (directory / "0f1e2d/kernel.cubin").read_bytes() == b"\x7fELF compiled"
        assert checkpoint.weight_files.fetch_kernels(key, directory) == 0  # once per version
        # A cache directory the user chose is theirs: nothing is fetched into it.
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
        assert kernel_cache.prepare(cpu, checkpoint, tmp_path / "node-c") is None
        assert not (tmp_path / "node-c").exists()
    finally:
        checkpoint.close()
