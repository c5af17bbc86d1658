"""OpenAI request bodies, parsed and type-checked by pydantic (FastAPI turns failures into 400s).

Responses are plain dicts encoded with msgspec (see `serving_*`): building a pydantic model per
streamed token would cost more than the rest of the token's path. Fields OpenAI or vLLM accept
that ember does not use are ignored with a log line, never rejected, so existing clients work.
A body holding a value JSON has no room for (NaN, a lone surrogate), wherever it is, is refused
before any field is read (`ember.server.json_values`). These models are also the request bodies
of the OpenAPI schema the server publishes.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ember.server.json_values import find_non_json_value
from ember.server.log_text import log_texts
from ember.server.structured_outputs import ResponseFormat
from ember.server.tool_calls.schema import ChatTool, MessageToolCall, ToolChoice
from ember.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Accepted for compatibility, with no effect on the result: not worth a log line each time.
_QUIETLY_IGNORED = frozenset({"user", "stream_options", "store", "metadata"})


# A token id: an integer, never a boolean, string or float that could pass for one.
TokenId = StrictInt

# The roles OpenAI documents for chat messages.
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class OpenAIRequest(BaseModel):
    """Base of every request body: unknown fields are kept aside and logged."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _refuse_non_json_values(cls, body: Any) -> Any:
        found = find_non_json_value(body)
        if found is not None:
            param, reason = found
            # A model-level error has no field: errors.validation_error reads ctx["param"].
            message = f"{param}: {reason}" if param else f"the request body: {reason}"
            context = {"message": message, "param": param or None}
            raise PydanticCustomError("invalid_json_value", "{message}", context)
        return body

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> OpenAIRequest:
        unknown = sorted(set(self.model_extra or ()) - _QUIETLY_IGNORED)
        if unknown:  # the client's names: escaped and bounded (ember.server.log_text)
            logger.info("%s: ignoring unknown fields %s", type(self).__name__, log_texts(unknown))
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIRequest):
    """Generation parameters shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured output (`ember.server.structured_outputs`): OpenAI's, vLLM's older fields and
    # its newer object; at most one of them.
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# A completions prompt: text, texts, token ids, or lists of token ids.
PromptInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: Annotated[int | None, Field(ge=0, le=20)] = None
    # vLLM's: the prompt tokens' logprobs with this many alternatives, in vLLM's shape.
    prompt_logprobs: Annotated[int | None, Field(ge=0, le=20)] = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # One message for the four shapes, instead of the first shape's complaint.
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(
                "prompt_shape",
                "must be a string, a list of strings, a list of token ids (integers) or a "
                "list of lists of token ids",
            ) from None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: ChatRole
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=20)] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None

    @property
    def output_limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeRequest(OpenAIRequest):
    """Either `prompt` (text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[TokenId]
