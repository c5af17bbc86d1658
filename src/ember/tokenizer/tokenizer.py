"""The model's tokenizer: HF `tokenizers` for text <-> ids, plus its chat template.

BOS follows the model's files: the tokenizer.json post-processor adds it where it says so (as
transformers does for Llama 3 style models); a tokenizer_config.json (or GGUF) saying
`add_bos_token: true` adds it where the post-processor does not (as llama.cpp does). Decoding
never applies transformers' `clean_up_tokenization_spaces`: it is meant for WordPiece and
transformers itself skips it for BPE, the only tokenizer type our models use.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, overload

import tokenizers

from ember.tokenizer.chat_template import (
    ChatTemplate,
    NoChatTemplateError,
    load_chat_template,
)
from ember.weights.checkpoint import Checkpoint

# tokenizer_config keys naming special tokens; they are also chat template variables.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encodes, decodes and renders chats for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        tokenizer_config: Mapping[str, Any],
        generation_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        """`chat_template` replaces the one in `tokenizer_config` when given."""
        self.backend = backend
        # A server must see whole prompts and never pad them: drop any limits the file set.
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        self.special_tokens = {
            key: token_text(tokenizer_config.get(key)) for key in SPECIAL_TOKEN_KEYS
        }
        self.bos_token_id = self._id_of(self.special_tokens["bos_token"])
        self.eos_token_id = self._id_of(self.special_tokens["eos_token"])
        generation_eos = _as_id_list((generation_config or {}).get("eos_token_id"))
        if self.eos_token_id is None and generation_eos:
            self.eos_token_id = generation_eos[0]
        # Every id that ends generation: the tokenizer's EOS and generation_config's list
        # (Llama 3 instruct models end turns with <|eot_id|>, listed only there).
        self.eos_token_ids = tuple(
            i for i in dict.fromkeys([self.eos_token_id, *generation_eos]) if i is not None
        )
        bos_from_post_processor = self._post_processor_adds_bos()
        self._prepend_bos = (
            bool(tokenizer_config.get("add_bos_token"))
            and self.bos_token_id is not None
            and not bos_from_post_processor
        )
        # Whether encode(text) starts with BOS; encode_chat gives a chat the same single BOS.
        self.adds_bos_token = self._prepend_bos or bos_from_post_processor
        template_source = chat_template or tokenizer_config.get("chat_template")
        self._chat_template = ChatTemplate(template_source) if template_source else None

    @classmethod
    def from_checkpoint(
        cls, checkpoint: Checkpoint, chat_template_override: str | None = None
    ) -> Tokenizer:
        """Build from a checkpoint; the override is a template file path or template text."""
        override = load_chat_template(chat_template_override) if chat_template_override else None
        return cls(
            checkpoint.tokenizer,
            checkpoint.tokenizer_config,
            checkpoint.generation_config,
            chat_template=override,
        )

    # ---- vocabulary ----

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (len() in HF)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of special added tokens and of the named special tokens, sorted."""
        ids = {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
        ids.update(self._id_of(text) for text in self.special_tokens.values())
        ids.discard(None)
        return sorted(ids)

    def added_token_id(self, text: str) -> int | None:
        """The id of ``text`` where it is one added token of the vocabulary (special or not,
        like Qwen's `<tool_call>`), else None."""
        token_id = self.backend.token_to_id(text)
        if token_id is None or token_id not in self.backend.get_added_tokens_decoder():
            return None
        return token_id

    @overload
    def convert_ids_to_tokens(self, ids: int) -> str | None: ...
    @overload
    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]: ...
    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | None | list[str | None]:
        """Token strings of `ids` (None for an id outside the vocabulary)."""
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    # ---- text <-> ids ----

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self._with_bos(ids) if add_special_tokens else ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Encode many texts at once (the Rust side works on them in parallel)."""
        encodings = self.backend.encode_batch_fast(
            list(texts), add_special_tokens=add_special_tokens
        )
        if not add_special_tokens:
            return [e.ids for e in encodings]
        return [self._with_bos(e.ids) for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat ----

    @property
    def chat_template(self) -> str | None:
        """The default chat template's text, or None when the model has none."""
        return self._chat_template.source if self._chat_template else None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation with the model's template (or the override) to prompt text."""
        if self._chat_template is None:
            raise NoChatTemplateError(
                "this model has no chat template; give one with --chat-template "
                "(a file or the template text), or use the completions API"
            )
        return self._chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self.special_tokens,
            **kwargs,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Render and encode a conversation, with exactly one BOS where the model wants one.

        The rendered text's own special tokens are kept; BOS is added only when the model adds
        one to plain text and the template did not already write it.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.adds_bos_token and not (ids and ids[0] == self.bos_token_id):
            return [self.bos_token_id, *ids]
        return ids

    # ---- helpers ----

    def _id_of(self, text: str | None) -> int | None:
        return None if text is None else self.backend.token_to_id(text)

    def _with_bos(self, ids: list[int]) -> list[int]:
        return [self.bos_token_id, *ids] if self._prepend_bos else ids

    def _post_processor_adds_bos(self) -> bool:
        if self.bos_token_id is None:
            return False
        probe = self.backend.encode("a", add_special_tokens=True).ids
        return bool(probe) and probe[0] == self.bos_token_id

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_token_id={self.eos_token_id})"


def token_text(value: Any) -> str | None:
    """A special token's text from tokenizer_config: a string or an AddedToken-like dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
