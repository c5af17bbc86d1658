"""The offline API's chat prompts: a conversation rendered through the model's chat template
(or one given for the call), with tools and extra template variables, to token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ember.tokenizer.chat_template import RENDER_ARGUMENTS, ChatTemplate, load_chat_template
from ember.tokenizer.tokenizer import Tokenizer


def chat_prompt_ids(
    tokenizer: Tokenizer,
    conversation: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids. ``chat_template`` (a file or the template text) replaces the
    model's for this call; ``chat_template_kwargs`` become template variables."""
    extra = dict(chat_template_kwargs or {})
    taken = sorted(RENDER_ARGUMENTS & set(extra))
    if taken:
        raise ValueError(f"chat_template_kwargs must not set {taken[0]!r}: it is an argument")
    if chat_template is None:
        return tokenizer.encode_chat(conversation, add_generation_prompt, tools, **extra)
    text = ChatTemplate(load_chat_template(chat_template)).render(
        conversation,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        special_tokens=tokenizer.special_tokens,
        **extra,
    )
    # One BOS where the model wants one, as Tokenizer.encode_chat gives it.
    ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
    if tokenizer.adds_bos_token and not (ids and ids[0] == tokenizer.bos_token_id):
        return [tokenizer.bos_token_id, *ids]
    return ids
