"""Skinny GEMM for decode: ``out[M, N] = x[M, K] @ w[N, K]^T`` with M small (a decode batch).

At small M a linear layer is a weight stream: every byte of ``w`` is read once and the few rows
of ``x`` stay in L2. A program owns ``BLOCK_N`` output columns and walks all of K with a
pipelined loop, so the whole GPU is busy reading weights with no split-K reduction. M is padded
to ``tl.dot``'s minimum of 16 rows; the padding rows are never loaded or stored.

``gated=True`` fuses the MLP's SiLU-and-mul into the load of ``x``: ``x`` is then the gate/up
GEMM's output ``[M, 2K]`` and the kernel multiplies ``silu(gate) * up`` (rounded to the model
dtype, as ``ember.kernels.silu_and_mul`` does) by ``w``, saving a launch and a round trip.

Whether this beats cuBLAS is a measured question per GPU and shape (``ember bench tune``);
``ember.kernels.linear`` routes to it only where the measurement says so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < M
    # The last column tile re-reads valid weight rows instead of masking: loads stay unmasked
    # along N and only the store is masked.
    w_rows = cols % N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_offsets = rows[:, None] * stride_xm + ks[None, :]
        w_offsets = w_rows[:, None].to(tl.int64) * stride_wn + ks[None, :]
        if EVEN_K:
            x_mask = row_valid[:, None]
            w = tl.load(w_ptr + w_offsets)
        else:
            x_mask = row_valid[:, None] & (ks[None, :] < K)
            w = tl.load(w_ptr + w_offsets, mask=ks[None, :] < K, other=0.0)
        if GATED:
            gate = tl.load(x_ptr + x_offsets, mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + x_offsets + K, mask=x_mask, other=0.0).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(w_ptr.dtype.element_ty).to(tl.float32)
            x = (silu * up).to(w_ptr.dtype.element_ty)
        else:
            x = tl.load(x_ptr + x_offsets, mask=x_mask, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & (cols[None, :] < N),
    )


# Largest M the kernel takes: beyond it the weight tile is re-used across enough rows that
# cuBLAS's tensor-core tiles win (and BLOCK_M would outgrow the registers).
MAX_M = 64


def default_config(m: int, n: int, k: int) -> dict[str, int]:
    """Tile sizes for an ``[m, k] x [n, k]^T`` product (see ``ember bench tune`` for the sweep)."""
    block_m = max(16, triton.next_power_of_2(m))
    return {"BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 256, "STAGES": 4, "num_warps": 4}


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    gated: bool = False,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [M, K]`` (``[M, 2K]`` gate|up when ``gated``), M <= 64.

    ``weight`` is ``[N, K]`` with K contiguous (``nn.Linear``'s layout); ``x`` rows may be
    strided. Returns ``out [M, N]`` in ``x``'s dtype.
    """
    m = x.shape[0]
    n, k = weight.shape
    if x.shape[1] != (2 * k if gated else k):
        raise ValueError(f"x has {x.shape[1]} columns; weight {tuple(weight.shape)} wants "
                         f"{2 * k if gated else k}{' (gate|up)' if gated else ''}")  # fmt: skip
    if m > MAX_M:
        raise ValueError(f"skinny_gemm takes at most {MAX_M} rows, got {m}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("the reduction dim must be contiguous in x and weight")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    config = dict(config or default_config(m, n, k))
    block_n = config.pop("BLOCK_N")
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        GATED=gated,
        EVEN_K=k % config["BLOCK_K"] == 0,
        BLOCK_N=block_n,
        # fp32 weights must not silently drop to tf32 on the tensor cores.
        DOT_PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        **config,
    )  # fmt: skip
    return out
