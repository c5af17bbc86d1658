"""`vllm serve` flags on `ember serve`: each one ember honours reaches the ServerConfig (and so
uvicorn or the app); each one it cannot honour stops the command with exit code 1 and one line
naming the flag, before any model is opened."""

from __future__ import annotations

import logging

import pytest

from ember import cli
from ember.cli import build_parser, server_config
from ember.server.config import CorsConfig
from ember.vllm_flags import RefusedFlag


def config_of(*argv: str):
    return server_config(build_parser().parse_args(["serve", *argv]))


@pytest.fixture
def no_serving(monkeypatch):
    """`ember serve` up to the point where it would start the server: that point fails."""
    import ember.server.serve

    def refuse(config):
        raise AssertionError("a refused flag must stop ember serve before it serves")

    monkeypatch.setattr(ember.server.serve, "run_server", refuse)


@pytest.mark.parametrize(
    ("argv", "flag", "why"),
    [
        (("--quantization", "awq"), "--quantization", "awq is not available"),
        (("m/dir", "-q", "gguf"), "--quantization", "gguf is not available"),  # not a .gguf
        (("--generation-config", "/configs/x"), "--generation-config", "only auto or vllm"),
        (("m/dir", "--load-format", "gguf"), "--load-format", "a .gguf file"),
        (("--load-format", "safetensors"), "--load-format", "a model directory"),  # embedded GGUF
        (("--max-logprobs", "100"), "--max-logprobs", "only 20"),
        (("--ssl-keyfile", "key.pem"), "--ssl-keyfile", "needs --ssl-certfile"),
        (("--ssl-certfile", "/no/such/cert.pem"), "--ssl-certfile", "no such file"),
    ],
)
def test_a_refused_flag_exits_1_with_one_line_naming_it(argv, flag, why, no_serving, caplog):
    with pytest.raises(RefusedFlag, match=why):
        config_of(*argv)
    with caplog.at_level(logging.ERROR, logger="ember.cli"):
        assert cli.main(["serve", *argv]) == 1
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage().startswith(f"ember serve: {flag}: ")
    assert why in record.getMessage() and "\n" not in record.getMessage()


def test_a_tool_call_parser_outside_the_choices_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--tool-call-parser", "pythonic"])
    assert exit_.value.code == 2 and "--tool-call-parser" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ("--enable-prefix-caching",),  # the default
        ("--kv-cache-dtype", "auto"),
        ("--generation-config", "vllm"),
        ("--tensor-parallel-size", "1"),
        ("--max-logprobs", "20"),
        ("--load-format", "auto"),
        ("--load-format", "gguf"),  # the embedded model is a GGUF file
        ("m.gguf", "--load-format", "gguf", "--quantization", "gguf"),
        ("m/dir", "--load-format", "safetensors"),
        ("--disable-log-stats",),
        ("--enable-auto-tool-choice",),  # ember serves tool_choice auto whenever it can
    ],
)
def test_what_ember_does_anyway_is_accepted_silently(argv, caplog):
    with caplog.at_level(logging.WARNING, logger="ember.cli"):
        config = config_of(*argv)
    assert config == config_of(*argv[: 1 if argv[0][0] != "-" else 0])  # as if not given
    assert not caplog.records


@pytest.mark.parametrize(
    ("argv", "note"),
    [
        (("--trust-remote-code",), "never runs a model's own code"),
        (("--generation-config", "auto"), "not its sampling defaults"),
    ],
)
def test_a_flag_taken_with_a_difference_says_so(argv, note, caplog):
    with caplog.at_level(logging.WARNING, logger="ember.cli"):
        config_of(*argv)
    assert note in caplog.text


@pytest.mark.parametrize("parser", ["llama3_json", "hermes", "mistral", "openai"])
def test_tool_call_parser_reaches_every_served_model(parser):
    config = config_of("a=x", "b=y.gguf", "--enable-auto-tool-choice", "--tool-call-parser", parser)
    assert [spec.tool_call_parser for spec in config.models] == [parser, parser]
    assert [spec.tool_call_parser for spec in config_of("a=x").models] == [None]


def test_reasoning_parser_reaches_every_served_model():
    config = config_of("a=x", "b=y.gguf", "--reasoning-parser", "openai_gptoss")
    assert [spec.reasoning_parser for spec in config.models] == ["openai_gptoss"] * 2
    assert [spec.reasoning_parser for spec in config_of("a=x").models] == [None]


def test_a_reasoning_parser_outside_the_choices_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--reasoning-parser", "granite"])
    assert exit_.value.code == 2 and "--reasoning-parser" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3"])
def test_an_fp8_kv_cache_dtype_reaches_every_served_model(value):
    config = config_of("a=x", "b=y.gguf", "--kv-cache-dtype", value)
    assert [spec.engine.cache.kv_cache_dtype for spec in config.models] == [value, value]
    assert [spec.engine.cache.kv_cache_dtype for spec in config_of("a=x").models] == ["auto"]


@pytest.mark.parametrize("value", ["fp8_e5m2", "bfloat16", "FP8"])
def test_a_kv_cache_dtype_outside_the_choices_is_a_usage_error(value, no_serving, capsys):
    """vLLM's other names (fp8_e5m2, a dtype) are no FP8 e4m3 cache: refused at parsing, with
    the choices listed."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--kv-cache-dtype", value])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and "--kv-cache-dtype" in error
    assert all(choice in error for choice in ("'auto'", "'fp8'", "'fp8_e4m3'"))


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "-tp"])
def test_tensor_parallel_size_reaches_every_served_model(flag):
    config = config_of("a=x", "b=y", flag, "2")
    assert [spec.engine.tensor_parallel_size for spec in config.models] == [2, 2]
    assert [spec.engine.tensor_parallel_size for spec in config_of("a=x").models] == [1]


def test_quantization_fp8_reaches_every_served_model():
    """vLLM's flag: FP8 weights for every model (a .gguf one dequantized, then quantized)."""
    config = config_of("a=x", "b=y.gguf", "--quantization", "fp8")
    assert [spec.engine.quantization for spec in config.models] == ["fp8", "fp8"]
    assert [spec.engine.quantization for spec in config_of("a=x", "-q", "fp8").models] == ["fp8"]
    assert [spec.engine.quantization for spec in config_of("a=x").models] == [None]


def test_load_format_dummy_reaches_every_served_model():
    """Dummy weights for every model, .gguf ones too; the other formats load from the source."""
    config = config_of("a=x", "b=y.gguf", "--load-format", "dummy")
    assert [spec.engine.load_format for spec in config.models] == ["dummy", "dummy"]
    assert all(spec.engine.dummy_weights for spec in config.models)
    (plain,) = config_of("a=x").models
    assert plain.engine.load_format == "auto" and not plain.engine.dummy_weights


def test_prefix_caching_is_on_unless_turned_off():
    (on,) = config_of().models
    (off,) = config_of("--no-enable-prefix-caching").models
    assert on.engine.cache.enable_prefix_caching
    assert not off.engine.cache.enable_prefix_caching


def test_cors_is_off_unless_a_cors_flag_is_given():
    assert config_of().cors is None
    cors = config_of("--allowed-origins", '["https://a.example", "https://b.example"]').cors
    assert cors == CorsConfig(allowed_origins=("https://a.example", "https://b.example"))
    full = config_of(
        "--allowed-origins",
        "https://a.example",  # a bare value is a list of one
        "--allowed-methods",
        '["GET", "POST"]',
        "--allowed-headers",
        '["Authorization"]',
        "--allow-credentials",
    ).cors
    assert full == CorsConfig(("https://a.example",), ("GET", "POST"), ("Authorization",), True)
    assert config_of("--allow-credentials").cors == CorsConfig(allow_credentials=True)


def test_a_cors_list_that_is_not_strings_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--allowed-origins", "[1, 2]"])
    assert "not a JSON list of strings" in capsys.readouterr().err


def test_root_path_and_tls_reach_uvicorn(tmp_path):
    from ember.server.serve import uvicorn_config

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    cert.write_text("c")
    config = config_of(
        "--root-path", "/ember", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)
    )
    served = uvicorn_config(config, app=None)
    assert served.root_path == "/ember"
    assert (served.ssl_keyfile, served.ssl_certfile) == (str(key), str(cert))
    plain = uvicorn_config(config_of(), app=None)
    assert plain.root_path == "" and plain.ssl_keyfile is None and plain.ssl_certfile is None


def test_request_logging_is_off_unless_enabled():
    assert config_of().log_requests is False
    assert config_of("--enable-log-requests").log_requests is True
    assert config_of("--disable-log-requests").log_requests is False
    with pytest.raises(SystemExit):
        config_of("--enable-log-requests", "--disable-log-requests")


def test_tokenizer_info_endpoint_is_off_unless_enabled():
    assert config_of().tokenizer_info_endpoint is False
    assert config_of("--enable-tokenizer-info-endpoint").tokenizer_info_endpoint is True


def test_download_dir_reaches_every_model():
    (spec,) = config_of("s3://bucket/model", "--download-dir", "/var/cache/m").models
    assert spec.engine.download_dir == "/var/cache/m"


def test_serve_help_groups_the_vllm_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for title in ("model format", "HTTP: TLS, CORS, root path", "logging:"):
        assert title in out
