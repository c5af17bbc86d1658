"""Turn the prompt of a request into token ids: completions prompts in their four shapes, chat
conversations through the model's chat template. Every failure is a 400."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ember.server.errors import BadRequestError
from ember.server.models import ServedModel
from ember.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from ember.server.tool_calls.request import template_tool_calls
from ember.tokenizer.chat_template import RENDER_ARGUMENTS

# Texts longer than this are tokenized on a worker thread (HF tokenizers releases the GIL), so
# one huge prompt does not stall every other stream; short ones are cheaper inline.
INLINE_TOKENIZE_CHARS = 8192
# Content part types that carry an image (OpenAI's chat and responses names).
_IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})

T = TypeVar("T")


@dataclass
class Prompt:
    """One prompt as the engine gets it, with its text when the client sent text."""

    token_ids: list[int]
    text: str | None = None


async def completion_prompts(request: CompletionRequest, model: ServedModel) -> list[Prompt]:
    """A string, a list of strings, a list of token ids or a list of lists of token ids."""
    raw = request.prompt
    if isinstance(raw, str):
        texts: list[str] | None = [raw]
    elif raw and all(isinstance(p, str) for p in raw):
        texts = list(raw)
    else:
        texts = None
    if texts is not None:
        size = sum(map(len, texts))
        tokenizer = model.tokenizer
        ids = await _maybe_in_thread(
            size, tokenizer.encode_batch, texts, request.add_special_tokens
        )
        prompts = [Prompt(token_ids, text) for token_ids, text in zip(ids, texts)]
    elif raw and all(isinstance(t, int) for t in raw):
        prompts = [Prompt(list(raw))]
    elif raw and all(isinstance(p, list) for p in raw):
        prompts = [Prompt(list(p)) for p in raw]
    else:
        raise BadRequestError("prompt must not be empty", param="prompt")
    for prompt in prompts:
        check_token_ids(prompt.token_ids, model.vocab_size, "prompt")
    return prompts


async def chat_prompt(
    request: ChatCompletionRequest, model: ServedModel, tools: list[dict[str, Any]] | None
) -> Prompt:
    """Render the conversation and `tools` (as the template gets them) and encode it."""
    ids = await encode_chat(
        model,
        request.messages,
        add_generation_prompt=request.add_generation_prompt,
        tools=tools,
        extra=request.chat_template_kwargs or {},
    )
    check_token_ids(ids, model.vocab_size, "messages")
    return Prompt(ids)


async def encode_chat(
    model: ServedModel,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> list[int]:
    if not messages:
        raise BadRequestError("messages must not be empty", param="messages")
    taken = sorted(RENDER_ARGUMENTS.intersection(extra or ()))
    if taken:
        raise BadRequestError(
            f"chat_template_kwargs must not set {taken[0]!r}: the server sets it itself",
            param="chat_template_kwargs",
        )
    conversation = [_message_dict(m, i) for i, m in enumerate(messages)]
    size = sum(len(m.get("content") or "") for m in conversation)

    def render() -> list[int]:
        return model.tokenizer.encode_chat(
            conversation, add_generation_prompt=add_generation_prompt, tools=tools, **(extra or {})
        )

    try:
        return await _maybe_in_thread(size, render)
    except ValueError as exc:  # template errors and "no chat template" come as ValueError
        raise BadRequestError(str(exc), param="messages") from exc


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    if not token_ids:
        raise BadRequestError(f"{param} must not be empty", param=param)
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise BadRequestError(
                f"token id {token_id} is outside the vocabulary [0, {vocab_size})", param=param
            )


def _message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates expect it: text parts joined into one content string."""
    result: dict[str, Any] = dict(message.model_extra or {})
    result["role"] = message.role
    content = message.content
    if isinstance(content, list):
        texts = []
        for position, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequestError(
                    _unsupported_part(f"messages[{index}].content[{position}]", part.get("type")),
                    param=f"messages.{index}.content",
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    result["content"] = content if content is not None else ""
    if message.name is not None:
        result["name"] = message.name
    if message.tool_calls:  # an empty list would make Llama 3.x templates render a call
        result["tool_calls"] = template_tool_calls(message.tool_calls)
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    return result


def _unsupported_part(where: str, kind: Any) -> str:
    """Why a content part other than text is refused: ember serves text models (of a multimodal
    checkpoint, such as Llama 4's, the text model alone: its vision tower is not loaded)."""
    if isinstance(kind, str) and kind in _IMAGE_PART_TYPES:
        return (
            f"{where}: image inputs are not supported: ember serves text only (of a multimodal "
            "model, the text model without its vision tower); send text parts"
        )
    return f"{where}: only text parts are supported, not {kind!r}"


async def encode_text(model: ServedModel, text: str, add_special_tokens: bool) -> list[int]:
    """``text``'s token ids; a long text is encoded on a thread, off the event loop."""
    return await _maybe_in_thread(len(text), model.tokenizer.encode, text, add_special_tokens)


async def _maybe_in_thread(size: int, function: Callable[..., T], *args: Any) -> T:
    if size <= INLINE_TOKENIZE_CHARS:
        return function(*args)
    return await asyncio.to_thread(function, *args)
