"""Which served models have their chat replies read as harmony: those named so by a flag
(vLLM's names: --reasoning-parser openai_gptoss, --tool-call-parser openai), and every model
whose tokenizer has harmony's special tokens (gpt-oss's o200k_harmony), whatever other parser
a flag names (flags apply to every model of a server: they must not break the gpt-oss among
them)."""

from __future__ import annotations

from collections.abc import Callable

from ember.server.reasoning.selection import HARMONY_REASONING_PARSER
from ember.server.tool_calls.registry import HARMONY_PARSER
from ember.tokenizer.harmony import harmony_token_ids


def uses_harmony(
    reasoning_parser: str | None,
    tool_call_parser: str | None,
    added_token_id: Callable[[str], int | None],
) -> bool:
    """Whether a model's replies are harmony: a flag says so, or its vocabulary does (the
    architecture alone does not: a tokenizer without the tokens cannot write the format)."""
    if reasoning_parser == HARMONY_REASONING_PARSER or tool_call_parser == HARMONY_PARSER:
        return True
    return harmony_token_ids(added_token_id) is not None
