"""Plain-PyTorch references of ember's custom ops: the CPU path and the kernels' specification.

Each function has the same signature and semantics as its Triton kernel in ``ember.kernels``
(``paged_attention_reference`` <-> ``paged_attention`` and so on) and follows docs/CONTRACTS.md.
They favour obvious correctness over speed, may read tensors on the host, and are what the
kernel tests compare against.
"""

from __future__ import annotations

import math

import torch

from ember.config import RopeScaling, YarnRopeScaling
from ember.kernels.attention_plan import KeyStart, key_start
from ember.layers.forward_context import ForwardContext
from ember.layers.fp8 import FP8_DTYPE, FP8_E4M3_MAX, Fp8Weight, dense_weight
from ember.layers.mxfp4 import Mxfp4Weight
from ember.layers.qk_norm import QkNorm, check_qk_norms
from ember.layers.row_norm import RowNorm
from ember.layers.yarn_rope import yarn_inv_freq

# ---------------------------------------------------------------------------------------------
# FP8 KV cache (docs/CONTRACTS.md, "FP8 KV cache")

FP8_KV_DTYPE = FP8_DTYPE


def quantize_kv_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` as an FP8 cache stores it: ``clamp(x / scale, -448, 448)`` in float8 e4m3 (fp32
    division, rounded to nearest even)."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv_reference(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 values an FP8 cache's ``stored`` entries stand for: ``stored * scale``."""
    return stored.float() * scale


def _as_stored(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` in the cache's dtype: quantized with ``scale`` for FP8, else only cast."""
    if cache_dtype == FP8_KV_DTYPE:
        return quantize_kv_reference(x, scale)
    return x.to(cache_dtype)


def _as_read(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache entries as float32: dequantized with ``scale`` for FP8, else only widened."""
    if stored.dtype == FP8_KV_DTYPE:
        return dequantize_kv_reference(stored, scale)
    return stored.float()


# ---------------------------------------------------------------------------------------------
# RoPE


def _llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by ``factor``, short ones kept, and a
    smooth blend in between (same arithmetic, in the same order, as HF transformers)."""
    context = scaling.original_max_position_embeddings
    low_freq_wavelen = context / scaling.low_freq_factor
    high_freq_wavelen = context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def build_cos_sin_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    rope_scaling: RopeScaling | YarnRopeScaling | None,
) -> torch.Tensor:
    """float32 ``[max_positions, head_dim]``: cos in ``[:, :head_dim//2]``, sin in the rest
    (under YaRN both times its attention factor, as transformers scales them)."""
    if isinstance(rope_scaling, YarnRopeScaling):
        inv_freq = yarn_inv_freq(head_dim, theta, rope_scaling)
    else:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv_freq = 1.0 / (theta**exponents)
    if isinstance(rope_scaling, RopeScaling):
        inv_freq = _llama3_scaled_inv_freq(inv_freq, rope_scaling)
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    if isinstance(rope_scaling, YarnRopeScaling):
        cos, sin = cos * rope_scaling.attention_factor, sin * rope_scaling.attention_factor
    return torch.cat([cos, sin], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half (neox) rotation of ``x [T, H, D]`` in fp32, cast back to ``x.dtype``."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def l2_normalize_heads_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama 4's QK norm (`Llama4TextL2Norm`): each head of ``x [T, H, D]`` times
    ``rsqrt(mean(x**2) + eps)``, no weight, in fp32 and cast back."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_and_cache_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    row_norm: RowNorm | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    use_rope: bool = True,
    qk_l2_norm_eps: float | None = None,
    qk_norm: QkNorm | None = None,
) -> None:
    """Rotate ``q`` and ``k`` in place, then store ``k`` and ``v`` at their slots (-1: skip).
    ``row_norm``: scale each token's q, k and v by its ``1/rms`` first (``v`` itself is left
    unscaled, only its cache copy is). An FP8 cache stores k and v (as rounded to their dtype)
    quantized by ``kv_scales`` (k_scale, v_scale); other caches ignore them. ``use_rope`` False
    (a NoPE layer) skips the rotation; ``qk_norm`` RMS-normalises each head of q and k before
    it (Qwen3's, `rms_norm_reference`), ``qk_l2_norm_eps`` after it
    (`l2_normalize_heads_reference`); not both."""
    check_qk_norms(qk_norm, qk_l2_norm_eps)
    if row_norm is not None:
        q.copy_(row_norm.apply(q))
        k.copy_(row_norm.apply(k))
        v = row_norm.apply(v)
    if qk_norm is not None:  # exactly the separate `rms_norm` of each head a layer would run
        q.copy_(rms_norm_reference(q, qk_norm.q_weight, qk_norm.eps))
        k.copy_(rms_norm_reference(k, qk_norm.k_weight, qk_norm.eps))
    if use_rope:
        half = q.shape[-1] // 2
        cos_sin = cos_sin_cache[positions]
        cos, sin = cos_sin[:, :half], cos_sin[:, half:]
        q.copy_(_rotate(q, cos, sin))
        k.copy_(_rotate(k, cos, sin))
    if qk_l2_norm_eps is not None:
        q.copy_(l2_normalize_heads_reference(q, qk_l2_norm_eps))
        k.copy_(l2_normalize_heads_reference(k, qk_l2_norm_eps))
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_scale, v_scale = kv_scales
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = _as_stored(k[keep], k_cache.dtype, k_scale)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = _as_stored(v[keep], v_cache.dtype, v_scale)


# ---------------------------------------------------------------------------------------------
# Attention


def first_visible_key(
    positions: torch.Tensor, window: int | None = None, chunk_size: int | None = None
) -> torch.Tensor:
    """The lowest key position a query at each of ``positions`` sees (docs/CONTRACTS.md,
    "Windows, sinks, chunks"): 0, ``p - window + 1`` (not below 0) or ``p // chunk * chunk``."""
    start, size = key_start(window, chunk_size)
    if start == KeyStart.WINDOW:
        return (positions - size + 1).clamp(min=0)
    if start == KeyStart.CHUNK:
        return positions // size * size
    return torch.zeros_like(positions)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of fp32 ``scores [..., H, G, Q, K]`` (query head ``h * G + g``);
    ``sinks [H * G]`` (gpt-oss) join each head's denominator as a key of logit ``sink`` and value
    zero, as transformers' eager attention concatenates them and drops their column."""
    if sinks is None:
        return scores.softmax(dim=-1)
    heads, group = scores.shape[-4], scores.shape[-3]
    sink = sinks.float().view(heads, group, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    split_counters: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over the paged cache, one sequence at a time in fp32; returns ``out``.
    ``split_counters`` (the kernel's split-KV workspace) is accepted and unused. An FP8 cache's
    keys and values read as ``stored * scale`` (``kv_scales``: k_scale, v_scale). ``window`` or
    ``chunk_size`` bound the keys each query sees from below (`first_visible_key`); ``sinks``
    (``[num_q_heads]``, read as float32) add each head's sink logit to its denominator.

    Steps where every sequence has exactly one query token take one batched pass instead of a
    loop over sequences; ``max_seq_len`` bounds the gathered context there.
    """
    key_start(window, chunk_size)  # checks them
    local = {"window": window, "chunk_size": chunk_size}
    if max_query_len == 1 and q.shape[0] == seq_lens.shape[0]:  # one query per sequence
        return _decode_attention_reference(
            q,
            k_cache,
            v_cache,
            seq_lens,
            block_tables,
            scale,
            out,
            max_seq_len,
            kv_scales,
            local,
            sinks,
        )
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    k_scale, v_scale = kv_scales
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        blocks = block_tables[seq, : (seq_len + page - 1) // page].long()
        keys = _as_read(k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len], k_scale)
        values = _as_read(v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len], v_scale)
        queries = q[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", queries, keys) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = (key_pos <= query_pos[:, None]) & (
            key_pos >= first_visible_key(query_pos, **local)[:, None]
        )
        scores = scores.masked_fill(~visible, float("-inf"))
        attn = torch.einsum("hgqk,khd->qhgd", _softmax_with_sinks(scores, sinks), values)
        out[q_start:q_end] = attn.reshape(q_len, num_q_heads, head_dim).to(out.dtype)
    return out


def rope_and_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: ForwardContext,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    row_norm: RowNorm | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    use_rope: bool = True,
    qk_l2_norm_eps: float | None = None,
    qk_norm: QkNorm | None = None,
) -> torch.Tensor:
    """One layer's attention step over the metadata ``ctx``: RoPE and the cache write, then
    paged attention (``row_norm``: q, k, v scaled by each token's ``1/rms`` first;
    ``kv_scales``: an FP8 cache's k_scale and v_scale; ``use_rope``, ``qk_norm``,
    ``qk_l2_norm_eps`` as `rope_and_cache_write_reference` takes them, ``window``,
    ``chunk_size`` and ``sinks`` as `paged_attention_reference` does)."""
    rope_and_cache_write_reference(
        q,
        k,
        v,
        ctx.positions,
        cos_sin_cache,
        ctx.slot_mapping,
        k_cache,
        v_cache,
        row_norm=row_norm,
        kv_scales=kv_scales,
        use_rope=use_rope,
        qk_l2_norm_eps=qk_l2_norm_eps,
        qk_norm=qk_norm,
    )
    return paged_attention_reference(
        q,
        k_cache,
        v_cache,
        ctx.query_start_loc,
        ctx.seq_lens,
        ctx.block_tables,
        scale,
        out,
        max_query_len=ctx.max_query_len,
        max_seq_len=ctx.max_seq_len,
        kv_scales=kv_scales,
        window=window,
        chunk_size=chunk_size,
        sinks=sinks,
    )


def _decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_seq_len: int,
    kv_scales: tuple[float, float],
    local: dict[str, int | None],
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One query token per sequence: gather every sequence's context at once, mask the tail
    (and, with a window or chunks, the head)."""
    num_seqs = seq_lens.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    k_scale, v_scale = kv_scales
    blocks = block_tables[:, : (max_seq_len + page - 1) // page].long()
    keys = _as_read(k_cache[blocks].reshape(num_seqs, -1, num_kv_heads, head_dim), k_scale)
    values = _as_read(v_cache[blocks].reshape(num_seqs, -1, num_kv_heads, head_dim), v_scale)
    queries = q[:num_seqs].float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("shgd,skhd->shgk", queries, keys) * scale
    key_pos = torch.arange(keys.shape[1], device=q.device)[None, :]
    first = first_visible_key(seq_lens.long() - 1, **local)
    visible = (key_pos < seq_lens[:, None]) & (key_pos >= first[:, None])
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = _softmax_with_sinks(scores[..., None, :], sinks)[..., 0, :]
    attn = torch.einsum("shgk,skhd->shgd", probs, values)
    out[:num_seqs] = attn.reshape(num_seqs, num_q_heads, head_dim).to(out.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Normalisation and activation (Hugging Face cast order)


def _rms_normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF LlamaRMSNorm: normalise in fp32, cast to the input dtype, then multiply by the weight.
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(x.dtype) * normed.to(x.dtype)).to(x.dtype)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim of ``x [..., H]``; returns ``out`` (new if None)."""
    result = _rms_normalize(x, weight, eps)
    if out is None:
        return result
    out.copy_(result)
    return out


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual += x`` (rounded to its dtype, as HF adds), ``x = rmsnorm(residual)``."""
    residual.copy_(residual + x)
    x.copy_(_rms_normalize(residual, weight, eps))


def add_parts_rms_norm_reference(
    residual: torch.Tensor, parts: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += sum(parts)`` in place (float32 parts summed in order, rounded to the
    dtype, then added as `fused_add_rms_norm_reference` adds), and ``rmsnorm(residual)``."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    residual.copy_(residual + total.to(residual.dtype))
    return _rms_normalize(residual, weight, eps)


def linear_parts_reference(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, parts: int
) -> torch.Tensor:
    """``x @ weight.T`` as ``parts`` float32 partial sums over equal slices of K, ``[P, T, N]``
    (the split-K form `add_parts_rms_norm_reference` reduces)."""
    k = x.shape[-1]
    if k % parts:
        raise ValueError(f"K={k} does not split into {parts} equal parts")
    x_parts = x.float().reshape(-1, parts, k // parts).transpose(0, 1)
    w_parts = dense_weight(weight, x.dtype).float().reshape(-1, parts, k // parts).permute(1, 2, 0)
    return torch.bmm(x_parts, w_parts)


def add_and_sum_squares_reference(
    residual: torch.Tensor, x: torch.Tensor | None = None
) -> torch.Tensor:
    """``residual += x`` in place (rounded to its dtype), then float32 ``[T, 1]``: each row's sum
    of squares (a `RowNorm`'s parts)."""
    if x is not None:
        residual.copy_(residual + x)
    return residual.float().pow(2).sum(-1, keepdim=True)


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias``, as ``F.linear``; an `Fp8Weight` is dequantized to ``x``'s dtype
    first (``weight * scale``, rounded once)."""
    return torch.nn.functional.linear(x, dense_weight(weight, x.dtype), bias)


def linear_add_reference(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, residual: torch.Tensor
) -> torch.Tensor:
    """``residual += x @ weight.T`` (the product rounded to the dtype first, as HF adds), and the
    new rows' sums of squares, float32 ``[T, 1]``."""
    return add_and_sum_squares_reference(residual, linear_reference(x, weight))


def silu_and_mul_reference(
    x: torch.Tensor, out: torch.Tensor | None = None, *, row_norm: RowNorm | None = None
) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]``: SiLU rounded to the dtype, then the mul
    (``row_norm``: ``x``'s rows scaled by their ``1/rms`` first)."""
    if row_norm is not None:
        x = row_norm.apply(x)
    inter = x.shape[-1] // 2
    result = torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]
    if out is None:
        return result
    out.copy_(result)
    return out


def gate_up_silu_reference(
    x: torch.Tensor, gate_up_weight: torch.Tensor | Fp8Weight, *, row_norm: RowNorm | None = None
) -> torch.Tensor:
    """The gated MLP's input side: `silu_and_mul_reference` of ``x @ gate_up_weight.T``."""
    return silu_and_mul_reference(linear_reference(x, gate_up_weight), row_norm=row_norm)


# ---------------------------------------------------------------------------------------------
# Mixture of experts (docs/CONTRACTS.md, "Mixture of experts")

# gpt-oss's clamped SwiGLU ("swiglu_oai"): the gate's ceiling, the up projection's bound, and the
# sigmoid's slope.
SWIGLU_OAI_LIMIT = 7.0
SWIGLU_OAI_ALPHA = 1.702
MOE_ACTIVATIONS = ("silu", "swiglu_oai")


def expert_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """An expert's gated activation of its ``gate`` and ``up`` projections, in their dtype and
    in transformers' order: "silu" ``silu(gate) * up``; "swiglu_oai" (gpt-oss) with the gate
    clamped to at most 7 and up to [-7, 7], ``(up + 1) * (gate * sigmoid(1.702 * gate))``."""
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
        up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))
    raise ValueError(f"unknown expert activation {activation!r}; choose one of {MOE_ACTIVATIONS}")


def moe_experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor | Fp8Weight | Mxfp4Weight,
    w2: torch.Tensor | Fp8Weight | Mxfp4Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[T, H]`` in ``x``'s dtype: each token's routed experts' outputs, weighted and summed.

    ``w13 [E, 2I, H]`` (gate rows, then up rows), ``w2 [E, H, I]``, either an `Fp8Weight`
    (scales ``[E, 2I]``, ``[E, H]``) or an `Mxfp4Weight`, optional biases ``b13 [E, 2I]``,
    ``b2 [E, H]``; ``topk_ids`` int32 and ``topk_weights`` float32 ``[T, k]``. One expert at a
    time, only those some token chose (their ids read on the host): an FP8 or MXFP4 expert
    dequantized to ``x``'s dtype as it runs (the weights stay packed in memory), the expert's
    products and activation in the model's dtype as transformers computes them, each output
    times its float32 weight, summed in float32 in expert order, rounded once."""
    inter = (w2.weight if isinstance(w2, Fp8Weight) else w2).shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = torch.nn.functional.linear(x[tokens], _expert(w13, expert, x.dtype))
        if b13 is not None:
            gate_up = gate_up + b13[expert]
        act = expert_activation(gate_up[:, :inter], gate_up[:, inter:], activation)
        y = torch.nn.functional.linear(act, _expert(w2, expert, x.dtype))
        if b2 is not None:
            y = y + b2[expert]
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots, None])
    return out.to(x.dtype)


def _expert(
    stacked: torch.Tensor | Fp8Weight | Mxfp4Weight, expert: int, dtype: torch.dtype
) -> torch.Tensor:
    """Expert ``expert``'s weight of stacked experts, an FP8 or MXFP4 one dequantized to
    ``dtype``."""
    if isinstance(stacked, Fp8Weight):
        return dense_weight(Fp8Weight(stacked.weight[expert], stacked.scale[expert]), dtype)
    if isinstance(stacked, Mxfp4Weight):
        return stacked.expert(expert).dequantize(dtype)
    return stacked[expert]


# ---------------------------------------------------------------------------------------------
# Sampling

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` in int64 without overflow: the 16-bit halves separately."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def hash_mix32(x: torch.Tensor) -> torch.Tensor:
    """The contract's 32-bit integer finaliser on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``u [B, num_tokens]`` in (0, 1): the counter-based stream of each (seed, step) row."""
    seeds = seeds.long()
    seed_lo, seed_hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    row_key = hash_mix32(hash_mix32(hash_mix32(seed_lo) ^ seed_hi) ^ (steps.long() & _MASK32))
    token_key = hash_mix32(torch.arange(num_tokens, dtype=torch.int64, device=seeds.device))
    bits = hash_mix32(row_key[:, None] ^ token_key[None, :])
    # Evaluated in float32, (2**24 - 1) + 0.5 rounds up to 2**24 and u to 1.0, which would make
    # E = 0 and that token win outright; clamp to the largest float32 below 1.
    u = ((bits >> 8).to(torch.float32) + 0.5) / float(1 << 24)
    return u.clamp(max=1.0 - 2.0**-24)


def sampling_keep_mask(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """bool ``[B, V]``: the tokens a sampled row may draw after top-k, top-p and min-p.

    The most probable token is always kept (so ``top_p <= 0`` degenerates to it). Top-p masses
    are summed in float64 so the reference sits as close to the exact rule as it can.
    """
    vocab = logits.shape[-1]
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    ordered = scaled.sort(dim=-1, descending=True).values
    top = ordered[:, :1]

    k_on = ((top_k > 0) & (top_k < vocab))[:, None]
    kth = ordered.gather(1, (top_k.long().clamp(1, vocab) - 1)[:, None])
    keep = ~k_on | (scaled >= kth)

    # Mass strictly above each sorted value, among the top-k survivors (a prefix of `ordered`).
    in_top_k = ~k_on | (ordered >= kth)
    mass = torch.where(in_top_k, torch.exp((ordered - top).double()), 0.0)
    above = mass.cumsum(dim=-1) - mass
    budget = top_p.double()[:, None] * mass.sum(dim=-1, keepdim=True)
    p_cut = torch.where(in_top_k & (above < budget), ordered, float("inf")).min(dim=-1).values
    p_cut = torch.minimum(p_cut[:, None], top)
    keep &= (top_p[:, None] >= 1) | (scaled >= p_cut)

    keep &= (min_p[:, None] <= 0) | (torch.exp(scaled - top) >= min_p[:, None])
    return keep


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """int64 ``[B]`` token ids per docs/CONTRACTS.md "Sampling semantics".

    ``temperature <= 0`` is greedy (first maximum). Otherwise the exponential race
    ``argmax(l - log(-log(u)))`` over the kept tokens, ``u`` from ``hash_uniform``.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = logits.argmax(dim=-1)
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    # Only rows that filter pay for the sort (this is the engine's CPU sampler too).
    filtered = (temperature > 0) & (((top_k > 0) & (top_k < vocab)) | (top_p < 1) | (min_p > 0))
    keep = torch.ones_like(logits, dtype=torch.bool)
    if filtered.any():
        rows = filtered.nonzero().squeeze(1)
        keep[rows] = sampling_keep_mask(
            logits[rows], temperature[rows], top_k[rows], top_p[rows], min_p[rows]
        )
    u = hash_uniform(seeds, steps, vocab)
    race = torch.where(keep, scaled - torch.log(-torch.log(u)), float("-inf"))
    return torch.where(temperature > 0, race.argmax(dim=-1), greedy)
