"""Pull (part of) a weight into L2 ahead of the GEMM that will read it.

At small batches a decode step's HBM traffic is its weights, and between two GEMMs (RoPE,
attention, the norms, SiLU) HBM idles while a few small kernels run: ~15 us per layer at batch 1
on an H200. Launched on a side stream during such a gap, this kernel brings the next GEMM's weight
(or its first part) into L2, and the GEMM then reads those bytes at L2 speed.

Each program issues Hopper bulk prefetches (``cp.async.bulk.prefetch.L2``): the SM's copy engine
fetches a chunk into L2 and nothing comes back to the SM. One copy engine moves ~0.2 TB/s (8
programs prefetched 32 MiB at 1.5 TB/s on an H200), so HBM speed takes a few dozen small programs,
which fit beside the step's own kernels. ``COVERAGE`` replaces the prefetch by a store
of 1 per chunk into a tensor, so the interpreter can check which chunks a launch covers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Bytes per bulk prefetch (a multiple of 16, as the instruction requires).
CHUNK_BYTES = 16384
_BLOCK = 128
DEFAULT_PROGRAMS = 32


def _prefetch_asm(chunk_bytes: int) -> str:
    return f"cp.async.bulk.prefetch.L2.global [$1], {chunk_bytes};\n mov.u32 $0, 0;"


@triton.jit
def _l2_prefetch_kernel(
    base,
    cover,
    num_chunks,
    CHUNK_ELEMS: tl.constexpr,
    ASM: tl.constexpr,
    BLOCK: tl.constexpr,
    COVERAGE: tl.constexpr,
):
    pid = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    for first in range(pid * BLOCK, num_chunks, stride):
        # Clamped, not masked: the asm takes no predicate, and prefetching a chunk twice is free.
        chunk = tl.minimum(first + tl.arange(0, BLOCK), num_chunks - 1)
        if COVERAGE:
            tl.store(cover + chunk, tl.full([BLOCK], 1, tl.int32))
        else:
            tl.inline_asm_elementwise(
                ASM,
                "=r,l",
                [base + chunk.to(tl.int64) * CHUNK_ELEMS],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )


def num_prefetch_chunks(
    weight: torch.Tensor, max_bytes: int | None = None, chunk_bytes: int = CHUNK_BYTES
) -> int:
    """Whole chunks of ``weight`` (contiguous) that a prefetch of at most ``max_bytes`` covers;
    a tail shorter than a chunk is left to the GEMM."""
    nbytes = weight.numel() * weight.element_size()
    if max_bytes is not None:
        nbytes = min(nbytes, max_bytes)
    return nbytes // chunk_bytes


def prefetch_to_l2(
    weight: torch.Tensor,
    max_bytes: int | None = None,
    *,
    num_programs: int = DEFAULT_PROGRAMS,
    chunk_bytes: int = CHUNK_BYTES,
    coverage: torch.Tensor | None = None,
) -> None:
    """Start bringing the first ``max_bytes`` (default: all) of ``weight`` into L2 with at most
    ``num_programs`` programs; writes nothing. ``coverage`` (int32, one entry per chunk) is for
    tests: each chunk the launch would prefetch gets a 1 instead."""
    if not weight.is_contiguous():
        raise ValueError("prefetch_to_l2 needs a contiguous weight")
    if chunk_bytes % 16 or chunk_bytes % weight.element_size():
        raise ValueError(f"chunk of {chunk_bytes} bytes: not a multiple of 16 and the element")
    num_chunks = num_prefetch_chunks(weight, max_bytes, chunk_bytes)
    if num_chunks == 0:
        return
    grid = (min(num_programs, triton.cdiv(num_chunks, _BLOCK)),)
    _l2_prefetch_kernel[grid](
        weight,
        coverage if coverage is not None else weight,
        num_chunks,
        CHUNK_ELEMS=chunk_bytes // weight.element_size(),
        ASM=_prefetch_asm(chunk_bytes),
        BLOCK=_BLOCK,
        COVERAGE=coverage is not None,
        num_warps=4,
    )
