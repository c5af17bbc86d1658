"""Skinny GEMM for decode: ``out[M, N] = x[M, K] @ w[N, K]^T`` with M small (a decode batch).

At small M a linear layer is a weight stream: every byte of ``w`` is read once and the few rows
of ``x`` stay in L2. A program owns ``BLOCK_N`` output columns and walks all of K with a
pipelined loop, so the whole GPU reads weights with no split-K reduction. M is padded to
``tl.dot``'s minimum of 16 rows; padding rows are never loaded or stored.

Where this beats cuBLAS is a measured question per GPU and shape (``ember bench tune``);
``ember.kernels.linear`` routes to it only there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.pdl import wait_for_producer
from ember.kernels.tiles import shrink_to_fit


# M (the batch) is a runtime value: specialising on it (M == 1, M % 16 == 0) compiled new variants
# mid-serving for eager steps, seconds of first-token latency; BLOCK_M already covers it.
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    parts_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    num_parts,
    eps,
    HAS_BIAS: tl.constexpr,
    ADD_TO_OUT: tl.constexpr,
    NORM_ROWS: tl.constexpr,
    GATED: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out = x @ w.T``, with a decoder layer's residual add, RMSNorm and SiLU gate optionally
    folded into the epilogue. The main loop is the same in every variant: work on the x tile
    before the dot (adding the residual or the norm's weight there) cost 2-4x on the H200.

    ``ADD_TO_OUT``: ``out`` holds the residual stream; the program writes ``out + x @ w.T``
    (the product rounded to the dtype first, as HF adds) and the sum of squares of its columns
    of each new row to ``parts[pid_n, row]``. ``NORM_ROWS`` (the RMSNorm's weight folded into
    ``w``): the dot products are scaled by ``1/rms`` of the input row, its mean square summed from
    ``parts`` (1) or from the rows themselves (2). ``GATED``: ``w`` holds gate rows ``[0, N)``
    then up rows ``[N, 2N)``, and the program writes ``silu(gate) * up`` for its columns, rounded
    as `ember.kernels.activation` does.
    """
    pid_n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < M
    # The last column tile re-reads valid weight rows instead of masking: loads stay unmasked
    # along N and only the store is masked.
    w_rows = cols % N
    w_row_offsets = w_rows[:, None].to(tl.int64) * stride_wn
    up_row_offsets = (w_rows + N)[:, None].to(tl.int64) * stride_wn
    # Loading the first weight tile before this wait (it needs nothing from the previous kernel)
    # was measured on the H200: no gain at batch 1 and +1.1 ms of GEMM per step at batch 64.
    wait_for_producer(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_offsets = rows[:, None] * stride_xm + ks[None, :]
        if EVEN_K:
            x = tl.load(x_ptr + x_offsets, mask=row_valid[:, None], other=0.0)
            w = tl.load(w_ptr + w_row_offsets + ks[None, :])
            if GATED:
                w_up = tl.load(w_ptr + up_row_offsets + ks[None, :])
        else:
            k_valid = ks[None, :] < K
            x = tl.load(x_ptr + x_offsets, mask=row_valid[:, None] & k_valid, other=0.0)
            w = tl.load(w_ptr + w_row_offsets + ks[None, :], mask=k_valid, other=0.0)
            if GATED:
                w_up = tl.load(w_ptr + up_row_offsets + ks[None, :], mask=k_valid, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        if GATED:
            acc_up += tl.dot(x, tl.trans(w_up), input_precision=DOT_PRECISION)
    if NORM_ROWS != 0:
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NORM_ROWS == 1:
            for p0 in range(0, num_parts, BLOCK_N):
                parts = p0 + tl.arange(0, BLOCK_N)
                part_mask = (parts[:, None] < num_parts) & row_valid[None, :]
                part = tl.load(parts_ptr + parts[:, None] * M + rows[None, :], mask=part_mask,
                               other=0.0)  # fmt: skip
                sum_sq += tl.sum(part, 0)
        else:
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                x_mask = row_valid[:, None] & (ks[None, :] < K)
                xf = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=x_mask,
                             other=0.0).to(tl.float32)  # fmt: skip
                sum_sq += tl.sum(xf * xf, 1)
        # As the RMSNorm kernel: correctly rounded division and square root.
        mean_sq = tl.math.div_rn(sum_sq, K * 1.0)  # div_rn takes fp32 operands only
        inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
        acc = acc * inv_rms[:, None]
        acc_up = acc_up * inv_rms[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
    result = acc
    if GATED:
        # The gate/up product rounded to the dtype, SiLU rounded again, then the product.
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        result = silu * up
    col_valid = cols < N
    out_offsets = rows[:, None] * stride_om + cols[None, :]
    out_mask = row_valid[:, None] & col_valid[None, :]
    if ADD_TO_OUT:
        residual = tl.load(out_ptr + out_offsets, mask=out_mask, other=0.0).to(tl.float32)
        hidden = (acc.to(out_ptr.dtype.element_ty).to(tl.float32) + residual).to(
            out_ptr.dtype.element_ty
        )
        hf = hidden.to(tl.float32)
        part = tl.sum(tl.where(col_valid[None, :], hf * hf, 0.0), 1)
        tl.store(parts_ptr + pid_n * M + rows, part, mask=row_valid)
        result = hf
    tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=out_mask)


# Largest M the kernel takes: past it the tensor-core tiles of cuBLAS re-use each weight tile
# across enough rows to win, and BLOCK_M would outgrow the registers.
MAX_M = 64


def block_m_for(m: int) -> int:
    """Rows of the program's tile: M padded to a power of two, at least ``tl.dot``'s 16."""
    return max(16, triton.next_power_of_2(m))


def default_config(
    m: int, n: int, k: int, elem_bytes: int = 2, gated: bool = False
) -> dict[str, int]:
    """Tiles for an ``[m, k] x [n, k]^T`` product, from `ember bench tune` on an H200 (8B shapes).

    Output projections (N >= 16 K) are long weight streams that want wide column tiles as M
    grows; so do the fused gate/up (N = 7 K: 128 x 128 on 8 warps, 8% over 32 x 256) and q/k/v
    (N = 1.5 K: 64-column tiles), which take this kernel under programmatic launch. The square
    and K-major shapes (o, down) ran best on 32 x 256 tiles with 4 stages. ``gated``: ``n`` is
    the output width and each program streams two weight tiles (gate and up) of ``BLOCK_N`` rows;
    32-row tiles give the 8B MLP (n = 3.5 K) 448 programs, ~3.4 per SM.
    """
    if gated:
        block_n, block_k, stages, warps = 32, 128, 4, 4
    elif n >= 16 * k:
        block_n, block_k, stages, warps = (
            (32, 128, 6, 4) if m <= 8 else (64, 128, 4, 4) if m <= 16 else (128, 128, 4, 8)
        )
    elif n >= 4 * k:
        block_n, block_k, stages, warps = 128, 128, 4, 8
    elif n > k:
        block_n, block_k, stages, warps = (64, 256, 4, 4) if m <= 32 else (64, 128, 4, 4)
    elif m <= 32:
        block_n, block_k, stages, warps = 32, 256, 4, 4
    else:
        block_n, block_k, stages, warps = 32, 128, 6, 4
    config = {"BLOCK_M": block_m_for(m), "BLOCK_N": block_n, "BLOCK_K": block_k, "STAGES": stages,
              "num_warps": warps}  # fmt: skip
    return fit_shared_memory(config, elem_bytes, gated)


def shared_memory_estimate(config: dict[str, int], elem_bytes: int, gated: bool = False) -> int:
    """Bytes of the pipelined x and w tiles (two w tiles when gated), what Triton stages in
    shared memory."""
    rows = config["BLOCK_M"] + config["BLOCK_N"] * (2 if gated else 1)
    return rows * config["BLOCK_K"] * elem_bytes * config["STAGES"]


def fit_shared_memory(
    config: dict[str, int], elem_bytes: int, gated: bool = False
) -> dict[str, int]:
    """Halve BLOCK_K, then drop stages, until the tiles fit (fp32 at BLOCK_M 64 asked 544 KiB)."""
    return shrink_to_fit(
        config,
        lambda c: shared_memory_estimate(c, elem_bytes, gated),
        [("BLOCK_K", 64, True), ("STAGES", 2, False)],
    )


def _check_operands(x: torch.Tensor, weight: torch.Tensor, weight_rows: int) -> None:
    m, k = x.shape
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns; weight {tuple(weight.shape)} wants {weight.shape[1]}")
    if weight.shape[0] != weight_rows:
        raise ValueError(f"weight has {weight.shape[0]} rows, expected {weight_rows}")
    if m > MAX_M:
        raise ValueError(f"skinny_gemm takes at most {MAX_M} rows, got {m}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("the reduction dim must be contiguous in x and weight")


def _launch(x, weight, bias, out, config, pdl, *, parts=None, num_parts=0, add_to_out=False,
            norm_rows=0, eps=0.0, gated=False) -> None:  # fmt: skip
    m, k = x.shape
    n = out.shape[1]
    if m == 0:
        return
    config = dict(config or default_config(m, n, k, weight.element_size(), gated))
    if config["BLOCK_M"] < m:
        raise ValueError(f"BLOCK_M {config['BLOCK_M']} is smaller than M {m}")
    block_n = config.pop("BLOCK_N")
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out,
        parts if parts is not None else weight,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), num_parts, eps,
        HAS_BIAS=bias is not None,
        ADD_TO_OUT=add_to_out,
        NORM_ROWS=norm_rows,
        GATED=gated,
        EVEN_K=k % config["BLOCK_K"] == 0,
        BLOCK_N=block_n,
        # fp32 weights must not silently drop to tf32 on the tensor cores.
        DOT_PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        PDL=pdl,
        launch_pdl=pdl,
        **config,
    )  # fmt: skip


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [M, K]`` with M <= ``MAX_M``.

    ``weight`` is ``[N, K]`` with K contiguous (``nn.Linear``'s layout); ``x`` rows may be
    strided. Returns ``out [M, N]`` in ``x``'s dtype. ``pdl``: launch with programmatic
    dependent launch (`ember.kernels.pdl`).
    """
    _check_operands(x, weight, weight.shape[0])
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, config, pdl)
    return out


def skinny_gemm_add(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    *,
    config: dict[str, int] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``residual += x @ weight.T`` in place (the product rounded to the dtype, then added, as
    HF's decoder layer does), for ``x [M, K]`` with M <= ``MAX_M``.

    Returns float32 ``[P, M]``: each program's sum of squares of the new residual rows over its
    columns, which `skinny_norm_gemm` adds up for the next RMSNorm instead of re-reading the rows.
    """
    _check_operands(x, weight, weight.shape[0])
    m, n = x.shape[0], weight.shape[0]
    if residual.shape != (m, n) or residual.stride(1) != 1:
        raise ValueError(f"residual must be [{m}, {n}] with a contiguous last dim")
    config = dict(config or default_config(m, n, x.shape[1], weight.element_size()))
    parts = torch.empty(triton.cdiv(n, config["BLOCK_N"]), m, dtype=torch.float32,
                        device=x.device)  # fmt: skip
    _launch(x, weight, None, residual, config, pdl, parts=parts, add_to_out=True)
    return parts


def skinny_norm_gemm(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None = None,
    *,
    sum_sq_parts: torch.Tensor | None = None,
    gated: bool = False,
    config: dict[str, int] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``rms_norm(hidden) @ weight.T (+ bias)`` with the norm's weight already folded into
    ``weight`` (``W diag(g)``, see `fold_norm_weight`), for M <= ``MAX_M`` rows.

    ``sum_sq_parts``: `skinny_gemm_add`'s partial sums of squares of these rows (else the program
    sums them from the rows). ``gated``: ``weight`` is gate rows then up rows, ``[2I, K]``, and
    the result is ``silu(gate) * up``, ``[M, I]``.
    """
    m = hidden.shape[0]
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    _check_operands(hidden, weight, 2 * n if gated else n)
    if bias is not None and gated:
        raise ValueError("the gated product takes no bias")
    if sum_sq_parts is not None and (sum_sq_parts.dim() != 2 or sum_sq_parts.shape[1] != m
                                     or sum_sq_parts.dtype != torch.float32
                                     or not sum_sq_parts.is_contiguous()):  # fmt: skip
        raise ValueError(f"sum_sq_parts must be contiguous float32 [P, {m}]")
    out = torch.empty(m, n, dtype=hidden.dtype, device=hidden.device)
    _launch(hidden, weight, bias, out, config, pdl, parts=sum_sq_parts,
            num_parts=0 if sum_sq_parts is None else sum_sq_parts.shape[0],
            norm_rows=2 if sum_sq_parts is None else 1, eps=eps, gated=gated)  # fmt: skip
    return out


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """``weight <- weight diag(norm_weight)`` in place (in float32, rounded once): the RMSNorm's
    scale moved into the projection after it, as `skinny_norm_gemm` expects."""
    weight.copy_(weight.float() * norm_weight.float()[None, :])
