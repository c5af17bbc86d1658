"""The messages of one engine step: scheduler -> runner -> scheduler.

The scheduler and the runner share one process (a model instance): a new request reaches the
runner as the scheduler's own `Request`, which the runner reads (its tokens, how many are
computed, its parameters) and into which it records each sample; after that only diffs travel
(new KV blocks, requests to forget). Outputs are plain lists, never tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from ember.engine.request import Request


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must resume after a preemption), with its blocks."""

    request: Request
    block_ids: list[int]
    # Its windowed layers' table, where they have a pool of their own (else None).
    local_block_ids: list[int] | None = None


@dataclass
class CachedRequestData:
    request_id: str
    new_block_ids: Sequence[int]
    # Where this step gave blocks back (out of every layer's window, or the windowed layers'
    # own table): how many at the head of that table are released now, their entries the
    # scratch block; else 0.
    num_released_blocks: int = 0
    new_local_block_ids: Sequence[int] = ()


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # Tokens each scheduled request feeds this step, in batch order (decodes first).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Requests the runner must forget (finished, aborted or preempted since the last step).
    finished_request_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprob of the sampled (or, for prompt logprobs, the prompt's) token and of the top
    alternatives at one position; ``rank``: the token's (1: the most likely), where known."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass
class RunnerOutput:
    # Requests that sampled a token this step (prefill chunks that end mid-prompt sample nothing).
    request_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Requests whose prompt logprobs are complete, in `Request.prompt_logprobs`, with this
    # step's sample, their first (None: none this step).
    prompts_scored: dict[str, Request] | None = None


# A Struct encoded as an array, not a dataclass (a map with its field names): the front end
# decodes one per streamed token, and that way it costs less than half as much.
class RequestUpdate(msgspec.Struct, array_like=True):
    """What one request gained in a step, as reported to the caller of the engine."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    # With a request's first update, if it asked: None for the first prompt token, then one
    # entry per prompt token (`SamplingParams.prompt_logprobs`).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
