"""The fused MoE experts on the GPU: `fused_moe`, the Triton ops' ``moe_experts``.

``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` with
``expert_e(x) = (act(x @ gate_e.T + bg) * (x @ up_e.T + bu)) @ w2_e.T + b2_e`` (the contract:
docs/CONTRACTS.md, "Fused MoE"). Routing is data-dependent but nothing here reads it on the
host: every buffer is sized by the token count alone and every grid is fixed by it, so a
decode step captures it in a CUDA graph and replays it under any routing.

The device's `MoeTuning` picks, per shape and token count, the path and tiles
(`ember.kernels.moe_tiles`): by pair at decode (two or three launches, each program streaming
one chosen expert's rows, so a step reads only the chosen experts' weights), grouped past it
(alignment, two grouped GEMMs, the sum over k; `ember.kernels.moe_gemm`). The by-pair products
run on the tensor cores (one row padded to `tl.dot`'s 16) or, where the table says ``gemv``, on
the CUDA cores (`ember.kernels.moe_gemv`).

FP8 experts (``w13`` and ``w2`` as `Fp8Weight`s: float8 e4m3 with a float32 scale per expert
and row) run the same kernels: each weight tile is read at one byte an element and widened to
the activations' dtype for the dot, and each expert's float32 accumulator is multiplied by its
rows' scales before the epilogue (exact: a row's scale is constant along K). The activations
stay in their dtype, so a step reads half the expert bytes of bf16 and rounds as the reference
does on the dequantized weights. The tiles are those of the activations' dtype.

MXFP4 experts (``w13`` and ``w2`` as `Mxfp4Weight`s: uint8 blocks, two e2m1 values a byte, and
a uint8 e8m0 scale per 32 values along K) run the same kernels too: each weight tile is read
packed (a quarter of bf16's bytes, plus 1/32 of a byte a value for the scales) and decoded in
registers to the activations' dtype for the dot (`ember.kernels.mxfp4`; Hopper has no FP4
product), exactly the values the reference dequantizes to. Their tiles are their own rows of
the table (`MoeShape.mxfp4`), each BLOCK_K whole scale groups.
"""

from __future__ import annotations

from functools import partial

import torch

from ember.kernels.moe_align import align_pairs
from ember.kernels.moe_gemm import (
    ACTIVATIONS,
    down_by_pair,
    down_by_token,
    down_grouped,
    gate_up_by_pair,
    gate_up_grouped,
    sum_over_top_k,
)
from ember.kernels.moe_gemv import down_gemv_by_token, gate_up_gemv
from ember.kernels.moe_tiles import MXFP4_GROUP, MoeShape, MoeTiles, MoeTuning
from ember.layers.fp8 import FP8_DTYPE, Fp8Weight
from ember.layers.mxfp4 import BLOCK_BYTES, Mxfp4Weight

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


ExpertWeight = torch.Tensor | Fp8Weight | Mxfp4Weight


def moe_shape(x: torch.Tensor, w13: ExpertWeight, topk_ids: torch.Tensor) -> MoeShape:
    """The `MoeShape` a call on these operands looks its tiles up by (FP8 and MXFP4 experts
    their own rows)."""
    fp8 = isinstance(w13, Fp8Weight)
    weight = w13.weight if fp8 else w13
    num_experts, two_inter, hidden = weight.shape
    mxfp4 = isinstance(w13, Mxfp4Weight)
    top_k = topk_ids.shape[1]
    return MoeShape(num_experts, hidden, two_inter // 2, top_k, x.element_size(), mxfp4, fp8)


def _unpacked(weights: ExpertWeight, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, scale)`` of stacked experts: an `Fp8Weight`'s or an `Mxfp4Weight`'s two
    tensors, a tensor with no scale. ValueError for a scale that does not pair."""
    if isinstance(weights, Mxfp4Weight):
        return _unpacked_mxfp4(weights, name)
    if not isinstance(weights, Fp8Weight):
        if weights.dtype == FP8_DTYPE:
            raise ValueError(f"FP8 {name} needs its scales: pass an Fp8Weight")
        return weights, None
    weight, scale = weights
    if weight.dtype != FP8_DTYPE or scale.dtype != torch.float32:
        raise ValueError(f"an FP8 {name} must be float8_e4m3fn with float32 scales")
    if weight.dim() != 3 or scale.shape != weight.shape[:2] or scale.stride(-1) != 1:
        raise ValueError(
            f"{name}'s scales must be [E, rows] = {tuple(weight.shape[:2])} with contiguous "
            f"rows, got {tuple(scale.shape)}"
        )
    return weight, scale


def _unpacked_mxfp4(weights: Mxfp4Weight, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of MXFP4 experts, checked: uint8 ``[E, rows, K / 32, 16]`` with
    contiguous rows and ``[E, rows, K / 32]`` with contiguous groups."""
    blocks, scales = weights
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"an MXFP4 {name} must be uint8 blocks with uint8 scales")
    if blocks.dim() != 4 or blocks.shape[3] != BLOCK_BYTES or scales.shape != blocks.shape[:3]:
        raise ValueError(
            f"{name}'s MXFP4 blocks must be [E, rows, K/32, 16] and its scales [E, rows, K/32], "
            f"got {tuple(blocks.shape)} and {tuple(scales.shape)}"
        )
    if blocks.stride(3) != 1 or blocks.stride(2) != BLOCK_BYTES or scales.stride(2) != 1:
        raise ValueError(f"{name}'s MXFP4 rows must be contiguous")
    return blocks, scales


def _check_operands(x, w13, w2, topk_weights, topk_ids, activation, b13, b2) -> None:
    """``w13`` and ``w2``: the weights as the op takes them (plain, FP8 or MXFP4)."""
    tokens, hidden = x.shape
    num_experts, two_inter, w13_hidden = _logical_shape(w13)
    inter = two_inter // 2
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, not {activation!r}")
    form = _form(w13, x.dtype)
    if x.dtype not in _DTYPES or form is None or _form(w2, x.dtype) != form:
        raise ValueError(
            f"x, w13 and w2 must share a dtype of {_DTYPES} (or w13 and w2 be both FP8, or "
            "both MXFP4)"
        )
    w2_shape = _logical_shape(w2)
    if two_inter % 2 or w13_hidden != hidden or w2_shape != (num_experts, hidden, inter):
        raise ValueError(
            f"want w13 [E, 2I, {hidden}] and w2 [E, {hidden}, I]; got {_logical_shape(w13)} and "
            f"{w2_shape}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != tokens:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [{tokens}, k]"
        )
    if b13 is not None and b13.shape != (num_experts, two_inter):
        raise ValueError(f"b13 must be [{num_experts}, {two_inter}], got {tuple(b13.shape)}")
    if b2 is not None and b2.shape != (num_experts, hidden):
        raise ValueError(f"b2 must be [{num_experts}, {hidden}], got {tuple(b2.shape)}")
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("b13", b13), ("b2", b2)):
        t = t.weight if isinstance(t, Fp8Weight) else t
        if isinstance(t, torch.Tensor) and t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous")


def _logical_shape(weights: ExpertWeight) -> tuple[int, ...]:
    return tuple((weights.weight if isinstance(weights, Fp8Weight) else weights).shape)


def _form(weights: ExpertWeight, dtype: torch.dtype) -> str | None:
    """The form of stacked experts the kernels take: "mxfp4", "fp8" or "plain" (in
    ``dtype``); None for any other."""
    if isinstance(weights, Mxfp4Weight):
        return "mxfp4"
    if isinstance(weights, Fp8Weight):
        return "fp8" if weights.weight.dtype == FP8_DTYPE else None
    return "plain" if weights.dtype == dtype else None


def _check_mxfp4_tiles(tiles: MoeTiles) -> None:
    for gemm in (tiles.gate_up, tiles.down):
        if gemm.block_k % MXFP4_GROUP:
            raise ValueError(
                f"MXFP4 experts need a BLOCK_K of whole {MXFP4_GROUP}-value groups, not "
                f"{gemm.block_k}"
            )


def fused_moe(
    x: torch.Tensor,
    w13: ExpertWeight,
    w2: ExpertWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    tuning: MoeTuning | None = None,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """The MoE experts of ``x [T, H]``: ``w13 [E, 2I, H]`` (gate rows, then up rows), ``w2
    [E, H, I]`` (both `Fp8Weight`s: scales ``[E, 2I]``, ``[E, H]``; or both `Mxfp4Weight`s),
    optional biases
    ``b13 [E, 2I]`` and ``b2 [E, H]``; routing ``topk_ids`` int ``[T, k]`` (experts in
    ``[0, E)``) and ``topk_weights [T, k]``; ``activation`` "silu" or "swiglu_oai". Returns
    ``[T, H]`` in ``x``'s dtype. ``tiles`` (else ``tuning``'s for the shape and T; else the
    heuristics) choose the path and tiles."""
    shape = moe_shape(x, w13, topk_ids)
    w13_operand, w2_operand = w13, w2
    w13, w13_scale = _unpacked(w13, "w13")
    w2, w2_scale = _unpacked(w2, "w2")
    _check_operands(x, w13_operand, w2_operand, topk_weights, topk_ids, activation, b13, b2)
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    tuning = tuning or MoeTuning()
    tiles = tiles or tuning.tiles_for(shape, tokens)
    if shape.mxfp4:
        _check_mxfp4_tiles(tiles)
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    if tiles.gemv:
        inter = gate_up_gemv(x, w13, b13, ids, top_k, activation, tiles.gate_up, scale=w13_scale)
        return down_gemv_by_token(inter, w2, b2, ids, weights, top_k, tiles.down, out, w2_scale)
    in_ptx = {"fp8_in_registers": tuning.fp8_widen_in_registers}
    if tiles.by_pair:
        inter = gate_up_by_pair(
            x, w13, b13, ids, top_k, activation, tiles.gate_up, w13_scale, **in_ptx
        )
        if tiles.down_by_token:
            return down_by_token(
                inter, w2, b2, ids, weights, top_k, tiles.down, out, w2_scale, **in_ptx
            )
        down = partial(
            down_by_pair, inter, w2, b2, ids, weights, tiles.down, scale=w2_scale, **in_ptx
        )
    else:
        blocks = align_pairs(ids, w13.shape[0], tiles.block_m, tuning.align_kernel_max_pairs)
        inter = gate_up_grouped(
            x, w13, b13, blocks, top_k, activation, tiles.gate_up, w13_scale, **in_ptx
        )
        down = partial(
            down_grouped, inter, w2, b2, weights, blocks, tiles.down, scale=w2_scale, **in_ptx
        )
    if top_k == 1:  # pair rows are token rows
        return down(out)
    parts = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    down(parts)
    return sum_over_top_k(parts, top_k, out)
