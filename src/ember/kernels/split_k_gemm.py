"""Split-K GEMM for mid-sized batches: ``out[M, N] = x[M, K] @ w[N, K]^T`` with 64 < M <= 256.

At these batches a decode step's narrow projections (q/k/v, o, down: N <= 2 K) are compute-bound
but have few output tiles: at M = 256 the o projection is 64 tiles of 128 x 128 for 132 SMs. In
the engine's step at batch 200 (`ember bench profile`, r15) cuBLAS ran them at 0.51 (o), 0.59
(q/k/v) and 0.70 (down, split-K plus a reduce kernel) of max(bytes, FLOPs) at the measured
ceilings. Here each output tile's K range is cut into ``SPLIT_K`` slices, chosen so the programs
fill whole waves of the GPU's SMs; each slice's program stores an fp32 partial and counts its
arrival, and the last to arrive sums the tile's partials in slice order (the result does not
depend on which program came last) and stores the tile: no reduce kernel.

The arrival counters live in a `SplitKWorkspace`, zero between launches (the summing program
zeroes its tile's counter again, so a CUDA graph replays without a memset). One workspace serves
one stream of launches: two split-K launches in flight at once must not share it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.pdl import wait_for_producer
from ember.kernels.tiles import shrink_to_fit

# Rows the kernel is meant for: below, the skinny GEMM streams the weights; above, cuBLAS has
# enough row tiles to fill the GPU.
MIN_M, MAX_M = 65, 256
# Tiles an output's counters can number: 256 rows of a 32,768-wide output in 128 x 128 tiles.
COUNTER_CAPACITY = 512
# Slices a tile's K range may be cut into, and the fewest BLOCK_K steps a slice keeps (shorter
# ones spend more on the partials' round trip than the extra SMs give back).
SPLIT_CHOICES = (1, 2, 3, 4, 6, 8)
MIN_K_STEPS_PER_SPLIT = 8


class SplitKWorkspace:
    """The arrival counters of `split_k_gemm`'s tiles and the SM count its splits fill.

    ``num_sms`` defaults to the GPU's; on a CPU (Triton's interpreter) it must be given."""

    def __init__(self, device: torch.device, num_sms: int | None = None) -> None:
        if num_sms is None:
            if device.type != "cuda":
                raise ValueError("num_sms must be given for a device without SMs")
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.num_sms = num_sms
        self.counters = torch.zeros(COUNTER_CAPACITY, dtype=torch.int32, device=device)


@triton.jit(do_not_specialize=["M"])
def _split_k_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    parts_ptr,
    counters_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (row tile, column tile, K slice) per program. Row tiles vary fastest, so the programs
    that read the same weight slice run side by side and the second finds it in L2. ``parts``
    is float32 ``[SPLIT_K, M, N]``; K is a multiple of BLOCK_K (the wrapper checks)."""
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    tile_m = pid % num_m_tiles
    tile_n = (pid // num_m_tiles) % num_n_tiles
    split = pid // (num_m_tiles * num_n_tiles)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Edge tiles re-read valid rows and columns instead of masking the loads; only the stores
    # are masked.
    x_row_offsets = (rows % M)[:, None].to(tl.int64) * stride_xm
    w_row_offsets = (cols % N)[:, None].to(tl.int64) * stride_wn
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    wait_for_producer(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + x_row_offsets + ks[None, :])
        w = tl.load(w_ptr + w_row_offsets + ks[None, :])
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    if SPLIT_K == 1:
        _store_tile(out_ptrs, acc, bias_ptr, cols % N, mask, HAS_BIAS)
    else:
        tile_offsets = rows[:, None] * N + cols[None, :]
        tl.store(parts_ptr + split * M * N + tile_offsets, acc, mask=mask)
        # Every thread's partial before the counter's release; the acquire makes the other
        # slices' partials visible to the program that sums them.
        tl.debug_barrier()
        counter = counters_ptr + tile_n * num_m_tiles + tile_m
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.store(counter, 0)  # zero again for the next launch (and graph replay)
            tl.debug_barrier()
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: other SMs wrote these; L1 must not serve a stale copy.
                total += tl.load(parts_ptr + s * M * N + tile_offsets, mask=mask, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            _store_tile(out_ptrs, total, bias_ptr, cols % N, mask, HAS_BIAS)


@triton.jit
def _store_tile(out_ptrs, acc, bias_ptr, bias_cols, mask, HAS_BIAS: tl.constexpr):
    """The fp32 tile plus the bias (as cuBLAS adds it, before the one rounding), stored."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + bias_cols).to(tl.float32)[None, :]
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)


def choose_split_k(tiles: int, k_steps: int, num_sms: int) -> int:
    """Slices per tile that keep the most SMs busy over the launch's waves (each slice at least
    `MIN_K_STEPS_PER_SPLIT` steps long); ties go to fewer slices, which move fewer partials.
    At 132 SMs and 256 rows: o and down (64 tiles) take 2, q/k/v (96 tiles) 4."""
    best, best_fill = 1, 0.0
    for split in SPLIT_CHOICES:
        if split > 1 and k_steps < split * MIN_K_STEPS_PER_SPLIT:
            break
        programs = tiles * split
        fill = programs / (triton.cdiv(programs, num_sms) * num_sms)
        if fill > best_fill + 1e-9:
            best, best_fill = split, fill
    return best


def default_config(m: int, n: int, k: int, num_sms: int, elem_bytes: int = 2) -> dict[str, int]:
    """128 x 128 output tiles on 64-wide K steps (the tensor-core tile Triton's Hopper matmuls
    run at), 4 stages, and the `choose_split_k` slices for the tile count."""
    block_m = 64 if m <= 64 else 128
    block_n, block_k = 128, 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "STAGES": 4,
              "num_warps": 8 if block_m * block_n >= 128 * 256 else 4,
              "SPLIT_K": choose_split_k(tiles, k // block_k, num_sms)}  # fmt: skip
    return shrink_to_fit(
        config,
        lambda c: (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * elem_bytes * c["STAGES"],
        [("STAGES", 2, False)],
    )


def split_k_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    workspace: SplitKWorkspace,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [M, K]``, ``weight [N, K]`` with K contiguous in both
    (``x``'s rows may be strided) and K a multiple of the config's BLOCK_K. Returns ``out [M, N]``
    in ``x``'s dtype; ``pdl``: launch with programmatic dependent launch (`ember.kernels.pdl`)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns; weight {tuple(weight.shape)} wants {weight.shape[1]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("the reduction dim must be contiguous in x and weight")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    config = dict(config or default_config(m, n, k, workspace.num_sms, weight.element_size()))
    if k % config["BLOCK_K"]:
        raise ValueError(f"K ({k}) must be a multiple of BLOCK_K ({config['BLOCK_K']})")
    split = config.pop("SPLIT_K")
    tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    if split > 1 and tiles > workspace.counters.numel():
        raise ValueError(f"{tiles} tiles exceed the workspace's {workspace.counters.numel()}")
    k_steps = k // config["BLOCK_K"]
    k_per_split = triton.cdiv(k_steps, split) * config["BLOCK_K"]
    parts = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _split_k_gemm_kernel[(tiles * split,)](
        x, weight, bias if bias is not None else weight, out, parts, workspace.counters,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        HAS_BIAS=bias is not None,
        SPLIT_K=split,
        # fp32 weights must not silently drop to tf32 on the tensor cores.
        DOT_PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        PDL=pdl,
        launch_pdl=pdl,
        **config,
    )  # fmt: skip
    return out
