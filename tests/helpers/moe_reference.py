"""A plain MoE experts reference and the routings the fused MoE tests run it on.

`moe_reference` is the contract of docs/CONTRACTS.md ("Fused MoE") written as loops over the
experts, in float64 (or ``compute_dtype``), with no rounding between its steps: a kernel's
roundings are what a test's tolerance allows for.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ember.kernels.moe_tiles import GemmTiles, MoeTiles

ROUTINGS = ("random", "one_expert", "some_experts_empty")

# Small tiles of each path for the bf16/fp32 and FP8 kernel tests (MXFP4's keep whole scale
# groups: their own, in tests/kernels/test_fused_moe_mxfp4.py).
BY_PAIR = MoeTiles(True, 16, GemmTiles(16, 32, 2, 4), GemmTiles(32, 32, 2, 4))
# By pair with down one program per pair, and the sum over k after.
BY_PAIR_SPLIT = replace(BY_PAIR, down_by_token=False)
# The products on the CUDA cores: column tiles narrower than `tl.dot`'s 16 rows, and (at H and
# I of 64 or 32 where the cases use them) K steps that do not divide K.
BY_PAIR_GEMV = MoeTiles(True, 16, GemmTiles(8, 64, 2, 4), GemmTiles(4, 64, 1, 2), gemv=True)
GROUPED = MoeTiles(False, 16, GemmTiles(32, 64, 2, 4), GemmTiles(32, 32, 2, 4, group_m=2))
# Rows of 32, column tiles past I and H, K steps that do not divide H or I.
GROUPED_ODD = MoeTiles(False, 32, GemmTiles(32, 32, 2, 4, group_m=3), GemmTiles(64, 32, 2, 4))


def _act(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=7.0)
        up = up.clamp(-7.0, 7.0)
        return (up + 1) * gate * torch.sigmoid(1.702 * gate)
    raise ValueError(activation)


def moe_reference(
    x, w13, w2, topk_weights, topk_ids, activation="silu", b13=None, b2=None, compute_dtype=None
) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` in
    ``compute_dtype`` (float64 by default)."""
    dtype = compute_dtype or torch.float64
    inter = w2.shape[2]
    x = x.to(dtype)
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    for expert in range(w13.shape[0]):
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = x[token] @ w13[expert].to(dtype).T
        if b13 is not None:
            gate_up = gate_up + b13[expert].to(dtype)
        hidden = _act(gate_up[:, :inter], gate_up[:, inter:], activation)
        y = hidden @ w2[expert].to(dtype).T
        if b2 is not None:
            y = y + b2[expert].to(dtype)
        out.index_add_(0, token, y * topk_weights[token, slot].to(dtype)[:, None])
    return out


def routing(
    kind: str, tokens: int, num_experts: int, top_k: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32 [T, k], topk_weights float32 [T, k]), each token's k experts distinct:

    - ``random``: any k experts a token;
    - ``one_expert``: every token on the same k experts (with k = 1 one expert takes every
      token; every other expert gets none);
    - ``some_experts_empty``: k of a few experts (never the first or last), the rest get none.
    """
    if kind == "random":
        pool = torch.arange(num_experts)
    elif kind == "one_expert":
        pool = torch.arange(top_k) + num_experts // 2 - top_k // 2
    elif kind == "some_experts_empty":
        pool = torch.arange(1, num_experts - 1, 2)[: max(top_k + 1, 2)]
    else:
        raise ValueError(kind)
    if len(pool) < top_k:
        raise ValueError(f"{kind} routing over {num_experts} experts has no {top_k} to pick")
    if kind == "one_expert":
        ids = pool.expand(tokens, top_k)
    else:
        ids = torch.stack(
            [pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(tokens)]
        )
    weights = torch.rand(tokens, top_k, generator=gen)
    weights = weights / weights.sum(1, keepdim=True)
    return ids.to(torch.int32).contiguous(), weights


def moe_weights(
    num_experts, hidden, inter, gen, dtype=torch.float32, bias=False, device="cpu"
) -> dict[str, torch.Tensor | None]:
    """Random ``w13``, ``w2`` (scaled to keep products near unit size) and, with ``bias``,
    ``b13`` and ``b2``, made on the CPU from ``gen`` and moved to ``device``."""

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    return {
        "w13": rand(num_experts, 2 * inter, hidden, scale=2 / hidden**0.5),
        "w2": rand(num_experts, hidden, inter, scale=1 / inter**0.5),
        "b13": rand(num_experts, 2 * inter, scale=0.5) if bias else None,
        "b2": rand(num_experts, hidden, scale=0.5) if bias else None,
    }


def assert_bf16_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    """A bf16 MoE output against its float64 reference. Gate, up, the activation, each expert's
    output and its weighted copy are rounded to bf16 (8 bits) in turn: the whole output's error
    is bounded, and each element's by a few ulps of the largest output (a relative bound per
    element fails near a cancellation)."""
    error = out.double() - expected
    assert error.norm() / expected.norm() < 1e-2, error.norm() / expected.norm()
    worst = expected.abs().max()
    assert error.abs().max() < 8 * 2**-8 * worst, (error.abs().max(), worst)
