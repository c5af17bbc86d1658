"""What a chat request asks of tool calling, checked against itself and the model: the tools
the chat template gets, and whether (and how) the output is read back into calls."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ember.server.errors import BadRequestError
from ember.server.tool_calls.base import ToolCallParser
from ember.server.tool_calls.grammar import forced_calls
from ember.server.tool_calls.registry import PARSER_NAMES, PARSERS, parser_name_for
from ember.server.tool_calls.schema import ChatTool, MessageToolCall, NamedToolChoice, ToolChoice
from ember.structured_output.params import StructuredOutputsParams


@dataclass(frozen=True)
class ToolUse:
    """One request's tool calling. `parser` None: the output is plain content, or harmony's
    (gpt-oss), whose calls its reader reads."""

    template_tools: list[dict[str, Any]] | None
    parser: ToolCallParser | None = None
    required: bool = False  # tool_choice "required" or a named function
    required_name: str | None = None
    parallel: bool = True

    @property
    def demands_calls(self) -> bool:
        """Whether tool_choice holds the reply to calls ("required": of any offered tool;
        named: of that one)."""
        return self.required and bool(self.template_tools)

    def forced_output(
        self, added_token_id: Callable[[str], int | None]
    ) -> StructuredOutputsParams | None:
        """What holds the reply to calls in the parser's text format when tool_choice demands
        them, else None (and for harmony, whose calls `ember.server.harmony.grammar` writes).
        ``added_token_id``: the tokenizer's."""
        if not self.demands_calls or self.parser is None:
            return None
        return forced_calls(self.parser, self.template_tools, self.parallel, added_token_id)

    def missed(self, names: list[str]) -> str | None:
        """Why the calls read do not meet tool_choice (a reply cut at max_tokens), or None."""
        if self.required_name is not None and self.required_name not in names:
            return f"tool_choice named {self.required_name!r}, the model called {names or 'none'}"
        if self.required and not names:
            return "tool_choice was 'required' and the model called no tool"
        return None


def tool_use(
    tools: list[ChatTool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    configured_parser: str | None,
    chat_template: str | None,
    harmony: bool = False,
) -> ToolUse:
    """Check the tool fields together (400 naming the parameter at fault); the parser is the
    configured one, else the one the model's chat template shows. ``harmony``: the model
    writes gpt-oss's format, whose calls the harmony reader reads (no text parser); it writes
    one call per reply."""
    tools = tools or None  # an empty list offers nothing, as no list
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tools is None:
        if tool_choice != "none":
            raise BadRequestError("tool_choice needs tools", param="tool_choice")
        return ToolUse(None)
    names = [tool.function.name for tool in tools]
    duplicate = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if duplicate is not None:
        raise BadRequestError(f"tools name {duplicate!r} more than once", param="tools")
    dumped = [tool.model_dump(exclude_unset=True) for tool in tools]  # as sent
    if tool_choice == "none":
        return ToolUse(None)  # as OpenAI: the model is not shown the tools
    required_name = None
    if isinstance(tool_choice, NamedToolChoice):
        required_name = tool_choice.function.name
        if required_name not in names:
            raise BadRequestError(
                f"tool_choice names {required_name!r}, which is not in tools",
                param="tool_choice",
            )
        dumped = [tool for tool in dumped if tool["function"]["name"] == required_name]
    parser = None
    if not harmony:
        parser_name = parser_name_for(configured_parser, chat_template)
        if parser_name is None:
            raise BadRequestError(
                "this model's tool-call format is not known: the server needs "
                f"--tool-call-parser ({', '.join(PARSER_NAMES)}) to serve tools",
                param="tools",
            )
        parser = PARSERS[parser_name]
    return ToolUse(
        dumped,
        parser,
        required=tool_choice == "required" or required_name is not None,
        required_name=required_name,
        parallel=parallel_tool_calls is not False,
    )


def template_tool_calls(calls: list[MessageToolCall]) -> list[dict[str, Any]]:
    """Earlier calls as HF chat templates read them (Llama 3.x and Qwen2.5 write
    `arguments | tojson` into the prompt): arguments that are a JSON object's text become
    the object, as vLLM passes them; any other text stays as it is."""
    result = []
    for call in calls:
        entry = {"type": "function", **call.model_dump(exclude_unset=True)}
        arguments = call.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                entry["function"]["arguments"] = parsed
        result.append(entry)
    return result
