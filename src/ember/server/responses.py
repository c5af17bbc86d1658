"""Small pieces every OpenAI response shares: ids, usage, and a msgspec-encoded JSON response."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from starlette.responses import Response


class JSONResponse(Response):
    """JSON encoded by msgspec (several times faster than the stdlib encoder)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(generation: Any, object_name: str) -> dict[str, Any]:
    """The fields every completion response and stream chunk starts with."""
    return {
        "id": generation.request_id,
        "object": object_name,
        "created": generation.created,
        "model": generation.model.name,
    }


def full_response(generation: Any, object_name: str, choices: list) -> dict[str, Any]:
    """A whole (non-streamed) completion response."""
    return {
        **envelope(generation, object_name),
        "choices": choices,
        "usage": usage(generation.num_prompt_tokens, generation.num_generated_tokens),
        "system_fingerprint": None,
    }
