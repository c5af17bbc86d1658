"""Counter-based random numbers for sampling: a pure function of (seed, step, token id).

Triton device helpers implementing docs/CONTRACTS.md "Sampling semantics", step 3, in wrapping
uint32 arithmetic; ``ember.layers.reference_ops.hash_uniform`` is the same stream in torch. No
state is carried between steps, so a request draws the same numbers whatever batch it is in.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mix32(x):
    """32-bit integer finaliser (xorshift-multiply); ``x`` is uint32, products wrap."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def row_key(seed, step):
    """uint32 key of one (seed, step) pair; ``seed`` and ``step`` are int64 scalars."""
    seed_lo = seed.to(tl.uint32)  # int64 -> uint32 keeps the low 32 bits
    seed_hi = (seed >> 32).to(tl.uint32)
    return mix32(mix32(mix32(seed_lo) ^ seed_hi) ^ step.to(tl.uint32))


@triton.jit
def token_uniform(key, token_ids):
    """Uniforms in (0, 1) for int32 ``token_ids`` under a row ``key``; 24 random bits each."""
    bits = mix32(key ^ mix32(token_ids.to(tl.uint32)))
    # ``+ 0.5`` needs a 25th bit, so float32 rounds (to even) exactly as torch does; the top
    # value would round to 1.0 (E = 0, an infinite race score), hence the clamp below 1.
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return tl.minimum(u, 0.99999994)  # 1 - 2**-24, the largest float32 below 1
