"""The request fields of tool calling, as pydantic checks them (`ember.server.protocol` uses
them): the tools offered, the tool choice, and the calls and results in earlier messages."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, StringConstraints

# OpenAI's rule for a function's name.
FunctionName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept: the chat template shows the tool as sent

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class MessageFunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON object's text


class MessageToolCall(BaseModel):
    """A call in an earlier assistant message."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall
