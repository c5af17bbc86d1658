"""Builds a step's inputs from the scheduler's decision, runs the model, samples.

The runner keeps, for every running request, what the GPU needs of it (its block table) and
which launched step holds its newest sample; everything else it reads from the scheduler's own
`Request` (tokens, computed count, parameters, the one count of samples in flight). It records
each sample into its request as it comes back; it never decides policy.

A step is `launch` (stage inputs, enqueue the forward pass and sampling, start an async copy of
the sampled ids to host memory) then `collect` (wait for that copy, hand back plain lists). The
engine launches step N+1 before it collects step N: a decode that feeds a token sampled in step N
reads it on the device (`gather_src` -> `gather_dst`), so the CPU never waits for it.

Rows with a grammar (structured output) draw under a mask of the tokens it allows: once the
forward pass is enqueued, the step in flight is collected (each grammar consumes its newest
sample), the masks are filled on the CPU while the GPU computes, and the sampler applies them.
Steps without such rows do none of this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ember.config import StepLimits
from ember.engine.kv_cache_manager import SCRATCH_BLOCK
from ember.engine.request import Request, RequestStatus
from ember.engine.step_types import RunnerOutput, SchedulerOutput, TokenLogprobs
from ember.layers.attention import AttentionBackend, StagedAttention
from ember.layers.forward_context import ForwardContext, step_context
from ember.parallel.shard_step import ShardStep, staged_runs
from ember.runner.cuda_graphs import GraphKey, StepGraphs
from ember.runner.input_buffers import InputBlock, InputBuffers
from ember.runner.prompt_scoring import PromptScoring, StepScores, plan_scores
from ember.runner.sampler import Sampler
from ember.structured_output.matcher import GrammarError

if TYPE_CHECKING:
    from ember.parallel.workers import StepPeers
    from ember.structured_output.bitmask import GrammarMasks, TokenMask

logger = logging.getLogger(__name__)


class RunningRequest:
    """The runner's view of one request it was handed: the request itself, its block table as
    an array, and the launched step whose sample is the request's newest token (with its row).
    It is also the sampler's row for the request (`ember.runner.sampler.SamplingRow`)."""

    __slots__ = (
        "block_array",
        "block_ids",
        "local_block_array",
        "local_block_ids",
        "pending_row",
        "pending_step",
        "request",
        "stop_ids_until_min_tokens",
    )

    def __init__(
        self,
        request: Request,
        block_ids: list[int],
        stop_ids: tuple[int, ...],
        local_block_ids: list[int] | None = None,
    ) -> None:
        self.request = request
        self.block_ids: list[int] = []
        self.block_array = np.zeros(0, np.int32)
        # The windowed layers' own table, where they have a pool of their own.
        self.local_block_ids: list[int] | None = None
        self.local_block_array = np.zeros(0, np.int32)
        if local_block_ids is not None:
            self.local_block_ids = []
            self.add_local_blocks(local_block_ids)
        # Masked until min_tokens: EOS and the request's stop ids.
        self.stop_ids_until_min_tokens = stop_ids + tuple(request.params.stop_token_ids)
        self.pending_step: StepHandle | None = None
        self.pending_row = 0
        self.add_blocks(block_ids)

    def add_blocks(self, block_ids: list[int]) -> None:
        self.block_ids.extend(block_ids)
        self.block_array = np.asarray(self.block_ids, dtype=np.int32)  # copied into block tables

    def add_local_blocks(self, block_ids: Sequence[int]) -> None:
        self.local_block_ids.extend(block_ids)
        self.local_block_array = np.asarray(self.local_block_ids, dtype=np.int32)

    def release_blocks(self, count: int) -> None:
        """The ``count`` blocks at the head of the table that gives blocks back (the local
        one, else the only one) are back in their pool: their entries point at the scratch
        block."""
        if self.local_block_ids is not None:
            self.local_block_ids[:count] = [SCRATCH_BLOCK] * count
            self.local_block_array = np.asarray(self.local_block_ids, dtype=np.int32)
            return
        self.block_ids[:count] = [SCRATCH_BLOCK] * count
        self.block_array = np.asarray(self.block_ids, dtype=np.int32)

    # The sampler's row.
    @property
    def params(self):
        return self.request.params

    @property
    def seed(self) -> int:
        return self.request.seed

    @property
    def step(self) -> int:
        """Tokens generated before the sample now being drawn (counted in flight already)."""
        request = self.request
        return len(request.output_token_ids) + request.num_pending_tokens - 1

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids


@dataclass(eq=False)
class StepHandle:
    """A launched step: what it sampled for whom, and where the ids will land on the host."""

    states: list[RunningRequest]
    tokens: torch.Tensor | None  # device
    host_tokens: torch.Tensor | None  # pinned on CUDA
    done: torch.cuda.Event | None
    logprobs: list[TokenLogprobs | None] | None
    result: RunnerOutput | None = None
    scores: StepScores | None = None  # prompt logprobs this step computed
    grammar_states: list[RunningRequest] | None = None  # rows that drew under a grammar


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attention: AttentionBackend,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        block_size: int,
        sampler: Sampler,
        stop_ids_until_min_tokens: tuple[int, ...],
        limits: StepLimits,
        use_cuda_graphs: bool,
        mixed_cuda_graphs: bool = True,
        compile_ahead: Callable[..., AbstractContextManager] | None = None,
        peers: StepPeers | None = None,
        local_layers: frozenset[int] = frozenset(),
    ) -> None:
        """``limits``: the instance's step limits, with ``max_model_len`` resolved;
        ``compile_ahead``: the ops' (`Ops.compile_ahead`), for `compile_kernels`; ``peers``:
        the other tensor-parallel ranks, sent each step's inputs as it launches (None: the
        model runs here alone); ``local_layers``: the windowed layers whose K/V sit in a pool
        of their own (`ember.engine.model_plan.ModelPlan.kv_local_layers`)."""
        self.peers = peers
        self.compile_ahead = compile_ahead
        self.model = model
        self.attention = attention
        self.kv_cache = kv_cache
        self.cos_sin_cache = cos_sin_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = kv_cache.device
        self.stop_ids_until_min_tokens = stop_ids_until_min_tokens
        self.limits = limits
        self.states: dict[str, RunningRequest] = {}
        # Requests whose prompt logprobs are still being computed (empty unless one asks).
        self._scoring: dict[str, PromptScoring] = {}
        # Requests with a grammar (structured output), their masks' buffers (made with the
        # first), and the requests whose grammar refused a sample (`take_grammar_failures`).
        self._structured: set[str] = set()
        self._grammar_masks: GrammarMasks | None = None
        self._grammar_failures: list[tuple[str, str]] = []
        self.local_layers = local_layers
        self.buffers = InputBuffers(
            limits, block_size, self.device, attention, local=bool(local_layers)
        )
        self.graphs = None
        if use_cuda_graphs and self.device.type == "cuda":
            self.graphs = StepGraphs(
                model,
                self.buffers,
                attention,
                kv_cache,
                cos_sin_cache,
                limits,
                mixed=mixed_cuda_graphs,
                local_layers=local_layers,
            )
        self._in_flight: StepHandle | None = None

    def capture_graphs(self, compile_workers: int = 0) -> int:
        """Capture every graph bucket now, so no request pays for a capture; returns the count.

        Each capture runs over an empty step padded to the bucket, exactly as a real step is
        padded: capture records addresses, but its warm-up pass must read valid indices. With
        ``compile_workers``, `compile_kernels` runs first. What a step launches outside its
        graph runs once after the captures, so its kernels are loaded before a request.
        """
        if self.graphs is None:
            return 0
        if compile_workers > 0:
            self.compile_kernels(compile_workers)
        with torch.inference_mode():
            for key in self.graphs.all_keys:
                self._stage_empty_step(key)
                self.graphs.capture(key)
            self._warm_eager_launches()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the warm-up's staged rows are copied out
        return len(self.graphs.captured)

    def compile_kernels(self, workers: int) -> None:
        """Compile the kernels of every graph's step, and those a step runs outside its graph,
        on ``workers`` threads (`ember.kernels.compile_ahead`). The pass's outputs are thrown
        away, so it may run while the weights are still loading. A failure here only costs the
        speed-up: the captures' warm-ups compile whatever is missing, one by one (and raise if
        a kernel really does not compile)."""
        if self.graphs is None or workers <= 0 or self.compile_ahead is None:
            return
        started = time.perf_counter()
        counts = self.graphs.compile_counts
        try:
            with torch.inference_mode(), self.compile_ahead(workers, counts):
                for key in self.graphs.all_keys:
                    self._stage_empty_step(key)
                    self.graphs.forward_for_launches(key)
                self._warm_eager_launches()
        except Exception:
            logger.warning(
                "compiling ahead failed; each kernel compiles at its first launch", exc_info=True
            )
        if self.device.type == "cuda":
            # The pass's own GEMMs, timed with it; not the device, whose other streams may be
            # copying weights meanwhile.
            torch.cuda.current_stream(self.device).synchronize()
        self.graphs.compile_seconds = time.perf_counter() - started

    def _warm_eager_launches(self) -> None:
        """Launch, at every row count, what a step runs outside its graph: a mixed step's logits
        projection (its GEMM's tiles follow the row count) and the sampler's kernels
        (`Sampler.warm_up`). A kernel first compiled at a step stalls the whole batch."""
        weight = next(self.model.parameters())
        max_rows = self.limits.max_num_seqs
        hidden = torch.zeros(
            max_rows, self.model.cfg.hidden_size, dtype=weight.dtype, device=self.device
        )
        for rows in range(1, max_rows + 1):
            self.model.compute_logits(hidden[:rows])
        self.sampler.warm_up(weight.dtype)

    def _stage_empty_step(self, key: GraphKey) -> None:
        """Upload an empty step padded to the graph ``key``."""
        block = self.buffers.block(key.decode)
        staging = block.next_staging()
        staging.numpy("query_start_loc")[0] = 0
        padded = self._pad_for_graph(staging, _StepPlan(local=bool(self.local_layers)), key)
        block.upload(staging, padded.upload_counts)

    # -- the step ---------------------------------------------------------------------------------

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """Launch and collect one step (no overlap)."""
        return self.collect(self.launch(scheduled))

    def launch(self, scheduled: SchedulerOutput) -> StepHandle:
        self._apply_diffs(scheduled)
        if scheduled.is_empty:
            return StepHandle([], None, None, None, None, result=RunnerOutput())
        with torch.inference_mode():
            handle = self._launch(scheduled)
        self._in_flight = handle
        return handle

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step and return its samples (idempotent)."""
        if handle.result is not None:
            return handle.result
        if handle.done is not None:
            handle.done.synchronize()  # a blocking-sync event: the thread sleeps, no spinning
        token_list = handle.host_tokens.tolist()
        ids, tokens, logprobs = [], [], []
        states, running = self.states, RequestStatus.RUNNING
        for i, state in enumerate(handle.states):
            if state.pending_step is handle:
                state.pending_step = None
            request = state.request
            if states.get(request.request_id) is not state or request.status is not running:
                continue  # finished or preempted while the step ran: its sample is stale
            request.record_sample(token_list[i])
            ids.append(request.request_id)
            tokens.append(token_list[i])
            logprobs.append(handle.logprobs[i] if handle.logprobs else None)
        handle.result = RunnerOutput(ids, tokens, logprobs if handle.logprobs else [])
        if handle.grammar_states:
            self._advance_grammars(handle.grammar_states)
        if handle.scores is not None:
            self._record_scores(handle.scores, handle.result)
        if self._in_flight is handle:
            self._in_flight = None
        return handle.result

    def _launch(self, scheduled: SchedulerOutput) -> StepHandle:
        buf = self.input_block(scheduled)
        staging = buf.next_staging()
        plan = self._stage_inputs(scheduled, staging)
        prev = self._in_flight
        if prev is not None and any(s.request.params.uses_penalties for s in plan.sampling_states):
            self.collect(prev)  # penalties need the whole output history on the host
        rows = plan.sampling_states
        bucket = self._graph_bucket(plan, buf)
        padded = self._pad_for_graph(staging, plan, bucket) if bucket is not None else plan
        buf.upload(staging, padded.upload_counts)
        if self.peers is not None:
            self.peers.send(self._shard_step(buf, staging, padded))
        if plan.num_gathers:
            self._gather_fed_tokens(buf, staging, plan.num_gathers, prev.tokens)
            if self.peers is not None:  # the other ranks' fed tokens, from this device
                self.model.parallel.broadcast(buf["input_ids"][: plan.num_tokens])
        num_samples = len(plan.sampling_states)
        if bucket is not None and bucket.decode:
            logits = self.graphs.replay(bucket)[:num_samples]
        else:
            if bucket is not None:
                rows_hidden = self.graphs.replay(bucket)
            else:
                hidden = self.model(
                    buf["input_ids"][: plan.num_tokens],
                    self._context(plan, buf),
                    self.cos_sin_cache,
                    self.kv_cache,
                )
                if plan.scores is not None:  # prompt logprobs, from every row they need
                    plan.scores.compute(self.model, hidden, self.limits.max_num_seqs)
                rows_hidden = hidden.index_select(0, buf["sample_indices"][:num_samples])
            if not num_samples:
                return self._unsampled_step(plan.scores)
            logits = self.model.compute_logits(rows_hidden[:num_samples])
        mask = grammar_states = None
        if self._structured:  # rare: rows that draw under a grammar
            mask, grammar_states = self._grammar_masks_for(rows, prev)
        tokens, logprobs = self.sampler(logits, rows, mask)
        host_tokens, done = self._copy_to_host(tokens, staging)
        handle = StepHandle(
            plan.sampling_states,
            tokens,
            host_tokens,
            done,
            logprobs,
            scores=plan.scores,
            grammar_states=grammar_states,
        )
        for i, state in enumerate(plan.sampling_states):
            state.pending_step, state.pending_row = handle, i
        return handle

    def _shard_step(self, buf: InputBlock, staging, plan: _StepPlan) -> ShardStep:
        """What the other tensor-parallel ranks need to run the step staged in ``staging``."""
        counts = plan.upload_counts
        return ShardStep(
            decode=buf is self.buffers.decode,
            runs=staged_runs(buf, staging, counts),
            counts=counts,
            num_tokens=plan.num_tokens,
            num_seqs=plan.num_seqs,
            max_query_len=plan.max_query_len,
            max_seq_len=plan.max_seq_len,
            attention=plan.attention,
            num_gathers=plan.num_gathers,
            num_samples=len(plan.sampling_states),
            score_rows=plan.scores.rows if plan.scores is not None else None,
            max_score_rows=self.limits.max_num_seqs,
        )

    def _grammar_masks_for(
        self, rows: list[RunningRequest], prev: StepHandle | None
    ) -> tuple[TokenMask | None, list[RunningRequest] | None]:
        """The masks of the sampling ``rows`` that have a grammar, and those rows (None, None:
        no row has one). Called once the forward pass is enqueued: the step in flight is
        collected first, so each grammar has consumed its request's newest sample."""
        indices = [i for i, state in enumerate(rows) if state.request.grammar is not None]
        if not indices:
            return None, None
        if prev is not None:
            self.collect(prev)
        states = [rows[i] for i in indices]
        grammars = [state.request.grammar for state in states]
        if self._grammar_masks is None:
            from ember.structured_output.bitmask import GrammarMasks

            self._grammar_masks = GrammarMasks(
                grammars[0].vocab_size, self.limits.max_num_seqs, self.device
            )
        return self._grammar_masks.fill(grammars, indices, len(rows)), states

    def _advance_grammars(self, states: list[RunningRequest]) -> None:
        """Bring the grammars of a collected step's rows up to date with their requests'
        recorded outputs (a dropped sample was not recorded, so it is not consumed); a grammar
        that refuses its sample fails its request alone."""
        for state in states:
            request = state.request
            try:
                request.grammar.catch_up(request.output_token_ids)
            except GrammarError as exc:
                logger.warning("%s: its grammar refused a sample: %s", request.request_id, exc)
                self._grammar_failures.append(
                    (request.request_id, f"structured output failed: {exc}")
                )

    def take_grammar_failures(self) -> list[tuple[str, str]]:
        """The requests whose grammar refused a sample since the last call, with why: they
        must end (`ModelInstance.step` aborts them)."""
        failures, self._grammar_failures = self._grammar_failures, []
        return failures

    def _unsampled_step(self, scores: StepScores | None) -> StepHandle:
        """A step of prompt chunks that sample nothing: done at once, unless it computed
        prompt logprobs, which come back when it is collected."""
        if scores is None:
            return StepHandle([], None, None, None, None, result=RunnerOutput())
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event(blocking=True)
            done.record()
        return StepHandle([], None, torch.empty(0, dtype=torch.long), done, None, scores=scores)

    def _record_scores(self, scores: StepScores, result: RunnerOutput) -> None:
        """Record a collected step's prompt logprobs into their requests, and hand over those
        whose prompt is now scored with their first sample. Rows of a request that ended or
        was handed over again while the step ran are dropped with its sample."""

        def current(state: RunningRequest) -> bool:
            request = state.request
            return (
                self.states.get(request.request_id) is state
                and request.status is RequestStatus.RUNNING
            )

        if scores.segments:
            for (state, _, _), entries in zip(scores.segments, scores.entries()):
                if current(state):
                    state.request.prompt_logprobs.extend(entries)
        for state in scores.completing:
            if current(state):
                result.prompts_scored = result.prompts_scored or {}
                result.prompts_scored[state.request.request_id] = state.request

    def input_block(self, scheduled: SchedulerOutput) -> InputBlock:
        """Where the step's inputs go: the decode block when every sequence feeds one token."""
        one_token = all(n == 1 for n in scheduled.num_scheduled_tokens.values())
        return self.buffers.block(decode=one_token)

    @staticmethod
    def _gather_fed_tokens(buf: InputBlock, staging, count: int, sampled: torch.Tensor) -> None:
        """Write the tokens sampled by the step in flight into this step's ``input_ids``, on the
        device. In a steady decode row i feeds row i: one copy instead of a gather kernel and
        a scatter kernel."""
        dst, src = staging.numpy("gather_dst")[:count], staging.numpy("gather_src")[:count]
        rows = np.arange(count)
        if np.array_equal(dst, rows) and np.array_equal(src, rows):
            buf["input_ids"][:count].copy_(sampled[:count])
            return
        index = buf["gather_dst"][:count]
        buf["input_ids"].index_copy_(0, index, sampled.index_select(0, buf["gather_src"][:count]))

    def _copy_to_host(self, tokens: torch.Tensor, staging):
        if self.device.type != "cuda":
            return tokens, None
        # This staging set is reused two steps later, after this step has been collected.
        host = staging.sampled[: tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event(blocking=True)
        done.record()
        return host, done

    # -- inputs -----------------------------------------------------------------------------------

    def _apply_diffs(self, scheduled: SchedulerOutput) -> None:
        states = self.states
        for request_id in scheduled.finished_request_ids:
            states.pop(request_id, None)
        if self._scoring:
            for request_id in scheduled.finished_request_ids:
                self._scoring.pop(request_id, None)
        if self._structured:
            self._structured.difference_update(scheduled.finished_request_ids)
        for new in scheduled.new_requests:
            state = RunningRequest(
                new.request, new.block_ids, self.stop_ids_until_min_tokens, new.local_block_ids
            )
            states[new.request.request_id] = state
            if new.request.params.prompt_logprobs is not None:
                self._start_scoring(state)
            if new.request.grammar is not None:
                self._structured.add(new.request.request_id)
        for cached in scheduled.cached_requests:
            if cached.num_released_blocks:
                states[cached.request_id].release_blocks(cached.num_released_blocks)
            if cached.new_block_ids:
                states[cached.request_id].add_blocks(cached.new_block_ids)
            if cached.new_local_block_ids:
                states[cached.request_id].add_local_blocks(cached.new_local_block_ids)

    def _start_scoring(self, state: RunningRequest) -> None:
        """Compute the prompt logprobs of a request that asks, from where an earlier run of it
        stopped (a preemption), unless its first sample, which carried them, is in."""
        request = state.request
        if request.output_token_ids:
            return
        if request.prompt_logprobs is None:
            request.prompt_logprobs = []
        self._scoring[request.request_id] = PromptScoring(state, len(request.prompt_logprobs))

    def _stage_inputs(self, scheduled: SchedulerOutput, st) -> _StepPlan:
        """Write the step's inputs into the staging set ``st``. The loop runs once per request
        per step, so it collects per-sequence values and decode tokens in lists and writes
        each array with one numpy assignment: item by item, numpy's writes (~70 ns each, seven
        a decode) cost as much as the rest of the loop (`ember bench cpu-step`;
        bench/results/README.md, "Host path")."""
        bs = self.block_size
        ids, pos, slots = st.numpy("input_ids"), st.numpy("positions"), st.numpy("slot_mapping")
        tables = st.numpy("block_tables")
        plan = _StepPlan(local=bool(self.local_layers))
        states, sampling_states = self.states, plan.sampling_states
        seq_ends, token_ends, sample_rows = [], [], []  # per sequence; per sampled sequence
        gather_dst, gather_src = [], []  # rows whose token is still on the device
        decode_rows, decode_pos, decode_slots = [], [], []  # per decode token
        id_rows, id_values = [], []  # decode tokens known on the host
        t = max_query_len = 0  # over the chunks; a decode's is 1
        for s, (request_id, n) in enumerate(scheduled.num_scheduled_tokens.items()):
            state = states[request_id]
            request = state.request
            end = request.num_computed_tokens  # the scheduler has counted this step's tokens
            start = end - n
            prompt, outputs = request.prompt_token_ids, request.output_token_ids
            num_prompt = len(prompt)
            known = num_prompt + len(outputs)  # on the host
            if end > known:  # the last token fed was sampled by the step still in flight
                gather_dst.append(t + n - 1)
                gather_src.append(state.pending_row)
            if n == 1:  # a decode
                if end <= known:
                    id_rows.append(t)
                    id_values.append(
                        prompt[start] if start < num_prompt else outputs[start - num_prompt]
                    )
                decode_rows.append(t)
                decode_pos.append(start)
                decode_slots.append(state.block_ids[start // bs] * bs + start % bs)
            else:
                host_end = min(end, known)
                ids[t : t + host_end - start] = _token_range(prompt, outputs, start, host_end)
                p = np.arange(start, end)
                pos[t : t + n] = p
                slots[t : t + n] = state.block_array[p // bs].astype(np.int64) * bs + p % bs
                max_query_len = max(max_query_len, n)
            block_array = state.block_array
            tables[s, : len(block_array)] = block_array
            t += n
            seq_ends.append(end)
            token_ends.append(t)
            if end == known + (state.pending_step is not None):  # it feeds every known token
                sample_rows.append(t - 1)
                sampling_states.append(state)
        num_seqs = len(seq_ends)
        st.numpy("query_start_loc")[: num_seqs + 1] = [0, *token_ends]
        st.numpy("seq_lens")[:num_seqs] = seq_ends
        st.numpy("sample_indices")[: len(sample_rows)] = sample_rows
        st.numpy("gather_dst")[: len(gather_dst)] = gather_dst
        st.numpy("gather_src")[: len(gather_src)] = gather_src
        _scatter(pos, decode_rows, decode_pos, t)
        _scatter(slots, decode_rows, decode_slots, t)
        _scatter(ids, id_rows, id_values, t)
        plan.num_gathers = len(gather_dst)
        plan.max_query_len = max(max_query_len, 1) if decode_rows else max_query_len
        plan.max_seq_len = max(seq_ends, default=0)
        plan.num_tokens, plan.num_seqs = t, num_seqs
        if self._scoring:  # rare: which rows give which prompt logprobs
            plan.scores = plan_scores(self._scoring, scheduled, token_ends, seq_ends)
        plan.attention = self.attention.stage(st, num_seqs, max_query_len)
        if self.local_layers:
            self._stage_local_tables(scheduled, st)
        return plan

    def _stage_local_tables(self, scheduled: SchedulerOutput, st) -> None:
        """The local layers' slot mapping and block tables, the main ones' twins over each
        request's local table (its released head points at the scratch block)."""
        bs = self.block_size
        slots, tables = st.numpy("local_slot_mapping"), st.numpy("local_block_tables")
        decode_rows, decode_slots = [], []  # per decode token, written at once (`_scatter`)
        t = 0
        for s, (request_id, n) in enumerate(scheduled.num_scheduled_tokens.items()):
            state = self.states[request_id]
            end = state.request.num_computed_tokens
            local = state.local_block_array
            if n == 1:
                decode_rows.append(t)
                decode_slots.append(state.local_block_ids[(end - 1) // bs] * bs + (end - 1) % bs)
            else:
                p = np.arange(end - n, end)
                slots[t : t + n] = local[p // bs].astype(np.int64) * bs + p % bs
            tables[s, : len(local)] = local
            t += n
        _scatter(slots, decode_rows, decode_slots, t)

    def _graph_bucket(self, plan: _StepPlan, buf: InputBlock) -> GraphKey | None:
        """The graph that runs the step, or None (eager); a graph reads the block its kind
        stages in, so a one-token step that does not sample everywhere runs eagerly, and so
        does a step that computes prompt logprobs (they need hidden states a graph drops)."""
        if self.graphs is None or (plan.scores is not None and plan.scores.rows):
            return None
        if plan.max_query_len == 1 and len(plan.sampling_states) == plan.num_seqs:
            key = self.graphs.bucket_for(plan.num_seqs, plan.max_seq_len)
        else:
            key = self.graphs.mixed_bucket_for(plan.num_tokens, plan.num_seqs, plan.attention.grid)
        return key if key is not None and self.buffers.block(key.decode) is buf else None

    def _pad_for_graph(self, st, plan: _StepPlan, key: GraphKey) -> _StepPlan:
        """Pad the staged inputs to the graph's shape; padding writes no KV and is never read.

        Decode: extra rows are 1-token sequences on scratch block 0. Mixed: extra tokens belong
        to no sequence, extra sequences are empty, extra sample rows point at token 0, and the
        attention backend pads its own arrays to the graph's grid.
        """
        t, s, n_samples = plan.num_tokens, plan.num_seqs, len(plan.sampling_states)
        st.numpy("input_ids")[t : key.num_tokens] = 0
        st.numpy("positions")[t : key.num_tokens] = 0
        st.numpy("slot_mapping")[t : key.num_tokens] = -1
        st.numpy("block_tables")[s : key.num_seqs] = 0
        if self.local_layers:
            st.numpy("local_slot_mapping")[t : key.num_tokens] = -1
            st.numpy("local_block_tables")[s : key.num_seqs] = 0
        st.numpy("sample_indices")[n_samples : key.num_seqs] = 0
        padded = _StepPlan(**plan.__dict__)
        if key.decode:
            st.numpy("seq_lens")[s : key.num_seqs] = 1
            st.numpy("query_start_loc")[s + 1 : key.num_seqs + 1] = np.arange(
                s + 1, key.num_seqs + 1
            )
        else:
            st.numpy("seq_lens")[s : key.num_seqs] = 0
            st.numpy("query_start_loc")[s + 1 : key.num_seqs + 1] = t
            grid = self.graphs.mixed_grid(key)
            padded.attention = self.attention.pad_for_graph(st, plan.attention, grid)
        padded.num_tokens, padded.num_seqs = key.num_tokens, key.num_seqs
        padded.num_sample_rows = key.num_seqs
        return padded

    def _context(self, plan: _StepPlan, buf: InputBlock) -> ForwardContext:
        return step_context(
            self.attention,
            buf,
            plan.num_tokens,
            plan.num_seqs,
            plan.max_query_len,
            plan.max_seq_len,
            plan.attention,
            self.local_layers,
        )


def _token_range(prompt: list[int], outputs: list[int], start: int, end: int) -> list[int]:
    """Tokens ``[start, end)`` of a request's prompt followed by its outputs (a resumed
    request's outputs are fed again like its prompt)."""
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    if start >= num_prompt:
        return outputs[start - num_prompt : end - num_prompt]
    return prompt[start:] + outputs[: end - num_prompt]


def _scatter(array: np.ndarray, rows: list[int], values: list[int], num_rows: int) -> None:
    """``array[rows] = values``; as a slice when ``rows`` are all of ``0..num_rows-1`` (a step
    of decodes only), in order."""
    if len(rows) == num_rows:
        array[:num_rows] = values
    elif rows:
        array[np.asarray(rows)] = values


@dataclass
class _StepPlan:
    num_tokens: int = 0
    num_seqs: int = 0
    max_query_len: int = 0
    max_seq_len: int = 0
    num_gathers: int = 0
    sampling_states: list[RunningRequest] = field(default_factory=list)
    num_sample_rows: int = 0  # sample_indices rows to upload beyond the sampled ones (padding)
    attention: StagedAttention = field(default_factory=StagedAttention)
    scores: StepScores | None = None  # prompt logprobs to compute (eagerly)
    local: bool = False  # the local layers' slots and tables are staged too

    @property
    def upload_counts(self) -> dict[str, int]:
        return {
            "input_ids": self.num_tokens,
            "positions": self.num_tokens,
            "slot_mapping": self.num_tokens,
            "query_start_loc": self.num_seqs + 1,
            "seq_lens": self.num_seqs,
            "block_tables": self.num_seqs,
            "sample_indices": max(len(self.sampling_states), self.num_sample_rows),
            "gather_dst": self.num_gathers,
            "gather_src": self.num_gathers,
            **self.attention.uploads,
            **(
                {"local_slot_mapping": self.num_tokens, "local_block_tables": self.num_seqs}
                if self.local
                else {}
            ),
        }
