"""SmolLM2's real tokenizer (49,152 ids) and a grammar compiler over it."""

from __future__ import annotations

import json

import pytest
import tokenizers
from helpers.tiny_models import SMOLLM2_EOS_ID, SMOLLM2_VOCAB_SIZE, smollm2_tokenizer_dir

from ember.structured_output.compiler import GrammarCompiler
from ember.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smol_tokenizer() -> Tokenizer:
    directory = smollm2_tokenizer_dir()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    return Tokenizer(tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")), config)


@pytest.fixture(scope="session")
def compiler(smol_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(smol_tokenizer, SMOLLM2_VOCAB_SIZE, (SMOLLM2_EOS_ID,))
