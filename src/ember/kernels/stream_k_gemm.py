"""Stream-K GEMM for decode batches past the skinny kernel: ``out[M, N] = x[M, K] @ w[N, K]^T``.

At 65-256 rows a decode step's products are compute-bound on an H200 and cuBLAS runs them in
whole output tiles, one per SM at a time. Their tile counts do not divide into the 132 SMs: the
8B model's fused gate/up at 256 rows is 224 tiles of 128 x 256, 1.7 waves, and cuBLAS takes as
long for its 28,672 columns as for 32,768. Here the work can be cut in K blocks instead: the
(column tile, K block) units are laid end to end and each group of programs (one program per row
tile, so a group reads each weight tile once) takes an equal run of them, so every SM finishes
together. A program that covers a whole tile stores it with the epilogue. A program that covers
part of one stores its fp32 partial sums; the last of the tile's programs to arrive (an atomic
ticket per tile) adds every partial in group order, so the result is the same on every run, and
stores the tile. A program holds at most two partial tiles, its first and its last; the tickets
and partial sums live in a `StreamKWorkspace`, and each launch leaves its tickets at zero for
the next.

Operands are read through TMA tensor descriptors (Hopper), the K loop pipelined by Triton.
``GATED``: ``w`` is the fused ``[2I, K]`` gate/up weight and each tile holds matching gate and
up columns, stored as ``silu(gate) * up`` (the SiLU-and-mul kernel's roundings).

The engine routes only the plain form, and only gate/up (`fits_one_wave`): up to 128 rows, 112
programs of one whole tile each, SiLU in the epilogue, beat cuBLAS and the SiLU kernel. The
partial sums cost more than the idle SMs they save, and on q/k/v, o, down and the output
projection cuBLAS's split-K kernels win (`ember bench tune --sections stream_k` and step A/Bs;
bench/results/README.md, "Stream-K gate/up rows").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ember.kernels.activation import silu_mul_rounded
from ember.kernels.compile_ahead import launch
from ember.kernels.pdl import wait_for_producer
from ember.kernels.tiles import shrink_to_fit


@triton.jit
def _store_tile(
    out_ptr,
    acc,
    acc_up,
    off_m,
    off_n,
    M,
    N,
    stride_om,
    BLOCK_M: tl.constexpr,
    OUT_N: tl.constexpr,
    GATED: tl.constexpr,
):
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, OUT_N)
    dtype = out_ptr.dtype.element_ty
    result = acc.to(dtype)
    if GATED:
        result = silu_mul_rounded(result.to(tl.float32), acc_up.to(dtype).to(tl.float32), dtype)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], result, mask=mask)


@triton.jit(noinline=True)
def _reduce_partials(
    out_ptr,
    partials_ptr,
    first,
    last,
    tile_first,
    total_units,
    groups,
    tiles_m,
    tile_m,
    off_m,
    off_n,
    M,
    N,
    stride_om,
    PART: tl.constexpr,
    BLOCK_M: tl.constexpr,
    OUT_N: tl.constexpr,
    GATED: tl.constexpr,
):
    """Add the partial tiles of groups ``first..last`` in group order and store the tile. Not
    inlined, and in row slices: beside the main loop's accumulators it spilled registers."""
    REDUCE_ROWS: tl.constexpr = BLOCK_M // 4 if BLOCK_M >= 64 else BLOCK_M
    offsets = tl.arange(0, REDUCE_ROWS)[:, None] * OUT_N + tl.arange(0, OUT_N)[None, :]
    for r in tl.static_range(0, BLOCK_M, REDUCE_ROWS):
        total = tl.zeros([REDUCE_ROWS, OUT_N], dtype=tl.float32)
        total_up = tl.zeros([REDUCE_ROWS, OUT_N], dtype=tl.float32)
        for g in range(first, last + 1):
            # This tile is g's first exactly when g starts inside it.
            g_slot = tl.where((g * total_units) // groups >= tile_first, 0, 1)
            g_base = partials_ptr + ((g * tiles_m + tile_m) * 2 + g_slot) * PART + r * OUT_N
            total += tl.load(g_base + offsets, cache_modifier=".cg")
            if GATED:
                total_up += tl.load(g_base + PART // 2 + offsets, cache_modifier=".cg")
        _store_tile(
            out_ptr, total, total_up, off_m + r, off_n, M, N, stride_om, REDUCE_ROWS, OUT_N, GATED
        )


@triton.jit
def _tile_product(
    x_desc,
    w_desc,
    off_m,
    off_n,
    kb_start,
    kb_stop,
    N,
    BLOCK_M: tl.constexpr,
    OUT_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    GATED: tl.constexpr,
):
    """The tile's fp32 sums over K blocks ``[kb_start, kb_stop)`` (and the up half's)."""
    acc = tl.zeros([BLOCK_M, OUT_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, OUT_N], dtype=tl.float32)  # GATED only
    for kb in tl.range(kb_start, kb_stop, num_stages=STAGES):
        k = kb * BLOCK_K
        x = x_desc.load([off_m, k])
        w = w_desc.load([off_n, k])
        acc = tl.dot(x, w.T, acc)
        if GATED:
            # A last tile past N reads up rows as gate rows (and zeros as up rows) for columns
            # the store masks: valid columns always get their own gate and up rows.
            w_up = w_desc.load([N + off_n, k])
            acc_up = tl.dot(x, w_up.T, acc_up)
    return acc, acc_up


@triton.jit(do_not_specialize=["M"])
def _stream_k_gemm_kernel(
    x_desc,
    w_desc,
    out_ptr,
    partials_ptr,
    counters_ptr,
    M,
    N,
    stride_om,
    tiles_m,
    k_blocks,
    total_units,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Programs come in groups of ``tiles_m``, one per row tile; group ``g`` of ``G`` computes
    units ``[g U / G, (g + 1) U / G)`` of the ``U = column tiles x k_blocks`` (column tile, K
    block) units for its program's row tile. A group's programs read the same weight tiles at the
    same time, so each is read from HBM once (spread over the programs, the row tiles of one
    column tile ran far apart and the product read its weights once per row tile). With as many
    groups as column tiles, each program computes one whole tile. ``N`` counts output columns
    (``I`` when ``GATED``); ``BLOCK_N`` counts weight rows a tile reads (half gate, half up when
    ``GATED``)."""
    OUT_N: tl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
    PART: tl.constexpr = BLOCK_M * OUT_N * (2 if GATED else 1)  # fp32 of one partial tile
    pid = tl.program_id(0)
    tile_m = pid % tiles_m
    group = pid // tiles_m
    groups = tl.num_programs(0) // tiles_m
    off_m = tile_m * BLOCK_M
    start = (group * total_units) // groups
    end = ((group + 1) * total_units) // groups
    wait_for_producer(PDL)
    part_offsets = tl.arange(0, BLOCK_M)[:, None] * OUT_N + tl.arange(0, OUT_N)[None, :]
    unit = start
    while unit < end:
        tile_n = unit // k_blocks
        tile_first = tile_n * k_blocks
        stop = tl.minimum(tile_first + k_blocks, end)
        off_n = tile_n * OUT_N
        acc, acc_up = _tile_product(
            x_desc,
            w_desc,
            off_m,
            off_n,
            unit - tile_first,
            stop - tile_first,
            N,
            BLOCK_M,
            OUT_N,
            BLOCK_K,
            STAGES,
            GATED,
        )
        if (unit == tile_first) & (stop == tile_first + k_blocks):
            _store_tile(out_ptr, acc, acc_up, off_m, off_n, M, N, stride_om, BLOCK_M, OUT_N, GATED)
        else:
            # Slot 0: the program's first tile; slot 1: its last. Gate partials, then up ones.
            # The barrier puts every thread's partials before the ticket's release.
            slot = tl.where(unit == start, 0, 1)
            base = partials_ptr + (pid * 2 + slot) * PART
            tl.store(base + part_offsets, acc)
            if GATED:
                tl.store(base + PART // 2 + part_offsets, acc_up)
            tl.debug_barrier()
            first = ((tile_first + 1) * groups - 1) // total_units
            last = ((tile_first + k_blocks) * groups - 1) // total_units
            ticket = counters_ptr + tile_n * tiles_m + tile_m
            arrived = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
            if arrived == last - first:
                tl.store(ticket, 0)  # zero again for the next launch
                tl.debug_barrier()
                _reduce_partials(
                    out_ptr,
                    partials_ptr,
                    first,
                    last,
                    tile_first,
                    total_units,
                    groups,
                    tiles_m,
                    tile_m,
                    off_m,
                    off_n,
                    M,
                    N,
                    stride_om,
                    PART,
                    BLOCK_M,
                    OUT_N,
                    GATED,
                )
        unit = stop


# The largest default tile, in fp32 partial sums.
MAX_TILE_ELEMS = 128 * 256


def fits_one_wave(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the gated product of ``x`` and the fused gate/up ``weight`` can run here as the
    engine runs it: on a Hopper GPU, half-precision operands TMA can read (16-byte aligned
    rows), and default tiles that fit one wave of one whole tile per program (stream-K's
    partial sums lose to cuBLAS; the module docstring). Which rows it serves is
    the caller's routing (`ember.kernels.tuning.LinearRoutes.stream_k_rows`)."""
    m, k = x.shape
    if not (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and torch.cuda.get_device_capability(x.device)[0] >= 9
        and all(_tma_readable(t) for t in (x, weight))
    ):
        return False
    config = default_config(m, weight.shape[0], k, gated=True)
    return num_tiles(m, weight.shape[0], config) <= _sm_count(x.device)


def _sm_count(device: torch.device) -> int:
    """The device's SMs; an H200's 132 off CUDA (the CPU interpreter runs the same grids)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tma_readable(t: torch.Tensor) -> bool:
    row_bytes = t.stride(0) * t.element_size()
    return t.stride(1) == 1 and row_bytes % 16 == 0 and t.data_ptr() % 16 == 0


def default_config(m: int, n: int, k: int, gated: bool = False) -> dict[str, int]:
    """Tiles for an ``[m, k] x [n, k]^T`` product (``n`` counts gate and up when ``gated``):
    row tiles of up to 128 (a 256-row tile spilled registers), 256 weight rows a tile (128 of
    gate and 128 of up), 64-wide K steps, 4 stages: the best of `ember bench tune --sections
    stream_k`'s sweep for the 8B gate/up at 128 rows (one tile per program, 112 programs)."""
    block_m = min(128, max(64, triton.next_power_of_2(m)))
    config = {"BLOCK_M": block_m, "BLOCK_N": 256, "BLOCK_K": 64, "STAGES": 4, "num_warps": 8}
    return fit_shared_memory(config)


def shared_memory_estimate(config: dict[str, int], elem_bytes: int = 2) -> int:
    """Bytes of the pipelined x and w tiles, what Triton stages in shared memory."""
    return (
        (config["BLOCK_M"] + config["BLOCK_N"]) * config["BLOCK_K"] * elem_bytes * config["STAGES"]
    )


def fit_shared_memory(config: dict[str, int]) -> dict[str, int]:
    """Drop stages (to 2) until the tiles fit in an SM's shared memory."""
    return shrink_to_fit(config, shared_memory_estimate, [("STAGES", 2, False)])


def num_tiles(m: int, n: int, config: dict[str, int]) -> int:
    """Tiles (and tickets) of a product of ``m`` rows and ``n`` weight rows."""
    return triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])


@dataclass
class StreamKWorkspace:
    """Tickets (int32, zero between launches) and fp32 partial tiles for the stream-K launches of
    one stream. Allocated at the first launch that needs them (one that computes whole tiles
    only needs none), on its device, at a fixed size and never regrown: a captured graph keeps
    their addresses. A launch that would need more raises."""

    tickets: int = 4096
    # fp32 elements of partial tiles; None: two of the largest default tile per SM.
    partial_elems: int | None = None
    counters: torch.Tensor | None = field(default=None, init=False)
    partials: torch.Tensor | None = field(default=None, init=False)

    def buffers(
        self, device: torch.device, tickets: int, partial_elems: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counters is None:
            capacity = self.partial_elems
            if capacity is None:
                capacity = 2 * _sm_count(device) * MAX_TILE_ELEMS
            self.counters = torch.zeros(self.tickets, dtype=torch.int32, device=device)
            self.partials = torch.empty(capacity, dtype=torch.float32, device=device)
        if tickets > self.counters.numel() or partial_elems > self.partials.numel():
            raise ValueError(
                f"a stream-K launch needs {tickets} tickets and {partial_elems} partial sums; the "
                f"workspace holds {self.counters.numel()} and {self.partials.numel()}"
            )
        return self.counters, self.partials


def stream_k_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    workspace: StreamKWorkspace | None = None,
    *,
    gated: bool = False,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    num_programs: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``x @ weight.T`` for ``x [M, K]`` (rows contiguous), ``weight [N, K]`` (K contiguous), or
    with ``gated`` ``silu(x @ gate.T) * (x @ up.T)`` of the fused ``[2I, K]`` gate/up weight
    (gate rows first). Returns ``out`` (``[M, N]``, or ``[M, I]``) in ``x``'s dtype.

    ``num_programs``: by default one per tile where the tiles fit in one wave of one per SM,
    else one per SM; programs come in whole groups of one per row tile, and at most one group
    per (column tile, K block) unit. Any other count than one group per column tile splits
    tiles (stream-K), which needs the ``workspace``."""
    m, k = x.shape
    n_rows = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns; weight {tuple(weight.shape)} wants {weight.shape[1]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("the reduction dim must be contiguous in x and weight")
    if gated and n_rows % 2:
        raise ValueError(f"a gated weight needs an even number of rows, got {n_rows}")
    n = n_rows // 2 if gated else n_rows
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    config = dict(config or default_config(m, n_rows, k, gated))
    num_warps = config.pop("num_warps")
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    tiles_m = triton.cdiv(m, block_m)
    tiles_n = triton.cdiv(n_rows, block_n)
    k_blocks = triton.cdiv(k, block_k)
    sms = _sm_count(x.device)
    if num_programs is None:
        num_programs = min(tiles_m * tiles_n, sms)
    groups = max(1, min(num_programs // tiles_m, tiles_n * k_blocks))
    programs = groups * tiles_m
    if groups == tiles_n:  # a whole tile a program: no tickets, no partial sums
        counters, partials = out, out
    elif workspace is None:
        raise ValueError(f"{tiles_m * tiles_n} tiles on {programs} programs need a workspace")
    else:
        counters, partials = workspace.buffers(
            x.device, tiles_m * tiles_n, programs * 2 * block_m * block_n
        )
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [block_n // 2 if gated else block_n, block_k])
    launch(
        _stream_k_gemm_kernel,
        (programs,),
        x_desc,
        w_desc,
        out,
        partials,
        counters,
        m,
        n,
        out.stride(0),
        tiles_m,
        k_blocks,
        tiles_n * k_blocks,
        GATED=gated,
        PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
        **config,
    )
    return out
