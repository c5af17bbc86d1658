"""`ember serve --config FILE`: the TOML file's models and engine-wide settings, combined with
the command line's, become the ServerConfig; every mistake in it names the file (no model is
opened: sources here are only strings)."""

from __future__ import annotations

import re
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest

from ember.cli import build_parser, server_config
from ember.config import ENGINE_OPTIONS, MemoryConfig, engine_config
from ember.server import config_file
from ember.server.config import ServedModelSpec
from ember.server.config_file import load_config_file, parse_config

README = (Path(__file__).parents[2] / "README.md").read_text()

TWO_MODELS = """
gpu_memory_utilization = 0.8
memory_budget_bytes = 30_000_000_000
sleep_host_memory_bytes = 64_000_000_000
model_load_timeout = 120

[[models]]
name = "llama"
source = "/models/llama-3.1-8b"
aliases = ["llama-8b", "default"]
pinned = true
idle_timeout = 600
memory_share = 0.5
max_model_len = 8192

[[models]]
source = "Qwen/Qwen3-8B"
idle_timeout = 30
preload = false
kv_cache_memory_bytes = 4_000_000_000
max_num_seqs = 64
enforce_eager = true
"""


@pytest.fixture
def write(tmp_path):
    def write(text: str, name: str = "models.toml") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write


def config_of(*argv: str):
    return server_config(build_parser().parse_args(["serve", *argv]))


def test_two_models_with_their_settings_and_the_engine_wide_ones(write):
    config = config_of("--config", write(TWO_MODELS))
    assert config.models == (
        ServedModelSpec(
            engine_config(
                "/models/llama-3.1-8b",
                served_model_name="llama",
                pinned=True,
                idle_timeout_s=600.0,
                memory_share=0.5,
                max_model_len=8192,
            ),
            aliases=("llama-8b", "default"),
        ),
        ServedModelSpec(
            engine_config(
                "Qwen/Qwen3-8B",
                served_model_name="Qwen/Qwen3-8B",  # no name: the source as written
                idle_timeout_s=30.0,
                preload=False,
                kv_cache_memory_bytes=4_000_000_000,
                max_num_seqs=64,
                enforce_eager=True,
            ),
        ),
    )
    assert config.memory == MemoryConfig(0.8, 30_000_000_000, 64_000_000_000)
    assert config.model_load_timeout_s == 120.0
    assert isinstance(config.models[0].engine.policy.idle_timeout_s, float)


def test_flags_are_every_models_defaults_and_a_models_key_overrides_them(write):
    path = write(
        """
        [[models]]
        name = "a"
        source = "x"
        max_model_len = 8192
        pinned = false
        chat_template = "{{ messages }}"

        [[models]]
        name = "b"
        source = "y"
        """
    )
    argv = ("--config", path, "--max-model-len", "4096", "--dtype", "float16", "--pinned")
    a, b = config_of(*argv, "--chat-template", "t.jinja").models
    assert (a.engine.limits.max_model_len, b.engine.limits.max_model_len) == (8192, 4096)
    assert a.engine.dtype == b.engine.dtype == "float16"
    assert (a.engine.policy.pinned, b.engine.policy.pinned) == (False, True)
    assert (a.chat_template, b.chat_template) == ("{{ messages }}", "t.jinja")


def test_a_models_kv_cache_dtype_overrides_the_flag(write):
    path = write('[[models]]\nname = "a"\nsource = "x"\nkv_cache_dtype = "fp8"\n')
    (a,) = config_of("--config", path).models
    assert a.engine.cache.kv_cache_dtype == "fp8"
    b, a = config_of("b=y", "--config", path, "--kv-cache-dtype", "fp8_e4m3").models
    assert (a.engine.cache.kv_cache_dtype, b.engine.cache.kv_cache_dtype) == ("fp8", "fp8_e4m3")


def test_a_models_quantization_overrides_the_flag(write):
    path = write('[[models]]\nname = "a"\nsource = "x"\nquantization = "fp8"\n')
    b, a = config_of("b=y", "--config", path).models
    assert (a.engine.quantization, b.engine.quantization) == ("fp8", None)
    b, a = config_of("b=y", "--config", path, "--quantization", "fp8").models
    assert a.engine.quantization == b.engine.quantization == "fp8"


def test_a_models_load_format_overrides_the_flag(write):
    path = write('[[models]]\nname = "a"\nsource = "x"\nload_format = "dummy"\n')
    b, a = config_of("b=y", "--config", path).models
    assert (a.engine.load_format, b.engine.load_format) == ("dummy", "auto")


def test_a_models_reply_parsers_override_the_flags(write):
    path = write(
        '[[models]]\nname = "a"\nsource = "x"\nreasoning_parser = "qwen3"\n'
        'tool_call_parser = "hermes"\n'
    )
    b, a = config_of("b=y", "--config", path).models
    assert (a.reasoning_parser, a.tool_call_parser) == ("qwen3", "hermes")
    assert (b.reasoning_parser, b.tool_call_parser) == (None, None)
    flags = ("--reasoning-parser", "deepseek_r1", "--tool-call-parser", "mistral")
    b, a = config_of("b=y", "--config", path, *flags).models
    assert (a.reasoning_parser, a.tool_call_parser) == ("qwen3", "hermes")
    assert (b.reasoning_parser, b.tool_call_parser) == ("deepseek_r1", "mistral")


def test_command_line_models_come_first_then_the_files(write):
    path = write('[[models]]\nname = "b"\nsource = "y"\n')
    config = config_of("a=x", "z", "--config", path)
    assert [spec.name for spec in config.models] == ["a", "z", "b"]


def test_an_engine_wide_flag_wins_over_the_file(write):
    path = write("gpu_memory_utilization = 0.8\nmodel_load_timeout = 120\n")
    config = config_of("--config", path, "--gpu-memory-utilization", "0.6")
    assert config.memory == MemoryConfig(gpu_memory_utilization=0.6)
    assert config.model_load_timeout_s == 120.0
    assert config_of("--config", path, "--model-load-timeout", "5").model_load_timeout_s == 5.0


def test_a_file_without_models_serves_the_default_model(write):
    (spec,) = config_of("--config", write("memory_budget_bytes = 1_000\n")).models
    assert spec.engine.model is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("colour = 1\n", r"unknown key 'colour'"),
        ("dtype = 'float16'\n", r"unknown key 'dtype'; it is a per-model key"),
        ("gpu-memory-utilization = 0.5\n", r"keys use underscores: 'gpu_memory_utilization'"),
        ('[[models]]\nsource = "x"\ncolour = 1\n', r"\[\[models\]\] #1: unknown key 'colour'"),
        ('[[models]]\nsource = "x"\nmax_model_length = 1\n', r"did you mean 'max_model_len'"),
        ('[[models]]\nsource = "x"\nidle_timeout_s = 1\n', r"here it is 'idle_timeout'"),
        (
            '[[models]]\nsource = "x"\nserved_model_name = "y"\n',
            r"'served_model_name' \(here it is 'name'\)",
        ),
    ],
)
def test_an_unknown_key_names_the_key_and_the_file(write, text, message):
    path = write(text)
    with pytest.raises(ValueError, match=message) as error:
        load_config_file(path)
    assert path in str(error.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[models]]\nsource = "x"\nmax_model_len = "long"\n', "max_model_len must be an integer"),
        ('[[models]]\nsource = "x"\nmax_num_seqs = 1.5\n', "max_num_seqs must be an integer"),
        ('[[models]]\nsource = "x"\npinned = 1\n', "pinned must be true or false"),
        ('[[models]]\nsource = "x"\nmax_model_len = true\n', "must be an integer, not True"),
        ('[[models]]\nsource = "x"\nmemory_share = 1.5\n', "memory_share must be greater than 0"),
        ('[[models]]\nsource = "x"\nidle_timeout = 0\n', "idle_timeout must be greater than 0"),
        ('[[models]]\nsource = "x"\ncuda_graph_mode = "some"\n', "must be one of full, decode"),
        (
            '[[models]]\nsource = "x"\nkv_cache_dtype = "fp8_e5m2"\n',
            "kv_cache_dtype must be one of auto, fp8, fp8_e4m3, not 'fp8_e5m2'",
        ),
        (
            '[[models]]\nsource = "x"\nquantization = "awq"\n',
            "quantization must be one of fp8, not 'awq'",
        ),
        (
            '[[models]]\nsource = "x"\nload_format = "pt"\n',
            "load_format must be one of auto, dummy, not 'pt'",
        ),
        (
            '[[models]]\nsource = "x"\nreasoning_parser = "granite"\n',
            "reasoning_parser must be one of deepseek_r1, openai_gptoss, qwen3, not 'granite'",
        ),
        ('[[models]]\nsource = "x"\naliases = "y"\n', "'aliases' must be a list of names"),
        ("[[models]]\nsource = 3\n", "source must be a string"),
        ('[[models]]\nname = "x"\n', "no 'source'"),
        ('[[models]]\nsource = "x"\nname = ""\n', "'name' is empty"),
        ("gpu_memory_utilization = 2\n", "gpu_memory_utilization must be greater than 0"),
        ("model_load_timeout = 'soon'\n", "model_load_timeout must be a number"),
        ('[models]\nsource = "x"\n', r"each starting with \[\[models\]\]"),
        ("models = [\n", "not valid TOML"),
    ],
)
def test_a_wrong_value_names_the_key_and_the_file(write, text, message):
    path = write(text)
    with pytest.raises(ValueError, match=message) as error:
        load_config_file(path)
    assert path in str(error.value)


def test_a_missing_file_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "none.toml"))):
        load_config_file(tmp_path / "none.toml")


def test_numbers_are_taken_as_floats_where_floats_are_asked(write):
    (spec,) = config_of("--config", write('[[models]]\nsource = "x"\nmemory_share = 1\n')).models
    assert spec.engine.policy.memory_share == 1.0
    assert isinstance(spec.engine.policy.memory_share, float)


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        ((), '[[models]]\nsource = "x"\n\n[[models]]\nsource = "x"\n'),
        ((), '[[models]]\nname = "a"\nsource = "x"\n\n[[models]]\nsource = "y"\naliases = ["a"]\n'),
        ((), '[[models]]\nname = "a"\nsource = "x"\naliases = ["b", "b"]\n'),
        (("a=z",), '[[models]]\nname = "a"\nsource = "x"\n'),
    ],
)
def test_a_name_given_twice_is_an_error(write, argv, text):
    path = write(text)
    with pytest.raises(ValueError, match="is given twice") as error:
        config_of(*argv, "--config", path)
    assert path in str(error.value)


def test_served_model_name_goes_with_no_file_models(write):
    path = write('[[models]]\nsource = "x"\n')
    with pytest.raises(ValueError, match="--served-model-name names one model"):
        config_of("--config", path, "--served-model-name", "llama")


def test_pinned_models_memory_shares_fit_the_budget(write):
    pinned = '[[models]]\nsource = "{}"\npinned = true\nmemory_share = 0.6\n'
    with pytest.raises(ValueError, match="add up to 1.2"):
        config_of("--config", write(pinned.format("x") + pinned.format("y")))
    unpinned = '[[models]]\nsource = "{}"\nmemory_share = 0.6\n'
    assert len(config_of("--config", write(unpinned.format("x") + unpinned.format("y"))).models)


def test_relative_paths_are_taken_from_the_files_folder_where_they_exist(tmp_path, write):
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    (tmp_path / "tune.json").write_text("{}")
    path = write(
        """
        [[models]]
        source = "models/m"
        chat_template = "t.jinja"
        kernel_tuning = "tune.json"

        [[models]]
        source = "org/name"
        chat_template = "{{ messages }}"
        """,
        name="sub.toml",
    )
    here, there = config_of("--config", path).models
    assert here.engine.model == str(tmp_path / "models" / "m")
    assert here.name == "models/m"  # named as written
    assert here.chat_template == str(tmp_path / "t.jinja")
    assert here.engine.kernel_tuning == str(tmp_path / "tune.json")
    assert there.engine.model == "org/name" and there.chat_template == "{{ messages }}"


def test_every_engine_option_has_a_type_to_check():
    types = config_file._option_types()
    assert set(types) == set(ENGINE_OPTIONS)
    assert not [option for option, hint in types.items() if hint is Any]


def test_the_readme_example_is_a_valid_config():
    (block,) = re.findall(r"^```toml\n(.*?)^```", README, flags=re.MULTILINE | re.DOTALL)
    config = parse_config(tomllib.loads(block), "README.md")
    assert [model.name for model in config.models] == ["llama", "qwen"]
    assert config.memory["gpu_memory_utilization"] == 0.9


def test_the_modules_example_is_a_valid_config():
    doc = config_file.__doc__
    example = textwrap.dedent(doc.split("::\n", 1)[1].split("\n\n\n", 1)[0].split("\nA ")[0])
    config = parse_config(tomllib.loads(example), "docstring")
    (model,) = config.models
    assert model.name == "llama" and model.options["max_model_len"] == 8192
