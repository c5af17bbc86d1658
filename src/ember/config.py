"""Frozen configuration objects, built once from a checkpoint or from the command line."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.quantization import Fp8Scheme

from ember.layer_attention import PLAIN, LayerAttention, layer_attention_from_hf

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
    "Llama4ForCausalLM",
    "Llama4ForConditionalGeneration",
)

# Llama 4's text model, alone or inside a multimodal checkpoint (whose vision tower ember does
# not serve).
LLAMA4_ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
# Architectures whose decoder layers route each token to a few of many MLPs (ember.models.moe).
MOE_ARCHITECTURES = (
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
    *LLAMA4_ARCHITECTURES,
)
# Multimodal architectures whose text model ember serves: config.json nests it under this key.
_TEXT_CONFIG_KEYS = {"Llama4ForConditionalGeneration": "text_config"}
# Those with a q/k RMSNorm per head (Qwen3's attention).
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Those whose attention output projection takes ``attention_bias`` too (Qwen2's never has one).
_O_PROJ_BIAS_ARCHITECTURES = ("GptOssForCausalLM",)
# Those whose ``attention_bias`` is on where a config.json leaves it out.
_ATTENTION_BIAS_DEFAULT = ("Qwen2ForCausalLM", "GptOssForCausalLM")
# RoPE base where a config.json names none (transformers' ``default_theta``).
_DEFAULT_ROPE_THETA = {"GptOssForCausalLM": 150000.0}
# gpt-oss's clamped SwiGLU, which its experts' activation ("swiglu_oai") is built for.
_GPT_OSS_SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}


# How a step's Triton kernels launch (ember.kernels.pdl): programmatic dependent launch at the
# device's measured step sizes (`KernelTuning.pdl_rows`), always, or never.
PDL_MODES = ("auto", "on", "off")

# What the paged KV cache stores (`CacheConfig.kv_cache_dtype`): "auto" is the model's dtype;
# "fp8" and "fp8_e4m3" (vLLM's names for one format) are float8 e4m3 with per-layer scales.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
KV_CACHE_DTYPES = ("auto", *FP8_KV_CACHE_DTYPES)

# What `EngineConfig.quantization` may ask for (vLLM's name): "fp8" quantizes the decoder's linear
# layers to float8 e4m3 as they load, unless the checkpoint holds FP8 weights already.
QUANTIZATION_CHOICES = ("fp8",)

# How a model's weights are read (`EngineConfig.load_format`, vLLM's `--load-format`): "auto"
# from its source (safetensors or GGUF); "dummy", none: random weights made on the device from
# config.json alone (`ember.weights.dummy_weights`).
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling ("llama3" rope_type); None means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN frequency scaling ("yarn" rope_type: gpt-oss), as transformers computes it: each
    frequency blends its interpolated (divided by ``factor``) and original values over the
    dimensions between the ``beta_fast`` and ``beta_slow`` rotation counts of the
    ``original_max_position_embeddings`` context (the range rounded outwards with ``truncate``),
    and cos and sin are scaled by ``attention_factor`` (already resolved from the config)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    truncate: bool
    attention_factor: float


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs to know about one architecture instance."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | YarnRopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (0 experts: every layer's MLP is dense). Each token goes to
    # ``num_experts_per_tok`` experts of ``moe_intermediate_size``; ``norm_topk_prob``: their
    # routing weights are renormalised to sum to 1. Qwen3-MoE keeps a dense MLP (of
    # ``intermediate_size``) in ``mlp_only_layers`` and in layers not a multiple of
    # ``decoder_sparse_step`` (counting from 1).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    # A dense gated MLP of this size beside the experts of every MoE layer, its output added to
    # theirs (Llama 4's shared expert); 0: none.
    shared_expert_intermediate_size: int = 0
    # The decoder's linear layers in float8 e4m3 (`ember.quantization`); None: the model's dtype.
    # Set when the model is planned, from the checkpoint's quantization_config and the engine's
    # `quantization` option.
    fp8: Fp8Scheme | None = None
    # A mixture of experts' weights held packed in MXFP4 (`ember.layers.mxfp4`), as gpt-oss's
    # checkpoints store them; set when the model is planned (`ember.quantization.mxfp4_experts`).
    # False with an MXFP4 checkpoint: its experts are dequantized to the model's dtype at load.
    mxfp4_experts: bool = False
    # Each layer's sliding window, chunks, sinks, NoPE, QK norm (`ember.layer_attention`): one
    # entry per layer, or one entry for every layer; () where every layer is plain attention.
    layer_attention: tuple[LayerAttention, ...] = ()
    # The attention output projection has a bias (gpt-oss's ``attention_bias`` covers o_proj).
    o_proj_bias: bool = False

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; ember supports: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        cfg = _text_model_config(arch, cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        attention_bias = bool(cfg.get("attention_bias", arch in _ATTENTION_BIAS_DEFAULT))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=_dense_intermediate_size(arch, cfg),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(cfg, _DEFAULT_ROPE_THETA.get(arch, 10000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch in _QK_NORM_ARCHITECTURES,
            rope_scaling=_rope_scaling(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **(_moe_fields(arch, cfg) if arch in MOE_ARCHITECTURES else {}),
            layer_attention=layer_attention_from_hf(cfg, arch),
            o_proj_bias=attention_bias and arch in _O_PROJ_BIAS_ARCHITECTURES,
        )

    def with_eos(self, eos_ids: tuple[int, ...]) -> ModelConfig:
        return dataclasses.replace(self, eos_token_ids=eos_ids)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (from 0) routes to experts; as transformers decides."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def kv_window(self, max_model_len: int) -> int | None:
        """The keys behind a query that any layer reads, when every layer attends through a
        window shorter than ``max_model_len`` (the largest window); else None (a layer reads
        every key before its query, or a chunk's from its start)."""
        # One entry (or none: plain) stands for every layer: no walk over a claimed layer count.
        layers = [a.within(max_model_len) for a in self.layer_attention or (PLAIN,)]
        if any(a.window is None or a.chunk_size is not None for a in layers):
            return None
        return max(a.window for a in layers)

    def kv_local_layers(self, max_model_len: int) -> tuple[frozenset[int], int] | None:
        """Where some layers read every key and others only a span behind the query (a window,
        or a chunk: at most its size), the latter's indices and their longest span, which a KV
        pool of their own need hold (`ember.engine.kv_cache_manager`); else None (every layer
        alike: `kv_window`)."""
        if len(self.layer_attention) <= 1:
            return None
        spans = [a.within(max_model_len).key_span for a in self.layer_attention]
        local = frozenset(i for i, span in enumerate(spans) if span is not None)
        if not local or len(local) == len(spans):
            return None
        return local, max(spans[i] for i in local)

    def attention_of(self, layer: int) -> LayerAttention:
        """How decoder layer ``layer`` attends."""
        if len(self.layer_attention) > 1:
            return self.layer_attention[layer]
        return self.layer_attention[0] if self.layer_attention else PLAIN

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _text_model_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The config of the text model ember serves: a multimodal config's nested text config (the
    vision tower's is ignored), else ``cfg`` itself."""
    key = _TEXT_CONFIG_KEYS.get(arch)
    if key is None:
        return cfg
    text = cfg.get(key)
    if isinstance(text, dict):
        return text
    raise ValueError(f"{arch} config has no {key!r} object (its text model's config)")


def _dense_intermediate_size(arch: str, cfg: dict[str, Any]) -> int:
    """The size of the dense MLPs: Llama 4 names it ``intermediate_size_mlp`` (transformers'
    default 16384; its ``intermediate_size`` is its experts')."""
    if arch in LLAMA4_ARCHITECTURES:
        return int(cfg.get("intermediate_size_mlp", 16384))
    return int(cfg["intermediate_size"])


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json. Mixtral's experts are of
    ``intermediate_size`` and always renormalised; Qwen3-MoE's are of ``moe_intermediate_size``.
    transformers 5 saves Qwen3-MoE's expert count as ``num_local_experts`` (Mixtral's name),
    the published configs as ``num_experts``."""
    num_experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if num_experts is None:
        raise ValueError(f"{arch} config has no num_experts / num_local_experts")
    # OpenAI's gpt-oss configs name the top k ``experts_per_token`` as well.
    per_token = cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
    if per_token is None:
        raise ValueError(f"{arch} config has no num_experts_per_tok")
    fields = {"num_experts": int(num_experts), "num_experts_per_tok": int(per_token)}
    if arch == "GptOssForCausalLM":
        _check_gpt_oss_swiglu(cfg)
        return {**fields, "moe_intermediate_size": int(cfg["intermediate_size"])}
    if arch == "MixtralForCausalLM":
        return {
            **fields,
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True,
        }
    if arch in LLAMA4_ARCHITECTURES:
        return _llama4_moe_fields(cfg, fields)
    return {
        **fields,
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or 1),
    }


def _llama4_moe_fields(cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Llama 4's experts and its shared expert are of ``intermediate_size``; its MoE layers are
    ``moe_layers``, by default every ``interleave_moe_layer_step``-th (as transformers decides),
    the others dense. Each token goes to one expert, whose input (not output) is scaled by the
    router's score: a weighted sum over several experts would not be the same, so top-k > 1 is
    refused."""
    if fields["num_experts_per_tok"] != 1:
        raise ValueError(
            f"Llama 4 with num_experts_per_tok={fields['num_experts_per_tok']} is not supported: "
            "it scales each token's input to its expert by the router's score, which ember runs "
            "for one expert per token only"
        )
    if cfg.get("attention_bias"):
        raise ValueError("Llama 4 with attention_bias (biases on q, k, v and o) is not supported")
    num_layers = int(cfg["num_hidden_layers"])
    step = int(cfg.get("interleave_moe_layer_step") or 1)
    moe_layers = cfg.get("moe_layers")
    sparse = set(range(step - 1, num_layers, step) if moe_layers is None else moe_layers)
    inter = int(cfg["intermediate_size"])
    return {
        **fields,
        "moe_intermediate_size": inter,
        "shared_expert_intermediate_size": inter,
        "mlp_only_layers": tuple(i for i in range(num_layers) if i not in sparse),
    }


def _check_gpt_oss_swiglu(cfg: dict[str, Any]) -> None:
    for name, value in _GPT_OSS_SWIGLU.items():
        if float(cfg.get(name, value)) != value:
            raise ValueError(
                f"GptOssForCausalLM: {name}={cfg[name]} is not supported; ember's gpt-oss "
                f"experts use {name}={value}"
            )


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 moved theta and scaling into "rope_parameters"; older files use rope_scaling.
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _rope_theta(cfg: dict[str, Any], default: float) -> float:
    return cfg.get("rope_theta") or _rope_params(cfg).get("rope_theta") or default


def _rope_scaling(cfg: dict[str, Any]) -> RopeScaling | YarnRopeScaling | None:
    params = _rope_params(cfg)
    kind = params.get("rope_type") or params.get("type")
    if kind in (None, "default"):
        return None
    if kind == "yarn":
        return _yarn_scaling(cfg, params)
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: llama3, yarn")
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _yarn_scaling(cfg: dict[str, Any], params: dict[str, Any]) -> YarnRopeScaling:
    """YaRN's parameters with transformers' defaults: the original context from the config's
    top level, else the rope parameters, else ``max_position_embeddings``; the attention
    factor, unless given, ``0.1 ln(factor) + 1`` (or the ratio of two such terms with
    ``mscale`` and ``mscale_all_dim``). ``factor`` is required, as transformers requires it."""
    if params.get("factor") is None:
        raise ValueError("yarn rope scaling without a factor")
    factor = float(params["factor"])
    original = int(
        cfg.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or cfg.get("max_position_embeddings", 4096)
    )
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return YarnRopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. The pool holds num_blocks blocks of block_size tokens."""

    block_size: int = 16
    num_blocks: int | None = None  # None: sized from the memory budget
    kv_cache_memory_bytes: int | None = None  # None: the model's share of the memory budget
    # Full blocks are kept after their request ends and shared by later requests with the same
    # prefix (`ember.engine.kv_cache_manager`).
    enable_prefix_caching: bool = True
    # One of KV_CACHE_DTYPES: "auto" stores keys and values in the model's dtype; "fp8" in
    # float8 e4m3, twice the tokens in the same bytes (docs/CONTRACTS.md, "FP8 KV cache").
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"not {self.kv_cache_dtype!r}"
            )


@dataclass(frozen=True)
class StepLimits:
    """What one engine step may hold, passed as one object to everything sized by it (the
    scheduler, the runner's buffers, its CUDA graphs, the sampler): sequences per step, tokens
    fed per step, a sequence's length (0: the model's), and the most tokens one prompt feeds in
    a step (0: the whole remaining budget)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    long_prefill_token_threshold: int = 0

    @property
    def max_step_tokens(self) -> int:
        """Rows the step's token arrays hold: a decode step may feed one per sequence even
        where that is more than the token budget."""
        return max(self.max_num_batched_tokens, self.max_num_seqs)


@dataclass(frozen=True)
class ModelPolicy:
    """How the engine treats one model among several (`ember.engine.model_pool`): ``pinned``
    models are never put to sleep; one idle (no request) for ``idle_timeout_s`` sleeps;
    ``preload`` loads it at start when it fits without evicting another; ``memory_share`` is
    the fraction of the memory budget its weights, KV cache and reserve aim for (None: the KV
    cache gets ``kv_cache_memory_bytes``, else an equal share of the budget per model)."""

    pinned: bool = False
    idle_timeout_s: float | None = None
    preload: bool = True
    memory_share: float | None = None


@dataclass(frozen=True)
class MemoryConfig:
    """The engine process's one memory budget, shared by every model it holds.

    ``gpu_memory_utilization``: the process's share of the GPU (weights, KV caches, graph pools
    and activations of all loaded models). ``memory_budget_bytes`` replaces it with a byte count
    (the only budget on a CPU, where None means no limit). ``sleep_host_memory_bytes`` bounds
    the pinned host memory holding sleeping models' weights (None: no bound); past it, a
    sleeping model's weights are dropped and read again from its checkpoint on wake."""

    gpu_memory_utilization: float = 0.90
    memory_budget_bytes: int | None = None
    sleep_host_memory_bytes: int | None = None


# Options of `memory_config` (engine-wide, not per model).
MEMORY_OPTIONS = tuple(f.name for f in dataclasses.fields(MemoryConfig))


def memory_config(**options: Any) -> MemoryConfig:
    """A `MemoryConfig` from flat options; one left out or None keeps its default."""
    unknown = sorted(set(options) - set(MEMORY_OPTIONS))
    if unknown:
        raise TypeError(f"unknown memory option(s): {', '.join(unknown)}")
    return MemoryConfig(**{k: v for k, v in options.items() if v is not None})


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    # Where models from an object store (s3://) are cached, and where compiled kernels are
    # kept (`ember.kernels.kernel_cache`); None: under the user's cache directory.
    download_dir: str | None = None
    kernel_cache_dir: str | None = None
    # `ember bench tune`'s tune.json whose fused-MoE tiles this model's kernels launch with,
    # over those shipped for its GPU (`ember.kernels.tuning_files`); None: the shipped ones.
    kernel_tuning: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    served_model_name: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    limits: StepLimits = field(default_factory=StepLimits)
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs
    lazy_cuda_graphs: bool = False  # capture each graph when first needed instead of at start
    # Threads that compile the graphs' Triton kernels before the captures (None: one per CPU
    # this process may use, up to 16; 0: each kernel compiles at its first launch).
    compile_workers: int | None = None
    # "full": graphs for decode and mixed (prefill) steps; "decode": decode steps only.
    cuda_graph_mode: str = "full"
    backend: str = "auto"  # compute primitives: auto (Triton on CUDA), triton or reference
    # Programmatic dependent launch between the Triton kernels of a step (Hopper and later):
    # "auto" at the device's measured step sizes (`KernelTuning.pdl_rows`), "on" or "off".
    programmatic_launch: str = "auto"
    # Decode steps apply RoPE and write the KV cache inside the attention kernel (Triton path;
    # bench/results/README.md, "RoPE in decode attention").
    decode_rope_in_attention: bool = True
    # Deferred RMSNorm (Triton path, ember.layers.row_norm): decoder norm weights folded into the
    # projections they feed; the residual add and the norm's statistics ride in the GEMM that
    # adds to the stream, 1/rms in the kernel that reads the next projection
    # (bench/results/README.md, "Deferred norms").
    defer_norms: bool = True
    # FP8 weight tiles (the skinny GEMM's, the experts') and an FP8 cache's widen to bf16 by
    # their bits in PTX, not Triton's conversions (Triton path; `ember.kernels.fp8_widen`;
    # bench/results/README.md, "FP8 widened in PTX").
    fp8_widen_in_registers: bool = True
    overlap: bool | None = None  # None: overlap CPU and GPU work when on a GPU
    policy: ModelPolicy = field(default_factory=ModelPolicy)
    # One of QUANTIZATION_CHOICES, or None: the checkpoint as it is (FP8 weights stay FP8).
    quantization: str | None = None
    # One of LOAD_FORMATS; "dummy": random weights, seeded by `seed`, no weight file read.
    load_format: str = "auto"
    # GPUs of this host the model is split over (vLLM's name): one worker process per GPU
    # past the first (`ember.parallel`); 1: the model runs in the engine process alone.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)} (or left out), "
                f"not {self.quantization!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, not {self.tensor_parallel_size}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, not {self.load_format!r}"
            )

    @property
    def dummy_weights(self) -> bool:
        """Whether the weights are random, made on the device (`load_format` "dummy")."""
        return self.load_format == "dummy"

    @property
    def asks_for_triton(self) -> bool:
        """Whether this config names the Triton path outright (a CUDA device or the Triton
        backend); "auto" decides only once the engine sees the device."""
        return self.backend == "triton" or (
            self.backend == "auto" and self.device.startswith("cuda")
        )


# Options of `engine_config` that set a field of a section, by the name users know them by
# (vLLM's, where vLLM has one).
_SECTION_OPTIONS: dict[str, tuple[str, str]] = {
    "block_size": ("cache", "block_size"),
    "num_gpu_blocks_override": ("cache", "num_blocks"),
    "kv_cache_memory_bytes": ("cache", "kv_cache_memory_bytes"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "kv_cache_dtype": ("cache", "kv_cache_dtype"),
    "max_num_seqs": ("limits", "max_num_seqs"),
    "max_num_batched_tokens": ("limits", "max_num_batched_tokens"),
    "max_model_len": ("limits", "max_model_len"),
    "long_prefill_token_threshold": ("limits", "long_prefill_token_threshold"),
    "pinned": ("policy", "pinned"),
    "idle_timeout_s": ("policy", "idle_timeout_s"),
    "preload": ("policy", "preload"),
    "memory_share": ("policy", "memory_share"),
}
_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig)) - {
    "model",
    "cache",
    "limits",
    "policy",
}
ENGINE_OPTIONS = tuple(sorted(_ENGINE_FIELDS | set(_SECTION_OPTIONS)))


def engine_config(model: str | None = None, **options: Any) -> EngineConfig:
    """The one way an `EngineConfig` is built from flat options (`ember serve`'s flags and the
    offline `LLM`'s keywords): each of `ENGINE_OPTIONS`; one left out or None keeps the default
    of its dataclass field above. ``max_num_batched_tokens`` defaults to the larger of its field's
    default and ``max_model_len``, so a whole prompt of the context fits one step."""
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
    given = {name: value for name, value in options.items() if value is not None}
    sections: dict[str, dict[str, Any]] = {"cache": {}, "limits": {}, "policy": {}}
    top: dict[str, Any] = {}
    for name, value in given.items():
        if name in _SECTION_OPTIONS:
            section, field_name = _SECTION_OPTIONS[name]
            sections[section][field_name] = value
        else:
            top[name] = value
    limits = sections["limits"]
    if "max_num_batched_tokens" not in limits:
        default = StepLimits.max_num_batched_tokens
        limits["max_num_batched_tokens"] = max(default, limits.get("max_model_len") or 0)
    return EngineConfig(
        model=model,
        cache=CacheConfig(**sections["cache"]),
        limits=StepLimits(**limits),
        policy=ModelPolicy(**sections["policy"]),
        **top,
    )
