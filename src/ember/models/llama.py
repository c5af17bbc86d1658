"""The Llama family in one implementation, with switches per architecture.

Llama 3.x and SmolLM2 (LlamaForCausalLM), Mistral (same graph), Qwen2 (q/k/v bias) and Qwen3
(per-head q/k RMSNorm, which the attention backend applies as it rotates q and k; explicit
head_dim). q/k/v and gate/up are fused into single GEMMs at load time; the linear products,
norms and activation go through the instance's `Ops`, attention through its `AttentionBackend`.
A subclass may give a layer another MLP (`mlp_for_layer`): the mixture-of-experts models of
`ember.models.llama_moe` reuse everything else. Each layer's `Attention` takes its sliding
window, chunks, sinks, NoPE, QK L2 norm and temperature tuning from
`ModelConfig.layer_attention` (Mistral's and Qwen2's windows today).

Where the ops defer the RMSNorm (`Ops.defer_norms`; not with a q/k/v bias or a q/k norm, which
sit between the projection and its reader, nor in a mixture of experts: `can_defer_norms`),
each decoder norm's weight is folded into the projection it feeds at load and the residual
stream runs in its deferred form (`ember.layers.residual`): no norm kernel inside the decoder. A pass of more rows than
`Ops.defer_norms_max_rows` runs the plain form on the same folded weights (the norms' weights are
then ones), faster where cuBLAS takes the products (bench/results/README.md, "Deferred norms").

FP8 weights (``ModelConfig.fp8``, `ember.quantization`): the decoder's projections hold float8
e4m3 weights and a float32 scale per output row, and pass the ops an `Fp8Weight`; embeddings,
norms and the output head stay in the model's dtype (the attention projections too where an FP8
checkpoint leaves them unquantized). Quantized at load, a projection takes its
norm's weight before it is quantized (one rounding). A checkpoint's FP8 weights cannot take it
without a second rounding, so a model loaded from one runs the plain form: its norms are never
folded. Loading is `ember.models.weight_placer`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ember.config import ModelConfig
from ember.layer_attention import PLAIN, AttentionTemperature, LayerAttention
from ember.layers.attention import AttentionBackend
from ember.layers.forward_context import ForwardContext
from ember.layers.fp8 import FP8_DTYPE, Fp8Weight, held_fp8_weights
from ember.layers.ops import Ops
from ember.layers.qk_norm import QkNorm
from ember.layers.residual import (
    ResidualStream,
    add_sub_block_output,
    final_norm,
    start_stream,
    sub_block_input,
)
from ember.models.checkpoint_layout import CheckpointLayout, Shapes, layer_of
from ember.models.weight_placer import (
    KV_SCALE_NAMES,
    SCALAR_SHAPES,
    TensorConversion,
    WeightPlacer,
)
from ember.parallel.group import ParallelGroup
from ember.parallel.sharding import TensorSlice, rank_config, tensor_slice, vocab_range, vocab_rows
from ember.weights.checkpoint import TensorHeader


class Projection(nn.Module):
    """A linear layer's parameters (``weight`` [out, in], ``bias``), which the ops compute with.
    ``fp8``: ``weight`` is float8 e4m3 and ``weight_scale`` float32 [out] its rows' scales.
    Not `nn.Linear`: its initialiser, run on the meta device where models are built, imports
    torch._dynamo (about a second of every start) to fill values that are never used."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fp8: bool = False) -> None:
        super().__init__()
        self.fp8 = fp8
        dtype = FP8_DTYPE if fp8 else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features)) if bias else None)
        if fp8:
            self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32))

    @property
    def operand(self) -> torch.Tensor | Fp8Weight:
        """The weight as the ops take it: an `Fp8Weight` of an FP8 projection."""
        return Fp8Weight(self.weight, self.weight_scale) if self.fp8 else self.weight

    def fp8_weights(self) -> list[Fp8Weight]:
        """Its FP8 weight with its scales (`ember.layers.fp8.held_fp8_weights`), if FP8."""
        return [self.operand] if self.fp8 else []


class Embedding(nn.Module):
    """The token embedding table (``weight`` [vocab, hidden]); `Projection` says why not
    `nn.Embedding`. Over several ranks (``parallel``), each holds its slice of the vocabulary
    (`ember.parallel.sharding`): a rank looks up the ids it holds, zero for the others, and
    the ranks' rows are summed."""

    def __init__(
        self, num_embeddings: int, dim: int, parallel: ParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.parallel = parallel or ParallelGroup()
        size = self.parallel.size
        self.first_id, self.num_ids = vocab_range(num_embeddings, self.parallel.rank, size)
        self.weight = nn.Parameter(torch.empty(vocab_rows(num_embeddings, size), dim))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return nn.functional.embedding(token_ids, self.weight)
        local = token_ids - self.first_id
        elsewhere = (local < 0) | (local >= self.num_ids)
        rows = nn.functional.embedding(local.masked_fill(elsewhere, 0), self.weight)
        rows.masked_fill_(elsewhere[:, None], 0.0)
        return self.parallel.all_reduce(rows)


# Rows of a projection folded with its norm weight at once (`_fold_norm_weights`).
_FOLD_ROWS = 2048

# Checkpoint name fragment -> (fused parameter fragment, shard index).
_FUSED_SHARDS = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def shared_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors outside the decoder layers (HF names), with their shapes."""
    hidden = cfg.hidden_size
    shared = {
        "model.embed_tokens.weight": (cfg.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not cfg.tie_word_embeddings:
        shared["lm_head.weight"] = (cfg.vocab_size, hidden)
    return shared


def attention_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A decoder layer's norms and attention tensors (names after ``model.layers.{i}.``)."""
    hidden = cfg.hidden_size
    tensors = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (cfg.q_size, hidden),
        "self_attn.k_proj.weight": (cfg.kv_size, hidden),
        "self_attn.v_proj.weight": (cfg.kv_size, hidden),
        "self_attn.o_proj.weight": (hidden, cfg.q_size),
    }
    if cfg.attention_bias:
        tensors["self_attn.q_proj.bias"] = (cfg.q_size,)
        tensors["self_attn.k_proj.bias"] = (cfg.kv_size,)
        tensors["self_attn.v_proj.bias"] = (cfg.kv_size,)
    if cfg.o_proj_bias:
        tensors["self_attn.o_proj.bias"] = (hidden,)
    if cfg.qk_norm:
        tensors["self_attn.q_norm.weight"] = (cfg.head_dim,)
        tensors["self_attn.k_norm.weight"] = (cfg.head_dim,)
    with_sinks = {layer.sinks for layer in cfg.layer_attention or (PLAIN,)}
    if len(with_sinks) > 1:
        raise ValueError("attention sinks on some layers only are not supported")
    if with_sinks == {True}:
        tensors["self_attn.sinks"] = (cfg.num_heads,)
    return tensors


def dense_mlp_tensors(hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    """A dense gated MLP's tensors (names after ``model.layers.{i}.``)."""
    return {
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }


def fp8_scale_tensors(cfg: ModelConfig, per_layer: dict[str, Shapes]) -> dict[str, Shapes]:
    """An FP8 checkpoint's scales: each projection's ``weight_scale`` added to ``per_layer``
    (one per tensor, or one per output row); returns those a layer may hold (static
    activation scales, the KV cache's)."""
    optional: dict[str, Shapes] = {}
    if cfg.fp8 is None or not cfg.fp8.from_checkpoint:
        return optional
    float_attention = not attention_in_fp8(cfg)
    for name in [name for name in per_layer if name.endswith("_proj.weight")]:
        if float_attention and name.startswith("self_attn."):
            continue
        projection = name.removesuffix(".weight")
        per_layer[f"{projection}.weight_scale"] = weight_scale_shapes(cfg, per_layer[name][0])
        optional[f"{projection}.input_scale"] = SCALAR_SHAPES
    optional.update(dict.fromkeys(KV_SCALE_NAMES, SCALAR_SHAPES))
    return optional


def attention_in_fp8(cfg: ModelConfig) -> bool:
    """Whether the attention projections are FP8: with the others, unless an FP8 checkpoint
    leaves them in float (`ember.quantization.Fp8Scheme.float_attention`)."""
    return cfg.fp8 is not None and not cfg.fp8.float_attention


def weight_scale_shapes(cfg: ModelConfig, rows: int) -> frozenset[tuple[int, ...]]:
    """The shapes an FP8 checkpoint's ``weight_scale`` of a weight of ``rows`` rows may take."""
    if cfg.fp8 is not None and cfg.fp8.weight_scales == "tensor":
        return SCALAR_SHAPES
    return frozenset({(rows, 1), (rows,)})


def is_ignored_tensor(cfg: ModelConfig, hf_name: str) -> bool:
    """A checkpoint tensor the model does not read: RoPE's inv_freq (some checkpoints store it;
    we compute our own), and the head of a model tied to its embeddings."""
    return "rotary_emb" in hf_name or (cfg.tie_word_embeddings and hf_name == "lm_head.weight")


class Attention(nn.Module):
    """A decoder layer's self-attention. ``layer`` says how it attends (a sliding window or
    chunks, sinks, NoPE, QK L2 norm, temperature tuning: docs/CONTRACTS.md, "Windows, sinks,
    chunks"); its attributes ``window``, ``chunk_size``, ``sinks`` (a parameter, or None),
    ``use_rope``, ``qk_l2_norm_eps`` and ``temperature`` reach the backend as its options, and
    Qwen3's q/k norm (``q_norm``, ``k_norm``) as ``qk_norm`` where ``fuses_qk_norm``."""

    def __init__(
        self,
        cfg: ModelConfig,
        ops: Ops,
        backend: AttentionBackend,
        layer: LayerAttention = PLAIN,
        parallel: ParallelGroup | None = None,
    ) -> None:
        """``cfg``: this rank's share of the model (`ember.parallel.sharding.rank_config`);
        ``parallel``: its ranks, which sum the output projection's products."""
        super().__init__()
        self.cfg, self.ops, self.backend = cfg, ops, backend
        self.parallel = parallel or ParallelGroup()
        fp8 = attention_in_fp8(cfg)
        self.qkv_proj = Projection(
            cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias, fp8
        )
        self.o_proj = Projection(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias, fp8=fp8)
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim))
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim))
        self.scale = cfg.head_dim**-0.5
        self.shard_sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        # An FP8 KV cache's per-tensor scales for this layer: it stores x / scale and reads
        # stored * scale. 1.0 unless a checkpoint carries calibrated ones (vLLM's default too).
        # Plain floats, set while the weights load (an FP8 checkpoint's, `WeightPlacer`): the
        # CUDA graphs captured after the load keep the values they saw. Any other cache dtype
        # ignores them.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # A window or chunk as long as the longest sequence hides nothing: dropped, it costs
        # nothing. (No backend: a model built to count its parameters.)
        layer = layer.within(backend.limits.max_model_len if backend is not None else 0)
        self.window, self.chunk_size = layer.window, layer.chunk_size
        self.use_rope, self.qk_l2_norm_eps = layer.use_rope, layer.qk_l2_norm_eps
        self.temperature = layer.temperature
        # Qwen3's q/k norms ride in the kernels that rotate q and k, where the backend takes
        # them; temperature tuning scales normalised queries, so with it they run first.
        self.fuses_qk_norm = (
            cfg.qk_norm
            and backend is not None
            and backend.takes_qk_norm
            and self.temperature is None
        )
        # gpt-oss: one learned logit per query head, in the model's dtype as transformers keeps
        # it (the kernels read it as float32).
        self.register_parameter(
            "sinks", nn.Parameter(torch.empty(cfg.num_heads)) if layer.sinks else None
        )

    def attention_options(self) -> dict[str, Any]:
        """This layer's options for `AttentionBackend.forward`: only those it sets, so a plain
        layer's call is the plain one."""
        options: dict[str, Any] = {}
        if self.window is not None:
            options["window"] = self.window
        if self.chunk_size is not None:
            options["chunk_size"] = self.chunk_size
        if self.sinks is not None:
            options["sinks"] = self.sinks
        if not self.use_rope:
            options["use_rope"] = False
        if self.qk_l2_norm_eps is not None:
            options["qk_l2_norm_eps"] = self.qk_l2_norm_eps
        if self.fuses_qk_norm:
            options["qk_norm"] = QkNorm(self.q_norm, self.k_norm, self.cfg.rms_norm_eps)
        return options

    def forward(
        self,
        stream: ResidualStream,
        norm_weight: torch.Tensor,
        ctx: ForwardContext,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> ResidualStream:
        cfg = self.cfg
        x, row_norm, stream = sub_block_input(self.ops, stream, norm_weight)
        n = x.shape[0]
        qkv = self.ops.linear(x, self.qkv_proj.operand, self.qkv_proj.bias)
        q, k, v = qkv.split(self.shard_sizes, dim=-1)
        q = q.reshape(n, cfg.num_heads, cfg.head_dim)
        k = k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm and not self.fuses_qk_norm:
            eps = cfg.rms_norm_eps
            q = self.ops.rms_norm(q.reshape(-1, cfg.head_dim), self.q_norm, eps).view_as(q)
            k = self.ops.rms_norm(k.reshape(-1, cfg.head_dim), self.k_norm, eps).view_as(k)
        if self.temperature is not None:
            scale_queries_by_position(q, ctx.positions, self.temperature)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.backend.forward(
            q,
            k,
            v,
            ctx,
            cos_sin_cache,
            k_cache,
            v_cache,
            self.scale,
            out,
            row_norm=row_norm,
            kv_scales=(self.k_scale, self.v_scale),
            **self.attention_options(),
        )
        return add_sub_block_output(
            self.ops,
            stream,
            out.view(n, cfg.q_size),
            self.o_proj.operand,
            self.o_proj.bias,
            self.parallel,
        )


def scale_queries_by_position(
    q: torch.Tensor, positions: torch.Tensor, temperature: AttentionTemperature
) -> None:
    """Llama 4's attention temperature tuning, in place on ``q [T, H, D]``: each token's query
    times ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` (float32, rounded back to
    q's dtype, as transformers scales them)."""
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / temperature.floor_scale))
    scales = scales * temperature.attn_scale + 1.0
    q.copy_((q.float() * scales[:, None, None]).to(q.dtype))


class MLP(nn.Module):
    """A dense gated MLP of ``intermediate_size`` (None: the config's); over several ranks
    (``parallel``) the rows of this rank's share, the down projection's products summed."""

    def __init__(
        self,
        cfg: ModelConfig,
        ops: Ops,
        intermediate_size: int | None = None,
        parallel: ParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.parallel = parallel or ParallelGroup()
        fp8 = cfg.fp8 is not None
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Projection(cfg.hidden_size, 2 * inter, bias=False, fp8=fp8)
        self.down_proj = Projection(inter, cfg.hidden_size, bias=False, fp8=fp8)

    def forward(self, stream: ResidualStream, norm_weight: torch.Tensor) -> ResidualStream:
        x, row_norm, stream = sub_block_input(self.ops, stream, norm_weight)
        act = self.ops.gate_up_silu(x, self.gate_up_proj.operand, row_norm=row_norm)
        return add_sub_block_output(
            self.ops, stream, act, self.down_proj.operand, parallel=self.parallel
        )


class DecoderLayer(nn.Module):
    """Pre-norm attention, then ``mlp``: a module called as ``mlp(stream, norm_weight)`` that
    returns the stream with its output added or pending (the dense `MLP`, or a mixture of
    experts). ``index``: the layer's place, which decides how it attends."""

    def __init__(
        self,
        cfg: ModelConfig,
        ops: Ops,
        attention: AttentionBackend,
        mlp: nn.Module,
        index: int,
        parallel: ParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, ops, attention, cfg.attention_of(index), parallel)
        self.mlp = mlp
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(
        self,
        stream: ResidualStream,
        ctx: ForwardContext,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> ResidualStream:
        stream = self.self_attn(stream, self.input_layernorm, ctx, cos_sin_cache, k_cache, v_cache)
        return self.mlp(stream, self.post_attention_layernorm)


class LlamaForCausalLM(nn.Module):
    """Token ids in, final hidden states out; `compute_logits` on the rows that sample.

    Over several ranks (``parallel``: `ember.parallel`), the model is one rank's share: built
    from the config of its share (``cfg``; the whole model's is ``full_cfg``), it reads its
    slices of the checkpoint (`tensor_slice`), and its collectives run inside `forward` and
    `compute_logits`, which every rank calls in the same order."""

    # Whether some checkpoint tensors are converted into their parameters (`tensor_conversion`).
    converts_tensors = False
    # What the checkpoint's names of the model's tensors start with (a multimodal checkpoint's
    # text model: Llama 4's ``language_model.``); its layers are under ``{prefix}model.layers.``.
    checkpoint_prefix = ""

    def __init__(
        self,
        cfg: ModelConfig,
        ops: Ops,
        attention: AttentionBackend,
        parallel: ParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel = parallel or ParallelGroup()
        self.full_cfg = cfg
        self.cfg = cfg = rank_config(cfg, parallel.size)
        self.ops = ops
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, ops, attention, self.mlp_for_layer(cfg, ops, i), i, parallel)
            for i in range(cfg.num_layers)
        )
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        if not cfg.tie_word_embeddings:
            rows = vocab_rows(cfg.vocab_size, parallel.size)
            self.lm_head = nn.Parameter(torch.empty(rows, cfg.hidden_size))
        # Temperature tuning scales the queries before attention could apply a deferred 1/rms.
        self.defers_norms = (
            ops.defer_norms
            and self.can_defer_norms(cfg)
            and all(layer.self_attn.temperature is None for layer in self.layers)
        )

    def mlp_for_layer(self, cfg: ModelConfig, ops: Ops, layer: int) -> nn.Module:
        """The MLP of decoder layer ``layer``: the dense gated one here."""
        return MLP(cfg, ops, parallel=self.parallel)

    @staticmethod
    def can_defer_norms(cfg: ModelConfig) -> bool:
        """Whether the decoder norms may be folded into the projections they feed: not where
        a q/k/v bias or a q/k norm sits between the projection and its reader, nor into an FP8
        checkpoint's weights (folding would round them twice)."""
        fp8_checkpoint = cfg.fp8 is not None and cfg.fp8.from_checkpoint
        return not cfg.attention_bias and not cfg.qk_norm and not fp8_checkpoint

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        stream = start_stream(
            self.ops, hidden, self.cfg.rms_norm_eps, self._defers_norms_for(hidden)
        )
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache[i]  # a local layer's: in its own pool (`for_layer`)
            stream = layer(stream, ctx.for_layer(i), cos_sin_cache, k_cache, v_cache)
        return final_norm(self.ops, stream, self.norm)

    def _defers_norms_for(self, hidden: torch.Tensor) -> bool:
        """Whether this pass runs the deferred form. The folded weights serve both: the plain
        form's norms have weights of ones, and ``W diag(g)`` then reads ``x / rms``."""
        limit = self.ops.defer_norms_max_rows
        return self.defers_norms and (limit is None or hidden.shape[0] <= limit)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits in the model's dtype, as Hugging Face's are: greedy decoding takes the argmax
        of them as they are (a bf16 value's float32 is exact), and the sampler widens them to
        float32 only where it computes with them, sparing a [B, V] float32 copy per step.
        Over several ranks each computes its vocabulary slice's and rank 0, the one that
        samples, gathers them (the others get None): the other ranks never read logits, so an
        all-gather would move (size - 1) times the bytes for nothing."""
        weight = self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head
        logits = self.ops.linear(hidden, weight)
        if self.parallel.size == 1:
            return logits
        gathered = self.parallel.gather_to_first(logits)
        vocab = self.cfg.vocab_size
        if gathered is None or gathered.shape[-1] == vocab:
            return gathered
        return gathered[:, :vocab].contiguous()  # the last rank's padding rows

    # -- weights ---------------------------------------------------------------------------------

    def cast_to(self, dtype: torch.dtype) -> LlamaForCausalLM:
        """The model with its parameters in ``dtype``, but FP8 weights and their scales (a
        projection's, stacked experts'), which keep float8 e4m3 and float32, and packed ones
        (MXFP4 experts' uint8 blocks and scales), which keep their integers."""
        kept = {id(param) for weight in held_fp8_weights(self) for param in weight}

        def cast(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) in kept or not tensor.is_floating_point():
                return tensor
            return tensor.to(dtype)

        return self._apply(cast)

    @classmethod
    def checkpoint_layout(
        cls, cfg: ModelConfig, stored_names: Collection[str] = ()
    ) -> CheckpointLayout:
        """The checkpoint tensors (HF names) a model of ``cfg`` reads, and their shapes.
        ``stored_names``: the checkpoint's tensor names, for a subclass whose tensors may be
        stored in more than one form (unused here)."""
        per_layer: dict[str, Shapes] = {
            **attention_tensors(cfg),
            **dense_mlp_tensors(cfg.hidden_size, cfg.intermediate_size),
        }
        optional = fp8_scale_tensors(cfg, per_layer)
        return CheckpointLayout(
            cfg.architecture,
            cfg.num_layers,
            shared_tensors(cfg),
            per_layer,
            functools.partial(is_ignored_tensor, cfg),
            optional,
        )

    def load_weights(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        on_tensor: Callable[[int], None] | None = None,
        headers: Mapping[str, TensorHeader] | None = None,
    ) -> None:
        """Copy checkpoint tensors (HF names) into the fused parameters; every one must land,
        and hold finite values. ``on_tensor(n)`` is called as the n-th tensor lands (or is
        skipped); ``headers`` (by HF name) name each tensor's file in errors. Weights quantized
        at load are quantized as soon as they (and the norm that folds into them) have landed."""
        placer = self.weight_placer(headers)
        for count, (hf_name, tensor) in enumerate(tensors, start=1):
            part = self.tensor_slice(hf_name, tuple(tensor.shape))
            if part is not None:  # a source read whole (GGUF): this rank's slice of it
                tensor = part.of(tensor)
            target = placer.target(hf_name, tuple(tensor.shape), tensor.dtype)
            if target is not None:
                target.copy_(tensor)
                if placer.transforms:
                    placer.transform_landed()
            if on_tensor is not None:
                on_tensor(count)
        placer.finish()

    def tensor_slice(self, hf_name: str, shape: tuple[int, ...]) -> TensorSlice | None:
        """The slice of checkpoint tensor ``hf_name`` (of ``shape``) this rank reads; None:
        all of it (`ember.parallel.sharding`)."""
        parallel = self.parallel
        if parallel.size == 1:
            return None
        return tensor_slice(self.full_cfg, hf_name, shape, parallel.rank, parallel.size)

    @property
    def vocab_parallel_params(self) -> frozenset[str]:
        """The parameters that hold a slice of the vocabulary, padded past it on the last rank
        (none on one rank)."""
        if self.parallel.size == 1:
            return frozenset()
        head = () if self.cfg.tie_word_embeddings else ("lm_head",)
        return frozenset({"embed_tokens.weight", *head})

    def load_group(self, hf_name: str) -> Hashable:
        """The tensors a loader lands together before the FP8 weights among them are quantized
        (`WeightPlacer.load_group`): a decoder layer's (None: the shared tensors)."""
        return layer_of(hf_name)

    def weight_placer(self, headers: Mapping[str, TensorHeader] | None = None) -> WeightPlacer:
        """Where each checkpoint tensor goes, for loaders that copy the bytes themselves
        (`ember.weights.parallel_load`); call its ``finish`` once every tensor has landed.
        ``headers`` (by HF name) name each tensor's file in errors."""
        return WeightPlacer(self, headers or {})

    def arrange_loaded_weights(self) -> None:
        """Reorder, once every tensor has landed, weights that a checkpoint stores in another
        order than the ops read (`WeightPlacer.finish` calls it): none here."""

    @torch.no_grad()
    def _fold_norm_weights(self) -> None:
        """``W <- W diag(g)`` for each decoder RMSNorm (weight g) and the projection it feeds,
        in float32 and rounded once; the norm keeps a weight of ones, so running it would
        change nothing. Row blocks at a time: the weights load after the KV cache has taken the
        GPU's free memory, and a whole fp32 copy of gate/up is ~1 GB on an 8B model. An FP8
        projection took its norm as it was quantized (`norm_folded_into`)."""
        for layer in self.layers:
            for norm, linear in (
                (layer.input_layernorm, layer.self_attn.qkv_proj),
                (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
            ):
                if not linear.fp8:
                    scale = norm.float()[None, :]
                    for rows in linear.weight.split(_FOLD_ROWS):
                        rows.copy_(rows.float() * scale)
                norm.fill_(1.0)

    def norm_folded_into(self, param_name: str) -> str | None:
        """The norm weight (parameter name) that a model deferring its norms folds into the
        projection weight ``param_name``, or None."""
        if not self.defers_norms:
            return None
        for projection, norm in (
            (".self_attn.qkv_proj.weight", ".input_layernorm"),
            (".mlp.gate_up_proj.weight", ".post_attention_layernorm"),
        ):
            if param_name.endswith(projection):
                return param_name.removesuffix(projection) + norm
        return None

    def is_row_parallel(self, param_name: str) -> bool:
        """Whether parameter ``param_name`` holds this rank's columns of whole rows (o, down,
        and the experts' w2 over several ranks), whose products the ranks sum."""
        row_parallel = (".o_proj.weight", ".down_proj.weight", ".w2")
        return self.parallel.size > 1 and param_name.endswith(row_parallel)

    def tensor_conversion(self, hf_name: str) -> TensorConversion | None:
        """How the checkpoint tensor ``hf_name`` becomes (part of) a parameter where it is not
        copied into one (`ember.models.weight_placer`): never here."""
        return None

    def _param_name(self, hf_name: str) -> tuple[str | None, int | None]:
        if is_ignored_tensor(self.cfg, hf_name):
            return None, None
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight":
            return "lm_head", None
        for suffix in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"):
            name = name.replace(f".{suffix}.weight", f".{suffix}")
        if name == "norm.weight":
            name = "norm"
        for fragment, (fused, shard) in _FUSED_SHARDS.items():
            if fragment in name:
                return name.replace(fragment, fused), shard
        return name, None

    def _shard_view(self, data: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        cfg = self.cfg
        sizes = (
            [cfg.q_size, cfg.kv_size, cfg.kv_size]
            if ".qkv_proj." in name
            else [cfg.intermediate_size, cfg.intermediate_size]
        )
        start = sum(sizes[:shard])
        return data.narrow(0, start, sizes[shard])

    def _shard_count(self, name: str) -> int:
        """How many checkpoint tensors fill parameter ``name`` shard by shard (0: one, whole);
        an FP8 projection's scales are fused as its weights are."""
        if name.endswith((".qkv_proj.weight", ".qkv_proj.bias", ".qkv_proj.weight_scale")):
            return 3
        if name.endswith((".gate_up_proj.weight", ".gate_up_proj.weight_scale")):
            return 2
        return 0

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name in loaded:  # whole, from one tensor
                continue
            count = self._shard_count(name)
            wanted = [f"{name}#{i}" for i in range(count)] if count else [name]
            missing += [w for w in wanted if w not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
