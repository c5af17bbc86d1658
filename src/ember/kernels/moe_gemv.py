"""The fused MoE's by-pair products on the CUDA cores: a GEMV per (pair, column tile).

At a token or two a pair, `tl.dot` pads the one row to 16 and, for MXFP4 experts, spends most
of its time decoding the weight tile for the tensor cores (`tl.dot_scaled`'s upcast: about 13
instructions a value). A GEMV needs neither: each program multiplies its weight rows by the one
activation row in fp32 FMAs and sums along K once at the end. It has no 16-column floor either,
so narrow column tiles fill the GPU at one token.

MXFP4 codes decode to their values times 2^-126 in three integer operations
(`ember.kernels.mxfp4`). A K step multiplies those by the activations times 2^96 (so no product is
subnormal), sums each scale group's 32 products and multiplies the sum by the group's scale
times 2^30, ``2^(x - 97)``, built from its bits: one multiply a group, not a value. That takes
the scales e8m0 can hold up to 2^97 (byte 224; weights sit far below) and activations up to
2^32 in magnitude.

`gate_up_gemv` stores the intermediate in pair order ``[T * k, I]``, `down_gemv_by_token` sums
each token's k experts itself, with the roundings of `ember.kernels.moe_gemm` (the contract the
reference path and the other kernels keep).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.compile_ahead import launch
from ember.kernels.moe_gemm import (
    ACTIVATIONS,
    activate,
    expert_operands,
    expert_strides,
    tile_args,
    weight_format,
)
from ember.kernels.moe_tiles import GemmTiles
from ember.kernels.mxfp4 import e2m1_pairs_times_2_neg126

# Values of an MXFP4 scale group, and its packed bytes.
_GROUP = tl.constexpr(32)
_GROUP_BYTES = tl.constexpr(16)


# The activations' factor, and the scales' (their product undoes the codes' 2^-126).
_X_FACTOR = tl.constexpr(2.0**96)
_SCALE_EXPONENT_BIAS = tl.constexpr(30)


@triton.jit
def _e8m0_times_2_30(exponents):
    """float32 ``2^(x - 97)`` of e8m0 bytes ``x`` (``2^(x - 127) * 2^30``; past byte 224, the
    largest such float32 exponent, infinite)."""
    biased = exponents.to(tl.int32) + _SCALE_EXPONENT_BIAS
    bits = tl.minimum(biased, 255) << 23
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _gemv_tile(
    acc,
    x_row_ptr,
    row_ptrs,
    scale_row_ptrs,
    k0,
    k_size,
    W_FORMAT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``acc`` plus the products of the weight rows ``row_ptrs`` (``[BLOCK_N, 1]``) with the
    activation row at ``x_row_ptr`` over K columns ``[k0, k0 + BLOCK_K)`` in fp32 (its columns
    summed once, after the last step). Plain and FP8 rows: ``acc [BLOCK_N, BLOCK_K]``, element by element.
    MXFP4 rows (packed bytes, ``scale_row_ptrs`` at their group scales): ``acc [BLOCK_N, G]``,
    each scale group's sum."""
    if W_FORMAT == 2:  # W_MXFP4
        groups: tl.constexpr = BLOCK_K // _GROUP
        g = tl.arange(0, groups)
        byte = tl.arange(0, _GROUP_BYTES)
        byte_cols = (k0 // 2 + g * _GROUP_BYTES)[:, None] + byte[None, :]  # [G, 16]
        x_cols = 2 * byte_cols[:, :, None] + tl.arange(0, 2)[None, None, :]  # [G, 16, 2]
        group_cols = k0 // _GROUP + g
        if EVEN_K:
            packed = tl.load(row_ptrs[:, :, None] + byte_cols[None, :, :])
            scales = tl.load(scale_row_ptrs + group_cols[None, :])
            x = tl.load(x_row_ptr + x_cols)
        else:
            packed = tl.load(
                row_ptrs[:, :, None] + byte_cols[None, :, :],
                mask=(byte_cols < k_size // 2)[None, :, :],
                other=0,
            )
            scales = tl.load(
                scale_row_ptrs + group_cols[None, :],
                mask=(group_cols < k_size // _GROUP)[None, :],
                other=127,
            )
            x = tl.load(x_row_ptr + x_cols, mask=x_cols < k_size, other=0.0)
        x_even, x_odd = tl.split(x.to(tl.float32) * _X_FACTOR)
        even, odd = e2m1_pairs_times_2_neg126(packed)
        group_sums = tl.sum(even * x_even[None, :, :] + odd * x_odd[None, :, :], axis=2)
        acc += group_sums * _e8m0_times_2_30(scales)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(row_ptrs + ks[None, :])
            x = tl.load(x_row_ptr + ks)
        else:
            w = tl.load(row_ptrs + ks[None, :], mask=ks[None, :] < k_size, other=0.0)
            x = tl.load(x_row_ptr + ks, mask=ks < k_size, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return acc


@triton.jit
def _gemv_acc(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_FORMAT: tl.constexpr):
    """`_gemv_tile`'s accumulator."""
    if W_FORMAT == 2:  # W_MXFP4
        acc = tl.zeros([BLOCK_N, BLOCK_K // _GROUP], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    return acc


@triton.jit(do_not_specialize=["pairs"])
def _gate_up_gemv_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    ids_ptr,
    pairs,
    inter,
    hidden,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    W_FORMAT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    """``out[pair] = act(x[token] @ gate_e.T + bg, x[token] @ up_e.T + bu)`` for BLOCK_N of
    the I columns, one pair a program (pairs fastest)."""
    pid = tl.program_id(0)
    pair = pid % pairs
    tile_n = pid // pairs
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xt
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # The last column tile re-reads valid rows rather than masking its weight loads.
    w_rows = cols % inter
    gate_rows = w_rows.to(tl.int64)[:, None]
    up_rows = (w_rows + inter).to(tl.int64)[:, None]
    w_expert = w_ptr + expert * stride_we
    s_expert = w_scale_ptr + expert * stride_se
    gate_ptrs, gate_scales = w_expert + gate_rows * stride_wn, s_expert + gate_rows * stride_sn
    up_ptrs, up_scales = w_expert + up_rows * stride_wn, s_expert + up_rows * stride_sn
    acc_gate = _gemv_acc(BLOCK_N, BLOCK_K, W_FORMAT)
    acc_up = _gemv_acc(BLOCK_N, BLOCK_K, W_FORMAT)
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
        acc_gate = _gemv_tile(
            acc_gate, x_row, gate_ptrs, gate_scales, k0, hidden, W_FORMAT, EVEN_K, BLOCK_K
        )
        acc_up = _gemv_tile(
            acc_up, x_row, up_ptrs, up_scales, k0, hidden, W_FORMAT, EVEN_K, BLOCK_K
        )
    gate = tl.sum(acc_gate, axis=1)
    up = tl.sum(acc_up, axis=1)
    if W_FORMAT == 1:  # FP8 (W_FP8): each row's scale
        gate *= tl.load(s_expert + w_rows)
        up *= tl.load(s_expert + inter + w_rows)
    if HAS_BIAS:
        bias = bias_ptr + expert * stride_be
        gate += tl.load(bias + w_rows).to(tl.float32)
        up += tl.load(bias + inter + w_rows).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    result = activate(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), ACTIVATION, dtype)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + cols, result, mask=cols < inter)


@triton.jit(do_not_specialize=["tokens"])
def _down_gemv_kernel(
    a_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    tokens,
    hidden,
    inter,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_ot,
    TOP_K: tl.constexpr,
    W_FORMAT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    """``out[t] = sum_j round(round(a[t*k+j] @ w2_e.T + b2_e) * weight[t*k+j])`` for BLOCK_N of
    the H columns, e = the j-th expert of token t, summed in fp32 in slot order."""
    pid = tl.program_id(0)
    token = pid % tokens
    tile_n = pid // tokens
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = cols % hidden
    w_row_offsets = w_rows.to(tl.int64)[:, None] * stride_wn
    s_row_offsets = w_rows.to(tl.int64)[:, None] * stride_sn
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token.to(tl.int64) * TOP_K + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        a_row = a_ptr + pair * stride_am
        w_ptrs = w_ptr + expert * stride_we + w_row_offsets
        s_ptrs = w_scale_ptr + expert * stride_se + s_row_offsets
        acc = _gemv_acc(BLOCK_N, BLOCK_K, W_FORMAT)
        for k0 in tl.range(0, inter, BLOCK_K, num_stages=STAGES):
            acc = _gemv_tile(acc, a_row, w_ptrs, s_ptrs, k0, inter, W_FORMAT, EVEN_K, BLOCK_K)
        expert_out = tl.sum(acc, axis=1)
        if W_FORMAT == 1:  # FP8 (W_FP8): each row's scale
            expert_out *= tl.load(w_scale_ptr + expert * stride_se + w_rows)
        if HAS_BIAS:
            expert_out += tl.load(bias_ptr + expert * stride_be + w_rows).to(tl.float32)
        weight = tl.load(weights_ptr + pair).to(tl.float32)
        total += (expert_out.to(dtype).to(tl.float32) * weight).to(dtype).to(tl.float32)
    out = out_ptr + token.to(tl.int64) * stride_ot + cols
    tl.store(out, total.to(dtype), mask=cols < hidden)


def _gemv_weight_format(weight: torch.Tensor, scale: torch.Tensor | None) -> int:
    """`W_FORMAT` of the GEMV's weights: it decodes MXFP4 on the CUDA cores itself whatever the
    activations' dtype (as `weight_format` has it for fp32 activations)."""
    return weight_format(weight, scale, torch.float32)


def gate_up_gemv(x, w13, b13, ids, top_k, activation, tiles: GemmTiles, scale=None) -> torch.Tensor:
    """``[T * k, I]`` in pair order, as `ember.kernels.moe_gemm.gate_up_by_pair`'s."""
    pairs = ids.numel()
    inter = w13.shape[1] // 2
    out = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    launch(
        _gate_up_gemv_kernel,
        (pairs * triton.cdiv(inter, tiles.block_n),),
        x,
        *expert_operands(w13, scale, b13),
        out,
        ids,
        pairs,
        inter,
        x.shape[1],
        x.stride(0),
        *expert_strides(w13, scale, b13),
        out.stride(0),
        TOP_K=top_k,
        ACTIVATION=ACTIVATIONS[activation],
        W_FORMAT=_gemv_weight_format(w13, scale),
        HAS_BIAS=b13 is not None,
        **tile_args(tiles, x.shape[1]),
    )
    return out


def down_gemv_by_token(
    a, w2, b2, ids, weights, top_k, tiles: GemmTiles, out: torch.Tensor, scale=None
) -> torch.Tensor:
    """``out [T, H]`` as `ember.kernels.moe_gemm.down_by_token`'s."""
    tokens, hidden = out.shape
    launch(
        _down_gemv_kernel,
        (tokens * triton.cdiv(hidden, tiles.block_n),),
        a,
        *expert_operands(w2, scale, b2),
        ids,
        weights,
        out,
        tokens,
        hidden,
        a.shape[1],
        a.stride(0),
        *expert_strides(w2, scale, b2),
        out.stride(0),
        TOP_K=top_k,
        W_FORMAT=_gemv_weight_format(w2, scale),
        HAS_BIAS=b2 is not None,
        **tile_args(tiles, a.shape[1]),
    )
    return out
