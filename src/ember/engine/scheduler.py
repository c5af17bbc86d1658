"""Continuous batching with chunked prefill under a per-step token budget.

The scheduler speaks in tokens per request, not in phases: each step it decides how many tokens
every request feeds (1 for a decode, up to the remaining budget for a prompt chunk). Running
decodes go first, then unfinished prompt chunks, then new requests. When the KV pool runs dry it
preempts the newest running request, freeing its blocks; it is recomputed later. It never touches
tensors.

Tokens sampled by a step the engine has not yet reported back are "pending"
(`Request.num_pending_tokens`): the scheduler may already schedule the decode that feeds them
(overlap of CPU and GPU), since the runner feeds sampled ids on the device. The runner records
each sample into its request when it comes back; `update` then decides what it means (a stop,
the length limit).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ember.config import StepLimits
from ember.engine.kv_cache_manager import KVCacheManager
from ember.engine.request import FinishReason, Request, RequestStatus
from ember.engine.step_types import (
    CachedRequestData,
    NewRequestData,
    RequestUpdate,
    RunnerOutput,
    SchedulerOutput,
)


@dataclass
class StepCounts:
    """What the scheduler has fed the model since it started: steps with prompt tokens (a
    chunk, or a preempted request's recomputation) and steps of decodes only, and the tokens
    of each kind (a decode feeds one). For /metrics: which kind of step a workload runs."""

    decode_only_steps: int = 0
    prefill_steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0


class Scheduler:
    def __init__(self, limits: StepLimits, kv_cache: KVCacheManager) -> None:
        self.limits = limits
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._known_to_runner: set[str] = set()
        self._runner_must_forget: set[str] = set()
        self.num_preemptions = 0
        self.step_counts = StepCounts()
        # Where a request's next full block ends, for the decode path's one comparison (a block
        # size beyond any sequence when nothing is cached: the comparison never holds).
        self._cache_block_size = kv_cache.block_size if kv_cache.prefix_caching else 1 << 62
        # How far a sliding window trails the next query (a lag beyond any sequence without
        # one): past it by a whole block, the block below goes back to the pool.
        window = kv_cache.release_window
        self._window_lag = window - 1 if window is not None else 1 << 62
        self._block_size = kv_cache.block_size

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """End a request now and free its blocks; False if it is unknown or already ended."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORT)
        return True

    def preempt_all(self) -> None:
        """Preempt every running request, oldest first in the waiting queue again (the model is
        going to sleep; each recomputes after it wakes)."""
        for request in reversed(list(self.running)):
            self._preempt(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.limits.max_num_batched_tokens
        prefill_tokens_before = self.step_counts.prefill_tokens

        # Decodes first, then the prompt chunks of running requests, each in arrival order.
        decodes, prefills = [], []
        for request in self.running:
            # `_is_decoding`, inlined: this runs for every request of every step.
            is_decoding = request.num_computed_tokens >= len(request.prompt_token_ids)
            (decodes if is_decoding else prefills).append(request)
        for request in decodes:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._feed_one_token(request, out):
                budget -= 1
            else:
                budget -= self._schedule_running(request, budget, out)
        for request in prefills:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue
            budget -= self._schedule_running(request, budget, out)

        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            request = self.waiting[0]
            cached = self.kv_cache.claim_cached_prefix(request)
            self.kv_cache.release_out_of_window(request)  # cached blocks its window has passed
            num_new = self._chunk_size(request, budget)
            new_blocks = self.kv_cache.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new
            )
            if new_blocks is None:
                if cached:  # given back; the cache keeps them
                    self.kv_cache.free(request)
                    request.num_computed_tokens = 0
                break  # no room: new work waits rather than preempting running work
            self.kv_cache.stats.record_admission(request.num_tokens, cached)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            local_ids = self.kv_cache.local_block_ids(request.request_id)
            out.new_requests.append(
                NewRequestData(
                    request,
                    list(self.kv_cache.block_ids(request.request_id)),
                    list(local_ids) if local_ids is not None else None,
                )
            )
            self._known_to_runner.add(request.request_id)
            self._commit(request, num_new, out)
            budget -= num_new
        # Sent last so that requests preempted in this very step are included; the runner drops
        # these before it adds this step's new requests.
        out.finished_request_ids, self._runner_must_forget = self._runner_must_forget, set()
        if out.num_scheduled_tokens:
            if self.step_counts.prefill_tokens > prefill_tokens_before:
                self.step_counts.prefill_steps += 1
            else:
                self.step_counts.decode_only_steps += 1
        return out

    def _feed_one_token(self, request: Request, out: SchedulerOutput) -> bool:
        """Schedule a decode's one token when it has exactly one to feed and a slot for it
        without preempting: `_schedule_running` and `_commit` for that case in one call, since
        it runs for most requests of most steps (`ember bench cpu-step`;
        bench/results/README.md, "Host path"). False: nothing was scheduled;
        `_schedule_running` decides."""
        request_id = request.request_id
        pending = request.num_pending_tokens
        num_output = len(request.output_token_ids)
        computed = request.num_computed_tokens
        if (
            num_output + pending >= request.max_tokens
            or len(request.prompt_token_ids) + num_output + pending - computed != 1
        ):
            return False
        if computed >= (request.num_cached_blocks + 1) * self._cache_block_size:
            self.kv_cache.cache_full_blocks(request)  # a block filled: keep it for later requests
        new_blocks = self.kv_cache.allocate_slots(request_id, computed + 1)
        if new_blocks is None:
            return False
        released = 0
        if computed - self._window_lag >= (request.num_released_blocks + 1) * self._block_size:
            released = self.kv_cache.release_out_of_window(request)
        out.cached_requests.append(
            CachedRequestData(request_id, new_blocks.main, released, new_blocks.local)
        )
        out.num_scheduled_tokens[request_id] = 1
        self.step_counts.decode_tokens += 1
        request.num_computed_tokens = computed + 1
        request.num_pending_tokens = pending + 1  # it now feeds every token it knows
        return True

    def _schedule_running(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedule one running request, preempting others if blocks run out; tokens used."""
        num_new = self._chunk_size(request, budget)
        if num_new <= 0:
            return 0
        self.kv_cache.cache_full_blocks(request)
        released = self.kv_cache.release_out_of_window(request)
        while True:
            new_blocks = self.kv_cache.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new
            )
            if new_blocks is not None:
                break
            victim = self._preemption_victim(out)
            if victim is None or victim is request:
                self._preempt(request)
                return 0
            self._preempt(victim)
        out.cached_requests.append(
            CachedRequestData(request.request_id, new_blocks.main, released, new_blocks.local)
        )
        self._commit(request, num_new, out)
        return num_new

    def _commit(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        out.num_scheduled_tokens[request.request_id] = num_new
        # Decodes take `_feed_one_token` in the common case; this counts the rest.
        if num_new == 1 and self._is_decoding(request):
            self.step_counts.decode_tokens += 1
        else:
            self.step_counts.prefill_tokens += num_new
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_known_tokens:
            request.num_pending_tokens += 1  # this step samples its next token

    def _is_decoding(self, request: Request) -> bool:
        return request.num_computed_tokens >= request.num_prompt_tokens

    def _chunk_size(self, request: Request, budget: int) -> int:
        if len(request.output_token_ids) + request.num_pending_tokens >= request.max_tokens:
            return 0  # its last token is on the way; nothing more to feed
        remaining = request.num_known_tokens - request.num_computed_tokens
        limit = self.limits.long_prefill_token_threshold or budget
        return max(0, min(remaining, budget, limit))

    def _preemption_victim(self, out: SchedulerOutput) -> Request | None:
        for candidate in reversed(self.running):
            if candidate.request_id not in out.num_scheduled_tokens:
                return candidate
        return None

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and queue it for recomputation from scratch."""
        self.running.remove(request)
        self.kv_cache.free(request)
        self._forget_in_runner(request.request_id)
        request.num_pending_tokens = 0  # a sample in flight is dropped: it is recomputed
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- results of a step ---------------------------------------------------------------------

    def update(self, scheduled: SchedulerOutput, result: RunnerOutput) -> list[RequestUpdate]:
        """Finish the requests a step's samples end (the runner has recorded them in their
        requests) and report what changed."""
        updates = []
        # Locals: this loop runs for every request of every step.
        requests, running = self.requests, RequestStatus.RUNNING
        logprobs = result.logprobs or None
        for i, (request_id, token_id) in enumerate(
            zip(result.request_ids, result.sampled_token_ids, strict=True)
        ):
            request = requests.get(request_id)
            if request is None or request.status is not running:
                continue  # aborted or preempted while the step ran: its token was dropped
            reason = request.stop_reason_after(token_id)
            if reason is not None:
                self._finish(request, reason)
            updates.append(
                RequestUpdate(
                    request_id=request_id,
                    new_token_ids=[token_id],
                    new_logprobs=[logprobs[i] if logprobs else None],
                    finish_reason=reason.value if reason else None,
                    num_prompt_tokens=len(request.prompt_token_ids),
                )
            )
        if result.prompts_scored:
            _attach_prompt_logprobs(updates, result.prompts_scored)
        return updates

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        self._forget_in_runner(request.request_id)
        del self.requests[request.request_id]

    def _forget_in_runner(self, request_id: str) -> None:
        if request_id in self._known_to_runner:
            self._known_to_runner.discard(request_id)
            self._runner_must_forget.add(request_id)

    def check_invariants(self) -> None:
        """Blocks are held only by live requests and none is lost (AssertionError if not)."""
        self.kv_cache.check_invariants(set(self.requests))
        if not self.requests:
            assert self.kv_cache.num_free_blocks == self.kv_cache.pool.capacity
            local = self.kv_cache.local_pool
            assert local is None or local.num_free == local.capacity


def _attach_prompt_logprobs(updates: list[RequestUpdate], scored: dict[str, Request]) -> None:
    """Give the first update of each request in ``scored`` its prompt logprobs; a prompt-only
    request (max_tokens 0) reports no token: the one its prefill sampled is dropped."""
    for update in updates:
        request = scored.get(update.request_id)
        if request is None:
            continue
        update.prompt_logprobs = [None, *request.prompt_logprobs]
        if request.params.max_tokens == 0:
            update.new_token_ids, update.new_logprobs = [], []
