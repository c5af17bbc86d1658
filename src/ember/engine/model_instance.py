"""Everything one served model needs, hung off one object: weights, KV pool, scheduler, runner.

Nothing here is global, so an engine process can hold several instances side by side.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ember.config import EngineConfig, MemoryConfig
from ember.engine.device_arena import ArenaFactory
from ember.engine.host_stash import HostStash, Stashed
from ember.engine.kv_cache_manager import KVCacheManager, LocalBlocks
from ember.engine.model_parts import (
    allocate_kv_cache,
    allocate_model,
    build_attention,
    cos_sin_cache,
    load_weights,
)
from ember.engine.model_plan import (
    ModelPlan,
    new_request,
    plan_model,
    standalone_kv_bytes,
    validate_prompt,
)
from ember.engine.request import Request
from ember.engine.scheduler import Scheduler
from ember.engine.step_loop import StepLoop
from ember.engine.step_types import RequestUpdate
from ember.kernels import kernel_cache
from ember.kernels.compile_ahead import default_compile_workers
from ember.kernels.tuning import KernelTuning
from ember.layers.ops import select_ops
from ember.parallel.group import ParallelGroup
from ember.parallel.workers import ShardWorkers
from ember.runner.cuda_graphs import StepGraphs
from ember.runner.model_runner import ModelRunner
from ember.runner.sampler import Sampler
from ember.sampling_params import SamplingParams
from ember.weights.checkpoint import Checkpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReport:
    seconds: float
    weight_bytes: int
    kv_cache_bytes: int
    num_blocks: int
    # The windowed layers' own pool, where they have one (`ModelPlan.kv_local_layers`).
    local_num_blocks: int | None = None
    graphs_captured: int = 0
    graph_capture_seconds: float = 0.0
    # Of graph_capture_seconds: the graphs' eager warm-up passes (first-time kernel compiles
    # and cache loads happen there) and the captures proper.
    graph_warmup_seconds: float = 0.0
    graph_record_seconds: float = 0.0
    # Reading the weights into the model (`ember.weights.parallel_load` for safetensors), on a
    # thread while the runner is built and the kernels compile; and how long the load
    # then still held up the captures.
    weight_load_seconds: float = 0.0
    weight_wait_seconds: float = 0.0
    # Before the load starts: config, tokenizer, the parameters' and the KV cache's allocation.
    setup_seconds: float = 0.0
    # Before the captures: their kernels compiled on several threads (EngineConfig's
    # compile_workers), and the threads used (0: none; each kernel compiles at its first launch).
    kernel_compile_seconds: float = 0.0
    compile_workers: int = 0
    # Of the pass's kernel specialisations: compiled, and found in Triton's cache (a start with
    # a warm kernel cache compiles none), with Triton's own seconds for each (summed over the
    # threads; the rest of kernel_compile_seconds is the pass's Python and launcher builds).
    kernels_compiled: int = 0
    kernels_from_cache: int = 0
    triton_compile_seconds: float = 0.0
    triton_cache_seconds: float = 0.0
    # Device memory the load took beyond its weights and KV cache (buffers, the CUDA graphs'
    # pool), measured by the allocator; kept while the model sleeps if its graphs are kept.
    resident_bytes: int = 0
    # When the load began (time.time(): comparable across processes, for start-up timelines).
    started_at: float = 0.0


class ModelInstance:
    """A loaded model with its own KV cache, scheduler and runner.

    Its weights and its KV cache each live in one arena (`ember.engine.device_arena`), so it can
    sleep (weights copied to host memory, both arenas' memory released) and wake again.
    """

    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint | None = None,
        on_tensor_loaded: Callable[[int], None] | None = None,
        *,
        plan: ModelPlan | None = None,
        kv_cache_bytes: int | None = None,
        arenas: ArenaFactory | None = None,
        memory: MemoryConfig | None = None,
    ) -> None:
        """Load ``config``'s model. ``on_tensor_loaded(n)`` is called, from the loading thread,
        as the n-th checkpoint tensor lands. ``plan``: the model already planned (else planned
        here); ``kv_cache_bytes``: the KV cache's size decided by the engine's memory budget
        (else sized as the only model under ``memory``)."""
        start = time.perf_counter()
        self.config = config
        # A plan given is its owner's (a pool slot keeps it across unloads and reloads, its
        # checkpoint open); one made here is this instance's, closed with it.
        self._owns_plan = plan is None
        self.plan = plan or plan_model(config, checkpoint)
        self.name = self.plan.name
        self.device = self.plan.device
        self.dtype = self.plan.dtype
        self.tokenizer = self.plan.tokenizer
        self.model_config = self.plan.model_config
        self.limits = self.plan.limits
        reserved_before = self._device_reserved()
        if self.device.type == "cuda":
            # Before any kernel compiles: kernels compiled by an earlier start, or published
            # beside the weights, are found there (`ember.kernels.kernel_cache`).
            kernel_cache.prepare(self.device, self.plan.checkpoint, config.kernel_cache_dir)
        # This instance's routing and tile tables, for its GPU (`ember.kernels.tuning`).
        self.tuning = KernelTuning.for_device(
            self.device, config.kernel_tuning, config.fp8_widen_in_registers
        )
        self.ops = select_ops(
            self.device,
            config.backend,
            config.programmatic_launch,
            config.defer_norms,
            self.tuning,
        )
        self.attention = build_attention(self.plan, self.ops, self.tuning)
        if config.cuda_graph_mode not in ("full", "decode"):
            raise ValueError(
                f"cuda_graph_mode must be 'full' or 'decode', not {config.cuda_graph_mode!r}"
            )
        compile_workers = self._compile_workers()
        if kv_cache_bytes is None:
            kv_cache_bytes = standalone_kv_bytes(self.plan, memory or MemoryConfig())
        block_size = config.cache.block_size
        num_blocks = config.cache.num_blocks or self.plan.kv_blocks_for(kv_cache_bytes)
        if num_blocks < self.plan.min_kv_blocks:
            raise ValueError(
                f"the KV cache holds {(num_blocks - 1) * block_size} tokens, fewer than one "
                f"sequence of max_model_len={self.max_model_len} needs "
                f"({(self.plan.min_kv_blocks - 1) * block_size}); give it more memory or lower "
                "max_model_len"
            )
        self.plan.check_complete()  # a missing tensor fails here, before anything is allocated
        self._arenas = arenas or ArenaFactory(self.device)
        # The other tensor-parallel ranks (none at size 1) start now: they plan and load
        # their shards while this process loads its own.
        self.workers: ShardWorkers | None = None
        self.parallel = ParallelGroup()
        if self.plan.tensor_parallel_size > 1:
            self.workers = ShardWorkers.start(config, self.device, num_blocks)
            self.parallel = self.workers.group
        try:
            self._load(
                config, compile_workers, num_blocks, on_tensor_loaded, start, reserved_before
            )
        except BaseException:
            self._stop_workers()
            raise

    def _load(
        self,
        config: EngineConfig,
        compile_workers: int,
        num_blocks: int,
        on_tensor_loaded: Callable[[int], None] | None,
        start: float,
        reserved_before: int,
    ) -> None:
        """Allocate, read the weights (beside the kernels' compiles), capture the graphs;
        ``start`` (perf_counter) and ``reserved_before`` (device bytes): the load's beginning."""
        started_at = time.time() - (time.perf_counter() - start)
        block_size = config.cache.block_size
        # Zeroed when kernels compile during the load: the compile pass runs the model's torch
        # ops on whatever the parameters hold, and uninitialised memory may hold NaNs.
        self.model = self._allocate_model(zeroed=compile_workers > 0)
        self.kv_cache, self.kv_arena = allocate_kv_cache(self.plan, num_blocks, self._arenas)
        local = self.plan.kv_local_layers
        self.kv_manager = KVCacheManager(
            num_blocks,
            block_size,
            prefix_caching=config.cache.enable_prefix_caching,
            window=self.plan.kv_window,
            local_blocks=LocalBlocks(self.plan.local_kv_blocks(num_blocks), local[1])
            if local
            else None,
        )
        self.asleep = False
        self._stashed: Stashed | None = None
        # Checkpoint bytes each tensor-parallel rank read (rank 0 alone at size 1; 0 where a
        # source is read tensor by tensor, uncounted).
        self.bytes_read_by_rank: dict[int, int] = {}
        setup_seconds = time.perf_counter() - start
        with ThreadPoolExecutor(1, thread_name_prefix="weight-load") as loader:
            loading = loader.submit(self._load_weights, self.plan.checkpoint, on_tensor_loaded)
            self._build_runner(config, block_size)
            if not config.lazy_cuda_graphs:
                self.runner.compile_kernels(compile_workers)
            waited = time.perf_counter()
            weight_load_seconds = loading.result()  # re-raises the loader's error
            if self.workers is not None:
                self.workers.wait_ready()
                self.bytes_read_by_rank.update(self.workers.bytes_read)
            weight_wait_seconds = time.perf_counter() - waited
        graphs, capture_seconds = self._capture_graphs()
        step_graphs = self.runner.graphs
        self.load_report = LoadReport(
            graphs_captured=graphs,
            graph_capture_seconds=capture_seconds,
            graph_warmup_seconds=step_graphs.warmup_seconds if step_graphs else 0.0,
            graph_record_seconds=step_graphs.record_seconds if step_graphs else 0.0,
            kernel_compile_seconds=step_graphs.compile_seconds if step_graphs else 0.0,
            compile_workers=compile_workers if graphs else 0,
            **_compile_counts(step_graphs),
            weight_load_seconds=weight_load_seconds,
            weight_wait_seconds=weight_wait_seconds,
            setup_seconds=setup_seconds,
            seconds=time.perf_counter() - start,
            weight_bytes=self.weight_bytes,
            kv_cache_bytes=self.kv_cache_bytes,
            num_blocks=num_blocks,
            local_num_blocks=self.plan.local_kv_blocks(num_blocks),
            resident_bytes=max(0, self._device_reserved() - reserved_before),
            started_at=started_at,
        )
        logger.info(
            "loaded %s in %.2f s: %s", self.name, self.load_report.seconds, self.load_report
        )

    @property
    def weight_bytes(self) -> int:
        return self.weight_arena.nbytes

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_arena.nbytes

    def _device_reserved(self) -> int:
        if self.device.type != "cuda":
            return 0
        return torch.cuda.memory_reserved(self.device)

    # -- sleep and wake ---------------------------------------------------------------------------

    def sleep(self, stash: HostStash | None) -> None:
        """Put the idle model to sleep: its weights go to ``stash`` (None, or a stash without
        room: they are dropped and read again from the checkpoint on wake), and the memory of
        its weights and KV cache goes back to the device. The caller has emptied the model
        (`preempt_all`) first. Where the arenas cannot keep their addresses, the CUDA graphs
        are dropped too (captured again on wake)."""
        if self.workers is not None:
            raise NotImplementedError(
                f"{self.name}: sleep and wake of a tensor-parallel model are not supported yet"
            )
        assert not self.asleep, f"{self.name} is already asleep"
        assert not self.scheduler.running, "sleep() needs a model with nothing running"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._stashed = stash.store(self.weight_arena.buffer) if stash is not None else None
        self.weight_arena.release()
        self.kv_arena.release()
        self.kv_manager.reset_prefix_cache()  # the blocks' contents are gone
        if not self._arenas.keeps_addresses and self.runner.graphs is not None:
            self.runner.graphs.clear()
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self, stash: HostStash | None) -> None:
        """Map the model's memory again and bring its weights back (from ``stash`` where they
        were kept, else from the checkpoint); graphs dropped by `sleep` are captured again."""
        assert self.asleep, f"{self.name} is awake"
        self.weight_arena.restore()
        self.kv_arena.restore()
        self.kv_cache.zero_()
        if self._stashed is not None and stash is not None:
            stash.load(self._stashed, self.weight_arena.buffer)
        else:
            self._load_weights(self.plan.checkpoint, None)
        self._stashed = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.runner.graphs is not None and not self.runner.graphs.captured:
            self._capture_graphs()
        self.asleep = False

    def _stop_workers(self) -> None:
        """Stop and join the other tensor-parallel ranks (none at size 1)."""
        workers, self.workers = self.workers, None
        if workers is not None:
            workers.close()

    @property
    def weights_stashed(self) -> bool:
        """Whether a sleeping model's weights are in host memory (else dropped)."""
        return self._stashed is not None

    def preempt_all(self) -> list[RequestUpdate]:
        """Collect the step in flight and preempt every running request (they recompute after
        the model wakes; nothing is lost). Returns the collected step's updates."""
        updates = self.loop.drain()
        self.scheduler.preempt_all()
        return updates

    def close(self, stash: HostStash | None = None) -> None:
        """Give back every byte of device memory, and its weights' host chunks to ``stash``
        (the model is unloaded)."""
        if self._stashed is not None and stash is not None:
            stash.give_back(self._stashed)
            self._stashed = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.runner.graphs is not None:
            self.runner.graphs.clear()
        self._stop_workers()
        self.weight_arena.close()
        self.kv_arena.close()
        if self._owns_plan:
            self.plan.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def max_model_len(self) -> int:
        """The context length this instance serves (its limits', resolved against the model)."""
        return self.limits.max_model_len

    def _build_runner(self, config: EngineConfig, block_size: int) -> None:
        """Scheduler and runner over the allocated cache (no weight value is read here)."""
        cfg = self.model_config
        self.scheduler = Scheduler(self.limits, self.kv_manager)
        cos_sin = cos_sin_cache(self.plan)
        self.runner = ModelRunner(
            model=self.model,
            attention=self.attention,
            kv_cache=self.kv_cache,
            cos_sin_cache=cos_sin,
            block_size=block_size,
            sampler=Sampler(self.ops, cfg.vocab_size, self.device, self.limits),
            stop_ids_until_min_tokens=cfg.eos_token_ids,
            limits=self.limits,
            # Not over several ranks yet: a captured all-reduce is the GPU work still to do.
            use_cuda_graphs=not config.enforce_eager
            and self.ops.capturable
            and self.workers is None,
            mixed_cuda_graphs=config.cuda_graph_mode == "full",
            compile_ahead=self.ops.compile_ahead,
            peers=self.workers,
            local_layers=self.plan.local_layers,
        )
        # Overlap: launch step N+1 before collecting step N (on by default on a GPU).
        self.overlap = config.overlap if config.overlap is not None else self.device.type == "cuda"
        self.loop = StepLoop(self.scheduler, self.runner, self.overlap)
        self._rng = random.Random(config.seed)
        self._failed_requests: list[tuple[str, str]] = []

    def _compile_workers(self) -> int:
        """Threads that compile the graphs' kernels ahead of the captures: the configured count,
        else one per CPU; none where the ops have nothing to compile."""
        workers = self.config.compile_workers
        if workers is not None and workers < 0:
            raise ValueError(f"compile_workers must be >= 0, got {workers}")
        if self.ops.compile_ahead is None:
            return 0
        if workers is None:
            workers = default_compile_workers()
        return workers

    def _capture_graphs(self) -> tuple[int, float]:
        """Capture every step graph before the first request (vLLM does the same): a lazy capture
        costs the request that meets a new shape ~0.1 s, and compiling the kernels several."""
        if self.runner.graphs is None or self.config.lazy_cuda_graphs:
            return 0, 0.0
        start = time.perf_counter()
        count = self.runner.capture_graphs()
        return count, time.perf_counter() - start

    def _allocate_model(self, zeroed: bool) -> torch.nn.Module:
        """The model (this rank's share) with its parameters as views of one arena, their
        values not yet read (`ember.engine.model_parts.allocate_model`)."""
        model, self.weight_arena = allocate_model(
            self.plan, self.ops, self.attention, self.parallel, self._arenas, zeroed
        )
        return model

    def _load_weights(self, ckpt: Checkpoint, on_tensor: Callable[[int], None] | None) -> float:
        """Fill the parameters from ``ckpt`` (`ember.engine.model_parts.load_weights`: this
        rank's slices of it); returns the seconds it took."""
        started = time.perf_counter()
        self.bytes_read_by_rank[0] = load_weights(self.model, self.plan, on_tensor)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the norm folding, timed too
        return time.perf_counter() - started

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        """Validate and queue a request; ValueError (and nothing queued) on bad input."""
        self.validate_prompt(prompt_token_ids, params)
        request = self.make_request(request_id, prompt_token_ids, params)
        self.scheduler.add_request(request)
        return request

    def make_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        return new_request(self.plan, self._rng, request_id, prompt_token_ids, params)

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(self.plan, prompt_token_ids, params)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.loop.has_work()

    def step(self) -> list[RequestUpdate]:
        """Advance by one step; returns what changed for each request. A request whose grammar
        refused a sample is aborted here and kept for `take_failed_requests`. A tensor-parallel
        rank that died fails the step with a `WorkerLostError` naming it."""
        try:
            updates = self.loop.step()
        except Exception as exc:
            if self.workers is not None:
                self.workers.check_alive(cause=exc)  # the cause, where a rank is gone
            raise
        failures = self.runner.take_grammar_failures()
        for request_id, _ in failures:
            self.scheduler.abort(request_id)
        self._failed_requests.extend(failures)
        return updates

    def take_failed_requests(self) -> list[tuple[str, str]]:
        """The requests that failed alone since the last call (their grammar refused a
        sample), each with why; they are already ended."""
        failed, self._failed_requests = self._failed_requests, []
        return failed


def _compile_counts(graphs: StepGraphs | None) -> dict[str, int | float]:
    """The `LoadReport` fields of a compile-ahead pass's `CompileCounts`."""
    if graphs is None:
        return {}
    counts = graphs.compile_counts
    return {
        "kernels_compiled": counts.compiled,
        "kernels_from_cache": counts.from_cache,
        "triton_compile_seconds": counts.compile_seconds,
        "triton_cache_seconds": counts.cache_seconds,
    }
