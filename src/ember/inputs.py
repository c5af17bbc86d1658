"""The prompt shapes `LLM.generate` takes, named as vLLM's (`from ember import TokensPrompt`)."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids, fed as they are; ``prompt``, when given, is only reported back
    in `RequestOutput.prompt`."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


# Keys a prompt dict may hold: any other (vLLM's multi_modal_data, ...) is refused, not dropped.
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})

PromptType = str | list[int] | TextPrompt | TokensPrompt
