"""The tool-call parsers by name (the `--tool-call-parser` choices), and the one a model gets
when none is configured: guessed from its chat template's tool-call syntax."""

from __future__ import annotations

from ember.server.tool_calls.base import ToolCallParser
from ember.server.tool_calls.hermes import HermesParser
from ember.server.tool_calls.llama3_json import Llama3JsonParser
from ember.server.tool_calls.mistral import MistralParser

# Parsers hold no state: one instance of each serves every request.
PARSERS: dict[str, ToolCallParser] = {
    "hermes": HermesParser(),
    "llama3_json": Llama3JsonParser(),
    "mistral": MistralParser(),
}
# gpt-oss's tool calls come in its harmony format, read with its channels by
# `ember.server.harmony` rather than by a text parser of this table.
HARMONY_PARSER = "openai"
PARSER_NAMES = (*PARSERS, HARMONY_PARSER)

# What a template writes when it shows the model its tool-call syntax, in the order checked.
_TEMPLATE_SIGNS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": ', "llama3_json"),
)


def parser_name_for(configured: str | None, chat_template: str | None) -> str | None:
    """The configured parser, else the one the chat template's syntax names, else None."""
    if configured is not None:
        if configured not in PARSER_NAMES:
            raise ValueError(
                f"unknown tool call parser {configured!r}; choose from {', '.join(PARSER_NAMES)}"
            )
        return configured
    for sign, name in _TEMPLATE_SIGNS:
        if chat_template and sign in chat_template:
            return name
    return None
