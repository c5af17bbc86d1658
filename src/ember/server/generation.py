"""The sequences of one HTTP request (prompts x n) as they come back from the engine: token ids
become text through an incremental detokenizer, stop strings end a sequence early (and abort it
in the engine), and finished sequences are recorded in the metrics.

The OpenAI layer above (`serving_completions`, `serving_chat`) only formats what `deltas`
yields; the engine client below only routes token ids.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ember.engine.step_types import RequestUpdate, TokenLogprobs
from ember.sampling_params import SamplingParams
from ember.server.config import QUEUE_FULL_RETRY_AFTER_S
from ember.server.engine_client import (
    EngineClient,
    EngineDeadError,
    QueueItem,
    RequestRejectedError,
)
from ember.server.errors import BadRequestError, QueueFullError, ServiceUnavailableError
from ember.server.inbox import Inbox
from ember.server.metrics import ServerMetrics
from ember.server.models import ServedModel
from ember.server.params import choice_params
from ember.server.prompts import Prompt
from ember.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class Sequence:
    """One choice: a prompt's i-th sample."""

    index: int
    request_id: str
    prompt: Prompt
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # The engine's prompt logprobs (None first), where asked; they come with the first update.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SequenceDelta:
    """What one sequence gained since the last delta: text, token ids and their logprobs."""

    sequence: Sequence
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False


class Generation:
    """Submits every sequence of a request and turns the engine's updates into deltas."""

    def __init__(
        self,
        client: EngineClient,
        model: ServedModel,
        metrics: ServerMetrics,
        prompts: list[Prompt],
        params: SamplingParams,
        n: int,
        request_id: str | None = None,
    ) -> None:
        self.client = client
        self.model = model
        self.metrics = metrics
        self.prompts = prompts
        self.request_id = request_id or uuid.uuid4().hex
        self.arrival = time.monotonic()
        self.created = int(time.time())
        self._inbox: Inbox[QueueItem] = Inbox()
        self.sequences = [
            self._sequence(prompt_index * n + i, prompt, choice_params(params, i))
            for prompt_index, prompt in enumerate(prompts)
            for i in range(n)
        ]
        self._num_unfinished = len(self.sequences)

    def _sequence(self, index: int, prompt: Prompt, params: SamplingParams) -> Sequence:
        detokenizer = IncrementalDetokenizer(
            self.model.tokenizer,
            prompt.token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        request_id = f"{self.request_id}-{index}"
        return Sequence(index, request_id, prompt, params, detokenizer)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens of the request, each prompt counted once whatever n is (as OpenAI)."""
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    def start(self, max_queue: int) -> None:
        """Submit every sequence, or none: 429 when the model's waiting queue would overflow."""
        waiting = self.client.num_waiting(self.model.name)
        if waiting + len(self.sequences) > max_queue:
            raise QueueFullError(
                f"the server has {waiting} requests waiting for {self.model.name} (the limit is "
                f"{max_queue}); retry later",
                headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
            )
        try:
            for sequence in self.sequences:
                self.client.submit(
                    sequence.request_id,
                    self.model.name,
                    sequence.prompt.token_ids,
                    sequence.params,
                    self._inbox,
                    sequence.index,
                )
        except EngineDeadError as exc:
            self.abort()
            raise ServiceUnavailableError(str(exc), code="engine_unavailable") from exc
        except ValueError as exc:  # parameters the engine's messages cannot carry
            self.abort()
            raise BadRequestError(str(exc)) from exc
        except BaseException:
            self.abort()  # all or nothing: no sequence of a failed request stays queued
            raise

    def abort(self) -> None:
        """Stop every unfinished sequence in the engine now (safe to call more than once)."""
        unfinished = [s for s in self.sequences if not s.finished]
        self.client.abort([s.request_id for s in unfinished])
        for sequence in unfinished:
            self._finish(sequence, "abort", None)

    async def deltas(self) -> AsyncIterator[list[SequenceDelta]]:
        """Batches of deltas, one per sequence that changed, until every sequence finished.

        Raises ServiceUnavailableError if the engine dies, BadRequestError if it rejects a
        sequence; the caller aborts the rest (`abort`).
        """
        while self._num_unfinished:
            items = await self._inbox.take()  # everything that is already there
            changed: dict[int, SequenceDelta] = {}
            for index, item in items:
                sequence = self.sequences[index]
                if sequence.finished:
                    continue  # a stop string ended it; updates already on the way are dropped
                if isinstance(item, EngineDeadError):
                    raise ServiceUnavailableError(str(item), code="engine_unavailable")
                if isinstance(item, RequestRejectedError):
                    if item.retry_after_s is not None:  # its model did not come up in time
                        retry = str(max(1, round(item.retry_after_s)))
                        raise ServiceUnavailableError(
                            str(item), code="model_unavailable", headers={"Retry-After": retry}
                        )
                    raise BadRequestError(str(item))
                delta = changed.setdefault(index, SequenceDelta(sequence))
                self._apply(sequence, item, delta)
            if changed:
                yield list(changed.values())

    def _apply(self, sequence: Sequence, update: RequestUpdate, delta: SequenceDelta) -> None:
        now = time.monotonic()
        if update.new_token_ids:  # a prompt scored without generating has no first token
            if sequence.first_token_at is None:
                sequence.first_token_at = now
            sequence.last_token_at = now
        if update.prompt_logprobs is not None:
            sequence.prompt_logprobs = update.prompt_logprobs
        sequence.token_ids.extend(update.new_token_ids)
        delta.token_ids.extend(update.new_token_ids)
        if sequence.params.logprobs is not None:
            new = [lp for lp in update.new_logprobs if lp is not None]
            sequence.logprobs.extend(new)
            delta.logprobs.extend(new)
        text = sequence.detokenizer.add(update.new_token_ids)
        if sequence.detokenizer.finished:
            # A stop string: the text is cut, the engine must stop generating.
            if update.finish_reason is None:
                self.client.abort([sequence.request_id])
            self._finish(sequence, "stop", sequence.detokenizer.stop_reason)
        elif update.finish_reason is not None:
            text += sequence.detokenizer.flush()
            last = update.new_token_ids[-1] if update.new_token_ids else None
            stop_token = last if last in sequence.params.stop_token_ids else None
            self._finish(sequence, update.finish_reason, stop_token)
        sequence.text += text
        delta.text += text
        delta.finished = sequence.finished

    def _finish(self, sequence: Sequence, reason: str, stop_reason: str | int | None) -> None:
        sequence.finish_reason = reason
        sequence.stop_reason = stop_reason
        self._num_unfinished -= 1
        self.metrics.observe_sequence(
            self.model.name,
            self.arrival,
            sequence.first_token_at,
            sequence.last_token_at,
            len(sequence.prompt.token_ids),
            len(sequence.token_ids),
            reason,
        )
