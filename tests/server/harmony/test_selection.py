"""Which models are read as harmony: those whose tokenizer has harmony's tokens, and those a
flag names so (vLLM's --reasoning-parser openai_gptoss, --tool-call-parser openai; the flags
themselves: tests/test_vllm_flags.py); and the stop tokens a harmony vocabulary adds to
generation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers.harmony import harmony_tokenizer, plain_byte_tokenizer

from ember.config import EngineConfig, ModelConfig
from ember.engine.model_plan import _with_generation_eos
from ember.server.config import ServedModelSpec
from ember.server.harmony.selection import uses_harmony
from ember.server.models import ServedModel
from ember.tokenizer.harmony import harmony_stop_token_ids, harmony_token_ids


def served(tokenizer, **spec_fields) -> ServedModel:
    return ServedModel(
        ServedModelSpec(EngineConfig(served_model_name="m"), **spec_fields), tokenizer
    )


def test_a_tokenizer_with_harmony_tokens_is_read_as_harmony():
    assert served(harmony_tokenizer()).reads_harmony
    assert not served(plain_byte_tokenizer()).reads_harmony


@pytest.mark.parametrize(
    "fields", [{"reasoning_parser": "openai_gptoss"}, {"tool_call_parser": "openai"}]
)
def test_a_flag_names_harmony_for_any_tokenizer(fields):
    assert served(plain_byte_tokenizer(), **fields).reads_harmony


def test_another_tool_call_parser_does_not_turn_harmony_off():
    # A flag given for every model of a server must not break the gpt-oss among them.
    assert uses_harmony(None, "hermes", harmony_tokenizer().added_token_id)
    assert not uses_harmony(None, "hermes", plain_byte_tokenizer().added_token_id)


def test_another_reasoning_parser_does_not_turn_harmony_off():
    assert served(harmony_tokenizer(), reasoning_parser="qwen3").reads_harmony
    assert not served(plain_byte_tokenizer(), reasoning_parser="qwen3").reads_harmony


def test_an_unknown_reasoning_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'"):
        ServedModelSpec(EngineConfig(served_model_name="m"), reasoning_parser="granite")


def test_return_and_call_end_generation_for_a_harmony_vocabulary():
    tokenizer = harmony_tokenizer()
    ids = harmony_token_ids(tokenizer.added_token_id)
    assert ids is not None
    assert harmony_stop_token_ids(tokenizer.added_token_id) == (ids["<|return|>"], ids["<|call|>"])
    assert harmony_stop_token_ids(plain_byte_tokenizer().added_token_id) == ()


def test_the_engine_stops_on_call_when_generation_config_lists_only_return():
    tokenizer = harmony_tokenizer()
    ids = harmony_token_ids(tokenizer.added_token_id)
    cfg = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 300,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "eos_token_id": ids["<|return|>"],
        }
    )
    checkpoint = SimpleNamespace(generation_config={"eos_token_id": ids["<|return|>"]})
    eos = _with_generation_eos(cfg, checkpoint, tokenizer).eos_token_ids  # type: ignore[arg-type]
    assert eos == (ids["<|return|>"], ids["<|call|>"])
    plain = _with_generation_eos(cfg, checkpoint, plain_byte_tokenizer())  # type: ignore[arg-type]
    assert plain.eos_token_ids == (ids["<|return|>"],)
