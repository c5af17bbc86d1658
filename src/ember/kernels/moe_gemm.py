"""The fused MoE's products: gate/up with the activation in the epilogue, and down with the
routing weights, on either path of `ember.kernels.moe_tiles`.

Grouped path (on `ember.kernels.moe_align.MoeBlocks`): a program takes one block of
``block_m`` rows (pairs of one expert) and one column tile. `gate_up_grouped` gathers the
block's token rows of ``x``, multiplies them by the expert's gate and up rows in the same
program and stores ``act(gate) * up`` at the block's rows of the intermediate (sorted order,
``[max_blocks * block_m, I]``); `down_grouped` reads those rows contiguously and stores each
pair's weighted expert output at its pair row of ``[T * k, H]``; `sum_over_top_k` adds each
token's k rows in slot order (deterministic: no atomics). Programs run row block by row block
(``group_m`` blocks sweep the column tiles together), so the used blocks, which come first,
run first and the unused ones' programs, which exit at once, trail.

By-pair path (decode): `gate_up_by_pair` runs one program per (pair, column tile), its one
row padded to `tl.dot`'s 16, and stores the intermediate in pair order ``[T * k, I]``;
`down_by_token` runs one program per (token, column tile) that walks the token's k experts in
one pipelined loop and stores the sum itself: two launches, no alignment.

FP8 experts (``scale`` given: float32 ``[E, rows]``, one per expert and weight row): each
weight tile is widened to the activations' dtype for the dot (bf16 with ``fp8_in_registers``
by its bits in PTX, `ember.kernels.fp8_widen`, else by Triton's conversions: the same values)
and the expert's fp32 accumulator multiplied by its rows' scales before the bias and the
roundings below. MXFP4 experts (``w``
uint8 ``[E, rows, K / 32, 16]`` packed, ``scale`` uint8 ``[E, rows, K / 32]``): each tile is
read packed and decoded with its group scales to the activations' dtype before the dot, exactly
the dequantized weights: compiled on bf16 activations by `tl.dot_scaled`, else by the
integer decode of `ember.kernels.mxfp4`. ``W_FORMAT`` (constexpr, `weight_format`) says which.

Roundings (both paths): gate and up (bias added in fp32) rounded to the dtype, as a GEMM stores
them; the activation from those, rounded (SiLU rounded before the product, as Hugging Face's
``act_fn(gate) * up``); each expert's down output (bias added) rounded, times its routing
weight, rounded; the k of a token summed in fp32 in slot order and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.activation import silu_mul_rounded
from ember.kernels.compile_ahead import kernels_interpreted, launch
from ember.kernels.fp8_widen import fp8_in_registers as widens_in_registers
from ember.kernels.fp8_widen import widen_e4m3
from ember.kernels.moe_align import MoeBlocks
from ember.kernels.moe_tiles import MIN_DOT_ROWS, GemmTiles
from ember.kernels.mxfp4 import mxfp4_tile, mxfp4_tile_k_major

# The activations `fused_moe` takes, by their kernel constant.
ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}
# gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit, sigmoid's slope alpha (constexprs:
# the kernels read them).
SWIGLU_OAI_LIMIT = tl.constexpr(7.0)
SWIGLU_OAI_ALPHA = tl.constexpr(1.702)
# Columns a program of the sum over k adds: 16-byte accesses for 4 warps.
_SUM_BLOCK = 1024
# The weights' forms, by their kernel constant (`weight_format`).
W_PLAIN, W_FP8, W_MXFP4, W_MXFP4_SCALED, W_MXFP4_PTX, W_FP8_PTX = 0, 1, 2, 3, 4, 5


@triton.jit
def _dot_weight_tile(
    a,
    acc,
    row_ptrs,
    scale_row_ptrs,
    k0,
    k_size,
    W_FORMAT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``acc + a @ W[:, k0 : k0 + BLOCK_K].T`` for the activations' tile ``a`` ``[M, BLOCK_K]``
    and the weight rows ``row_ptrs`` ``[BLOCK_N, 1]`` point at (zeros past ``k_size`` unless
    ``EVEN_K``), their tile widened to ``a``'s dtype. MXFP4 rows (``scale_row_ptrs``: their
    scales) decode to their even and odd K columns, which multiply ``a``'s (split in registers:
    an interleaved [N, K] weight operand did not compile for Hopper's wgmma) in two dots:
    through `tl.dot_scaled` (3), in PTX to a K-major tile (4), or in Triton (2)."""
    # One return at the end: Triton would still trace the code after an early one.
    if W_FORMAT == 3:
        acc = _dot_scaled_mxfp4_tile(a, acc, row_ptrs, scale_row_ptrs, k0, k_size, EVEN_K, BLOCK_K)
    elif W_FORMAT == 4:
        even, odd = tl.split(tl.reshape(a, (a.shape[0], BLOCK_K // 2, 2)))
        col_ptrs, scale_col_ptrs = tl.trans(row_ptrs), tl.trans(scale_row_ptrs)
        low, high = mxfp4_tile_k_major(col_ptrs, scale_col_ptrs, k0, k_size, EVEN_K, BLOCK_K)
        acc = tl.dot(even, low, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(odd, high, acc, input_precision=DOT_PRECISION)
    elif W_FORMAT == 2:
        even, odd = tl.split(tl.reshape(a, (a.shape[0], BLOCK_K // 2, 2)))
        low, high = mxfp4_tile(row_ptrs, scale_row_ptrs, k0, k_size, a.dtype, EVEN_K, BLOCK_K)
        acc = tl.dot(even, tl.trans(low), acc, input_precision=DOT_PRECISION)
        acc = tl.dot(odd, tl.trans(high), acc, input_precision=DOT_PRECISION)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(row_ptrs + ks[None, :])
        else:
            w = tl.load(row_ptrs + ks[None, :], mask=ks[None, :] < k_size, other=0.0)
        # FP8 widened (in PTX for W_FP8_PTX); the activations' own dtype as it is.
        w = widen_e4m3(w, a.dtype, W_FORMAT == 5)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _fp8_format(W_FORMAT: tl.constexpr):
    """Whether ``W_FORMAT`` is FP8 rows (`W_FP8`, `W_FP8_PTX`), scaled per row after the K loop."""
    return (W_FORMAT == 1) | (W_FORMAT == 5)


@triton.jit
def _dot_scaled_mxfp4_tile(
    a, acc, row_ptrs, scale_row_ptrs, k0, k_size, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr
):
    """``acc + a @ W[:, k0 : k0 + BLOCK_K].T`` for packed MXFP4 rows through `tl.dot_scaled`,
    which decodes the e2m1 values and their e8m0 scales to bf16 (``a``'s dtype) in Triton's own
    upcast, exactly the dequantized weights, before the dot."""
    cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte columns
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    if EVEN_K:
        packed = tl.load(row_ptrs + cols[None, :])
        scales = tl.load(scale_row_ptrs + groups[None, :])
    else:
        packed = tl.load(row_ptrs + cols[None, :], mask=cols[None, :] < k_size // 2, other=0)
        valid = groups[None, :] < k_size // 32
        scales = tl.load(scale_row_ptrs + groups[None, :], mask=valid, other=127)
    return tl.dot_scaled(a, None, "bf16", tl.trans(packed), scales, "e2m1", acc)


@triton.jit
def activate(gate, up, ACTIVATION: tl.constexpr, dtype: tl.constexpr):
    """``act(gate, up)`` in ``dtype`` from fp32 operands already rounded to it."""
    if ACTIVATION == 0:
        return silu_mul_rounded(gate, up, dtype)
    gate = tl.minimum(gate, SWIGLU_OAI_LIMIT)
    up = tl.minimum(tl.maximum(up, -SWIGLU_OAI_LIMIT), SWIGLU_OAI_LIMIT)
    glu = gate * tl.sigmoid(SWIGLU_OAI_ALPHA * gate)
    return ((up + 1.0) * glu).to(dtype)


@triton.jit
def _grouped_tile(num_blocks, tiles_n, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program: ``GROUP_M`` row blocks at a time sweep the
    column tiles, row block fastest."""
    pid = tl.program_id(0)
    per_group = GROUP_M * tiles_n
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_blocks - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit(do_not_specialize=["pairs", "num_blocks"])
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    sorted_ids_ptr,
    experts_ptr,
    pairs,
    inter,
    hidden,
    num_blocks,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    TOP_K: tl.constexpr,
    BY_PAIR: tl.constexpr,
    ACTIVATION: tl.constexpr,
    W_FORMAT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``out[row] = act(x[token] @ gate_e.T + bg, x[token] @ up_e.T + bu)`` for BLOCK_N of the
    I columns. Grouped: the rows of block ``b`` (``experts_ptr``: expert of each block, -1
    unused). ``BY_PAIR``: one pair a program, row = pair (``experts_ptr``: the flat ids)."""
    rows = tl.arange(0, BLOCK_M)
    if BY_PAIR:
        pid = tl.program_id(0)
        block = pid % pairs  # the pair
        tile_n = pid // pairs
        pair = tl.where(rows == 0, block, pairs)
        out_rows = pair
    else:
        block, tile_n = _grouped_tile(num_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
        out_rows = block * BLOCK_M + rows
        pair = tl.load(sorted_ids_ptr + out_rows)
    expert = tl.load(experts_ptr + block)
    if expert < 0:
        return
    row_valid = pair < pairs
    x_rows = x_ptr + (pair // TOP_K).to(tl.int64)[:, None] * stride_xt
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # The last column tile re-reads valid rows rather than masking its weight loads.
    w_rows = cols % inter
    gate_rows = w_rows.to(tl.int64)[:, None]
    up_rows = (w_rows + inter).to(tl.int64)[:, None]
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    s_expert = w_scale_ptr + expert.to(tl.int64) * stride_se
    gate_ptrs, gate_scales = w_expert + gate_rows * stride_wn, s_expert + gate_rows * stride_sn
    up_ptrs, up_scales = w_expert + up_rows * stride_wn, s_expert + up_rows * stride_sn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_rows + ks[None, :], mask=row_valid[:, None], other=0.0)
        else:
            k_valid = ks[None, :] < hidden
            x = tl.load(x_rows + ks[None, :], mask=row_valid[:, None] & k_valid, other=0.0)
        acc_gate = _dot_weight_tile(
            x,
            acc_gate,
            gate_ptrs,
            gate_scales,
            k0,
            hidden,
            W_FORMAT,
            EVEN_K,
            BLOCK_K,
            DOT_PRECISION,
        )
        acc_up = _dot_weight_tile(
            x, acc_up, up_ptrs, up_scales, k0, hidden, W_FORMAT, EVEN_K, BLOCK_K, DOT_PRECISION
        )
    if _fp8_format(W_FORMAT):  # FP8: each row's scale
        scales = w_scale_ptr + expert.to(tl.int64) * stride_se
        acc_gate *= tl.load(scales + w_rows)[None, :]
        acc_up *= tl.load(scales + inter + w_rows)[None, :]
    if HAS_BIAS:
        bias = bias_ptr + expert.to(tl.int64) * stride_be
        acc_gate += tl.load(bias + w_rows).to(tl.float32)[None, :]
        acc_up += tl.load(bias + inter + w_rows).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    result = activate(gate, up, ACTIVATION, dtype)
    mask = row_valid[:, None] & (cols < inter)[None, :]
    tl.store(out_ptr + out_rows.to(tl.int64)[:, None] * stride_om + cols[None, :], result, mask)


@triton.jit(do_not_specialize=["pairs", "num_blocks"])
def _down_kernel(
    a_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    weights_ptr,
    out_ptr,
    sorted_ids_ptr,
    expert_of_block_ptr,
    pairs,
    hidden,
    inter,
    num_blocks,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    BY_PAIR: tl.constexpr,
    W_FORMAT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``out[pair] = round(a[row] @ w2_e.T + b2_e) * weight[pair]`` for BLOCK_N of the H
    columns; ``out`` rows are pairs (``[T, k, H]``). Grouped: the rows of block ``b`` (sorted
    order). ``BY_PAIR``: one pair a program, ``a`` in pair order (``expert_of_block_ptr``: the
    flat ids)."""
    if BY_PAIR:
        pid = tl.program_id(0)
        block = pid % pairs  # the pair
        tile_n = pid // pairs
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, block, pairs)
        rows = pair
    else:
        block, tile_n = _grouped_tile(num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    expert = tl.load(expert_of_block_ptr + block)
    if expert < 0:
        return
    if not BY_PAIR:
        pair = tl.load(sorted_ids_ptr + rows)
    row_valid = pair < pairs
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = cols % hidden
    rows_n = w_rows.to(tl.int64)[:, None]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rows_n * stride_wn
    s_ptrs = w_scale_ptr + expert.to(tl.int64) * stride_se + rows_n * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, inter, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(a_rows + ks[None, :], mask=row_valid[:, None], other=0.0)
        else:
            k_valid = ks[None, :] < inter
            a = tl.load(a_rows + ks[None, :], mask=row_valid[:, None] & k_valid, other=0.0)
        acc = _dot_weight_tile(
            a, acc, w_ptrs, s_ptrs, k0, inter, W_FORMAT, EVEN_K, BLOCK_K, DOT_PRECISION
        )
    if _fp8_format(W_FORMAT):  # FP8: each row's scale
        acc *= tl.load(w_scale_ptr + expert.to(tl.int64) * stride_se + w_rows)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + w_rows).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    routing = tl.load(weights_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)
    result = (acc.to(dtype).to(tl.float32) * routing[:, None]).to(dtype)
    mask = row_valid[:, None] & (cols < hidden)[None, :]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_om + cols[None, :], result, mask)


@triton.jit(do_not_specialize=["tokens"])
def _down_by_token_kernel(
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
    SLOTS: tl.constexpr,
    W_FORMAT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``out[t] = sum_j round(round(a[t*k+j] @ w2_e.T + b2_e) * weight[t*k+j])`` for BLOCK_N of
    the H columns, e = the j-th expert of token t. The k experts' K steps run as one pipelined
    loop (one per expert would drain the pipeline k times, a memory latency each); an expert's
    sum leaves the accumulator at its last K step."""
    pid = tl.program_id(0)
    token = pid % tokens
    tile_n = pid // tokens
    rows = tl.arange(0, BLOCK_M)
    first_row = rows == 0
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = cols % hidden
    w_row_offsets = w_rows.to(tl.int64)[:, None] * stride_wn
    s_row_offsets = w_rows.to(tl.int64)[:, None] * stride_sn
    k_blocks = tl.cdiv(inter, BLOCK_K)
    # The token's experts and weights in registers: an expert id loaded inside the loop, to
    # address the weights, kept Triton from pipelining their loads.
    slots = tl.arange(0, SLOTS)
    slot_valid = slots < TOP_K
    token_pairs = token * TOP_K + slots
    experts = tl.load(ids_ptr + token_pairs, mask=slot_valid, other=0).to(tl.int64)
    routing = tl.load(weights_ptr + token_pairs, mask=slot_valid, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dtype = out_ptr.dtype.element_ty
    for step in tl.range(0, TOP_K * k_blocks, num_stages=STAGES):
        slot = step // k_blocks
        k0 = (step - slot * k_blocks) * BLOCK_K
        expert = tl.sum(tl.where(slots == slot, experts, 0))
        pair = (token * TOP_K + slot).to(tl.int64)
        ks = k0 + tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + pair * stride_am + ks[None, :] + rows[:, None] * 0
        w_ptrs = w_ptr + expert * stride_we + w_row_offsets
        s_ptrs = w_scale_ptr + expert * stride_se + s_row_offsets
        if EVEN_K:
            a = tl.load(a_ptrs, mask=first_row[:, None], other=0.0)
        else:
            k_valid = ks[None, :] < inter
            a = tl.load(a_ptrs, mask=first_row[:, None] & k_valid, other=0.0)
        acc = _dot_weight_tile(
            a, acc, w_ptrs, s_ptrs, k0, inter, W_FORMAT, EVEN_K, BLOCK_K, DOT_PRECISION
        )
        last = k0 + BLOCK_K >= inter
        expert_out = acc
        if _fp8_format(W_FORMAT):  # FP8: the expert's row scales, read at its last K step only
            scale_ptrs = w_scale_ptr + expert * stride_se + w_rows
            scales = tl.load(scale_ptrs, mask=(w_rows < hidden) & last, other=0.0)
            expert_out = expert_out * scales[None, :]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_be + w_rows).to(tl.float32)
            expert_out += bias[None, :]
        weight = tl.sum(tl.where(slots == slot, routing, 0.0))
        weighted = (expert_out.to(dtype).to(tl.float32) * weight).to(dtype).to(tl.float32)
        total += tl.where(last, weighted, 0.0)
        acc = tl.where(last, 0.0, acc)
    mask = first_row[:, None] & (cols < hidden)[None, :]
    offsets = token.to(tl.int64) * stride_ot + rows[:, None] * 0 + cols[None, :]
    tl.store(out_ptr + offsets, total.to(dtype), mask)


@triton.jit
def _sum_over_top_k_kernel(
    parts_ptr, out_ptr, hidden, stride_pp, stride_ot, TOP_K: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        row = parts_ptr + (token * TOP_K + slot) * stride_pp
        total += tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands (an FP8 weight's widened to fp32 activations too) must not silently drop to
    # tf32 on the tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def weight_format(
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
    mxfp4_in_registers: bool = False,
    fp8_in_registers: bool = False,
) -> int:
    """The kernels' ``W_FORMAT`` of stacked experts: plain (no scale), FP8 (float8 weights with
    float32 row scales) or MXFP4 (uint8 packed weights with uint8 group scales) with activations
    of ``dtype``. Compiled FP8 tiles on bf16 activations widen in PTX where
    ``fp8_in_registers`` (`ember.kernels.fp8_widen`). Compiled MXFP4 products on bf16
    activations go through `tl.dot_scaled` (Triton's upcast), or where the tiles say
    ``mxfp4_in_registers`` decode in PTX (`ember.kernels.mxfp4.mxfp4_tile_k_major`); the
    interpreter (no `tl.dot_scaled`, no PTX) and fp16/fp32 activations decode in Triton
    (`ember.kernels.mxfp4.mxfp4_tile`)."""
    if scale is None:
        return W_PLAIN
    if weight.dtype != torch.uint8:
        in_ptx = dtype == torch.bfloat16 and widens_in_registers(fp8_in_registers)
        return W_FP8_PTX if in_ptx else W_FP8
    if dtype != torch.bfloat16 or kernels_interpreted():
        return W_MXFP4
    return W_MXFP4_PTX if mxfp4_in_registers else W_MXFP4_SCALED


def expert_operands(w: torch.Tensor, scale, bias) -> tuple[torch.Tensor, ...]:
    """The kernels' weight, scale and bias pointers of stacked experts (the weights stand in
    for an absent scale or bias: the kernel reads neither)."""
    return w, scale if scale is not None else w, bias if bias is not None else w


def expert_strides(w: torch.Tensor, scale, bias) -> tuple[int, ...]:
    """The kernels' per-expert and per-row strides of the weights and the scales, and the
    per-expert stride of the bias (0 for an absent one)."""
    scale_strides = (scale.stride(0), scale.stride(1)) if scale is not None else (0, 0)
    return w.stride(0), w.stride(1), *scale_strides, bias.stride(0) if bias is not None else 0


def tile_args(tiles: GemmTiles, k: int) -> dict:
    return {
        "EVEN_K": k % tiles.block_k == 0,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "STAGES": tiles.stages,
        "num_warps": tiles.num_warps,
    }


def _launch_gate_up(
    x,
    w13,
    scale,
    b13,
    out,
    sorted_ids,
    experts,
    num_blocks,
    top_k,
    activation,
    tiles,
    block_m,
    by_pair,
    fp8_in_registers=False,
):
    pairs = x.shape[0] * top_k
    inter = w13.shape[1] // 2
    tiles_n = triton.cdiv(inter, tiles.block_n)
    grid = (pairs if by_pair else num_blocks) * tiles_n
    launch(
        _gate_up_kernel,
        (grid,),
        x,
        *expert_operands(w13, scale, b13),
        out,
        sorted_ids,
        experts,
        pairs,
        inter,
        x.shape[1],
        num_blocks,
        x.stride(0),
        *expert_strides(w13, scale, b13),
        out.stride(0),
        TOP_K=top_k,
        BY_PAIR=by_pair,
        ACTIVATION=ACTIVATIONS[activation],
        W_FORMAT=weight_format(w13, scale, x.dtype, tiles.mxfp4_in_registers, fp8_in_registers),
        HAS_BIAS=b13 is not None,
        BLOCK_M=block_m,
        GROUP_M=tiles.group_m,
        DOT_PRECISION=_dot_precision(x.dtype),
        **tile_args(tiles, x.shape[1]),
    )


def gate_up_by_pair(
    x, w13, b13, ids, top_k, activation, tiles: GemmTiles, scale=None, fp8_in_registers=False
) -> torch.Tensor:
    """``[T * k, I]`` in pair order: ``act`` of each pair's gate and up products. ``scale``:
    FP8 ``w13``'s float32 ``[E, 2I]``, or packed MXFP4 ``w13``'s uint8 ``[E, 2I, H / 32]``
    (None: ``w13`` in ``x``'s dtype), as for each product; ``fp8_in_registers``: FP8 tiles
    widen in PTX (`weight_format`), as for each product."""
    out = torch.empty(ids.numel(), w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    _launch_gate_up(
        *(x, w13, scale, b13, out, ids, ids, 0, top_k, activation, tiles, MIN_DOT_ROWS),
        by_pair=True,
        fp8_in_registers=fp8_in_registers,
    )
    return out


def gate_up_grouped(
    x,
    w13,
    b13,
    blocks: MoeBlocks,
    top_k,
    activation,
    tiles: GemmTiles,
    scale=None,
    fp8_in_registers=False,
) -> torch.Tensor:
    """``[max_blocks * block_m, I]`` in sorted order (padding rows left unwritten)."""
    rows = blocks.sorted_ids.numel()
    out = torch.empty(rows, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    _launch_gate_up(
        x,
        w13,
        scale,
        b13,
        out,
        blocks.sorted_ids,
        blocks.expert_of_block,
        blocks.expert_of_block.numel(),
        top_k,
        activation,
        tiles,
        blocks.block_m,
        by_pair=False,
        fp8_in_registers=fp8_in_registers,
    )
    return out


def down_grouped(
    a,
    w2,
    b2,
    weights,
    blocks: MoeBlocks,
    tiles: GemmTiles,
    out: torch.Tensor,
    scale=None,
    fp8_in_registers=False,
) -> torch.Tensor:
    """``out [T * k, H]``: each pair's expert output times its routing weight, from ``a`` in
    sorted order. ``scale``: FP8 ``w2``'s float32 ``[E, H]`` or MXFP4 ``w2``'s uint8
    ``[E, H, I / 32]`` (None: ``w2`` in ``a``'s dtype); ``fp8_in_registers``: FP8 tiles widen
    in PTX (`weight_format`)."""
    num_blocks = blocks.expert_of_block.numel()
    _launch_down(
        a,
        w2,
        b2,
        weights,
        blocks.sorted_ids,
        blocks.expert_of_block,
        num_blocks,
        tiles,
        out,
        scale,
        blocks.block_m,
        by_pair=False,
        fp8_in_registers=fp8_in_registers,
    )
    return out


def down_by_pair(
    a, w2, b2, ids, weights, tiles: GemmTiles, out: torch.Tensor, scale=None, fp8_in_registers=False
) -> torch.Tensor:
    """``out [T * k, H]`` as `down_grouped`'s, from ``a`` in pair order (`gate_up_by_pair`'s),
    one program per pair and column tile: no alignment, and k times the programs of
    `down_by_token` for a GPU that one token's column tiles would leave half idle."""
    _launch_down(
        *(a, w2, b2, weights, ids, ids, 0, tiles, out, scale, MIN_DOT_ROWS),
        by_pair=True,
        fp8_in_registers=fp8_in_registers,
    )
    return out


def _launch_down(
    a,
    w2,
    b2,
    weights,
    sorted_ids,
    experts,
    num_blocks,
    tiles,
    out,
    scale,
    block_m,
    by_pair,
    fp8_in_registers=False,
):
    pairs, hidden = out.shape
    grid = (pairs if by_pair else num_blocks) * triton.cdiv(hidden, tiles.block_n)
    launch(
        _down_kernel,
        (grid,),
        a,
        *expert_operands(w2, scale, b2),
        weights,
        out,
        sorted_ids,
        experts,
        pairs,
        hidden,
        a.shape[1],
        num_blocks,
        a.stride(0),
        *expert_strides(w2, scale, b2),
        out.stride(0),
        BY_PAIR=by_pair,
        W_FORMAT=weight_format(w2, scale, a.dtype, tiles.mxfp4_in_registers, fp8_in_registers),
        HAS_BIAS=b2 is not None,
        BLOCK_M=block_m,
        GROUP_M=tiles.group_m,
        DOT_PRECISION=_dot_precision(a.dtype),
        **tile_args(tiles, a.shape[1]),
    )


def down_by_token(
    a,
    w2,
    b2,
    ids,
    weights,
    top_k,
    tiles: GemmTiles,
    out: torch.Tensor,
    scale=None,
    fp8_in_registers=False,
) -> torch.Tensor:
    """``out [T, H]``: each token's k weighted expert outputs, summed in slot order. ``scale``
    and ``fp8_in_registers``: as `down_grouped`'s."""
    tokens, hidden = out.shape
    launch(
        _down_by_token_kernel,
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
        SLOTS=triton.next_power_of_2(top_k),
        W_FORMAT=weight_format(w2, scale, a.dtype, tiles.mxfp4_in_registers, fp8_in_registers),
        HAS_BIAS=b2 is not None,
        BLOCK_M=MIN_DOT_ROWS,
        DOT_PRECISION=_dot_precision(a.dtype),
        **tile_args(tiles, a.shape[1]),
    )
    return out


def sum_over_top_k(parts: torch.Tensor, top_k: int, out: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j parts[t * k + j]`` in fp32, slot by slot, rounded once."""
    tokens, hidden = out.shape
    launch(
        _sum_over_top_k_kernel,
        (tokens, triton.cdiv(hidden, _SUM_BLOCK)),
        parts,
        out,
        hidden,
        parts.stride(0),
        out.stride(0),
        TOP_K=top_k,
        BLOCK=_SUM_BLOCK,
        num_warps=4,
    )
    return out
