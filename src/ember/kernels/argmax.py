"""Greedy decoding's argmax over the vocabulary, split across programs.

One row is one decode step's logits (128k floats for Llama 3). A single program per row (as
``torch.argmax`` runs a small batch) reads it at a fraction of HBM speed; here each row is cut
into up to 64 chunks whose programs find their chunk's first maximum, and a second launch picks
the first maximum among the chunks (with one chunk per row, a small vocabulary, the first launch
writes the tokens). Batches above `MAX_SPLIT_BATCH` stay with ``torch.argmax``, faster there.

Ties resolve to the lowest index, as ``torch.argmax`` does; NaN never wins (a row of NaNs and
-inf gives the first -inf or index 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.compile_ahead import launch
from ember.kernels.sampling import _first_argmax

_BLOCK_V = 1024
# A chunk is at least this many logits (4 loop steps), and a batch gets ~this many programs.
_MIN_CHUNK = 4096
_TARGET_PROGRAMS = 256
_MAX_SPLITS = 64
# Above this batch torch.argmax is used, faster at 256: a step A/B at batch 64-256
# (bench/results/README.md, "Greedy argmax split").
MAX_SPLIT_BATCH = 64


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr,
    stride_row,
    vocab,
    chunk,
    best_val_ptr,
    best_idx_ptr,
    tokens_ptr,
    SPLITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    lanes = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    # Each lane's first position, so an all -inf chunk answers its first index.
    best_idx = tl.minimum(start + lanes, vocab - 1)
    for offset in range(start, end, BLOCK_V):
        idx = offset + lanes
        x = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        better = x > best  # strict: each lane keeps its earliest maximum
        best = tl.where(better, x, best)
        best_idx = tl.where(better, idx, best_idx)
    first = _first_argmax(best, best_idx, vocab)
    if SPLITS == 1:
        tl.store(tokens_ptr + row, first.to(tl.int64))
    else:
        tl.store(best_val_ptr + row * SPLITS + split, tl.max(best, 0))
        tl.store(best_idx_ptr + row * SPLITS + split, first)


@triton.jit
def _merge_chunks_kernel(best_val_ptr, best_idx_ptr, tokens_ptr, vocab, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    offsets = row * SPLITS + tl.arange(0, SPLITS)
    first = _first_argmax(tl.load(best_val_ptr + offsets), tl.load(best_idx_ptr + offsets), vocab)
    tl.store(tokens_ptr + row, first.to(tl.int64))


def num_argmax_splits(batch: int, vocab: int) -> int:
    """Chunks per row: ~_TARGET_PROGRAMS programs in all, chunks of >= _MIN_CHUNK logits, a
    power of two (the merge loads them as one block)."""
    want = max(1, min(_MAX_SPLITS, triton.cdiv(vocab, _MIN_CHUNK), _TARGET_PROGRAMS // batch))
    return 1 << (want.bit_length() - 1)


_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """First index of each row's maximum: int64 ``[B]`` from ``[B, V]`` float32, bfloat16 or
    float16 logits (compared in float32, which holds the half types exactly), no host sync."""
    if logits.dtype not in _LOGIT_DTYPES or logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(
            "logits must be 2-D float32, bfloat16 or float16 with a contiguous last dim"
        )
    batch, vocab = logits.shape
    if batch > MAX_SPLIT_BATCH:
        return logits.argmax(dim=-1)
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return tokens
    if vocab == 0:
        raise ValueError("argmax over an empty vocabulary")
    splits = num_argmax_splits(batch, vocab)
    # Whole loop steps per chunk; rounding up can leave the last chunks empty (they lose).
    chunk = triton.cdiv(triton.cdiv(vocab, splits), _BLOCK_V) * _BLOCK_V
    best_val = best_idx = tokens  # unused with one chunk per row
    if splits > 1:
        best_val = torch.empty(batch * splits, dtype=torch.float32, device=logits.device)
        best_idx = torch.empty(batch * splits, dtype=torch.int32, device=logits.device)
    launch(
        _chunk_argmax_kernel,
        (batch, splits),
        logits,
        logits.stride(0),
        vocab,
        chunk,
        best_val,
        best_idx,
        tokens,
        SPLITS=splits,
        BLOCK_V=_BLOCK_V,
        num_warps=4,
    )
    if splits > 1:
        launch(_merge_chunks_kernel, (batch,), best_val, best_idx, tokens, vocab, SPLITS=splits)
    return tokens
