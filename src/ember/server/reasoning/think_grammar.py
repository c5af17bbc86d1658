"""A constraint on the answer of a `<think>` reply, as one grammar of the whole reply: the
reasoning free, then the answer held to the constraint.

The grammar takes the shape `ThinkReader` reads: where the reply starts inside the block, any
text up to `</think>` (a `<think>` first is allowed, as a model may write it again); else an
optional block that opens with `<think>`. A few line breaks or spaces may follow `</think>`
(Qwen3 writes two line breaks) before the answer. The reasoning may not hold a special token,
nor end the reply: only `</think>` ends it.
"""

from __future__ import annotations

from ember.server.reasoning.think import CLOSE, OPEN, ThinkTags
from ember.structured_output.lark import AddedTokenId, exact_marker, nested, text_until

# Between </think> and the answer: bounded, so that whitespace cannot run on forever.
_AFTER_CLOSE = r"/[ \t\r\n]{0,8}/"


def after_thinking(answer: str, tags: ThinkTags, added_token_id: AddedTokenId) -> str:
    """The Lark grammar of a reply whose answer follows ``answer`` (a whole Lark grammar) after
    its reasoning, with the markers as ``added_token_id`` (the tokenizer's) has them."""
    open_ = exact_marker(OPEN, added_token_id)
    if tags.starts_inside:
        start = f"start: {open_}? thinking answer\n"
    else:
        start = f"start: ({open_} thinking)? answer\n"
    return (
        start
        + f"thinking: reasoning {_AFTER_CLOSE}\n"
        + text_until("reasoning", CLOSE, added_token_id)
        + nested("answer", answer)
    )
