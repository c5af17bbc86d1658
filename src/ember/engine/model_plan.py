"""What a model will need, known before a byte of its weights is read: its configuration,
tokenizer, dtype and device, the limits it serves under, and its memory footprint.

The engine plans every configured model at start (config.json, the tokenizer and the weight
files' headers only), so it can validate requests for a model that is not loaded yet and decide
what fits in its budget. A config whose sizes disagree with its checkpoint's tensors fails
here, before anything is sized from it (`ember.models.checkpoint_layout`). A model of dummy
weights (`load_format` "dummy") is planned from its config and tokenizer alone: it has no
weight file to look at.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ember.config import (
    FP8_KV_CACHE_DTYPES,
    EngineConfig,
    MemoryConfig,
    ModelConfig,
    StepLimits,
)
from ember.engine.request import Request
from ember.models.checkpoint_layout import CheckpointLayout, check_complete, check_fits
from ember.parallel.group import ShapeGroup
from ember.parallel.sharding import check_shardable, rank_config
from ember.quantization import fp8_scheme, mxfp4_experts
from ember.sampling_params import SamplingParams
from ember.tokenizer.harmony import harmony_stop_token_ids
from ember.tokenizer.tokenizer import Tokenizer
from ember.weights.checkpoint import Checkpoint, TensorHeader
from ember.weights.resolve import open_checkpoint

if TYPE_CHECKING:
    from ember.structured_output.compiler import GrammarCompiler

CPU_KV_BYTES_DEFAULT = 1 << 30
GPU_ACTIVATION_RESERVE = 1 << 30


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


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's ``dtype`` for "auto", float8 e4m3 for the FP8
    names (`ember.config.KV_CACHE_DTYPES`, checked when the config is built)."""
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return torch.float8_e4m3fn
    return dtype


@dataclass
class ModelPlan:
    """One configured model before it loads. ``checkpoint`` is open (metadata only);
    ``tensor_headers``: its tensors by HF name, which fit ``layout``, the tensors the model
    reads."""

    name: str
    config: EngineConfig
    checkpoint: Checkpoint
    tokenizer: Tokenizer
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    limits: StepLimits
    tensor_headers: dict[str, TensorHeader]
    layout: CheckpointLayout

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size

    @functools.cached_property
    def rank_config(self) -> ModelConfig:
        """One tensor-parallel rank's share of the model (`ember.parallel.sharding`): its
        heads, KV heads and MLP rows; the model's config at tensor_parallel_size 1. Every
        rank's is the same, and so are its bytes: sizes below are per rank (per GPU)."""
        return rank_config(self.model_config, self.tensor_parallel_size)

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Compiles the model's structured-output requests (kept across unloads and reloads;
        llguidance is imported with the first one)."""
        from ember.structured_output.compiler import GrammarCompiler

        cfg = self.model_config
        return GrammarCompiler(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache stores (`CacheConfig.kv_cache_dtype`, resolved)."""
        return resolve_kv_cache_dtype(self.config.cache.kv_cache_dtype, self.dtype)

    @property
    def kv_elem_bytes(self) -> int:
        return torch.empty((), dtype=self.kv_dtype).element_size()

    @property
    def kv_layer_block_bytes(self) -> int:
        """Bytes of one block of one layer (of one rank's KV heads)."""
        cfg, block_size = self.rank_config, self.config.cache.block_size
        return 2 * block_size * cfg.num_kv_heads * cfg.head_dim * self.kv_elem_bytes

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block over every layer (of one rank's KV heads)."""
        return self.rank_config.num_layers * self.kv_layer_block_bytes

    @functools.cached_property
    def kv_local_layers(self) -> tuple[frozenset[int], int] | None:
        """The windowed layers that keep their K/V in a pool of their own, and their longest
        span of keys, where the model mixes them with full-attention layers
        (`ModelConfig.kv_local_layers`); else None."""
        return self.model_config.kv_local_layers(self.max_model_len)

    @property
    def local_layers(self) -> frozenset[int]:
        return self.kv_local_layers[0] if self.kv_local_layers else frozenset()

    @property
    def local_kv_bound(self) -> int | None:
        """Blocks the local pool is given at most (the scratch block included): each running
        sequence holds the blocks over its window and the chunk it computes, at most the
        window's blocks and three more (a partial block at each end, one its registration may
        keep), and the chunks of a step span at most their tokens' blocks. Under prefix
        caching, as many windows again: a cached prefix is taken back only with the local
        blocks its last window covers, and that room keeps one for each running sequence."""
        if self.kv_local_layers is None:
            return None
        window, block_size = self.kv_local_layers[1], self.config.cache.block_size
        windows = self.limits.max_num_seqs * (-(-(window - 1) // block_size) + 3)
        chunks = -(-self.limits.max_num_batched_tokens // block_size)
        cached = windows if self.config.cache.enable_prefix_caching else 0
        return windows + chunks + cached + 1

    def local_kv_blocks(self, num_blocks: int) -> int | None:
        """The local pool's blocks beside ``num_blocks`` of the full layers' (no more than
        those: a local table is never longer), None without local layers."""
        bound = self.local_kv_bound
        return None if bound is None else min(num_blocks, bound)

    def kv_bytes_for(self, num_blocks: int) -> int:
        """The KV cache's bytes at ``num_blocks`` (the full layers' pool, with the local one
        beside it)."""
        local = self.local_kv_blocks(num_blocks)
        if local is None:
            return num_blocks * self.kv_block_bytes
        local_layers = len(self.local_layers)
        main_layers = self.rank_config.num_layers - local_layers
        return (num_blocks * main_layers + local * local_layers) * self.kv_layer_block_bytes

    @functools.cached_property
    def kv_window(self) -> int | None:
        """Every layer's window within the served context (the largest), or None: some layer
        reads every key (`ModelConfig.kv_window`)."""
        return self.model_config.kv_window(self.max_model_len)

    @property
    def min_kv_blocks(self) -> int:
        """Blocks one sequence of the full context needs, plus the scratch block. Where every
        layer attends through a window, a sequence holds only the blocks over its window and
        the chunk a step adds (`ember.engine.kv_cache_manager`): at most one block more than
        ``window - 1 + max_num_batched_tokens`` positions span."""
        block_size = self.config.cache.block_size
        blocks = -(-self.max_model_len // block_size)
        window = self.kv_window
        if window is not None:
            span = window - 1 + self.limits.max_num_batched_tokens
            blocks = min(blocks, -(-span // block_size) + 1)
        return blocks + 1

    @functools.cached_property
    def weight_bytes(self) -> int:
        """The parameters' bytes (of one tensor-parallel rank), counted on a model built on the
        meta device: each at its own element size (an FP8 weight's one byte, its float32
        scales' four)."""
        from ember.models.registry import model_class

        cls = model_class(self.model_config.architecture)
        parallel = ShapeGroup(0, self.tensor_parallel_size)
        with torch.device("meta"):
            model = cls(self.model_config, _NoOps(), None, parallel).cast_to(self.dtype)
        return sum(p.numel() * p.element_size() for p in model.parameters())

    @property
    def reserve_bytes(self) -> int:
        """Room kept for the largest step's activations and logits, and on a GPU the CUDA
        graphs' pool: an estimate, charged to the model while it is loaded."""
        cfg, limits = self.rank_config, self.limits
        per_token = _mlp_activations(cfg) + cfg.q_size + 2 * cfg.kv_size + 3 * cfg.hidden_size
        # x2: an op's input and output are alive together; logits are fp32, plus a processed copy.
        step = 2 * limits.max_num_batched_tokens * per_token * self.elem_bytes
        logits = 2 * limits.max_num_seqs * cfg.vocab_size * 4
        fixed = GPU_ACTIVATION_RESERVE if self.device.type == "cuda" else 0
        return fixed + step + logits

    def check_complete(self) -> None:
        """ValueError naming the file and the tensor if the checkpoint lacks one the model
        reads (headers only: for the load to call before it allocates anything); dummy weights
        read none."""
        if not self.config.dummy_weights:
            check_complete(self.layout, list(self.tensor_headers.values()))

    def kv_blocks_for(self, kv_bytes: int) -> int:
        """The most blocks (of the full layers' pool, beside the local one) ``kv_bytes``
        hold."""
        blocks = max(2, kv_bytes // self.kv_block_bytes)  # as many local blocks as full ones
        bound = self.local_kv_bound
        if bound is None or blocks <= bound:
            return blocks
        local_bytes = bound * len(self.local_layers) * self.kv_layer_block_bytes
        main_layers = self.rank_config.num_layers - len(self.local_layers)
        return max(bound, (kv_bytes - local_bytes) // (main_layers * self.kv_layer_block_bytes))

    def close(self) -> None:
        close = getattr(self.checkpoint, "close", None)
        if close is not None:
            close()


def _mlp_activations(cfg: ModelConfig) -> int:
    """Elements one token's MLP holds at once: gate and up of a dense MLP; of a mixture of
    experts, the router's logits and, for each of its experts, gate and up, their product and
    the expert's output before the weighted sum (a fused kernel's scratch), and a shared
    expert's gate, up and product."""
    dense = 2 * cfg.intermediate_size
    if cfg.num_experts == 0:
        return dense
    per_expert = 3 * cfg.moe_intermediate_size + cfg.hidden_size
    shared = 3 * cfg.shared_expert_intermediate_size
    return max(dense, cfg.num_experts + cfg.num_experts_per_tok * per_expert + shared)


class _NoOps:
    """Stands in for `Ops` when a model is built only to count its parameters."""

    def __getattr__(self, name: str):
        return None


def plan_model(config: EngineConfig, checkpoint: Checkpoint | None = None) -> ModelPlan:
    """Read ``config``'s checkpoint metadata, tensor headers and tokenizer; no weight is read.
    ValueError naming the tensor and its file where the config's sizes disagree with the
    tensors (`check_fits`), or for a quantization ember cannot load (`fp8_scheme`). Dummy
    weights: the config and tokenizer alone (a ValueError saying so where there is no config)."""
    from ember.models.registry import model_class

    ckpt = checkpoint or _open(config)
    device = resolve_device(config.device)
    headers = [] if config.dummy_weights else ckpt.tensor_headers()
    stored_names = None if config.dummy_weights else [header.name for header in headers]
    # MXFP4 experts stay packed on every device: the Triton ops multiply them packed, the
    # reference dequantizes each expert it runs, so a CPU run checks the bytes a GPU reads.
    model_config = dataclasses.replace(
        ModelConfig.from_hf_dict(ckpt.hf_config),
        fp8=fp8_scheme(ckpt.hf_config, config.quantization),
        mxfp4_experts=mxfp4_experts(ckpt.hf_config, stored_names),
    )
    layout = model_class(model_config.architecture).checkpoint_layout(
        model_config, [header.name for header in headers]
    )
    if not config.dummy_weights:
        check_fits(layout, headers)
    tokenizer = Tokenizer.from_checkpoint(ckpt)
    model_config = _with_generation_eos(model_config, ckpt, tokenizer)
    check_shardable(model_config, config.tensor_parallel_size)
    max_model_len = min(
        config.limits.max_model_len or model_config.max_position_embeddings,
        model_config.max_position_embeddings,
    )
    return ModelPlan(
        name=config.served_model_name or config.model or ckpt.name,
        config=config,
        checkpoint=ckpt,
        tokenizer=tokenizer,
        model_config=model_config,
        device=device,
        dtype=resolve_dtype(config.dtype, device, ckpt.hf_config),
        limits=dataclasses.replace(config.limits, max_model_len=max_model_len),
        tensor_headers={header.name: header for header in headers},
        layout=layout,
    )


def _open(config: EngineConfig) -> Checkpoint:
    """``config``'s checkpoint; with dummy weights its metadata only (no weight file needed)."""
    if not config.dummy_weights:
        return open_checkpoint(config.model, download_dir=config.download_dir)
    try:
        return open_checkpoint(config.model, download_dir=config.download_dir, weights=False)
    except ValueError as error:
        raise ValueError(
            f"--load-format dummy makes the weights from the model's config.json: {error}"
        ) from error


def standalone_kv_bytes(plan: ModelPlan, memory: MemoryConfig) -> int:
    """The KV cache of a model that has the budget to itself (`LLM`, the step benchmarks):
    its configured size, else what the budget leaves after its weights and reserve."""
    cache = plan.config.cache
    if cache.num_blocks is not None:
        return plan.kv_bytes_for(cache.num_blocks)
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    if memory.memory_budget_bytes is not None:
        return memory.memory_budget_bytes - plan.weight_bytes - plan.reserve_bytes
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()  # cached-but-free blocks are not "used"
        free, total = torch.cuda.mem_get_info(plan.device)
        budget = int(total * memory.gpu_memory_utilization) - (total - free)
        return budget - plan.weight_bytes - plan.reserve_bytes
    return CPU_KV_BYTES_DEFAULT


def validate_prompt(plan: ModelPlan, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """ValueError, saying what is wrong, for a prompt or parameters the model cannot take."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    vocab = plan.model_config.vocab_size
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if len(prompt_token_ids) >= plan.max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt_token_ids)} tokens; this model's context length "
            f"is {plan.max_model_len}, so the prompt must have fewer"
        )
    for token_id in list(params.logit_bias or ()) + list(params.stop_token_ids):
        if not 0 <= int(token_id) < vocab:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {vocab})")
    if params.structured_outputs is not None:
        plan.grammars.check(params.structured_outputs)  # compiled now, kept for the request


def new_request(
    plan: ModelPlan,
    rng: random.Random,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
) -> Request:
    """The engine's request for a validated prompt: ``max_tokens`` cut to the context, a seed
    from ``rng`` where the request has none, its grammar compiled where it asks for structured
    output (ValueError if that grammar does not compile for this model)."""
    room = plan.max_model_len - len(prompt_token_ids)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    # A prompt-only request (max_tokens 0) samples after its prefill as any request does; the
    # scheduler drops that token from its one update (`Scheduler.update`).
    max_tokens = max(max_tokens, 1)
    seed = params.seed if params.seed is not None else rng.getrandbits(63)
    structured = params.structured_outputs
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        params=params,
        seed=seed,
        max_tokens=max_tokens,
        eos_token_ids=plan.model_config.eos_token_ids,
        grammar=plan.grammars.matcher(structured) if structured is not None else None,
    )


def _with_generation_eos(cfg: ModelConfig, ckpt: Checkpoint, tokenizer: Tokenizer) -> ModelConfig:
    """EOS ids come from config.json, generation_config.json and the tokenizer, merged; a
    harmony vocabulary (gpt-oss) adds `<|return|>` and `<|call|>`, which end an assistant's
    turn even where a checkpoint's generation_config.json does not list them."""
    ids: list[int] = list(cfg.eos_token_ids)
    gen_eos = ckpt.generation_config.get("eos_token_id")
    ids += gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    ids += harmony_stop_token_ids(tokenizer.added_token_id)
    return cfg.with_eos(tuple(dict.fromkeys(int(i) for i in ids)))
