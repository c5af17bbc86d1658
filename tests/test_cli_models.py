"""`ember serve [NAME=]SOURCE ...`: how the command line's models, names and flags become the
ServerConfig (no model is opened: sources here are only strings)."""

from __future__ import annotations

import logging

import pytest

from ember import cli
from ember.cli import build_parser, engine_options, parse_model_argument, server_config
from ember.config import ENGINE_OPTIONS, MemoryConfig, engine_config
from ember.server.config import DEFAULT_MODEL_LOAD_TIMEOUT_S
from ember.server.models import served_name_for


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def config_of(*argv: str):
    return server_config(serve_args(*argv))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("llama=/models/llama", ("llama", "/models/llama")),
        ("qwen=Qwen/Qwen3-8B", ("qwen", "Qwen/Qwen3-8B")),
        ("llama=a=b.gguf", ("llama", "a=b.gguf")),  # split at the first '=' only
        ("/models/llama", (None, "/models/llama")),
        ("Qwen/Qwen3-8B", (None, "Qwen/Qwen3-8B")),
        ("./runs/lr=0.1", (None, "./runs/lr=0.1")),  # before '=' is a path, not a name
        ("runs/lr=0.1/model.gguf", (None, "runs/lr=0.1/model.gguf")),
        ("llama=", (None, "llama=")),  # nothing after '='
        ("=model.gguf", (None, "=model.gguf")),  # nothing before it
    ],
)
def test_name_equals_source_is_split_only_at_a_plain_name(text, expected):
    assert parse_model_argument(text) == expected


def test_an_argument_with_equals_that_exists_on_disk_is_a_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lr=0.1.gguf").write_bytes(b"")
    (tmp_path / "v=2").mkdir()
    assert parse_model_argument("lr=0.1.gguf") == (None, "lr=0.1.gguf")
    assert parse_model_argument("v=2") == (None, "v=2")
    assert parse_model_argument("v=3") == ("v", "3")  # not on disk: a name and a source
    (spec,) = config_of("lr=0.1.gguf").models
    assert spec.name == "lr=0.1.gguf" and spec.engine.model == "lr=0.1.gguf"


def test_no_model_serves_the_embedded_default_as_before():
    (spec,) = config_of().models
    assert spec.engine == engine_config(None, served_model_name=served_name_for(None, None))
    assert spec.aliases == () and spec.chat_template is None
    (named,) = config_of("--served-model-name", "llama").models
    assert named.name == "llama" and named.engine.model is None


def test_one_model_keeps_its_flags_and_name_as_before():
    argv = ("./m.gguf", "--served-model-name", "llama", "--max-model-len", "8192", "--seed", "3")
    config = config_of(*argv, "--chat-template", "t.jinja")
    (spec,) = config.models
    assert spec.engine == engine_config(
        "./m.gguf", served_model_name="llama", max_model_len=8192, seed=3
    )
    assert spec.chat_template == "t.jinja"
    assert config.memory == MemoryConfig()
    assert config.model_load_timeout_s == DEFAULT_MODEL_LOAD_TIMEOUT_S
    (unnamed,) = config_of("org/model").models
    assert unnamed.name == served_name_for("org/model", None) == "org/model"


def test_several_models_in_order_with_the_flags_as_every_models_defaults():
    config = config_of(
        "llama=/models/llama",
        "org/qwen",
        "--max-model-len",
        "4096",
        "--dtype",
        "float16",
        "--pinned",
        "--idle-timeout",
        "90",
        "--no-preload",
    )
    assert [spec.name for spec in config.models] == ["llama", "org/qwen"]
    assert [spec.engine.model for spec in config.models] == ["/models/llama", "org/qwen"]
    for spec in config.models:
        assert spec.engine.limits.max_model_len == 4096 and spec.engine.dtype == "float16"
        assert spec.engine.policy.pinned is True
        assert spec.engine.policy.idle_timeout_s == 90.0
        assert spec.engine.policy.preload is False


def test_policy_flags_left_out_keep_the_policy_defaults():
    for spec in config_of("a=x", "b=y").models:
        assert spec.engine.policy == engine_config().policy


def test_engine_wide_flags_go_to_the_memory_config_not_to_the_engines():
    config = config_of(
        "a=x",
        "--gpu-memory-utilization",
        "0.5",
        "--memory-budget-bytes",
        "1000",
        "--sleep-host-memory-bytes",
        "2000",
        "--model-load-timeout",
        "12.5",
    )
    assert config.memory == MemoryConfig(0.5, 1000, 2000)
    assert config.model_load_timeout_s == 12.5
    options = engine_options(serve_args("--gpu-memory-utilization", "0.5", "--pinned"))
    assert set(options) <= set(ENGINE_OPTIONS)
    assert "gpu_memory_utilization" not in options and options["pinned"] is True


def test_served_model_name_with_two_models_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "a", "b", "--served-model-name", "llama"])
    assert exit_.value.code == 2
    assert "--served-model-name names one model, but 2 are given" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--served-model-name"):
        config_of("a", "b", "--served-model-name", "llama")


def test_served_model_name_and_a_named_model_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "llama=/models/x", "--served-model-name", "other"])
    assert "names its model already" in capsys.readouterr().err


@pytest.mark.parametrize(
    "models",
    [("llama=x", "llama=y"), ("org/m", "org/m"), ("m.gguf", "m.gguf=other.gguf")],
)
def test_a_served_name_given_twice_is_an_error(models):
    with pytest.raises(ValueError, match="given twice"):
        config_of(*models)


def test_models_may_follow_flags(monkeypatch):
    seen = {}

    def fake_run_serve(args):
        seen["models"] = list(args.models)
        return 0

    monkeypatch.setattr(cli, "run_serve", fake_run_serve)
    assert cli.main(["serve", "a=x", "--port", "8001", "b=y"]) == 0
    assert seen["models"] == ["a=x", "b=y"]
    with pytest.raises(SystemExit):
        cli.main(["serve", "a=x", "--no-such-flag"])


def test_a_bad_config_file_is_logged_and_exit_code_1(tmp_path, caplog):
    missing = tmp_path / "missing.toml"
    with caplog.at_level(logging.ERROR, logger="ember.cli"):
        assert cli.run_serve(serve_args("--config", str(missing))) == 1
    assert str(missing) in caplog.text
    assert "Traceback" not in caplog.text


def test_the_multi_model_benchmark_is_listed():
    command = cli.BENCH_COMMANDS["multi-model"]
    assert command.module == "ember.bench.multi_model"
    assert (command.add_arguments, command.run) == ("add_arguments", "run")
