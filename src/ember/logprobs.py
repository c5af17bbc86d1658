"""Prompt logprobs in vLLM's shape, for the offline API and the completions endpoint's
`prompt_logprobs` field: None for the first prompt token (nothing comes before it), then per
token a dict {token id: Logprob} holding the token itself and its top alternatives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ember.engine.step_types import TokenLogprobs


@dataclass
class Logprob:
    """One token's logprob at a position, its rank there (1: the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def prompt_logprob_dicts(
    entries: list[TokenLogprobs | None],
    token_text: Callable[[int], str],
    top_k: int | None = None,
) -> list[dict[int, Logprob] | None]:
    """vLLM's `prompt_logprobs` from the engine's entries; ``top_k``: how many alternatives to
    keep (None: all the engine gave)."""
    result: list[dict[int, Logprob] | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        top = entry.top if top_k is None else entry.top[:top_k]
        token = {entry.token_id: Logprob(entry.logprob, entry.rank, token_text(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(top, start=1):
            token.setdefault(token_id, Logprob(logprob, rank, token_text(token_id)))
        result.append(token)
    return result
