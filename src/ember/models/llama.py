"""The Llama family in one implementation, with switches per architecture.

Llama 3.x and SmolLM2 (LlamaForCausalLM), Mistral (same graph), Qwen2 (q/k/v bias) and Qwen3
(per-head q/k RMSNorm, explicit head_dim). q/k/v and gate/up are fused into single GEMMs at load
time; the linear products, norms and activation go through the instance's `Ops`, attention
through its `AttentionBackend`. Each layer's `Attention` takes its sliding window, chunks, sinks,
NoPE, QK L2 norm and temperature tuning from `ModelConfig.layer_attention` (Mistral's and
Qwen2's windows today; the mixture-of-experts families reuse the module).

Where the ops defer the RMSNorm (`Ops.defer_norms`; not with a q/k/v bias or a q/k norm, which
sit between the projection and its reader), each decoder norm's weight is folded into the
projection it feeds at load and the residual stream runs in its deferred form
(`ember.layers.residual`): no norm kernel inside the decoder. A pass of more rows than
`Ops.defer_norms_max_rows` runs the plain form on the same folded weights (the norms' weights are
then ones), faster where cuBLAS takes the products (bench/results/README.md, "Deferred norms").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ember.config import ModelConfig
from ember.layer_attention import PLAIN, AttentionTemperature, LayerAttention
from ember.layers.attention import AttentionBackend
from ember.layers.forward_context import ForwardContext
from ember.layers.ops import Ops
from ember.layers.residual import (
    ResidualStream,
    add_sub_block_output,
    final_norm,
    start_stream,
    sub_block_input,
)
from ember.models.checkpoint_layout import CheckpointLayout
from ember.weights.checkpoint import TensorHeader
from ember.weights.finite_check import first_non_finite


class Projection(nn.Module):
    """A linear layer's parameters (``weight`` [out, in], ``bias``), which the ops compute with.
    Not `nn.Linear`: its initialiser, run on the meta device where models are built, imports
    torch._dynamo (about a second of every start) to fill values that are never used."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features)) if bias else None)


class Embedding(nn.Module):
    """The token embedding table (``weight`` [vocab, hidden]); `Projection` says why not
    `nn.Embedding`."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(token_ids, self.weight)


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


def _ignored(cfg: ModelConfig, hf_name: str) -> bool:
    """A checkpoint tensor the model does not read: RoPE's inv_freq (some checkpoints store it;
    we compute our own), and the head of a model tied to its embeddings."""
    return "rotary_emb" in hf_name or (cfg.tie_word_embeddings and hf_name == "lm_head.weight")


class Attention(nn.Module):
    """A decoder layer's self-attention. ``layer`` says how it attends (a sliding window or
    chunks, sinks, NoPE, QK L2 norm, temperature tuning: docs/CONTRACTS.md, "Windows, sinks,
    chunks"); its attributes ``window``, ``chunk_size``, ``sinks`` (a parameter, or None),
    ``use_rope``, ``qk_l2_norm_eps`` and ``temperature`` reach the backend as its options."""

    def __init__(
        self,
        cfg: ModelConfig,
        ops: Ops,
        backend: AttentionBackend,
        layer: LayerAttention = PLAIN,
    ) -> None:
        super().__init__()
        self.cfg, self.ops, self.backend = cfg, ops, backend
        self.qkv_proj = Projection(
            cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias
        )
        self.o_proj = Projection(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim))
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim))
        self.scale = cfg.head_dim**-0.5
        self.shard_sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        # An FP8 KV cache's per-tensor scales for this layer: it stores x / scale and reads
        # stored * scale. 1.0 unless a checkpoint carries calibrated ones (vLLM's default too).
        # Plain floats, set while the weights load: the CUDA graphs captured after the load
        # keep the values they saw. Any other cache dtype ignores them.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # A window or chunk as long as the longest sequence hides nothing: dropped, it costs
        # nothing. (No backend: a model built to count its parameters.)
        layer = layer.within(backend.limits.max_model_len if backend is not None else 0)
        self.window, self.chunk_size = layer.window, layer.chunk_size
        self.use_rope, self.qk_l2_norm_eps = layer.use_rope, layer.qk_l2_norm_eps
        self.temperature = layer.temperature
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
        qkv = self.ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split(self.shard_sizes, dim=-1)
        q = q.reshape(n, cfg.num_heads, cfg.head_dim)
        k = k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
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
        return add_sub_block_output(self.ops, stream, out.view(n, cfg.q_size), self.o_proj.weight)


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
    def __init__(self, cfg: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = Projection(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Projection(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, stream: ResidualStream, norm_weight: torch.Tensor) -> ResidualStream:
        x, row_norm, stream = sub_block_input(self.ops, stream, norm_weight)
        act = self.ops.gate_up_silu(x, self.gate_up_proj.weight, row_norm=row_norm)
        return add_sub_block_output(self.ops, stream, act, self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, ops: Ops, attention: AttentionBackend, index: int = 0
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, ops, attention, cfg.attention_of(index))
        self.mlp = MLP(cfg, ops)
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
    """Token ids in, final hidden states out; `compute_logits` on the rows that sample."""

    def __init__(self, cfg: ModelConfig, ops: Ops, attention: AttentionBackend) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, ops, attention, i) for i in range(cfg.num_layers)
        )
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        # Temperature tuning scales the queries before attention could apply a deferred 1/rms.
        self.defers_norms = (
            ops.defer_norms
            and not cfg.attention_bias
            and not cfg.qk_norm
            and all(layer.self_attn.temperature is None for layer in self.layers)
        )

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
            stream = layer(stream, ctx, cos_sin_cache, kv_cache[i, 0], kv_cache[i, 1])
        return final_norm(self.ops, stream, self.norm)

    def _defers_norms_for(self, hidden: torch.Tensor) -> bool:
        """Whether this pass runs the deferred form. The folded weights serve both: the plain
        form's norms have weights of ones, and ``W diag(g)`` then reads ``x / rms``."""
        limit = self.ops.defer_norms_max_rows
        return self.defers_norms and (limit is None or hidden.shape[0] <= limit)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype, as Hugging Face's are: greedy decoding takes the argmax
        of them as they are (a bf16 value's float32 is exact), and the sampler widens them to
        float32 only where it computes with them, sparing a [B, V] float32 copy per step."""
        weight = self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head
        return self.ops.linear(hidden, weight)

    # -- weights ---------------------------------------------------------------------------------

    @staticmethod
    def checkpoint_layout(cfg: ModelConfig) -> CheckpointLayout:
        """The checkpoint tensors (HF names) a model of ``cfg`` reads, and their shapes."""
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        shared = {
            "model.embed_tokens.weight": (cfg.vocab_size, hidden),
            "model.norm.weight": (hidden,),
        }
        if not cfg.tie_word_embeddings:
            shared["lm_head.weight"] = (cfg.vocab_size, hidden)
        per_layer = {
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (cfg.q_size, hidden),
            "self_attn.k_proj.weight": (cfg.kv_size, hidden),
            "self_attn.v_proj.weight": (cfg.kv_size, hidden),
            "self_attn.o_proj.weight": (hidden, cfg.q_size),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
        }
        if cfg.attention_bias:
            per_layer["self_attn.q_proj.bias"] = (cfg.q_size,)
            per_layer["self_attn.k_proj.bias"] = (cfg.kv_size,)
            per_layer["self_attn.v_proj.bias"] = (cfg.kv_size,)
        if cfg.qk_norm:
            per_layer["self_attn.q_norm.weight"] = (cfg.head_dim,)
            per_layer["self_attn.k_norm.weight"] = (cfg.head_dim,)
        with_sinks = {layer.sinks for layer in cfg.layer_attention or (PLAIN,)}
        if len(with_sinks) > 1:
            raise ValueError("attention sinks on some layers only are not supported")
        if with_sinks == {True}:
            per_layer["self_attn.sinks"] = (cfg.num_heads,)
        return CheckpointLayout(
            cfg.architecture, cfg.num_layers, shared, per_layer, functools.partial(_ignored, cfg)
        )

    def load_weights(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        on_tensor: Callable[[int], None] | None = None,
        headers: Mapping[str, TensorHeader] | None = None,
    ) -> None:
        """Copy checkpoint tensors (HF names) into the fused parameters; every one must land,
        and hold finite values. ``on_tensor(n)`` is called as the n-th tensor lands (or is
        skipped); ``headers`` (by HF name) name each tensor's file in errors."""
        placer = self.weight_placer(headers)
        for count, (hf_name, tensor) in enumerate(tensors, start=1):
            target = placer.target(hf_name, tuple(tensor.shape))
            if target is not None:
                target.copy_(tensor)
            if on_tensor is not None:
                on_tensor(count)
        placer.finish()

    def weight_placer(self, headers: Mapping[str, TensorHeader] | None = None) -> WeightPlacer:
        """Where each checkpoint tensor goes, for loaders that copy the bytes themselves
        (`ember.weights.parallel_load`); call its ``finish`` once every tensor has landed.
        ``headers`` (by HF name) name each tensor's file in errors."""
        return WeightPlacer(self, headers or {})

    @torch.no_grad()
    def _fold_norm_weights(self) -> None:
        """``W <- W diag(g)`` for each decoder RMSNorm (weight g) and the projection it feeds,
        in float32 and rounded once; the norm keeps a weight of ones, so running it would
        change nothing. Row blocks at a time: the weights load after the KV cache has taken the
        GPU's free memory, and a whole fp32 copy of gate/up is ~1 GB on an 8B model."""
        for layer in self.layers:
            for norm, linear in (
                (layer.input_layernorm, layer.self_attn.qkv_proj),
                (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
            ):
                scale = norm.float()[None, :]
                for rows in linear.weight.split(_FOLD_ROWS):
                    rows.copy_(rows.float() * scale)
                norm.fill_(1.0)

    def _param_name(self, hf_name: str) -> tuple[str | None, int | None]:
        if _ignored(self.cfg, hf_name):
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

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name.endswith((".qkv_proj.weight", ".qkv_proj.bias")):
                wanted = [f"{name}#{i}" for i in range(3)]
            elif name.endswith(".gate_up_proj.weight"):
                wanted = [f"{name}#{i}" for i in range(2)]
            else:
                wanted = [name]
            missing += [w for w in wanted if w not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


class WeightPlacer:
    """Maps checkpoint tensors (HF names) onto a model's fused parameters and checks, once all
    have been copied, that every parameter got its tensors and that they hold finite values.
    ``headers`` (by HF name) name each tensor's file in errors."""

    def __init__(self, model: LlamaForCausalLM, headers: Mapping[str, TensorHeader]) -> None:
        self._model = model
        self._headers = headers
        self._params = dict(model.named_parameters())
        self._placed: set[str] = set()
        self._targets: list[tuple[str, torch.Tensor]] = []  # (HF name, what it fills), in order

    def target(self, hf_name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The parameter (or the shard of a fused one) ``hf_name`` fills, or None for a tensor
        the model does not use; ValueError for one it has no place for or of the wrong shape."""
        model = self._model
        name, shard = model._param_name(hf_name)
        if name is None:
            return None
        if name not in self._params:
            raise ValueError(f"{self._describe(hf_name)} has no place in {model.cfg.architecture}")
        param = self._params[name]
        target = param.data if shard is None else model._shard_view(param.data, name, shard)
        if tuple(target.shape) != tuple(shape):
            raise ValueError(
                f"{self._describe(hf_name)} has shape {tuple(shape)}, "
                f"expected {tuple(target.shape)}"
            )
        self._placed.add(name if shard is None else f"{name}#{shard}")
        self._targets.append((hf_name, target))
        return target

    def finish(self) -> None:
        """Raise if a parameter was not filled or holds a NaN or an infinity; then fold the
        norms if the model defers them (after the check: folding would hide a bad norm)."""
        self._model._check_all_loaded(self._params, self._placed)
        bad = first_non_finite(self._targets)
        if bad is not None:
            dtype = str(self._targets[0][1].dtype).removeprefix("torch.")
            raise ValueError(
                f"{self._describe(bad)} holds NaN or infinite values (as {dtype}), which would "
                "make the logits NaN: the file is damaged, or its values do not fit that dtype"
            )
        if self._model.defers_norms:
            self._model._fold_norm_weights()

    def _describe(self, hf_name: str) -> str:
        header = self._headers.get(hf_name)
        return header.describe() if header is not None else f"checkpoint tensor {hf_name!r}"
