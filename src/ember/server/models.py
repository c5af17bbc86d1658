"""The models the front end serves: each one's tokenizer (loaded here, in the front end) and
what the engine reported about it once loaded (context length, vocabulary size)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

from ember.engine.ipc import ModelInfo
from ember.server.config import ServedModelSpec
from ember.server.errors import NotFoundError, ServiceUnavailableError
from ember.server.harmony.selection import uses_harmony
from ember.tokenizer.tokenizer import Tokenizer


def served_name_for(model: str | None, served_model_name: str | None) -> str:
    """The name clients use: --served-model-name, else MODEL as typed, else the default
    model's file name."""
    if served_model_name:
        return served_model_name
    if model:
        return model
    from ember.weights.default_model import default_model_path

    return Path(default_model_path()).stem


@dataclass
class ServedModel:
    """One model as the front end sees it."""

    spec: ServedModelSpec
    tokenizer: Tokenizer
    created: int = field(default_factory=lambda: int(time.time()))
    info: ModelInfo | None = None  # set when the engine has loaded the model
    _token_texts: dict[int, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @functools.cached_property
    def reads_harmony(self) -> bool:
        """Whether chat replies are gpt-oss's harmony format (`ember.server.harmony`)."""
        spec = self.spec
        return uses_harmony(
            spec.reasoning_parser, spec.tool_call_parser, self.tokenizer.added_token_id
        )

    @property
    def max_model_len(self) -> int:
        assert self.info is not None, "the engine has not loaded this model yet"
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        assert self.info is not None, "the engine has not loaded this model yet"
        return self.info.vocab_size

    def tokenizer_info(self) -> dict:
        """`GET /tokenizer_info`, in vLLM's shape (tokenizer_config.json's keys): what a client
        needs to tokenize for this model through /tokenize and /detokenize (lm-eval's remote
        tokenizer reads eos_token, bos_token and chat_template)."""
        tokenizer = self.tokenizer
        info = {
            # The transformers class that reads the same tokenizer.json.
            "tokenizer_class": "PreTrainedTokenizerFast",
            **tokenizer.special_tokens,
            "add_bos_token": tokenizer.adds_bos_token,
            "model_max_length": self.max_model_len,
        }
        if tokenizer.chat_template is not None:
            info["chat_template"] = tokenizer.chat_template
        return info

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs), cached: the vocabulary is bounded."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text


def load_served_model(spec: ServedModelSpec) -> ServedModel:
    """Open the checkpoint's metadata and build the tokenizer (no weights are read)."""
    from ember.weights.resolve import open_checkpoint

    checkpoint = open_checkpoint(
        spec.engine.model, download_dir=spec.engine.download_dir, weights=False
    )
    try:
        tokenizer = Tokenizer.from_checkpoint(checkpoint, spec.chat_template)
    finally:
        close = getattr(checkpoint, "close", None)
        if close is not None:
            close()  # the front end needs no tensor bytes
    return ServedModel(spec=spec, tokenizer=tokenizer)


class ModelRegistry:
    """Served models by name; the first one answers requests that name no model.

    Names are known from the start (so an unknown model is a 404 even while loading); each
    model's tokenizer arrives once loaded.
    """

    def __init__(self, specs: list[ServedModelSpec]) -> None:
        self._specs = {spec.name: spec for spec in specs}
        self._loaded: dict[str, ServedModel] = {}
        self._failed: dict[str, str] = {}  # could not be opened, with why
        self._default = specs[0].name if specs else None
        # Every name a client may use (the served name and its aliases) -> the served name.
        self._names = {spec.name: spec.name for spec in specs}
        for spec in specs:
            for alias in spec.aliases:
                self._names.setdefault(alias, spec.name)

    @property
    def specs(self) -> list[ServedModelSpec]:
        return list(self._specs.values())

    def canonical(self, name: str) -> str | None:
        """The served name behind ``name`` (itself or an alias), None if none."""
        return self._names.get(name)

    def loaded(self) -> list[ServedModel]:
        return list(self._loaded.values())

    def add(self, model: ServedModel) -> None:
        self._loaded[model.name] = model

    def add_failed(self, name: str, reason: str) -> None:
        self._failed[name] = reason

    def get(self, name: str | None) -> ServedModel:
        """The model called `name` (None or "": the default one).

        NotFoundError if no such model is served; ServiceUnavailableError while it loads.
        """
        key = self._names.get(name or self._default)
        if key is None:
            raise NotFoundError(
                f"The model `{name}` does not exist. Served models: {', '.join(self._specs)}",
                param="model",
            )
        if key in self._failed:
            raise ServiceUnavailableError(
                f"the model {key} cannot be served: {self._failed[key]}", code="model_unavailable"
            )
        model = self._loaded.get(key)
        if model is None or model.info is None:
            raise ServiceUnavailableError(f"the model {key} is still loading", code="loading")
        return model
