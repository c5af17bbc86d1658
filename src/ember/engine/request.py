"""A request as the engine tracks it: its tokens, how many are in the KV cache, its state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ember.engine.step_types import TokenLogprobs
    from ember.structured_output.matcher import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token, or (decided by the front end) a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    """One sequence to generate. `seed` is always set: unseeded requests get a random one."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # Samples of launched steps not yet recorded: the one count of tokens in flight. The
    # scheduler adds one when it schedules a step that samples; the runner takes it back as it
    # records the sample (`record_sample`), and the scheduler clears it when it preempts.
    num_pending_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Prompt tokens 1.. scored so far, where `params.prompt_logprobs` asks (the runner fills it
    # as it collects steps; kept across a preemption, so no position is scored twice).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Prefix caching (`ember.engine.kv_cache_manager`): the keys of the request's full blocks
    # computed so far (they depend on its tokens only, so they survive a preemption), and how
    # many blocks at the head of its current table are in the cache.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    # Blocks at the head of its table given back because every layer's window has passed
    # them (`KVCacheManager.release_out_of_window`): their entries point at the scratch block.
    num_released_blocks: int = 0
    # Where `params.structured_outputs` asks: the grammar, which the runner brings up to date
    # with the recorded outputs as it collects each step.
    grammar: GrammarMatcher | None = None

    def record_sample(self, token_id: int) -> None:
        """A launched step's sample has come back: it becomes an output token."""
        self.output_token_ids.append(token_id)
        self.num_pending_tokens -= 1

    @property
    def num_known_tokens(self) -> int:
        """Tokens including samples still on their way back."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def stop_reason_after(self, token_id: int) -> FinishReason | None:
        """Why generation ends once `token_id` has been appended, or None to go on."""
        if self.grammar is not None and self.grammar.terminated:
            return FinishReason.STOP  # the grammar is complete: nothing may follow
        n_out = len(self.output_token_ids)
        if n_out >= self.max_tokens:
            return FinishReason.LENGTH
        if n_out < self.params.min_tokens:
            return None
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if token_id in self.params.stop_token_ids:
            return FinishReason.STOP
        return None
