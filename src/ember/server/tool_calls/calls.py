"""A tool call read from a model's output, and its OpenAI JSON shape."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    """An OpenAI-style call id: `call_` and 24 random hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON object's text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The `tool_calls` entry of a message, or of a stream delta when `index` is given."""
        entry: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return entry if index is None else {"index": index, **entry}


def call_from_object(value: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """`{"name": ..., <argument key>: {...}}` as a call, or None when it is not one.

    Arguments may be an object or a string holding one (some models quote them); a missing
    arguments key means no arguments.
    """
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in value:
            arguments = value[key]
            break
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
