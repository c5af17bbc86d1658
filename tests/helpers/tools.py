"""OpenAI tool entries for tests that demand calls: closed argument objects (no properties
beyond those listed), so a random-weight model's calls end."""

from __future__ import annotations

from typing import Any


def function_tool(name: str, **properties: dict[str, Any]) -> dict[str, Any]:
    """A function tool whose arguments are exactly ``properties``, all required."""
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}
