"""Skinny GEMM for decode: ``out[M, N] = x[M, K] @ w[N, K]^T`` with M small (a decode batch).

At small M a linear layer is a weight stream: every byte of ``w`` is read once and the few rows
of ``x`` stay in L2. A program owns ``BLOCK_N`` output columns and walks all of K with a
pipelined loop, so the whole GPU reads weights with no split-K reduction. M is padded to
``tl.dot``'s minimum of 16 rows; padding rows are never loaded or stored.

`skinny_gemm_add` adds the product into a residual stream in its epilogue and leaves the new
rows' partial sums of squares, for a deferred RMSNorm (`ember.layers.row_norm`): the residual
add and the norm's statistics cost no launch of their own. `skinny_gemm_silu` is the gated MLP's
input side in one launch: each program computes its columns of both gate and up and stores
``silu(gate) * up``, with the deferred norm's ``1/rms`` applied in the epilogue.

Each takes an FP8 weight too (float8 e4m3 with a float32 scale per output row,
`ember.layers.fp8.Fp8Weight`): its tiles are read at one byte an element, widened to the
activations' dtype for the dot, and the float32 accumulator is multiplied by each column's scale
before any epilogue. The activations stay in their dtype (no FP8 rounding of them at decode).

Where this beats cuBLAS is a measured question per GPU and shape: `ember.kernels.linear`
routes to it only where the device's `LinearRoutes` say so
(bench/results/README.md, "Skinny GEMM routing").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.activation import silu_mul_rounded
from ember.kernels.compile_ahead import launch
from ember.kernels.fp8_widen import fp8_in_registers, widen_e4m3
from ember.kernels.pdl import wait_for_producer
from ember.kernels.row_norm import check_row_norm, load_inv_rms_rows, row_norm_args, scale_and_round
from ember.kernels.tiles import shrink_to_fit
from ember.kernels.tuning import SKINNY_GEMM_MAX_ROWS
from ember.layers.fp8 import FP8_DTYPE, Fp8Weight
from ember.layers.row_norm import RowNorm


# M (the batch) is a runtime value: specialising on it (M == 1, M % 16 == 0) compiled new variants
# mid-serving for eager steps, seconds of first-token latency; BLOCK_M already covers it.
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    parts_ptr,
    norm_parts_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    num_norm_parts,
    hidden,
    eps,
    HAS_BIAS: tl.constexpr,
    W_SCALED: tl.constexpr,
    ADD_TO_OUT: tl.constexpr,
    GATED: tl.constexpr,
    ROW_NORM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    FP8_IN_REGISTERS: tl.constexpr = False,
):
    """``out = x @ w.T (+ bias)``. ``ADD_TO_OUT``: ``out`` holds a residual stream and becomes
    ``out + x @ w.T`` (the product rounded to the dtype first, as HF adds), and the program
    stores the sum of squares of its columns of each new row at ``parts[row, pid_n]``. The main
    loop is the same either way: work on the x tile between its load and the dot slows it
    several times over (bench/results/README.md, "Leads measured and closed").

    ``GATED``: ``w`` is ``[2N, K]``, gate rows then up rows, and ``out [M, N]`` becomes
    ``silu(gate) * up`` (each product rounded to the dtype, as the unfused GEMM stores it, then
    SiLU-and-mul's roundings); ``ROW_NORM``: gate and up are first scaled by their row's ``1/rms``
    from ``norm_parts`` (a deferred RMSNorm, `ember.layers.row_norm`).

    ``W_SCALED``: ``w`` is FP8 with a float32 scale per row at ``w_scale``; each weight tile is
    widened to ``x``'s dtype for the dot, and the accumulators are scaled per column after the
    loop, before the bias and the other epilogues. ``FP8_IN_REGISTERS``: widened by
    `ember.kernels.fp8_widen`'s bit form, not Triton's conversions."""
    pid_n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < M
    # The last column tile re-reads valid weight rows instead of masking: loads stay unmasked
    # along N and only the store is masked.
    w_rows = cols % N
    w_row_offsets = w_rows[:, None].to(tl.int64) * stride_wn
    up_row_offsets = (w_rows + N)[:, None].to(tl.int64) * stride_wn  # GATED: the up half's rows
    # The first weight tile is not loaded before this wait, though it needs nothing from the
    # previous kernel: held through the wait it slowed the GEMM
    # (bench/results/README.md, "Leads measured and closed").
    wait_for_producer(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # GATED only
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
        if W_SCALED:
            w = widen_e4m3(w, x_ptr.dtype.element_ty, FP8_IN_REGISTERS)
            if GATED:
                w_up = widen_e4m3(w_up, x_ptr.dtype.element_ty, FP8_IN_REGISTERS)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        if GATED:
            acc_up += tl.dot(x, tl.trans(w_up), input_precision=DOT_PRECISION)
    if W_SCALED:
        acc *= tl.load(w_scale_ptr + w_rows)[None, :]
        if GATED:
            acc_up *= tl.load(w_scale_ptr + w_rows + N)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
    col_valid = cols < N
    out_offsets = rows[:, None] * stride_om + cols[None, :]
    out_mask = row_valid[:, None] & col_valid[None, :]
    result = acc.to(out_ptr.dtype.element_ty)
    if GATED:
        inv_rms = 1.0
        if ROW_NORM:
            inv_rms = load_inv_rms_rows(
                norm_parts_ptr, rows, row_valid, num_norm_parts, hidden, eps, BLOCK_P
            )[:, None]
        dtype = out_ptr.dtype.element_ty
        gate = scale_and_round(result, inv_rms, dtype, ROW_NORM)
        up = scale_and_round(acc_up.to(dtype), inv_rms, dtype, ROW_NORM)
        result = silu_mul_rounded(gate, up, dtype)
    if ADD_TO_OUT:
        # Loaded here, not before the main loop: held through the loop, the residual tile made
        # the down projection slower (bench/results/README.md, "Leads measured and closed").
        residual = tl.load(out_ptr + out_offsets, mask=out_mask, other=0.0)
        result = (result.to(tl.float32) + residual.to(tl.float32)).to(out_ptr.dtype.element_ty)
        squares = tl.where(col_valid[None, :], result.to(tl.float32) * result.to(tl.float32), 0.0)
        tl.store(parts_ptr + rows * tl.num_programs(0) + pid_n, tl.sum(squares, 1), mask=row_valid)
    tl.store(out_ptr + out_offsets, result, mask=out_mask)


# Largest M the kernel takes: past it the tensor-core tiles of cuBLAS re-use each weight tile
# across enough rows to win, and BLOCK_M would outgrow the registers.
MAX_M = SKINNY_GEMM_MAX_ROWS


def block_m_for(m: int) -> int:
    """Rows of the program's tile: M padded to a power of two, at least ``tl.dot``'s 16."""
    return max(16, triton.next_power_of_2(m))


def default_config(
    m: int,
    n: int,
    k: int,
    elem_bytes: int = 2,
    gated: bool = False,
    weight_bytes: int | None = None,
) -> dict[str, int]:
    """Tiles for an ``[m, k] x [n, k]^T`` product, chosen on an H200 (8B shapes) by `ember bench
    tune --sections gemm`, `python -m ember.bench.compile_check` (shared memory) and step A/Bs
    (bench/results/README.md, "Skinny GEMM tiles").

    Output projections (N >= 16 K) are long weight streams that want wider column tiles as M
    grows; so do the fused gate/up (N = 7 K) and q/k/v (N = 1.5 K), which take this kernel under
    PDL. Up to 32 rows gate/up takes 256 x 128 tiles on 3 stages: 112 programs, one wave of one
    per SM, not 224 in 1.7 waves. o and down (N <= K) take 32-column tiles on 6 stages, over
    half an SM's shared memory, so no two programs share an SM: under PDL they start on
    whichever SMs the previous kernel has left, and tiles that let two share one lose.

    ``gated`` (`skinny_gemm_silu`; ``n`` counts gate and up): the same tiles, each program's
    columns split between a gate and an up tile, so a stage moves as many weight bytes.

    ``weight_bytes`` (default ``elem_bytes``): an FP8 weight (1) takes twice the K of its
    activations' tiles, so each stage still moves as many weight bytes.
    """
    if n >= 16 * k:
        block_n, block_k, stages, warps = (
            (32, 128, 6, 4) if m <= 8 else (64, 128, 4, 4) if m <= 16 else (128, 128, 4, 8)
        )
    elif n >= 4 * k:
        # Up to 32 rows, 256-column tiles: the fused gate/up (N = 7 K) in 112 programs, one wave
        # of one per SM, not 224 in 1.7 waves (see the docstring).
        block_n, block_k, stages, warps = (256, 128, 3, 8) if m <= 32 else (128, 128, 4, 8)
    elif n > k:
        block_n, block_k, stages, warps = (64, 256, 4, 4) if m <= 32 else (64, 128, 4, 4)
    elif m <= 32:
        block_n, block_k, stages, warps = 32, 256, 6, 4
    else:
        block_n, block_k, stages, warps = 32, 128, 6, 4
    if gated:
        block_n //= 2
    weight_bytes = weight_bytes or elem_bytes
    if weight_bytes < elem_bytes and block_k * elem_bytes // weight_bytes <= k:
        block_k = block_k * elem_bytes // weight_bytes
    config = {
        "BLOCK_M": block_m_for(m),
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "STAGES": stages,
        "num_warps": warps,
    }
    return fit_shared_memory(config, elem_bytes, gated, weight_bytes)


def shared_memory_estimate(
    config: dict[str, int], elem_bytes: int, gated: bool = False, weight_bytes: int | None = None
) -> int:
    """Bytes of the pipelined x and w tiles (two w tiles when ``gated``; ``weight_bytes`` an
    element, default ``elem_bytes``), what Triton stages in shared memory."""
    x_bytes = config["BLOCK_M"] * elem_bytes
    w_bytes = config["BLOCK_N"] * (2 if gated else 1) * (weight_bytes or elem_bytes)
    return (x_bytes + w_bytes) * config["BLOCK_K"] * config["STAGES"]


def fit_shared_memory(
    config: dict[str, int], elem_bytes: int, gated: bool = False, weight_bytes: int | None = None
):
    """Halve BLOCK_K, then drop stages, until the tiles fit (fp32 at BLOCK_M 64 asks 544 KiB)."""
    return shrink_to_fit(
        config,
        lambda c: shared_memory_estimate(c, elem_bytes, gated, weight_bytes),
        [("BLOCK_K", 64, True), ("STAGES", 2, False)],
    )


def _unpacked(weight: torch.Tensor | Fp8Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, scale)`` of an operand: an `Fp8Weight`'s two tensors, a tensor with no scale."""
    if isinstance(weight, Fp8Weight):
        if weight.scale.dtype != torch.float32 or weight.scale.shape != weight.weight.shape[:1]:
            raise ValueError("an FP8 weight's scale must be float32 with one value per row")
        return weight.weight, weight.scale.contiguous()
    if weight.dtype == FP8_DTYPE:
        raise ValueError("an FP8 weight needs its scale: pass an Fp8Weight")
    return weight, None


def _check_operands(x: torch.Tensor, weight: torch.Tensor) -> None:
    m, k = x.shape
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns; weight {tuple(weight.shape)} wants {weight.shape[1]}")
    if m > MAX_M:
        raise ValueError(f"skinny_gemm takes at most {MAX_M} rows, got {m}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("the reduction dim must be contiguous in x and weight")


def _resolved_config(x, weight, config: dict[str, int] | None, gated=False) -> dict[str, int]:
    """``config`` (a copy), or the shape's default tiles; checked against the rows. The tiles are
    sized by ``x``'s element size and the weight's: an FP8 weight's take twice the K."""
    m, k = x.shape
    config = dict(
        config
        or default_config(m, weight.shape[0], k, x.element_size(), gated, weight.element_size())
    )
    if config["BLOCK_M"] < m:
        raise ValueError(f"BLOCK_M {config['BLOCK_M']} is smaller than M {m}")
    return config


def _launch(
    x,
    weight,
    scale,
    bias,
    out,
    parts,
    config: dict[str, int],
    pdl,
    gated=False,
    row_norm=None,
    fp8_widen_in_registers=False,
) -> None:
    """Launch on a `_resolved_config` (consumed: BLOCK_N is popped). ``scale``: an FP8 weight's
    row scales (None: a weight of ``x``'s dtype), widened in registers where
    ``fp8_widen_in_registers`` (`ember.kernels.fp8_widen`). ``gated``: ``out`` is
    ``silu(gate) * up`` of the weight's two halves, ``row_norm`` applied to both first."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    block_n = config.pop("BLOCK_N")
    (norm_parts, num_norm_parts, hidden, eps), block_p = row_norm_args(row_norm, out)
    launch(
        _skinny_gemm_kernel,
        (triton.cdiv(n, block_n),),
        x,
        weight,
        scale if scale is not None else weight,
        bias if bias is not None else weight,
        out,
        parts if parts is not None else out,
        norm_parts,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        num_norm_parts,
        hidden,
        eps,
        HAS_BIAS=bias is not None,
        W_SCALED=scale is not None,
        ADD_TO_OUT=parts is not None,
        GATED=gated,
        ROW_NORM=row_norm is not None,
        BLOCK_P=block_p,
        EVEN_K=k % config["BLOCK_K"] == 0,
        BLOCK_N=block_n,
        # fp32 products must not silently drop to tf32 on the tensor cores.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=pdl,
        FP8_IN_REGISTERS=scale is not None and fp8_in_registers(fp8_widen_in_registers),
        launch_pdl=pdl,
        **config,
    )


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    pdl: bool = False,
    fp8_widen_in_registers: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [M, K]`` with M <= ``MAX_M``.

    ``weight`` is ``[N, K]`` with K contiguous (``nn.Linear``'s layout), or an `Fp8Weight` of
    one (``fp8_widen_in_registers``: widened by `ember.kernels.fp8_widen`'s bit form); ``x``
    rows may be strided. Returns ``out [M, N]`` in ``x``'s dtype. ``pdl``: launch with
    programmatic dependent launch (`ember.kernels.pdl`).
    """
    weight, scale = _unpacked(weight)
    _check_operands(x, weight)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if x.shape[0]:
        config = _resolved_config(x, weight, config)
        _launch(
            x,
            weight,
            scale,
            bias,
            out,
            None,
            config,
            pdl,
            fp8_widen_in_registers=fp8_widen_in_registers,
        )
    return out


def skinny_gemm_add(
    x: torch.Tensor,
    weight: torch.Tensor | Fp8Weight,
    residual: torch.Tensor,
    *,
    config: dict[str, int] | None = None,
    pdl: bool = False,
    fp8_widen_in_registers: bool = False,
) -> torch.Tensor:
    """``residual += x @ weight.T`` in place (``residual [M, N]`` contiguous in N; the product
    rounded to the dtype before the add), returning float32 ``[M, P]``: the sums of squares of
    the new rows, one column per program (`ember.layers.row_norm.RowNorm`'s ``parts``).
    ``weight`` may be an `Fp8Weight` (``fp8_widen_in_registers`` as `skinny_gemm`'s)."""
    weight, scale = _unpacked(weight)
    _check_operands(x, weight)
    m = x.shape[0]
    n = weight.shape[0]
    if residual.shape != (m, n) or residual.stride(1) != 1:
        raise ValueError(f"residual must be [{m}, {n}] with contiguous rows")
    config = _resolved_config(x, weight, config)
    parts = torch.empty(m, triton.cdiv(n, config["BLOCK_N"]), dtype=torch.float32, device=x.device)
    if m:
        _launch(
            x,
            weight,
            scale,
            None,
            residual,
            parts,
            config,
            pdl,
            fp8_widen_in_registers=fp8_widen_in_registers,
        )
    return parts


def skinny_gemm_silu(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor | Fp8Weight,
    *,
    row_norm: RowNorm | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    pdl: bool = False,
    fp8_widen_in_registers: bool = False,
) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` for ``gate_up_weight [2I, K]`` (gate rows first), as
    `ember.kernels.activation.silu_and_mul` of the [M, 2I] product gives, without storing that
    product. ``row_norm``: both products scaled by their row's ``1/rms`` first. Returns
    ``out [M, I]``; ``config``'s BLOCK_N counts the columns of one half. ``gate_up_weight`` may
    be an `Fp8Weight` (``fp8_widen_in_registers`` as `skinny_gemm`'s)."""
    gate_up_weight, scale = _unpacked(gate_up_weight)
    _check_operands(x, gate_up_weight)
    m = x.shape[0]
    if gate_up_weight.shape[0] % 2:
        raise ValueError(f"gate_up_weight has an odd number of rows, {gate_up_weight.shape[0]}")
    check_row_norm(row_norm, m)
    if out is None:
        out = torch.empty(m, gate_up_weight.shape[0] // 2, dtype=x.dtype, device=x.device)
    if m:
        config = _resolved_config(x, gate_up_weight, config, gated=True)
        _launch(
            x,
            gate_up_weight,
            scale,
            None,
            out,
            None,
            config,
            pdl,
            gated=True,
            row_norm=row_norm,
            fp8_widen_in_registers=fp8_widen_in_registers,
        )
    return out
