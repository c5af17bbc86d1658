"""Token sampling on the GPU without a host sync: greedy, temperature, top-k, top-p, min-p.

Semantics are docs/CONTRACTS.md "Sampling semantics"; ``reference_ops.sample_reference`` is the
specification and this kernel picks the same tokens (barring exact float ties). One program
owns one row and streams it in ``_BLOCK_V`` chunks, taking the cheapest path the row allows:

* greedy rows: one pass, first maximum;
* no top-k/top-p/min-p: one pass, the exponential race ``argmax(l - log E)`` over all tokens;
* min-p only: a max pass, then the race over ``exp(l - l_max) >= min_p``;
* top-k/top-p: thresholds without sorting the vocabulary. Every filter keeps "tokens whose
  logit is >= a threshold", so each threshold is a search over logit values, done on an int32
  key that orders floats. A search pass counts (top-k) or weighs (top-p) the tokens at or above
  16 probe keys at once and keeps the bracket holding the threshold; the first pass places its
  probes at 0.25..45 logits below the max, later ones split the bracket evenly, so a 2**32 key
  range resolves in at most 8 passes. As soon as the bracket's floor has <= ``_CANDIDATES``
  tokens at or above it, those (they include every kept token) are compacted into a per-row
  scratch list and the rest is exact in registers. Typical rows: 3 streaming passes.

Probabilities are never normalised: masses are ``exp(l - l_max)``, and the top-p budget is
``top_p`` times the kept mass, so scale cancels. Raw logits give the keys: dividing by the
temperature is monotone, so thresholds found on raw logits select the same tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.compile_ahead import launch
from ember.kernels.hash_rng import row_key, token_uniform

# 1024 logits per step: measured on an H200 faster than 2048 with loop-level pipelining.
_BLOCK_V = 1024
_NUM_PROBES = 16
# Candidate list size per row: big enough for usual top-k / top-p sets, small enough to search
# in registers ([_CANDIDATES, _NUM_PROBES] comparisons per probe pass).
_CANDIDATES = 1024
_LOG2E = tl.constexpr(1.4426950408889634)  # read inside the kernel: must be a constexpr


@triton.jit
def _float_key(x):
    """int32 key with the order of float32 ``x``: flip the magnitude bits of negatives."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_float(key):
    """Inverse of ``_float_key`` (the same bit flip)."""
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _first_argmax(best, best_idx, vocab):
    """Lowest index holding the maximum of per-lane running bests."""
    top = tl.max(best, 0)
    return tl.min(tl.where(best == top, best_idx, vocab), 0)


@triton.jit
def _row_argmax(row_ptr, vocab, BLOCK_V: tl.constexpr):
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf"))
        better = x > best  # strict: each lane keeps its earliest maximum
        best = tl.where(better, x, best)
        best_idx = tl.where(better, idx, best_idx)
    return _first_argmax(best, best_idx, vocab)


@triton.jit
def _race_score(x, idx, key, scale):
    """Exponential-race score in log2 units: ``log2(e) * (l - log E) + const``."""
    u = token_uniform(key, idx)
    return x * scale - tl.log2(-tl.log2(u))


@triton.jit
def _row_race(
    row_ptr,
    vocab,
    key,
    scale,
    floor_key,
    top,
    min_p,
    FILTERED: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Race over the row; if FILTERED only over keys >= floor_key passing min-p."""
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        in_row = idx < vocab
        x = tl.load(row_ptr + idx, mask=in_row, other=float("-inf"))
        score = _race_score(x, idx, key, scale)
        keep = in_row
        if FILTERED:
            keep &= (_float_key(x) >= floor_key) & (tl.exp2((x - top) * scale) >= min_p)
        score = tl.where(keep, score, float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, idx, best_idx)
    return _first_argmax(best, best_idx, vocab)


@triton.jit
def _row_stats(row_ptr, vocab, scale, BLOCK_V: tl.constexpr):
    """Max, min and ``sum(exp(l - l_max))`` of a row in one pass (per-lane online rescale).

    The running max starts at -1e30 (below any real logit), not -inf, so a lane of -inf logits
    never computes -inf - -inf.
    """
    run_max = tl.full([BLOCK_V], -1e30, tl.float32)
    run_min = tl.full([BLOCK_V], float("inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        in_row = idx < vocab
        x = tl.load(row_ptr + idx, mask=in_row, other=float("-inf"))
        new_max = tl.maximum(run_max, x)
        run_sum = run_sum * tl.exp2((run_max - new_max) * scale) + tl.exp2((x - new_max) * scale)
        run_max = new_max
        run_min = tl.minimum(run_min, tl.where(in_row, x, float("inf")))
    top = tl.max(run_max, 0)
    total = tl.sum(run_sum * tl.exp2((run_max - top) * scale), 0)
    return top, tl.min(run_min, 0), total


@triton.jit
def _probe_stats(keys, weights, probes):
    """Count and mass of ``keys`` at or above each of the probe keys."""
    above = keys[:, None] >= probes[None, :]
    count = tl.sum(above.to(tl.float32), 0)
    mass = tl.sum(tl.where(above, weights[:, None], 0.0), 0)
    return count, mass


@triton.jit
def _row_probe_stats(
    row_ptr,
    vocab,
    top,
    scale,
    probes,
    BLOCK_V: tl.constexpr,
    NUM_PROBES: tl.constexpr,
):
    probe_keys = probes.to(tl.int32)  # probes lie inside the int32 key range
    count = tl.zeros([NUM_PROBES], tl.float32)
    mass = tl.zeros([NUM_PROBES], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        in_row = idx < vocab
        x = tl.load(row_ptr + idx, mask=in_row, other=float("-inf"))
        keys = tl.where(in_row, _float_key(x), -2147483648)
        block_count, block_mass = _probe_stats(keys, tl.exp2((x - top) * scale), probe_keys)
        count += block_count
        mass += block_mass
    return count, mass


@triton.jit
def _narrow(lo, hi, count_lo, mass_lo, probes, count, mass, target, by_count):
    """Shrink the bracket [lo, hi] around the largest key t with stat(>= t) >= target.

    ``stat`` (count or mass at or above a key) falls as the key rises, so the probes meeting the
    target are exactly those below the answer: the highest becomes ``lo``, the lowest failing
    one bounds ``hi``. Returns the new bracket and the count/mass at its floor.
    """
    stat = tl.where(by_count, count, mass)
    in_bracket = (probes > lo) & (probes <= hi)
    meets = in_bracket & (stat >= target)
    any_meets = tl.max(meets.to(tl.int32), 0) > 0
    new_lo = tl.where(any_meets, tl.max(tl.where(meets, probes, lo), 0), lo)
    new_hi = tl.min(tl.where(in_bracket & ~meets, probes - 1, hi), 0)
    new_count = tl.where(any_meets, tl.min(tl.where(meets, count, float("inf")), 0), count_lo)
    new_mass = tl.where(any_meets, tl.min(tl.where(meets, mass, float("inf")), 0), mass_lo)
    return new_lo, new_hi, new_count, new_mass


@triton.jit
def _even_probes(lo, hi, NUM_PROBES: tl.constexpr):
    """Probe keys splitting (lo, hi] into NUM_PROBES + 1 near-equal parts (int64, <= hi)."""
    step = (hi - lo) // (NUM_PROBES + 1) + 1
    probes = lo + step * (tl.arange(0, NUM_PROBES) + 1).to(tl.int64)
    return tl.minimum(probes, hi)


@triton.jit
def _search_row(
    row_ptr,
    vocab,
    top,
    scale,
    unit,
    lo,
    hi,
    count_lo,
    mass_lo,
    target,
    by_count,
    coarse,
    cap,
    BLOCK_V: tl.constexpr,
    NUM_PROBES: tl.constexpr,
):
    """Narrow a threshold bracket over the whole row until it is exact or has <= cap tokens.

    With ``coarse`` the first pass probes at ``top - unit * 0.25 * sqrt(2)**j`` (j < 16): where
    top-k/top-p thresholds usually are, so one pass often gets under ``cap``.
    """
    if coarse:
        ladder = (NUM_PROBES - 1 - tl.arange(0, NUM_PROBES)).to(tl.float32)
        probes = _float_key(top - unit * 0.25 * tl.exp2(0.5 * ladder)).to(tl.int64)
        count, mass = _row_probe_stats(row_ptr, vocab, top, scale, probes, BLOCK_V, NUM_PROBES)
        lo, hi, count_lo, mass_lo = _narrow(
            lo, hi, count_lo, mass_lo, probes, count, mass, target, by_count
        )
    while (lo < hi) & (count_lo > cap):
        probes = _even_probes(lo, hi, NUM_PROBES)
        count, mass = _row_probe_stats(row_ptr, vocab, top, scale, probes, BLOCK_V, NUM_PROBES)
        lo, hi, count_lo, mass_lo = _narrow(
            lo, hi, count_lo, mass_lo, probes, count, mass, target, by_count
        )
    return lo, hi, count_lo, mass_lo


@triton.jit
def _search_candidates(keys, weights, lo, hi, target, by_count, NUM_PROBES: tl.constexpr):
    """Exact threshold key among candidates held in registers (same bracket search)."""
    while lo < hi:
        probes = _even_probes(lo, hi, NUM_PROBES)
        count, mass = _probe_stats(keys, weights, probes.to(tl.int32))
        lo, hi, _, _ = _narrow(lo, hi, 0.0, 0.0, probes, count, mass, target, by_count)
    return lo


@triton.jit
def _compact_candidates(row_ptr, vocab, floor_key, cand_ptr, BLOCK_V: tl.constexpr):
    """Write the index of every token with key >= floor_key to the row's scratch list."""
    num = 0
    for start in range(0, vocab, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        in_row = idx < vocab
        x = tl.load(row_ptr + idx, mask=in_row, other=float("-inf"))
        take = in_row & (_float_key(x) >= floor_key)
        slot = num + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(cand_ptr + slot, idx, mask=take)
        num += tl.sum(take.to(tl.int32), 0)
    return num


@triton.jit
def _sample_candidates(
    row_ptr,
    cand_ptr,
    num_cands,
    key,
    scale,
    top,
    floor_key,
    k_pending,
    top_k,
    k_key,
    k_mass,
    p_pending,
    top_p,
    min_p,
    CANDIDATES: tl.constexpr,
    NUM_PROBES: tl.constexpr,
):
    """Finish the pending thresholds on the candidate list, then race over the kept ones."""
    slots = tl.arange(0, CANDIDATES)
    valid = slots < num_cands
    idx = tl.load(cand_ptr + slots, mask=valid, other=0)
    x = tl.load(row_ptr + idx, mask=valid, other=float("-inf"))
    keys = tl.where(valid, _float_key(x), -2147483648)
    weights = tl.exp2((x - top) * scale)
    top_key = _float_key(top).to(tl.int64)
    if k_pending:
        k_key = _search_candidates(
            keys, weights, floor_key, top_key, top_k.to(tl.float32), True, NUM_PROBES
        )
        k_mass = tl.sum(tl.where(keys >= k_key, weights, 0.0), 0)
    p_key = k_key
    if p_pending:
        p_key = _search_candidates(
            keys, weights, tl.maximum(floor_key, k_key), top_key, top_p * k_mass, False, NUM_PROBES
        )
    keep = valid & (keys >= tl.maximum(k_key, p_key)) & (weights >= min_p)
    score = tl.where(keep, _race_score(x, idx, key, scale), float("-inf"))
    best = tl.max(score, 0)
    return tl.min(tl.where(score == best, idx, 2147483647), 0)


@triton.jit
def _sample_filtered(
    row_ptr,
    cand_ptr,
    vocab,
    key,
    temperature,
    scale,
    top_k,
    top_p,
    min_p,
    BLOCK_V: tl.constexpr,
    NUM_PROBES: tl.constexpr,
    CANDIDATES: tl.constexpr,
):
    """A row with top-k and/or top-p (and maybe min-p): find thresholds, then race."""
    top, bottom, total = _row_stats(row_ptr, vocab, scale, BLOCK_V)
    k_on = (top_k > 0) & (top_k < vocab)
    k_off = (top_k <= 0) | (top_k >= vocab)
    p_on = top_p < 1.0
    top_key = _float_key(top).to(tl.int64)
    lo = _float_key(bottom).to(tl.int64)
    hi = top_key
    count_lo = vocab.to(tl.float32)
    mass_lo = total
    # Resolved thresholds start at the row's minimum key: no restriction.
    k_key = lo
    k_mass = total
    p_key = lo
    k_pending = k_on
    p_pending = p_on

    if k_on:  # top-k first: top-p's budget depends on the mass top-k keeps
        lo, hi, count_lo, mass_lo = _search_row(
            row_ptr,
            vocab,
            top,
            scale,
            1.0,
            lo,
            hi,
            count_lo,
            mass_lo,
            top_k.to(tl.float32),
            True,
            True,
            CANDIDATES,
            BLOCK_V,
            NUM_PROBES,
        )
        if count_lo > CANDIDATES:  # exact, with a kept set too large for the list
            k_key = lo
            k_mass = mass_lo
            k_pending = False
            hi = top_key
    if p_on & (count_lo > CANDIDATES):
        lo, hi, count_lo, mass_lo = _search_row(
            row_ptr,
            vocab,
            top,
            scale,
            temperature,
            lo,
            hi,
            count_lo,
            mass_lo,
            top_p * k_mass,
            False,
            k_off,
            CANDIDATES,
            BLOCK_V,
            NUM_PROBES,
        )
        if count_lo > CANDIDATES:
            p_key = lo
            p_pending = False

    if count_lo <= CANDIDATES:
        num_cands = _compact_candidates(row_ptr, vocab, lo.to(tl.int32), cand_ptr, BLOCK_V)
        tl.debug_barrier()  # the list is read back by other threads of this program
        token = _sample_candidates(
            row_ptr,
            cand_ptr,
            num_cands,
            key,
            scale,
            top,
            lo,
            k_pending,
            top_k,
            k_key,
            k_mass,
            p_pending,
            top_p,
            min_p,
            CANDIDATES,
            NUM_PROBES,
        )
    else:
        floor_key = tl.maximum(k_key, p_key).to(tl.int32)
        token = _row_race(row_ptr, vocab, key, scale, floor_key, top, min_p, True, BLOCK_V)
    return token


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seeds_ptr,
    steps_ptr,
    out_ptr,
    cand_ptr,
    vocab,
    BLOCK_V: tl.constexpr,
    NUM_PROBES: tl.constexpr,
    CANDIDATES: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    temperature = tl.load(temperature_ptr + row)
    if temperature <= 0:
        token = _row_argmax(row_ptr, vocab, BLOCK_V)
    else:
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        key = row_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
        scale = _LOG2E / temperature  # logits * scale = l * log2(e)
        if ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0):
            token = _sample_filtered(
                row_ptr,
                cand_ptr + row.to(tl.int64) * CANDIDATES,
                vocab,
                key,
                temperature,
                scale,
                top_k,
                top_p,
                min_p,
                BLOCK_V,
                NUM_PROBES,
                CANDIDATES,
            )
        elif min_p > 0:
            top, _, _ = _row_stats(row_ptr, vocab, scale, BLOCK_V)
            token = _row_race(row_ptr, vocab, key, scale, -2147483648, top, min_p, True, BLOCK_V)
        else:
            token = _row_race(row_ptr, vocab, key, scale, 0, 0.0, 0.0, False, BLOCK_V)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """Sample one token per row; returns int64 ``[B]`` on the logits' device, no host sync.

    Args:
        logits: float32 ``[B, V]`` (last dim contiguous), already penalised/biased.
        temperature: float32 ``[B]``; ``<= 0`` is greedy.
        top_k: int32 ``[B]``; active when ``0 < k < V``.
        top_p: float32 ``[B]``; active when ``< 1``.
        min_p: float32 ``[B]``; active when ``> 0``.
        seeds, steps: int64 ``[B]``: the request's seed and its number of generated tokens.

    Rows with top-k/top-p use an int32 scratch list of ``_CANDIDATES`` entries per row
    (``torch.empty``, 4 KiB a row), the only allocation besides the output.
    """
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError("logits must be float32 with a contiguous last dim")
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    candidates = torch.empty(batch * _CANDIDATES, dtype=torch.int32, device=logits.device)
    launch(
        _sample_kernel,
        (batch,),
        logits,
        logits.stride(0),
        temperature,
        top_k,
        top_p,
        min_p,
        seeds,
        steps,
        out,
        candidates,
        vocab,
        BLOCK_V=_BLOCK_V,
        NUM_PROBES=_NUM_PROBES,
        CANDIDATES=_CANDIDATES,
        num_warps=8,
    )
    return out
