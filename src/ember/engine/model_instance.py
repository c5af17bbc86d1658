"""Everything one served model needs, hung off one object: weights, KV pool, scheduler, runner.

Nothing here is global, so an engine process can hold several instances side by side.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ember.config import EngineConfig, ModelConfig
from ember.engine.kv_cache_manager import KVCacheManager
from ember.engine.request import Request
from ember.engine.scheduler import Scheduler
from ember.engine.step_loop import StepLoop
from ember.engine.step_types import RequestUpdate
from ember.kernels.compile_ahead import default_compile_workers
from ember.kernels.tuning import KernelTuning
from ember.layers.attention import select_attention
from ember.layers.ops import select_ops
from ember.layers.reference_ops import build_cos_sin_cache
from ember.models.registry import model_class
from ember.runner.model_runner import ModelRunner
from ember.runner.sampler import Sampler
from ember.sampling_params import SamplingParams
from ember.tokenizer.tokenizer import Tokenizer
from ember.weights.checkpoint import Checkpoint
from ember.weights.parallel_load import load_extents
from ember.weights.resolve import open_checkpoint

logger = logging.getLogger(__name__)

_CPU_KV_BYTES_DEFAULT = 1 << 30
_GPU_ACTIVATION_RESERVE = 1 << 30


@dataclass(frozen=True)
class LoadReport:
    seconds: float
    weight_bytes: int
    kv_cache_bytes: int
    num_blocks: int
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


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, hf_config: dict) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32  # CPU bf16 matmuls are slow and lossy; CPU is the oracle path
        stored = hf_config.get("torch_dtype") or hf_config.get("dtype")
        return torch.float16 if stored == "float16" else torch.bfloat16
    names = {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "half": torch.float16,
        "float": torch.float32,
        "bf16": torch.bfloat16,
    }
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(names)}")
    return names[dtype]


class ModelInstance:
    """A loaded model with its own KV cache, scheduler and runner."""

    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint | None = None,
        on_tensor_loaded: Callable[[int], None] | None = None,
    ) -> None:
        """Load ``config``'s model. ``on_tensor_loaded(n)`` is called, from the loading thread,
        as the n-th checkpoint tensor lands."""
        start = time.perf_counter()
        self.config = config
        ckpt = checkpoint or open_checkpoint(config.model)
        self.name = config.served_model_name or config.model or ckpt.name
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, ckpt.hf_config)
        self.tokenizer = Tokenizer.from_checkpoint(ckpt)
        self.model_config = _with_generation_eos(
            ModelConfig.from_hf_dict(ckpt.hf_config), ckpt, self.tokenizer
        )
        cfg = self.model_config
        max_model_len = min(
            config.limits.max_model_len or cfg.max_position_embeddings,
            cfg.max_position_embeddings,
        )
        self.limits = dataclasses.replace(config.limits, max_model_len=max_model_len)
        # This instance's routing and tile tables, for its GPU (`ember.kernels.tuning`).
        self.tuning = KernelTuning.for_device(self.device)
        self.ops = select_ops(
            self.device,
            config.backend,
            config.programmatic_launch,
            config.defer_norms,
            self.tuning,
        )
        self.attention = select_attention(
            self.ops,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
            self.limits,
            self.tuning.attention,
            fuse_decode=config.decode_rope_in_attention,
        )
        if config.cuda_graph_mode not in ("full", "decode"):
            raise ValueError(
                f"cuda_graph_mode must be 'full' or 'decode', not {config.cuda_graph_mode!r}"
            )
        compile_workers = self._compile_workers()
        # Zeroed when kernels compile during the load: the compile pass runs the model's torch
        # ops on whatever the parameters hold, and uninitialised memory may hold NaNs.
        self.model = self._allocate_model(zeroed=compile_workers > 0)
        block_size = config.cache.block_size
        num_blocks = self._num_kv_blocks()
        self.kv_cache = torch.zeros(
            (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        if (num_blocks - 1) * block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {(num_blocks - 1) * block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}; give it more memory or lower max_model_len"
            )
        self.kv_manager = KVCacheManager(num_blocks, block_size)
        setup_seconds = time.perf_counter() - start
        with ThreadPoolExecutor(1, thread_name_prefix="weight-load") as loader:
            loading = loader.submit(self._load_weights, ckpt, on_tensor_loaded)
            self._build_runner(config, block_size)
            if not config.lazy_cuda_graphs:
                self.runner.compile_kernels(compile_workers)
            waited = time.perf_counter()
            weight_load_seconds = loading.result()  # re-raises the loader's error
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
            weight_load_seconds=weight_load_seconds,
            weight_wait_seconds=weight_wait_seconds,
            setup_seconds=setup_seconds,
            seconds=time.perf_counter() - start,
            weight_bytes=sum(p.numel() * p.element_size() for p in self.model.parameters()),
            kv_cache_bytes=self.kv_cache.numel() * self.kv_cache.element_size(),
            num_blocks=num_blocks,
        )
        logger.info(
            "loaded %s in %.2f s: %s", self.name, self.load_report.seconds, self.load_report
        )

    @property
    def max_model_len(self) -> int:
        """The context length this instance serves (its limits', resolved against the model)."""
        return self.limits.max_model_len

    def _build_runner(self, config: EngineConfig, block_size: int) -> None:
        """Scheduler and runner over the allocated cache (no weight value is read here)."""
        cfg = self.model_config
        self.scheduler = Scheduler(self.limits, self.kv_manager)
        cos_sin = build_cos_sin_cache(
            cfg.head_dim, self.max_model_len, cfg.rope_theta, cfg.rope_scaling
        ).to(self.device)
        self.runner = ModelRunner(
            model=self.model,
            attention=self.attention,
            kv_cache=self.kv_cache,
            cos_sin_cache=cos_sin,
            block_size=block_size,
            sampler=Sampler(self.ops, cfg.vocab_size, self.device, self.limits),
            stop_ids_until_min_tokens=cfg.eos_token_ids,
            limits=self.limits,
            use_cuda_graphs=not config.enforce_eager and self.ops.capturable,
            mixed_cuda_graphs=config.cuda_graph_mode == "full",
            compile_ahead=self.ops.compile_ahead,
        )
        # Overlap: launch step N+1 before collecting step N (on by default on a GPU).
        self.overlap = config.overlap if config.overlap is not None else self.device.type == "cuda"
        self.loop = StepLoop(self.scheduler, self.runner, self.overlap)
        self._rng = random.Random(config.seed)

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
        """The model with its parameters allocated on the device, their values not yet read."""
        cls = model_class(self.model_config.architecture)
        with torch.device("meta"):
            model = cls(self.model_config, self.ops, self.attention)
        model = model.to(dtype=self.dtype).to_empty(device=self.device)
        if zeroed:
            for param in model.parameters():
                param.data.zero_()
        return model.eval()

    def _load_weights(self, ckpt: Checkpoint, on_tensor: Callable[[int], None] | None) -> float:
        """Fill the parameters from ``ckpt``; returns the seconds it took. Safetensors files are
        read on several threads through pinned buffers (`ember.weights.parallel_load`); other
        formats tensor by tensor through `Checkpoint.iter_tensors`."""
        started = time.perf_counter()
        extents = getattr(ckpt, "tensor_extents", None)
        if extents is None:
            self.model.load_weights(ckpt.iter_tensors(self.dtype), on_tensor)
        else:
            placer = self.model.weight_placer()
            load_extents(
                extents(),
                lambda extent: placer.target(extent.name, extent.shape),
                self.device,
                on_tensor=on_tensor,
            )
            placer.finish()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the norm folding, timed too
        return time.perf_counter() - started

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        cfg = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        block_bytes = 2 * cfg.num_layers * cache.block_size * cfg.num_kv_heads * cfg.head_dim * elem
        if cache.num_blocks is not None:
            return cache.num_blocks
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()  # cached-but-free blocks are not "used"
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cache.gpu_memory_utilization) - used - self._activation_bytes()
        else:
            budget = _CPU_KV_BYTES_DEFAULT
        return max(2, budget // block_bytes)

    def _activation_bytes(self) -> int:
        """Room kept free for the largest step's activations, logits and CUDA graphs."""
        cfg, sched = self.model_config, self.limits
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_token = 2 * cfg.intermediate_size + cfg.q_size + 2 * cfg.kv_size + 3 * cfg.hidden_size
        # x2: an op's input and output are alive together; logits are fp32, plus a processed copy.
        step = 2 * sched.max_num_batched_tokens * per_token * elem
        logits = 2 * sched.max_num_seqs * cfg.vocab_size * 4
        return _GPU_ACTIVATION_RESERVE + step + logits

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
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            seed=seed,
            max_tokens=max_tokens,
            eos_token_ids=self.model_config.eos_token_ids,
        )

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context length "
                f"is {self.max_model_len}, so the prompt must have fewer"
            )
        for token_id in list(params.logit_bias or ()) + list(params.stop_token_ids):
            if not 0 <= int(token_id) < vocab:
                raise ValueError(f"token id {token_id} is outside the vocabulary [0, {vocab})")

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.loop.has_work()

    def step(self) -> list[RequestUpdate]:
        """Advance by one step; returns what changed for each request."""
        return self.loop.step()


def _with_generation_eos(cfg: ModelConfig, ckpt: Checkpoint, tokenizer: Tokenizer) -> ModelConfig:
    """EOS ids come from config.json, generation_config.json and the tokenizer, merged."""
    ids: list[int] = list(cfg.eos_token_ids)
    gen_eos = ckpt.generation_config.get("eos_token_id")
    ids += gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return cfg.with_eos(tuple(dict.fromkeys(int(i) for i in ids)))
