"""The special tokens of gpt-oss's "harmony" format, and whether a tokenizer has them.

A harmony message is ``<|start|>{role}[ to={recipient}]<|channel|>{channel}[ to={recipient}]
[ <|constrain|>{type}]<|message|>{text}`` ended by ``<|end|>``, by ``<|return|>`` (the final
answer: generation is over) or by ``<|call|>`` (a tool call: generation waits for its result).
The engine reads this module for the stop tokens, the server for its reply parser.
"""

from __future__ import annotations

from collections.abc import Callable

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"
END_OF_TEXT = "<|endoftext|>"

# The tokens that say a vocabulary is harmony's (o200k_harmony has every one as one token).
_SIGNATURE = (START, END, MESSAGE, CHANNEL, RETURN, CALL)
# The tokens after which an assistant's turn is over.
STOP_TOKENS = (RETURN, CALL)


def harmony_token_ids(added_token_id: Callable[[str], int | None]) -> dict[str, int] | None:
    """The harmony tokens' ids, or None when the vocabulary lacks any of them;
    ``added_token_id``: the tokenizer's (the id of a text that is one added token)."""
    ids = {text: added_token_id(text) for text in _SIGNATURE}
    if any(token_id is None for token_id in ids.values()):
        return None
    return ids  # type: ignore[return-value]


def harmony_stop_token_ids(added_token_id: Callable[[str], int | None]) -> tuple[int, ...]:
    """``<|return|>`` and ``<|call|>`` of a harmony vocabulary (both end generation, whatever
    generation_config.json lists); () for any other vocabulary."""
    ids = harmony_token_ids(added_token_id)
    return () if ids is None else tuple(ids[text] for text in STOP_TOKENS)
