"""Builds a step's inputs from the scheduler's decision, runs the model, samples.

The runner keeps a persistent record of every request it has seen (its tokens and block table),
updated from the scheduler's diffs; it never decides policy.

A step is `launch` (stage inputs, enqueue the forward pass and sampling, start an async copy of
the sampled ids to host memory) then `collect` (wait for that copy, hand back plain lists). The
engine launches step N+1 before it collects step N: a decode that feeds a token sampled in step N
reads it on the device (`gather_src` -> `gather_dst`), so the CPU never waits for it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ember.engine.step_types import RunnerOutput, SchedulerOutput, TokenLogprobs
from ember.kernels.attention_plan import ChunkTiles, chunk_tile_map, prefill_query_tile
from ember.kernels.compile_ahead import compile_ahead
from ember.layers.forward_context import ForwardContext
from ember.runner.cuda_graphs import GraphKey, StepGraphs
from ember.runner.input_buffers import InputBlock, InputBuffers
from ember.runner.sampler import Sampler, SamplingRow
from ember.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class RequestState:
    request_id: str
    token_ids: list[int]  # known on the host
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    num_output_tokens: int  # includes samples still on their way back
    block_ids: list[int]
    num_computed_tokens: int
    block_array: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    stop_ids: tuple[int, ...] = ()  # masked until min_tokens: EOS and the request's stop ids
    # The launched step whose sample is our newest token, and the row of that sample.
    pending_step: StepHandle | None = None
    pending_row: int = 0

    def add_blocks(self, block_ids: list[int]) -> None:
        self.block_ids.extend(block_ids)
        self.block_array = np.asarray(self.block_ids, dtype=np.int32)  # copied into block tables

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) + (self.pending_step is not None)


@dataclass(eq=False)
class StepHandle:
    """A launched step: what it sampled for whom, and where the ids will land on the host."""

    states: list[RequestState]
    tokens: torch.Tensor | None  # device
    host_tokens: torch.Tensor | None  # pinned on CUDA
    done: torch.cuda.Event | None
    logprobs: list[TokenLogprobs | None] | None
    result: RunnerOutput | None = None


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        block_size: int,
        sampler: Sampler,
        stop_ids_until_min_tokens: tuple[int, ...],
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        use_cuda_graphs: bool,
        mixed_cuda_graphs: bool = True,
        num_q_heads: int | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.cos_sin_cache = cos_sin_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = kv_cache.device
        self.stop_ids_until_min_tokens = stop_ids_until_min_tokens
        self.max_num_seqs = max_num_seqs
        self.states: dict[str, RequestState] = {}
        # Query tokens per tile of a mixed step's chunk tile map (None: no map; the kernel
        # searches instead).
        self.chunk_tile_tokens = (
            prefill_query_tile(num_q_heads, kv_cache.shape[-2]) if num_q_heads else None
        )
        self.buffers = InputBuffers(
            max_tokens=max(max_num_batched_tokens, max_num_seqs),
            max_seqs=max_num_seqs,
            max_blocks_per_seq=-(-max_model_len // block_size),
            device=self.device,
            num_kv_heads=kv_cache.shape[-2],
            chunk_tile_tokens=self.chunk_tile_tokens or 1,
        )
        self.graphs = None
        if use_cuda_graphs and self.device.type == "cuda":
            self.graphs = StepGraphs(
                model,
                self.buffers,
                kv_cache,
                cos_sin_cache,
                max_num_seqs,
                max_model_len,
                max_tokens=max_num_batched_tokens if mixed_cuda_graphs else None,
                chunk_tile_tokens=self.chunk_tile_tokens,
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
        if self.graphs is None or workers <= 0:
            return
        started = time.perf_counter()
        try:
            with torch.inference_mode(), compile_ahead(workers):
                for key in self.graphs.all_keys:
                    self._stage_empty_step(key)
                    self.graphs.forward_for_launches(key)
                self._warm_eager_launches()
        except Exception:
            logger.warning("compiling ahead failed; each kernel compiles at its first launch",
                           exc_info=True)  # fmt: skip
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
        max_rows = self.max_num_seqs
        hidden = torch.zeros(max_rows, self.model.cfg.hidden_size, dtype=weight.dtype,
                             device=self.device)  # fmt: skip
        for rows in range(1, max_rows + 1):
            self.model.compute_logits(hidden[:rows])
        self.sampler.warm_up(weight.dtype)

    def _stage_empty_step(self, key: GraphKey) -> None:
        """Upload an empty step padded to the graph ``key``."""
        block = self.buffers.block(key.decode)
        staging = block.next_staging()
        staging.numpy("query_start_loc")[0] = 0
        padded = self._pad_for_graph(staging, _StepPlan(), key)
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
        for i, state in enumerate(handle.states):
            if state.pending_step is handle:
                state.pending_step = None
            if self.states.get(state.request_id) is not state:
                continue  # finished or preempted while the step ran: its sample is stale
            state.token_ids.append(token_list[i])
            ids.append(state.request_id)
            tokens.append(token_list[i])
            logprobs.append(handle.logprobs[i] if handle.logprobs else None)
        handle.result = RunnerOutput(ids, tokens, logprobs if handle.logprobs else [])
        if self._in_flight is handle:
            self._in_flight = None
        return handle.result

    def _launch(self, scheduled: SchedulerOutput) -> StepHandle:
        buf = self.input_block(scheduled)
        staging = buf.next_staging()
        plan = self._stage_inputs(scheduled, staging)
        prev = self._in_flight
        if prev is not None and any(s.params.uses_penalties for s in plan.sampling_states):
            self.collect(prev)  # penalties need the whole output history on the host
        rows = [self._sampling_row(s) for s in plan.sampling_states]
        bucket = self._graph_bucket(plan, buf)
        padded = self._pad_for_graph(staging, plan, bucket) if bucket is not None else plan
        buf.upload(staging, padded.upload_counts)
        if plan.num_gathers:
            self._gather_fed_tokens(buf, staging, plan.num_gathers, prev.tokens)
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
                rows_hidden = hidden.index_select(0, buf["sample_indices"][:num_samples])
            if not num_samples:
                return StepHandle([], None, None, None, None, result=RunnerOutput())
            logits = self.model.compute_logits(rows_hidden[:num_samples])
        tokens, logprobs = self.sampler(logits, rows)
        host_tokens, done = self._copy_to_host(tokens, staging)
        handle = StepHandle(
            plan.sampling_states,
            tokens,
            host_tokens,
            done,
            logprobs,
        )
        for i, state in enumerate(plan.sampling_states):
            state.num_output_tokens += 1
            state.pending_step, state.pending_row = handle, i
        return handle

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
        for request_id in scheduled.finished_request_ids:
            self.states.pop(request_id, None)
        for new in scheduled.new_requests:
            self.states[new.request_id] = RequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                params=new.params,
                seed=new.seed,
                num_output_tokens=new.num_output_tokens,
                block_ids=[],
                num_computed_tokens=new.num_computed_tokens,
                stop_ids=self.stop_ids_until_min_tokens + tuple(new.params.stop_token_ids),
            )
            self.states[new.request_id].add_blocks(new.block_ids)
        for cached in scheduled.cached_requests:
            state = self.states[cached.request_id]
            if cached.new_block_ids:
                state.add_blocks(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _stage_inputs(self, scheduled: SchedulerOutput, st) -> _StepPlan:
        """Write the step's inputs into the staging set ``st``. The loop runs once per request
        per step, so it collects per-sequence values and decode tokens in lists and writes
        each array with one numpy assignment: item by item, numpy's writes (~70 ns each, seven
        a decode) cost as much as the rest of the loop."""
        bs = self.block_size
        ids, pos, slots = st.numpy("input_ids"), st.numpy("positions"), st.numpy("slot_mapping")
        tables = st.numpy("block_tables")
        plan = _StepPlan()
        states, sampling_states = self.states, plan.sampling_states
        seq_ends, token_ends, sample_rows = [], [], []  # per sequence; per sampled sequence
        gather_dst, gather_src = [], []  # rows whose token is still on the device
        decode_rows, decode_pos, decode_slots = [], [], []  # per decode token
        id_rows, id_values = [], []  # decode tokens known on the host
        t = max_query_len = 0  # over the chunks; a decode's is 1
        for s, (request_id, n) in enumerate(scheduled.num_scheduled_tokens.items()):
            state = states[request_id]
            start = state.num_computed_tokens
            token_ids = state.token_ids
            known = len(token_ids)
            end = start + n
            if end > known:  # the last token fed was sampled by the step still in flight
                gather_dst.append(t + n - 1)
                gather_src.append(state.pending_row)
            if n == 1:  # a decode
                if end <= known:
                    id_rows.append(t)
                    id_values.append(token_ids[start])
                decode_rows.append(t)
                decode_pos.append(start)
                decode_slots.append(state.block_ids[start // bs] * bs + start % bs)
            else:
                host_end = min(end, known)
                ids[t : t + host_end - start] = token_ids[start:host_end]
                p = np.arange(start, end)
                pos[t : t + n] = p
                slots[t : t + n] = state.block_array[p // bs].astype(np.int64) * bs + p % bs
                max_query_len = max(max_query_len, n)
            block_array = state.block_array
            tables[s, : len(block_array)] = block_array
            t += n
            seq_ends.append(end)
            token_ends.append(t)
            state.num_computed_tokens = end
            if end == known + (state.pending_step is not None):  # `num_known_tokens`
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
        if max_query_len > 1 and self.chunk_tile_tokens:
            plan.num_chunk_tiles = chunk_tile_map(st.numpy("query_start_loc"), num_seqs,
                                                  self.chunk_tile_tokens,
                                                  st.numpy("chunk_tiles"))  # fmt: skip
        return plan

    def _graph_bucket(self, plan: _StepPlan, buf: InputBlock) -> GraphKey | None:
        """The graph that runs the step, or None (eager); a graph reads the block its kind
        stages in, so a one-token step that does not sample everywhere runs eagerly."""
        if self.graphs is None:
            return None
        if plan.max_query_len == 1 and len(plan.sampling_states) == plan.num_seqs:
            key = self.graphs.bucket_for(plan.num_seqs, plan.max_seq_len)
        else:
            key = self.graphs.mixed_bucket_for(plan.num_tokens, plan.num_seqs,
                                               plan.num_chunk_tiles)  # fmt: skip
        return key if key is not None and self.buffers.block(key.decode) is buf else None

    def _pad_for_graph(self, st, plan: _StepPlan, key: GraphKey) -> _StepPlan:
        """Pad the staged inputs to the graph's shape; padding writes no KV and is never read.

        Decode: extra rows are 1-token sequences on scratch block 0. Mixed: extra tokens belong
        to no sequence, extra sequences are empty, extra sample rows point at token 0, extra
        chunk tiles are spare (-1).
        """
        t, s, n_samples = plan.num_tokens, plan.num_seqs, len(plan.sampling_states)
        st.numpy("input_ids")[t : key.num_tokens] = 0
        st.numpy("positions")[t : key.num_tokens] = 0
        st.numpy("slot_mapping")[t : key.num_tokens] = -1
        st.numpy("block_tables")[s : key.num_seqs] = 0
        st.numpy("sample_indices")[n_samples : key.num_seqs] = 0
        if key.decode:
            st.numpy("seq_lens")[s : key.num_seqs] = 1
            st.numpy("query_start_loc")[s + 1 : key.num_seqs + 1] = np.arange(
                s + 1, key.num_seqs + 1
            )
        else:
            st.numpy("seq_lens")[s : key.num_seqs] = 0
            st.numpy("query_start_loc")[s + 1 : key.num_seqs + 1] = t
        padded = _StepPlan(**plan.__dict__)
        padded.num_tokens, padded.num_seqs = key.num_tokens, key.num_seqs
        padded.num_sample_rows = key.num_seqs
        if not key.decode and self.graphs.chunk_tile_tokens:
            grid = self.graphs.chunk_tile_grid(key.num_tokens)
            st.numpy("chunk_tiles")[plan.num_chunk_tiles : grid] = -1
            padded.num_chunk_tiles = grid
        return padded

    def _context(self, plan: _StepPlan, buf: InputBlock) -> ForwardContext:
        return ForwardContext(
            positions=buf["positions"][: plan.num_tokens],
            slot_mapping=buf["slot_mapping"][: plan.num_tokens],
            query_start_loc=buf["query_start_loc"][: plan.num_seqs + 1],
            seq_lens=buf["seq_lens"][: plan.num_seqs],
            block_tables=buf["block_tables"][: plan.num_seqs],
            max_query_len=plan.max_query_len,
            max_seq_len=plan.max_seq_len,
            split_kv_counters=self.buffers.split_kv_counters,
            chunk_tiles=ChunkTiles(buf["chunk_tiles"], plan.num_chunk_tiles, self.chunk_tile_tokens)
            if plan.num_chunk_tiles
            else None,
        )

    def _sampling_row(self, state: RequestState) -> SamplingRow:
        return SamplingRow(
            params=state.params,
            seed=state.seed,
            step=state.num_output_tokens,
            token_ids=state.token_ids,
            num_prompt_tokens=state.num_prompt_tokens,
            stop_ids_until_min_tokens=state.stop_ids,
        )


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
    sampling_states: list[RequestState] = field(default_factory=list)
    num_sample_rows: int = 0  # sample_indices rows to upload beyond the sampled ones (padding)
    num_chunk_tiles: int = 0  # chunk_tiles entries staged (a graph's grid when padded)

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
            "chunk_tiles": self.num_chunk_tiles,
        }
